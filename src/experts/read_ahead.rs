//! Reads that run ahead of the compute that needs them: a streaming decode's
//! guess of the next MoE layer's experts ([`ExpertCache::guess_next`]), and
//! a long call's staged experts, each group read while the group before it
//! computes ([`GroupReads`]).

use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use slotstream_backend::{Backend, Routes};

use super::{CacheCounters, ExpertCache, ExpertRecord, ExpertStore};

/// Where a read on the store's threads sends its records and seconds ([`ExpertStore::read_later`]).
type Landing = Receiver<Result<(Vec<ExpertRecord>, f64)>>;

/// Experts of one MoE layer being read ahead of its call.
pub(super) struct Ahead {
    pub layer: usize,
    pub experts: Vec<u32>,
    pub records: Landing,
}

impl ExpertCache {
    /// Notes `guess` (the next MoE layer's router applied to this layer's
    /// input: in trained models the hidden state moves little between
    /// layers) as a guess of MoE layer `layer`'s experts. Those not in a
    /// slot are read once the current call has issued its own reads, and
    /// that call uses whichever it then needs. Output never depends on it.
    /// The current call's `current` routes are read back with the guess (one
    /// round trip on a GPU); their ids are returned for [`ExpertCache::run_layer`].
    pub fn guess_next(&mut self, b: &dyn Backend, layer: usize, guess: &Routes, current: &Routes) -> Result<Vec<u32>> {
        if layer >= self.store.layers || guess.gating.experts != self.store.experts_per_layer {
            bail!("a guess for MoE layer {layer} over {} experts does not fit the store", guess.gating.experts);
        }
        let mut both = b.routed_experts_many(&[current, guess])?.into_iter();
        let (Some(current_ids), Some(guessed)) = (both.next(), both.next()) else {
            bail!("the backend read back fewer routings than asked for");
        };
        // Each token's best `read_ahead` guesses (ids come best first).
        let k = guess.gating.top_k.max(1);
        let mut ids: Vec<u32> = guessed.chunks(k).flat_map(|t| t[..self.read_ahead.min(t.len())].to_vec()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.retain(|&e| (e as usize) < self.store.experts_per_layer && !self.slot_of.contains_key(&self.key(layer, e)));
        self.guessed = (!ids.is_empty()).then_some((layer, ids));
        Ok(current_ids)
    }

    /// Takes what is being read ahead for `layer`, counted in `counters`
    /// (without waiting for it), with the experts of `misses` it holds;
    /// `None` when it holds none of them. Anything read ahead is counted
    /// as read, whether used or dropped (for another layer).
    pub(super) fn take_ahead(&mut self, layer: usize, misses: &[u32], counters: &mut CacheCounters) -> Option<(Ahead, Vec<u32>)> {
        let ahead = self.ahead.take()?;
        let covered: Vec<u32> =
            if ahead.layer == layer { misses.iter().copied().filter(|e| ahead.experts.contains(e)).collect() } else { Vec::new() };
        counters.read_ahead += ahead.experts.len() as u64;
        counters.read_ahead_used += covered.len() as u64;
        // The guesses not used were read all the same.
        counters.bytes_read += (ahead.experts.len() - covered.len()) as u64 * self.store.record_bytes;
        (!covered.is_empty()).then_some((ahead, covered))
    }
}

/// A call's staged experts read group by group on the store's read threads,
/// the next group's read in flight while the caller computes the one it has.
pub(super) struct GroupReads {
    store: Arc<ExpertStore>,
    layer: usize,
    groups: std::vec::IntoIter<Vec<u32>>,
    in_flight: Option<(Vec<u32>, Landing)>,
}

/// One group's records as they came back.
pub(super) struct GroupRead {
    pub experts: Vec<u32>,
    pub records: Vec<ExpertRecord>,
    /// Seconds the reads took, and seconds the caller stood waiting for them.
    pub read_seconds: f64,
    pub wait_seconds: f64,
}

impl GroupReads {
    /// Issues the first group's reads.
    pub fn start(store: &Arc<ExpertStore>, layer: usize, groups: Vec<Vec<u32>>) -> GroupReads {
        let mut reads = GroupReads { store: Arc::clone(store), layer, groups: groups.into_iter(), in_flight: None };
        reads.issue();
        reads
    }

    pub fn store(&self) -> &ExpertStore {
        &self.store
    }

    fn issue(&mut self) {
        self.in_flight = self.groups.next().map(|experts| (experts.clone(), self.store.read_later(self.layer, experts)));
    }

    /// Waits for the group in flight and issues the next one's reads.
    pub fn next_group(&mut self) -> Option<Result<GroupRead>> {
        let (experts, records) = self.in_flight.take()?;
        let wait = Instant::now();
        let got = records.recv();
        let wait_seconds = wait.elapsed().as_secs_f64();
        self.issue();
        Some(match got {
            Ok(Ok((records, read_seconds))) => Ok(GroupRead { experts, records, read_seconds, wait_seconds }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(anyhow::anyhow!("the read of MoE layer {}'s staged experts ended without an answer", self.layer)),
        })
    }
}
