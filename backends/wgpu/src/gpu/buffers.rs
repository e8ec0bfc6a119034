//! Device buffers: bindings, pooled activation buffers, the ring of small
//! per-call inputs, and buffers that live outside the pool (weights, states).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use slotstream_backend::{BackendError, Result};

use super::{Gpu, Held, Ledger, Scratch};

/// Small uploads served from the ring (larger ones get a buffer of their own).
const RING_MAX_BYTES: usize = 1 << 20;

/// A storage binding: a whole buffer (`size` 0) or `size` bytes from `offset`
/// (a view, e.g. columns of a one-row tensor; see `slice_cols`).
#[derive(Clone, Copy)]
pub struct Bind<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: u64,
}

/// The whole of `buffer` as a binding.
pub fn whole(buffer: &wgpu::Buffer) -> Bind<'_> {
    Bind { buffer, offset: 0, size: 0 }
}

/// Buffers freed by dropped tensors, by size, for reuse.
pub(super) type FreeList = Arc<Mutex<BTreeMap<u64, Vec<wgpu::Buffer>>>>;

/// A free buffer up to this many times the size asked for may serve it. A
/// prompt's last, shorter chunk then runs in the buffers of the full chunks
/// before it, where asking for the exact size made a second set of every
/// activation: on a 4-layer qwen3_moe synthetic (hidden 256) a 7,292-token
/// prompt (three chunks of 2,048 and one of 1,148) created 98.2 MB of
/// activation buffers before, 60.2 MB with this; scaled to Qwen3-30B-A3B's
/// trunk (hidden 2048) about 0.3 GB less at the peak of a long prompt.
const REUSE_SLACK: u64 = 2;

/// The smallest free buffer of `size` to `REUSE_SLACK * size` bytes, taken
/// out of `free`.
fn take_fitting(free: &mut BTreeMap<u64, Vec<wgpu::Buffer>>, size: u64) -> Option<wgpu::Buffer> {
    let (&fit, _) = free.range(size..=size.saturating_mul(REUSE_SLACK)).find(|(_, list)| !list.is_empty())?;
    let list = free.get_mut(&fit)?;
    let buffer = list.pop();
    if list.is_empty() {
        free.remove(&fit);
    }
    buffer
}

/// A device buffer holding an activation tensor. Returned to the free list
/// when the last tensor sharing it is dropped; reuse is safe because every
/// later write is recorded after every earlier read in the same queue.
pub struct GpuBuf {
    buffer: Option<wgpu::Buffer>,
    free: FreeList,
    /// What it is in use for, counted in the ledger until dropped.
    scratch: Scratch,
    ledger: Arc<Ledger>,
}

impl GpuBuf {
    pub fn buffer(&self) -> &wgpu::Buffer {
        // Only `Drop` takes the buffer out.
        self.buffer.as_ref().expect("GpuBuf used after drop")
    }
    pub fn bind(&self) -> Bind<'_> {
        whole(self.buffer())
    }
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut free)) = (self.buffer.take(), self.free.lock()) {
            self.ledger.give(self.scratch, b.size());
            free.entry(b.size()).or_default().push(b);
        }
    }
}

impl Gpu {
    /// An uninitialised activation buffer of at least `bytes` bytes (a free
    /// one of up to twice that size where there is one: kernels take their
    /// extents from their parameters, never from the buffer's length).
    pub fn alloc(&self, bytes: u64) -> Result<GpuBuf> {
        self.alloc_for(Scratch::Tensors, bytes)
    }

    /// [`Gpu::alloc`] counted in the ledger as in use for `scratch`.
    pub fn alloc_for(&self, scratch: Scratch, bytes: u64) -> Result<GpuBuf> {
        let size = bytes.max(16).div_ceil(16) * 16;
        let limit = self.max_binding();
        if size > limit {
            return Err(BackendError::Device(format!(
                "an activation of {size} bytes exceeds the adapter's {limit} byte storage binding limit"
            )));
        }
        let reused = self.free.lock().ok().and_then(|mut f| take_fitting(&mut f, size));
        let buffer = reused.unwrap_or_else(|| {
            use std::sync::atomic::Ordering::Relaxed;
            self.host_time.buffers.fetch_add(1, Relaxed);
            self.host_time.buffer_bytes.fetch_add(size, Relaxed);
            self.ledger.add(Held::Activations, size);
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("activation"),
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        Ok(self.pooled(buffer, scratch))
    }

    /// `buffer` handed out as in use for `scratch`, back to the pool when dropped.
    fn pooled(&self, buffer: wgpu::Buffer, scratch: Scratch) -> GpuBuf {
        self.ledger.take(scratch, buffer.size());
        GpuBuf { buffer: Some(buffer), free: self.free.clone(), scratch, ledger: self.ledger.clone() }
    }

    /// A new buffer holding `bytes` (padded to 16 bytes), written at creation,
    /// so it never races with recorded work.
    pub fn buffer_with(&self, label: &str, bytes: &[u8], usage: wgpu::BufferUsages) -> Result<wgpu::Buffer> {
        self.buffer_filled(label, bytes.len(), usage, |view| view.copy_from_slice(bytes))
    }

    /// A new buffer of `len` bytes (padded to 16) that `fill` writes in place
    /// at creation (the staging of a discrete GPU, or the buffer itself), so
    /// it never races with recorded work.
    pub fn buffer_filled(
        &self,
        label: &str,
        len: usize,
        usage: wgpu::BufferUsages,
        fill: impl FnOnce(&mut wgpu::WriteOnly<'_, [u8]>),
    ) -> Result<wgpu::Buffer> {
        let size = (len as u64).max(16).div_ceil(16) * 16;
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor { label: Some(label), size, usage, mapped_at_creation: true });
        {
            let mut view = buffer.slice(..).get_mapped_range_mut().map_err(|e| super::device_error("writing a new buffer", e))?;
            fill(&mut view.slice(..len));
        }
        buffer.unmap();
        Ok(buffer)
    }

    /// A read-only storage buffer holding `bytes` for the ops recorded next
    /// (until the next submission): a ring entry written just before that
    /// submission, or a new buffer for large inputs.
    pub fn small_input(&self, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer> {
        if bytes.len() > RING_MAX_BYTES {
            return self.buffer_with(label, bytes, wgpu::BufferUsages::STORAGE);
        }
        let mut guard = self.pending()?;
        let p = &mut *guard;
        let size = (bytes.len() as u64).max(16).div_ceil(16) * 16;
        // The same bytes again in one submission (every layer's rotary table
        // and key selection for a token) share the entry that holds them.
        let mut data = bytes.to_vec();
        data.resize(size as usize, 0);
        if let Some(&i) = p.ring_index.get(&data) {
            return Ok(p.ring[i].clone());
        }
        let i = p.ring_data.len();
        if p.ring.len() <= i || p.ring[i].size() < size {
            let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("small inputs"),
                size: size.next_power_of_two().max(256),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            self.ledger.add(Held::Inputs, buffer.size());
            if p.ring.len() <= i {
                p.ring.push(buffer);
            } else {
                self.ledger.sub(Held::Inputs, p.ring[i].size());
                p.ring[i] = buffer;
            }
        }
        p.ring_index.insert(data.clone(), i);
        p.ring_data.push(data);
        Ok(p.ring[i].clone())
    }

    /// A pooled activation buffer holding `bytes`.
    pub fn upload_activation(&self, bytes: &[u8]) -> Result<GpuBuf> {
        let buffer = self.buffer_with(
            "upload",
            bytes,
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        )?;
        self.ledger.add(Held::Activations, buffer.size());
        Ok(self.pooled(buffer, Scratch::Tensors))
    }

    /// A zero-filled buffer that lives outside the pool (states).
    pub fn zeroed(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(16).div_ceil(16) * 16,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }
}
