//! Per-sequence state on the device: the KV cache (grown by a quarter), the
//! window of a causal convolution and the gated delta rule's matrix state.
//! Each holds the device it lives on, so it can copy itself.

use std::sync::Arc;

use slotstream_backend::{BackendError, DeviceState, KvCacheType, Result};

use crate::gpu::{Bind, Claim, Gpu, Held};

/// Positions a new KV cache has room for before it first grows.
const KV_INITIAL_CAPACITY: usize = 256;

/// A device copy of `b` (recorded in op order, after every earlier write).
fn duplicate_buffer(gpu: &Gpu, b: &wgpu::Buffer, label: &str) -> Result<wgpu::Buffer> {
    let copy = gpu.zeroed(label, b.size());
    gpu.copy(b, 0, &copy, 0, b.size())?;
    Ok(copy)
}

/// Keys and values of one attention layer, `[capacity, kv_heads*head_dim]`
/// of f32, or of f16 two to a word, or q8 (by `kind`; each head's
/// row `head_dim / 4` words of four int8 then `head_dim / 64` words of two
/// f16 scales, one per block of 32: `wgsl/flash_attention.wgsl`), grown by
/// a quarter.
pub struct GpuKvCache {
    gpu: Arc<Gpu>,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) kind: KvCacheType,
    pub(crate) len: usize,
    capacity: usize,
    pub(crate) keys: wgpu::Buffer,
    pub(crate) values: wgpu::Buffer,
    /// Both buffers' bytes in the device's ledger.
    claim: Claim,
}

impl GpuKvCache {
    /// An empty cache of `kind` (q8 for a head dim of whole 64s).
    pub(crate) fn new(gpu: &Arc<Gpu>, kv_heads: usize, head_dim: usize, kind: KvCacheType) -> GpuKvCache {
        let capacity = KV_INITIAL_CAPACITY;
        let row = (kv_heads * kind.bytes(head_dim)) as u64;
        let (keys, values) = (gpu.zeroed("kv keys", row * capacity as u64), gpu.zeroed("kv values", row * capacity as u64));
        GpuKvCache {
            gpu: gpu.clone(),
            kv_heads,
            head_dim,
            kind,
            len: 0,
            capacity,
            claim: gpu.ledger.claim(Held::KvCache, keys.size() + values.size()),
            keys,
            values,
        }
    }

    /// Bytes of one position's keys (or values).
    fn row_bytes(&self) -> u64 {
        (self.kv_heads * self.kind.bytes(self.head_dim)) as u64
    }

    /// Records appending `tokens` rows of keys `k` and values `v`
    /// (`[tokens, kv_heads*head_dim]` each, f32) to an f32 cache, growing it
    /// first if needed (an f16 or q8 cache converts them in a kernel:
    /// `attention::append`).
    pub(crate) fn append(&mut self, k: Bind<'_>, v: Bind<'_>, tokens: usize) -> Result<()> {
        if self.kind != KvCacheType::F32 {
            return Err(BackendError::Device(format!("a {} KV cache takes its rows through a kernel, not a copy", self.kind)));
        }
        let row = self.row_bytes();
        let past = self.len;
        self.reserve(tokens)?;
        self.gpu.copy(k.buffer, k.offset, &self.keys, row * past as u64, row * tokens as u64)?;
        self.gpu.copy(v.buffer, v.offset, &self.values, row * past as u64, row * tokens as u64)?;
        self.len += tokens;
        Ok(())
    }

    /// Counts `tokens` more positions whose rows the attention kernel itself
    /// writes (its `fresh` mode), growing the cache first if needed.
    pub(crate) fn append_in_kernel(&mut self, tokens: usize) -> Result<()> {
        self.reserve(tokens)?;
        self.len += tokens;
        Ok(())
    }

    /// Room for `tokens` more positions (a copy into a larger cache when full).
    pub(crate) fn reserve(&mut self, tokens: usize) -> Result<()> {
        let row = self.row_bytes();
        let past = self.len;
        if past + tokens > self.capacity {
            // A quarter more, in whole initial capacities: at most 25% of
            // the cache unused (doubling left up to half of a long
            // context's cache unused), for a copy of the cache every
            // quarter of its length.
            let capacity = (self.capacity + self.capacity / 4).max(past + tokens).div_ceil(KV_INITIAL_CAPACITY) * KV_INITIAL_CAPACITY;
            if row * capacity as u64 > self.gpu.max_binding() {
                return Err(BackendError::Unsupported(format!(
                    "a KV cache of {capacity} positions exceeds the adapter's storage binding limit"
                )));
            }
            // The load's upload staging is freed before the cache takes its room.
            self.gpu.settle_uploads()?;
            let keys = self.gpu.zeroed("kv keys", row * capacity as u64);
            let values = self.gpu.zeroed("kv values", row * capacity as u64);
            self.gpu.copy(&self.keys, 0, &keys, 0, row * past as u64)?;
            self.gpu.copy(&self.values, 0, &values, 0, row * past as u64)?;
            // The old buffers live until the copy has run; counted as released now.
            self.claim = self.gpu.ledger.claim(Held::KvCache, keys.size() + values.size());
            (self.keys, self.values, self.capacity) = (keys, values, capacity);
        }
        Ok(())
    }
}

impl DeviceState for GpuKvCache {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(GpuKvCache {
            gpu: self.gpu.clone(),
            keys: duplicate_buffer(&self.gpu, &self.keys, "kv keys")?,
            values: duplicate_buffer(&self.gpu, &self.values, "kv values")?,
            claim: self.gpu.ledger.claim(Held::KvCache, self.keys.size() + self.values.size()),
            ..*self
        }))
    }

    fn bytes(&self) -> usize {
        (self.keys.size() + self.values.size()) as usize
    }
}

/// The last `(kernel-1)*dilation` inputs of a causal convolution,
/// `[(kernel-1)*dilation, channels]`.
pub struct GpuConvState {
    gpu: Arc<Gpu>,
    pub(crate) channels: usize,
    pub(crate) kernel: usize,
    pub(crate) dilation: usize,
    pub(crate) window: wgpu::Buffer,
    /// The buffer the next call writes the new window into (then swapped).
    pub(crate) spare: wgpu::Buffer,
    _claim: Claim,
}

impl GpuConvState {
    pub(crate) fn new(gpu: &Arc<Gpu>, channels: usize, kernel: usize, dilation: usize) -> GpuConvState {
        let bytes = 4 * ((kernel - 1) * dilation * channels) as u64;
        let window = gpu.zeroed("conv window", bytes);
        let spare = gpu.zeroed("conv window", bytes);
        let claim = gpu.ledger.claim(Held::States, window.size() + spare.size());
        GpuConvState { gpu: gpu.clone(), channels, kernel, dilation, window, spare, _claim: claim }
    }
}

impl DeviceState for GpuConvState {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(GpuConvState {
            gpu: self.gpu.clone(),
            window: duplicate_buffer(&self.gpu, &self.window, "conv window")?,
            spare: self.gpu.zeroed("conv window", self.spare.size()),
            _claim: self.gpu.ledger.claim(Held::States, self.window.size() + self.spare.size()),
            ..*self
        }))
    }

    fn bytes(&self) -> usize {
        (self.window.size() + self.spare.size()) as usize
    }
}

/// Gated DeltaNet matrix state, `[heads, value_dim, key_dim]`.
pub struct GpuRecurrentState {
    gpu: Arc<Gpu>,
    pub(crate) heads: usize,
    pub(crate) key_dim: usize,
    pub(crate) value_dim: usize,
    pub(crate) s: wgpu::Buffer,
    _claim: Claim,
}

impl GpuRecurrentState {
    pub(crate) fn new(gpu: &Arc<Gpu>, heads: usize, key_dim: usize, value_dim: usize) -> GpuRecurrentState {
        let s = gpu.zeroed("recurrent state", 4 * (heads * key_dim * value_dim) as u64);
        let claim = gpu.ledger.claim(Held::States, s.size());
        GpuRecurrentState { gpu: gpu.clone(), heads, key_dim, value_dim, s, _claim: claim }
    }
}

impl DeviceState for GpuRecurrentState {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(GpuRecurrentState {
            gpu: self.gpu.clone(),
            s: duplicate_buffer(&self.gpu, &self.s, "recurrent state")?,
            _claim: self.gpu.ledger.claim(Held::States, self.s.size()),
            ..*self
        }))
    }

    fn bytes(&self) -> usize {
        self.s.size() as usize
    }
}
