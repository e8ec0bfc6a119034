//! Device memory by what it holds (weights, the expert pool, KV caches,
//! states, the activation pool, small inputs, upload staging, read-back
//! staging), the most held at once and what by use at that moment, and the
//! most of the activation pool in use at once and by which kind of scratch
//! (tensors, attention partials, MoE scratch, matmul copies, recurrent
//! records). Counters only: a buffer's creation or release moves one of
//! them, a pooled buffer's hand-out another; nothing is logged.
//!
//! These are the bytes the backend asked wgpu for; the driver adds its own
//! (contexts, pipelines) and the allocator rounds to its blocks, which
//! [`Ledger::report`] adds from wgpu's allocator report where there is one.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use slotstream_backend::DeviceMemory;

/// What a device buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    Weights,
    ExpertPool,
    KvCache,
    /// Convolution windows and Gated DeltaNet states.
    States,
    /// The activation pool: every pooled buffer, in use or free.
    Activations,
    /// The ring of small per-submission inputs and the parameter arenas.
    Inputs,
    /// Bytes staged for upload and not yet known to have landed (wgpu's
    /// own staging; host-visible memory that may sit in the device's BAR).
    UploadStaging,
    /// Host-readable buffers of downloads (host memory; not in the total).
    Readback,
}

const HELD: [Held; 8] =
    [Held::Weights, Held::ExpertPool, Held::KvCache, Held::States, Held::Activations, Held::Inputs, Held::UploadStaging, Held::Readback];

impl Held {
    pub fn name(self) -> &'static str {
        match self {
            Held::Weights => "weights",
            Held::ExpertPool => "expert_pool",
            Held::KvCache => "kv_cache",
            Held::States => "states",
            Held::Activations => "activation_pool",
            Held::Inputs => "inputs",
            Held::UploadStaging => "upload_staging",
            Held::Readback => "readback",
        }
    }
}

/// What a pooled activation buffer is in use for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scratch {
    /// Op outputs (tensors).
    Tensors,
    /// Attention's per-chunk partial sums (split and flash attention).
    Partials,
    /// The MoE layer's routing logits, pair sort and expert activations.
    Moe,
    /// Products' converted copies of their input (f16, int8).
    Matmul,
    /// Gated DeltaNet's chunk records.
    Recurrent,
}

const SCRATCH: [Scratch; 5] = [Scratch::Tensors, Scratch::Partials, Scratch::Moe, Scratch::Matmul, Scratch::Recurrent];

impl Scratch {
    pub fn name(self) -> &'static str {
        match self {
            Scratch::Tensors => "tensors",
            Scratch::Partials => "attention_partials",
            Scratch::Moe => "moe_scratch",
            Scratch::Matmul => "matmul_scratch",
            Scratch::Recurrent => "recurrent_scratch",
        }
    }
}

/// The most held at once, and by use at that moment.
#[derive(Default, Clone, Copy)]
struct Peak {
    total: u64,
    held: [u64; HELD.len()],
    in_use: [u64; SCRATCH.len()],
}

/// The counters of one device.
#[derive(Default)]
pub struct Ledger {
    held: [AtomicU64; HELD.len()],
    in_use: [AtomicU64; SCRATCH.len()],
    /// The device total's high-water mark (every use but `Readback`).
    peak: Mutex<Peak>,
    /// The activation pool's high-water mark of bytes in use.
    in_use_peak: Mutex<Peak>,
    /// The two marks' totals, read without the locks: a count below its
    /// mark (nearly every one once the pool is warm) takes no lock.
    peak_total: AtomicU64,
    in_use_total: AtomicU64,
}

impl Ledger {
    /// `bytes` more held for `h`.
    pub fn add(&self, h: Held, bytes: u64) {
        self.held[h as usize].fetch_add(bytes, Relaxed);
        self.note_peak();
    }

    /// `bytes` of `h` released.
    pub fn sub(&self, h: Held, bytes: u64) {
        let _ = self.held[h as usize].fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(bytes)));
    }

    /// `h` holds `bytes` now.
    pub fn set(&self, h: Held, bytes: u64) {
        self.held[h as usize].store(bytes, Relaxed);
        self.note_peak();
    }

    /// A claim on `bytes` of `h`, released when it is dropped.
    pub fn claim(self: &Arc<Self>, h: Held, bytes: u64) -> Claim {
        self.add(h, bytes);
        Claim { ledger: self.clone(), held: h, bytes }
    }

    fn held_now(&self) -> [u64; HELD.len()] {
        std::array::from_fn(|i| self.held[i].load(Relaxed))
    }

    fn in_use_now(&self) -> [u64; SCRATCH.len()] {
        std::array::from_fn(|i| self.in_use[i].load(Relaxed))
    }

    fn device_total(held: &[u64; HELD.len()]) -> u64 {
        HELD.iter().zip(held).filter(|(h, _)| **h != Held::Readback).map(|(_, b)| b).sum()
    }

    fn note_peak(&self) {
        let held = self.held_now();
        let total = Self::device_total(&held);
        if total <= self.peak_total.load(Relaxed) {
            return;
        }
        if let Ok(mut p) = self.peak.lock() {
            if total > p.total {
                self.peak_total.store(total, Relaxed);
                *p = Peak { total, held, in_use: self.in_use_now() };
            }
        }
    }

    /// A pooled buffer of `bytes` handed out for `s`.
    pub fn take(&self, s: Scratch, bytes: u64) {
        self.in_use[s as usize].fetch_add(bytes, Relaxed);
        let in_use = self.in_use_now();
        let total: u64 = in_use.iter().sum();
        // The lock only when the mark may move (rare once the pool is warm).
        if total <= self.in_use_total.load(Relaxed) {
            return;
        }
        let Ok(mut p) = self.in_use_peak.lock() else { return };
        if total > p.total {
            self.in_use_total.store(total, Relaxed);
            *p = Peak { total, held: self.held_now(), in_use };
        }
    }

    /// A pooled buffer of `bytes` given back by `s`.
    pub fn give(&self, s: Scratch, bytes: u64) {
        let _ = self.in_use[s as usize].fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(bytes)));
    }

    /// The report, with the allocator's blocks and allocated bytes where
    /// wgpu reports them.
    pub fn report(&self, allocator: Option<wgpu::AllocatorReport>) -> DeviceMemory {
        let named = |h: &[u64; HELD.len()]| HELD.iter().zip(h).map(|(k, b)| (k.name(), *b)).collect();
        let scratch = |s: &[u64; SCRATCH.len()]| SCRATCH.iter().zip(s).map(|(k, b)| (k.name(), *b)).collect();
        let held = self.held_now();
        let peak = self.peak.lock().map(|p| *p).unwrap_or_default();
        let in_use = self.in_use_peak.lock().map(|p| *p).unwrap_or_default();
        DeviceMemory {
            now_bytes: Self::device_total(&held),
            now: named(&held),
            peak_bytes: peak.total,
            at_peak: named(&peak.held),
            in_use_at_peak: scratch(&peak.in_use),
            scratch_peak_bytes: in_use.total,
            scratch_at_peak: scratch(&in_use.in_use),
            allocator: allocator.map(|r| (r.total_reserved_bytes, r.total_allocated_bytes)),
        }
    }
}

/// Bytes held for one use until dropped (a weight's shards, a KV cache's
/// buffers, a state).
pub struct Claim {
    ledger: Arc<Ledger>,
    held: Held,
    bytes: u64,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.ledger.sub(self.held, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(v: &[(&'static str, u64)], name: &str) -> u64 {
        v.iter().find(|(n, _)| *n == name).map_or(u64::MAX, |(_, b)| *b)
    }

    #[test]
    fn the_peak_keeps_what_was_held_at_that_moment() {
        let ledger = Arc::new(Ledger::default());
        let weights = ledger.claim(Held::Weights, 100);
        ledger.add(Held::Activations, 40);
        ledger.take(Scratch::Moe, 40);
        // Read-back buffers are host memory: listed, not in the device total.
        ledger.add(Held::Readback, 1000);
        let kv = ledger.claim(Held::KvCache, 60);
        drop(kv);
        ledger.give(Scratch::Moe, 40);
        ledger.take(Scratch::Tensors, 30);
        drop(weights);
        let r = ledger.report(None);
        assert_eq!((r.peak_bytes, r.now_bytes), (200, 40));
        assert_eq!((named(&r.at_peak, "kv_cache"), named(&r.at_peak, "weights")), (60, 100));
        assert_eq!(named(&r.in_use_at_peak, "moe_scratch"), 40);
        assert_eq!((named(&r.now, "kv_cache"), named(&r.now, "readback")), (0, 1000));
        // The scratch mark is the most in use at once (40, not 40 + 30), by kind then.
        assert_eq!((r.scratch_peak_bytes, named(&r.scratch_at_peak, "tensors")), (40, 0));
        // Staging is set, not added: each send states what is still in flight.
        ledger.set(Held::UploadStaging, 500);
        ledger.set(Held::UploadStaging, 0);
        assert_eq!(ledger.report(None).peak_bytes, 540);
    }
}
