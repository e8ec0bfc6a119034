//! How the backend's tensors and weights map onto device buffers: a tensor is
//! a pooled buffer or a view of columns of one, and binds as such.

use std::sync::Arc;

use slotstream_backend::{BackendError, Result, Tensor, Weight};

use crate::gpu::{whole, Bind, Gpu, GpuBuf};
use crate::weights::GpuWeight;

/// Columns of a one-row tensor, shared with it rather than copied: `bytes`
/// from byte `offset` of `base`'s buffer (`base` is never itself a view).
pub(crate) struct GpuView {
    base: Tensor,
    offset: u64,
    bytes: u64,
}

/// A tensor's storage binding: its whole buffer, or the bytes a view covers.
pub(crate) fn buf(t: &Tensor) -> Result<Bind<'_>> {
    if let Some(b) = t.buffer::<GpuBuf>() {
        return Ok(whole(b.buffer()));
    }
    if let Some(v) = t.buffer::<GpuView>() {
        let b = v.base.buffer::<GpuBuf>().ok_or_else(|| BackendError::Device("view of a non-wgpu tensor".into()))?;
        return Ok(Bind { buffer: b.buffer(), offset: v.offset, size: v.bytes });
    }
    Err(BackendError::Device("tensor does not belong to the wgpu backend".into()))
}

/// A tensor's bytes read back, as floats.
pub(crate) fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub(crate) fn weight(w: &Weight) -> Result<&GpuWeight> {
    w.buffer::<GpuWeight>().ok_or_else(|| BackendError::Device("weight does not belong to the wgpu backend".into()))
}

/// A new (uninitialised) tensor of `floats` values, and its buffer to bind as output.
pub(crate) fn new_tensor(gpu: &Gpu, floats: usize, shape: Vec<usize>) -> Result<(Tensor, Arc<GpuBuf>)> {
    let b = Arc::new(gpu.alloc(4 * floats as u64)?);
    Ok((Tensor::from_buffer(b.clone(), shape), b))
}

/// Columns `[start, start+len)` of the one-row `x` as a view sharing its
/// buffer, when the adapter can bind it: the offset suits the binding
/// alignment and the size is a whole number of vec4s (which some kernels bind
/// x as). `None`: the columns need a copy.
pub(crate) fn column_view(gpu: &Gpu, x: &Tensor, start: usize, len: usize) -> Result<Option<Tensor>> {
    let xb = buf(x)?;
    let offset = xb.offset + 4 * start as u64;
    let align = gpu.limits.min_storage_buffer_offset_alignment as u64;
    if !gpu.views || x.rows() != 1 || len == 0 || offset % align.max(4) != 0 || len % 4 != 0 {
        return Ok(None);
    }
    let base = match x.buffer::<GpuView>() {
        Some(v) => v.base.clone(),
        None => x.clone(),
    };
    let view = GpuView { base, offset, bytes: 4 * len as u64 };
    Ok(Some(Tensor::from_buffer(Arc::new(view), vec![1, len])))
}
