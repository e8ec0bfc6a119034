//! The wgpu backend: every op of [`slotstream_backend::Backend`] as a WGSL
//! compute kernel (sources in `wgsl/` at the repository root), on Vulkan
//! (Linux, Windows) or Metal (macOS).
//!
//! Activations, weights, the expert pool and all per-sequence state stay on
//! the GPU. Ops are recorded lazily into one command encoder and submitted
//! when the host needs data back: per decoded token that is one submission
//! and one wait per MoE layer (the router logits, which decide which experts
//! the slot pool must hold) plus one for the final logits. Writing an expert
//! into the pool also submits what was recorded before it (without waiting),
//! so the write lands after every earlier read of that slot.

mod device;
mod gpu;
pub mod kernels;
mod weights;

use std::sync::Arc;

use slotstream_backend::{
    shape_error, Backend, BackendError, ExpertAssignment, ExpertLayout, ExpertPool, GateAct, HostExpert, HostMatrix,
    KeySelection, Result, State, Tensor, Weight, DType, DeviceState,
};

pub use device::AdapterChoice;
pub use gpu::FamilyTime;
/// The wgpu version this backend is built on (for `device_type` and similar).
pub use wgpu;
use gpu::{whole, Bind, Gpu, GpuBuf};
use weights::{GpuPool, GpuWeight};

/// Tokens up to which `matmul` uses the row-per-subgroup matvec kernel;
/// longer inputs use the tiled kernel.
const MATVEC_MAX_TOKENS: usize = 8;

/// Interleaved 4-bit weights of at least this many rows take one subgroup per
/// eight rows in the one-token matvec (fewer: four, for more parallelism).
/// `SLOTSTREAM_WGPU_Q4_EIGHT_ROWS_FROM` overrides it (tests set 1).
const Q4_EIGHT_ROWS_FROM: usize = 8192;

fn q4_eight_rows_from() -> usize {
    static FROM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| {
        std::env::var("SLOTSTREAM_WGPU_Q4_EIGHT_ROWS_FROM").ok().and_then(|v| v.parse().ok()).unwrap_or(Q4_EIGHT_ROWS_FROM)
    })
}

/// Groups at least this long are normalised by a whole workgroup each.
const WIDE_NORM_DIM: usize = 1024;

/// Weights below this many bytes keep f32 activations in int8 mode. Their
/// one-token products are bound by latency, not by arithmetic: on an H200 a
/// 3.6 MB matrix takes 9.7 µs exact and 15.3 µs in int8 (the extra quantize
/// dispatch costs ~5.6 µs), a 176 MB one 97.5 µs exact and 67.0 µs in int8;
/// with int8 at ~0.6x the exact time plus 5.6 µs they break even near 27 MB
/// (BENCHMARKS.md, GPU (a) int8).
pub const INT8_MIN_BYTES: usize = 32 << 20;

/// How one-token matmuls of 4-bit weights treat the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulMode {
    /// f32 activations everywhere: the reference the kernel tests compare with
    /// the CPU backend at 1e-5.
    Exact,
    /// One-token products with large interleaved 4-bit weights (resident
    /// weights with 16-bit scales, at least [`INT8_MIN_BYTES`]; see
    /// [`WgpuBackend::with_int8_min_bytes`]) quantize x to int8 per block of
    /// 32 columns and use packed integer dot products (`wgsl/matvec_q8.wgsl`);
    /// like the CPU backend's int8 activations this costs a few 1e-3 relative
    /// error per matmul. Everything else is computed as in `Exact`.
    Int8,
}

impl MatmulMode {
    /// The mode `SLOTSTREAM_WGPU_MATMUL` asks for (`exact` or `int8`), else `default`.
    pub fn from_env(default: MatmulMode) -> MatmulMode {
        match std::env::var("SLOTSTREAM_WGPU_MATMUL").as_deref() {
            Ok("exact") => MatmulMode::Exact,
            Ok("int8") => MatmulMode::Int8,
            _ => default,
        }
    }
}

/// The wgpu implementation of the backend trait. Clones share the device and
/// its command recorder (so a benchmark can keep a handle for profiling after
/// giving the backend to an engine).
#[derive(Clone)]
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    mode: MatmulMode,
    /// Int8 mode applies to weights of at least this many bytes.
    int8_min_bytes: usize,
}

fn f(x: f32) -> u32 {
    x.to_bits()
}

fn u(x: usize) -> u32 {
    x as u32
}

/// A tensor's storage binding: its whole buffer, or the bytes a view
/// (`GpuView`, from `slice_cols`) covers.
fn buf(t: &Tensor) -> Result<Bind<'_>> {
    if let Some(b) = t.buffer::<GpuBuf>() {
        return Ok(whole(b.buffer()));
    }
    if let Some(v) = t.buffer::<GpuView>() {
        let b = v.base.buffer::<GpuBuf>().ok_or_else(|| BackendError::Device("view of a non-wgpu tensor".into()))?;
        return Ok(Bind { buffer: b.buffer(), offset: v.offset, size: v.bytes });
    }
    Err(BackendError::Device("tensor does not belong to the wgpu backend".into()))
}

/// Columns of a one-row tensor, shared with it rather than copied: `bytes`
/// from byte `offset` of `base`'s buffer (`base` is never itself a view).
struct GpuView {
    base: Tensor,
    offset: u64,
    bytes: u64,
}

fn weight(w: &Weight) -> Result<&GpuWeight> {
    w.buffer::<GpuWeight>().ok_or_else(|| BackendError::Device("weight does not belong to the wgpu backend".into()))
}

fn groups_of(op: &'static str, x: &Tensor, dim: usize) -> Result<()> {
    if dim == 0 || x.numel() % dim != 0 {
        return Err(shape_error(op, format!("{:?} is not a whole number of groups of {dim}", x.shape())));
    }
    Ok(())
}

fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(shape_error(op, format!("{:?} vs {:?}", a.shape(), b.shape())));
    }
    Ok(())
}

/// Query rows of a key selection as `attention_sparse` reads them, `per_query + 1`
/// words each: `[DENSE, ..]`, or `[count, blocks..]` with the listed blocks that
/// add keys to [`KeySelection::keys_of`]'s set beyond the query's own trailing
/// partial block: UNUSED entries, repeats and blocks not wholly before that
/// partial block are dropped. Also returns the most keys any query sees.
fn selection_rows(sel: &KeySelection, past: usize, tokens: usize) -> (Vec<u32>, usize) {
    let (block, per) = (sel.block, sel.per_query);
    let mut words = vec![0u32; tokens * (per + 1)];
    let mut seen = vec![0u64; ((past + tokens) / block).div_ceil(64).max(1)];
    let mut most = 0;
    for (t, (entries, row)) in sel.blocks.chunks_exact(per).zip(words.chunks_exact_mut(per + 1)).enumerate() {
        let pos = past + t;
        if entries[0] == KeySelection::DENSE {
            row[0] = KeySelection::DENSE;
            most = most.max(pos + 1);
            continue;
        }
        let own = (pos + 1) / block;
        let mut count = 0;
        for &b in entries {
            let bi = b as usize;
            if b == KeySelection::UNUSED || bi >= own || seen[bi / 64] & (1 << (bi % 64)) != 0 {
                continue;
            }
            seen[bi / 64] |= 1 << (bi % 64);
            count += 1;
            row[count] = b;
        }
        for &b in &row[1..=count] {
            seen[b as usize / 64] = 0;
        }
        row[0] = count as u32;
        most = most.max(count * block + pos + 1 - own * block);
    }
    (words, most)
}

/// Keys and values of one attention layer, `[capacity, kv_heads*head_dim]`,
/// grown by doubling.
pub struct GpuKvCache {
    gpu: Arc<Gpu>,
    kv_heads: usize,
    head_dim: usize,
    len: usize,
    capacity: usize,
    keys: wgpu::Buffer,
    values: wgpu::Buffer,
}

/// The last `(kernel-1)*dilation` inputs of a causal convolution,
/// `[(kernel-1)*dilation, channels]`.
pub struct GpuConvState {
    gpu: Arc<Gpu>,
    channels: usize,
    kernel: usize,
    dilation: usize,
    window: wgpu::Buffer,
    /// The buffer the next call writes the new window into (then swapped).
    spare: wgpu::Buffer,
}

/// Gated DeltaNet matrix state, `[heads, value_dim, key_dim]`.
pub struct GpuRecurrentState {
    gpu: Arc<Gpu>,
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    s: wgpu::Buffer,
}

impl WgpuBackend {
    /// Opens the adapter `choice` selects (see [`AdapterChoice`]), in
    /// [`MatmulMode::Exact`] (see [`WgpuBackend::with_matmul_mode`]).
    pub fn new(choice: &AdapterChoice) -> Result<WgpuBackend> {
        let adapter = device::select_adapter(choice)?;
        Ok(WgpuBackend { gpu: Arc::new(Gpu::open(adapter, true)?), mode: MatmulMode::Exact, int8_min_bytes: INT8_MIN_BYTES })
    }

    /// The same device with matmuls in `mode` (a clone: shares the device,
    /// its pipelines and its command recorder).
    pub fn with_matmul_mode(&self, mode: MatmulMode) -> WgpuBackend {
        WgpuBackend { gpu: self.gpu.clone(), mode, int8_min_bytes: self.int8_min_bytes }
    }

    /// The same device with int8 mode applied to weights of at least `bytes`
    /// bytes instead of [`INT8_MIN_BYTES`] (tests and benchmarks use 0 to
    /// reach the int8 kernels with small matrices).
    pub fn with_int8_min_bytes(&self, bytes: usize) -> WgpuBackend {
        WgpuBackend { gpu: self.gpu.clone(), mode: self.mode, int8_min_bytes: bytes }
    }

    pub fn matmul_mode(&self) -> MatmulMode {
        self.mode
    }

    /// The int8 form of a one-row `x` exactly as `matvec_q8` reads it, one
    /// `[even bytes, odd bytes, sum bits, scale bits]` entry per 8 columns
    /// (see `wgsl/matvec_q8.wgsl`): lets tests check the quantize kernel
    /// against a host reference.
    pub fn quantized_x8(&self, x: &Tensor) -> Result<Vec<[u32; 4]>> {
        let cols = x.cols();
        if x.rows() != 1 || cols % 32 != 0 {
            return Err(shape_error("quantized_x8", format!("x {:?} (one row of a multiple of 32 columns)", x.shape())));
        }
        let xq = self.quantize_x8(buf(x)?, cols)?;
        let bytes = self.gpu.download(xq.bind(), 2 * cols as u64)?;
        Ok(bytes
            .chunks_exact(16)
            .map(|e| std::array::from_fn(|k| u32::from_le_bytes([e[4 * k], e[4 * k + 1], e[4 * k + 2], e[4 * k + 3]])))
            .collect())
    }

    /// Like [`WgpuBackend::new`], but the kernels are compiled without the
    /// bounds checks wgpu adds to every buffer access (for benchmarking what
    /// they cost).
    ///
    /// # Safety
    /// An out-of-bounds index in a kernel then reads or writes arbitrary GPU
    /// memory; only use this with inputs the checked backend has run cleanly.
    pub unsafe fn new_unchecked(choice: &AdapterChoice) -> Result<WgpuBackend> {
        let adapter = device::select_adapter(choice)?;
        Ok(WgpuBackend { gpu: Arc::new(Gpu::open(adapter, false)?), mode: MatmulMode::Exact, int8_min_bytes: INT8_MIN_BYTES })
    }

    /// The adapter's type (a software rasterizer reports `Cpu`).
    pub fn device_type(&self) -> wgpu::DeviceType {
        self.gpu.info.device_type
    }

    /// Shards weights and expert pools to at most `bytes` per buffer (instead
    /// of the adapter's binding limit) from now on: lets tests exercise
    /// sharding with small matrices. 0 restores the adapter's limit.
    pub fn cap_shard_bytes(&self, bytes: u64) {
        self.gpu.binding_cap.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Smallest and largest subgroup size the adapter reports.
    pub fn subgroup_sizes(&self) -> (u32, u32) {
        (self.gpu.subgroup_min, self.gpu.subgroup_max)
    }

    /// Whether uploads into the expert pool map the (unified-memory) buffers
    /// directly instead of going through staging copies.
    pub fn uses_mapped_primary_buffers(&self) -> bool {
        self.gpu.mapped_primary
    }

    /// Starts or stops timing each kernel dispatch (needs timestamp queries).
    /// While on, every submission waits for its timings.
    pub fn set_profiling(&self, on: bool) -> Result<()> {
        self.gpu.set_profiling(on)
    }

    /// GPU time by kernel family (the `wgsl/` file) since profiling started.
    pub fn kernel_profile(&self) -> Vec<(String, FamilyTime)> {
        self.gpu.profile()
    }

    /// Submits recorded work after every `n` dispatches (0: only when the
    /// host reads data back or writes the expert pool).
    pub fn set_flush_every(&self, n: u32) {
        self.gpu.flush_every.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts command submissions the host asked for (downloads, pool writes,
    /// flushes; not the periodic ones of [`WgpuBackend::set_flush_every`]),
    /// i.e. the round trips; stays valid
    /// after the backend is moved into an engine.
    pub fn submission_counter(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.gpu.submissions.clone()
    }

    /// Submits recorded work and waits until the GPU is idle.
    pub fn sync(&self) -> Result<()> {
        self.gpu.flush()?;
        self.gpu
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| BackendError::Device(format!("waiting for the GPU: {e}")))?;
        Ok(())
    }

    fn new_tensor(&self, floats: usize, shape: Vec<usize>) -> Result<(Tensor, Arc<GpuBuf>)> {
        let b = Arc::new(self.gpu.alloc(4 * floats as u64)?);
        Ok((Tensor::from_buffer(b.clone(), shape), b))
    }

    /// A one-thread-per-value elementwise kernel over `n` outputs.
    fn elementwise(&self, entry: &str, params: [u32; 8], binds: &[(u32, Bind<'_>)], n: usize) -> Result<()> {
        self.gpu.dispatch(entry, &params, binds, Gpu::grid((n as u64).div_ceil(256)))
    }

    /// Workgroups for kernels that give each of `items` one subgroup, in
    /// workgroups of `wg` invocations.
    fn subgroup_grid(&self, items: usize, wg: u32) -> u32 {
        let per_wg = (wg / self.gpu.subgroup_max).max(1) as usize;
        items.div_ceil(per_wg).clamp(1, gpu::MAX_GROUPS as usize) as u32
    }

    /// `causal_conv1d`, then `silu` when `silu`.
    fn conv(&self, x: &Tensor, w: &Tensor, state: &mut State, silu: bool) -> Result<Tensor> {
        let st = state.get_mut::<GpuConvState>().ok_or_else(|| BackendError::Device("not a wgpu conv state".into()))?;
        let (c, kk, dil) = (st.channels, st.kernel, st.dilation);
        if x.cols() != c || w.numel() != c * kk {
            return Err(shape_error("causal_conv1d", format!("x {:?}, weight {:?}, {c} channels x {kk}", x.shape(), w.shape())));
        }
        let tokens = x.rows();
        let n = tokens * c;
        let (out, ob) = self.new_tensor(n, vec![tokens, c])?;
        let xb = buf(x)?;
        let params = [u(tokens), u(c), u(kk), u(n), u(dil), u(silu as usize), 0, 0];
        self.elementwise("conv1d", params, &[(2, xb), (3, ob.bind()), (4, buf(w)?), (5, whole(&st.window))], n)?;
        let hist = (kk - 1) * dil * c;
        if hist > 0 {
            let params = [u(tokens), u(c), u(kk), u(hist), u(dil), 0, 0, 0];
            self.elementwise("conv_window", params, &[(2, xb), (3, whole(&st.spare)), (5, whole(&st.window))], hist)?;
            std::mem::swap(&mut st.window, &mut st.spare);
        }
        Ok(out)
    }

    /// One x row quantized for `matvec_q8` (see `wgsl/matvec_q8.wgsl`):
    /// `cols / 8` 16-byte entries.
    fn quantize_x8(&self, x: Bind<'_>, cols: usize) -> Result<GpuBuf> {
        let xq = self.gpu.alloc(2 * cols as u64)?;
        let mut params = vec![0u32; 8];
        params.extend([0, 1, 0, 0, u(cols), 0, 0, 0]);
        self.gpu.dispatch("quantize_x8", &params, &[(2, x), (5, xq.bind())], [u((cols / 32).div_ceil(64)), 1, 1])?;
        Ok(xq)
    }

    fn matmul_into(&self, x: Bind<'_>, tokens: usize, w: &GpuWeight, out: Bind<'_>) -> Result<()> {
        let total_rows = w.experts * w.rows;
        // Int8 mode: one token against a large interleaved 4-bit weight (every
        // shard of a weight has the same layout) quantizes x once for all shards.
        let int8 = self.mode == MatmulMode::Int8
            && tokens == 1
            && w.bytes >= self.int8_min_bytes
            && w.cols % 32 == 0
            && w.shards.iter().all(|s| s.desc[0] == 4);
        let xq = if int8 { Some(self.quantize_x8(x, w.cols)?) } else { None };
        for s in &w.shards {
            if let Some(xq) = &xq {
                let mut params = s.desc.to_vec();
                params.extend([u(s.rows), 1, u(total_rows), u(s.row_start), u(w.cols), 0, 0, 0]);
                let groups = [self.subgroup_grid(s.rows.div_ceil(4), 128), 1, 1];
                let binds = [(1, whole(&s.buffer)), (6, whole(&s.buffer)), (4, xq.bind()), (3, out)];
                self.gpu.dispatch("matvec_q8", &params, &binds, groups)?;
            } else if tokens <= MATVEC_MAX_TOKENS {
                let group_rows = if s.rows >= q4_eight_rows_from() { 8 } else { 4 };
                let mut params = s.desc.to_vec();
                params.extend([u(s.rows), u(tokens), u(total_rows), u(s.row_start), u(w.cols), u(group_rows), 0, 0]);
                // One token: a subgroup per four rows (eight for interleaved
                // 4-bit); more: a subgroup per row.
                let items = match (tokens, s.desc[0]) {
                    (1, 4) => s.rows.div_ceil(group_rows),
                    (1, _) => s.rows.div_ceil(4),
                    _ => s.rows,
                };
                let groups = [self.subgroup_grid(items, 128), u(tokens.div_ceil(4)), 1];
                self.gpu.dispatch("matvec", &params, &[(1, whole(&s.buffer)), (6, whole(&s.buffer)), (2, x), (3, out)], groups)?;
            } else {
                let mut params = s.desc.to_vec();
                params.extend([u(s.rows), u(tokens), u(total_rows), u(s.row_start), 0, 0, 0, 0]);
                let groups = [u(s.rows.div_ceil(32)), u(tokens.div_ceil(32)), 1];
                self.gpu.dispatch("matmul_tiled", &params, &[(6, whole(&s.buffer)), (2, x), (3, out)], groups)?;
            }
        }
        Ok(())
    }
}

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        let i = &self.gpu.info;
        let uploads = if self.gpu.mapped_primary { "mapped primary buffers" } else { "staging uploads" };
        let mode = match self.mode {
            MatmulMode::Exact => "",
            MatmulMode::Int8 => ", int8 activations for large 4-bit matmuls",
        };
        format!("wgpu ({}, {:?}; {uploads}{mode})", i.name, i.backend)
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(shape_error("upload", format!("{} values for shape {shape:?}", data.len())));
        }
        let b = self.gpu.upload_activation(bytemuck::cast_slice(data))?;
        Ok(Tensor::from_buffer(Arc::new(b), shape.to_vec()))
    }

    fn download(&self, t: &Tensor) -> Result<Vec<f32>> {
        let bytes = self.gpu.download(buf(t)?, 4 * t.numel() as u64)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    fn load_weight(&self, m: &HostMatrix<'_>) -> Result<Weight> {
        let w = GpuWeight::upload(&self.gpu, m)?;
        let bytes = w.bytes;
        Ok(Weight::from_buffer(Arc::new(w), m.experts, m.rows, m.cols, bytes))
    }

    fn slice_cols(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let (rows, cols) = (x.rows(), x.cols());
        if start + len > cols {
            return Err(shape_error("slice_cols", format!("[{start}, {}) of {cols} columns", start + len)));
        }
        if start == 0 && len == cols {
            return x.reshape(&[rows, len]);
        }
        // One row: the columns are contiguous, so a view replaces the copy
        // when its offset suits the adapter's binding alignment (the size a
        // whole number of vec4s, which some kernels bind x as).
        let xb = buf(x)?;
        let offset = xb.offset + 4 * start as u64;
        let align = self.gpu.limits.min_storage_buffer_offset_alignment as u64;
        if self.gpu.views && rows == 1 && len > 0 && offset % align.max(4) == 0 && len % 4 == 0 {
            let base = match x.buffer::<GpuView>() {
                Some(v) => v.base.clone(),
                None => x.clone(),
            };
            let view = GpuView { base, offset, bytes: 4 * len as u64 };
            return Ok(Tensor::from_buffer(Arc::new(view), vec![rows, len]));
        }
        let (out, ob) = self.new_tensor(rows * len, vec![rows, len])?;
        let n = rows * len;
        self.elementwise("copy_cols", [u(n), u(len), u(cols), u(start), 0, 0, 0, 0], &[(2, buf(x)?), (3, ob.bind())], n)?;
        Ok(out)
    }

    fn slice_rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let (rows, cols) = (x.rows(), x.cols());
        if start + len > rows {
            return Err(shape_error("slice_rows", format!("[{start}, {}) of {rows} rows", start + len)));
        }
        let (out, ob) = self.new_tensor(len * cols, vec![len, cols])?;
        let xb = buf(x)?;
        self.gpu.copy(xb.buffer, xb.offset + 4 * (start * cols) as u64, ob.buffer(), 0, 4 * (len * cols) as u64)?;
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Result<Tensor> {
        let cols = parts.first().map(|t| t.cols()).unwrap_or(0);
        if let Some(p) = parts.iter().find(|p| p.cols() != cols) {
            return Err(shape_error("concat_rows", format!("{} vs {} columns", p.cols(), cols)));
        }
        let total: usize = parts.iter().map(|p| p.numel()).sum();
        let (out, ob) = self.new_tensor(total, vec![total / cols.max(1), cols])?;
        let mut at = 0u64;
        for p in parts {
            let bytes = 4 * p.numel() as u64;
            let pb = buf(p)?;
            self.gpu.copy(pb.buffer, pb.offset, ob.buffer(), at, bytes)?;
            at += bytes;
        }
        Ok(out)
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        same_shape("add", a, b)?;
        let n = a.numel();
        let (out, ob) = self.new_tensor(n, a.shape().to_vec())?;
        self.elementwise("add", [u(n), 0, 0, 0, 0, 0, 0, 0], &[(2, buf(a)?), (4, buf(b)?), (3, ob.bind())], n)?;
        Ok(out)
    }

    fn sigmoid_mul(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let n = x.numel();
        let per_row = if gate.numel() == n {
            0
        } else if gate.numel() == x.rows() {
            1
        } else {
            return Err(shape_error("sigmoid_mul", format!("x {:?}, gate {:?}", x.shape(), gate.shape())));
        };
        let (out, ob) = self.new_tensor(n, x.shape().to_vec())?;
        let params = [u(n), u(x.cols()), 0, 0, per_row, 0, 0, 0];
        self.elementwise("sigmoid_mul", params, &[(2, buf(x)?), (4, buf(gate)?), (3, ob.bind())], n)?;
        Ok(out)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape("silu_mul", gate, up)?;
        let n = gate.numel();
        let (out, ob) = self.new_tensor(n, gate.shape().to_vec())?;
        self.elementwise("silu_mul", [u(n), 0, 0, 0, 0, 0, 0, 0], &[(2, buf(gate)?), (4, buf(up)?), (3, ob.bind())], n)?;
        Ok(out)
    }

    fn add_sigmoid_mul(&self, y: &Tensor, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        same_shape("add_sigmoid_mul", y, x)?;
        let n = x.numel();
        let per_row = if gate.numel() == n {
            0
        } else if gate.numel() == x.rows() {
            1
        } else {
            return Err(shape_error("add_sigmoid_mul", format!("x {:?}, gate {:?}", x.shape(), gate.shape())));
        };
        let (out, ob) = self.new_tensor(n, x.shape().to_vec())?;
        let params = [u(n), u(x.cols()), 0, 0, per_row, 0, 0, 0];
        let binds = [(2, buf(x)?), (4, buf(gate)?), (5, buf(y)?), (3, ob.bind())];
        self.elementwise("add_sigmoid_mul", params, &binds, n)?;
        Ok(out)
    }

    fn silu(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.numel();
        let (out, ob) = self.new_tensor(n, x.shape().to_vec())?;
        self.elementwise("silu_only", [u(n), 0, 0, 0, 0, 0, 0, 0], &[(2, buf(x)?), (3, ob.bind())], n)?;
        Ok(out)
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        let n = x.numel();
        let (out, ob) = self.new_tensor(n, x.shape().to_vec())?;
        self.elementwise("scale", [u(n), 0, 0, 0, 0, 0, f(s), 0], &[(2, buf(x)?), (3, ob.bind())], n)?;
        Ok(out)
    }

    fn repeat_cols(&self, x: &Tensor, n: usize) -> Result<Tensor> {
        let (rows, d) = (x.rows(), x.cols());
        let total = rows * n * d;
        let (out, ob) = self.new_tensor(total, vec![rows, n * d])?;
        self.elementwise("repeat_cols", [u(total), u(d), u(n), 0, 0, 0, 0, 0], &[(2, buf(x)?), (3, ob.bind())], total)?;
        Ok(out)
    }

    fn sigmoid_weighted_stream_mean(&self, normed: &Tensor, mix: &Tensor, streams: usize) -> Result<Tensor> {
        same_shape("hc_mix", normed, mix)?;
        if streams == 0 || normed.cols() % streams != 0 {
            return Err(shape_error("hc_mix", format!("{:?} is not {streams} streams", normed.shape())));
        }
        let (rows, d) = (normed.rows(), normed.cols() / streams);
        let n = rows * d;
        let (out, ob) = self.new_tensor(n, vec![rows, d])?;
        let binds = [(2, buf(normed)?), (4, buf(mix)?), (3, ob.bind())];
        self.elementwise("hc_mix", [u(n), u(d), u(streams), 0, 0, 0, 0, 0], &binds, n)?;
        Ok(out)
    }

    fn add_gated_to_streams(&self, h: &Tensor, x: &Tensor, logits: &Tensor, logit_scale: f32) -> Result<Tensor> {
        let (rows, streams, d) = (h.rows(), logits.cols(), x.cols());
        if x.rows() != rows || logits.rows() != rows || h.cols() != streams * d {
            return Err(shape_error("hc_inject", format!("h {:?}, x {:?}, logits {:?}", h.shape(), x.shape(), logits.shape())));
        }
        let n = h.numel();
        let (out, ob) = self.new_tensor(n, h.shape().to_vec())?;
        let binds = [(2, buf(h)?), (4, buf(x)?), (5, buf(logits)?), (3, ob.bind())];
        self.elementwise("hc_inject", [u(n), u(d), u(streams), 0, f(logit_scale), 0, 0, 0], &binds, n)?;
        Ok(out)
    }

    fn stream_dot_gate(&self, key: &Tensor, query: &Tensor, value: &Tensor, streams: usize) -> Result<Tensor> {
        same_shape("ple_gate", key, query)?;
        let (rows, d) = (value.rows(), value.cols());
        if streams == 0 || key.rows() != rows || key.cols() != streams * d {
            return Err(shape_error("ple_gate", format!("key {:?}, value {:?}, {streams} streams", key.shape(), value.shape())));
        }
        let groups = rows * streams;
        let (out, ob) = self.new_tensor(groups * d, vec![rows, streams * d])?;
        let params = [0, u(d), u(streams), u(groups), f(1.0 / (d as f32).sqrt()), 0, 0, 0];
        let binds = [(2, buf(key)?), (4, buf(query)?), (5, buf(value)?), (3, ob.bind())];
        self.gpu.dispatch("ple_gate", &params, &binds, [self.subgroup_grid(groups, 64), 1, 1])?;
        Ok(out)
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        let w = weight(table)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= w.experts * w.rows) {
            return Err(shape_error("embed", format!("token id {id} >= vocabulary size {}", w.rows)));
        }
        if ids.len() > gpu::MAX_GROUPS as usize {
            return Err(shape_error("embed", format!("{} tokens in one call (at most {})", ids.len(), gpu::MAX_GROUPS)));
        }
        let (out, ob) = self.new_tensor(ids.len() * w.cols, vec![ids.len(), w.cols])?;
        let id_buf = self.gpu.small_input("token ids", bytemuck::cast_slice(ids))?;
        for s in &w.shards {
            let mut params = s.desc.to_vec();
            params.extend([u(ids.len()), u(s.row_start), u(s.rows), 0]);
            let groups = [u(w.cols.div_ceil(64)), u(ids.len()), 1];
            self.gpu.dispatch("embed", &params, &[(6, whole(&s.buffer)), (3, ob.bind()), (4, whole(&id_buf))], groups)?;
        }
        Ok(out)
    }

    fn matmul(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let gw = weight(w)?;
        if x.cols() != gw.cols || gw.experts != 1 {
            return Err(shape_error(
                "matmul",
                format!("x {:?} @ W[{} x {} x {}]^T", x.shape(), gw.experts, gw.rows, gw.cols),
            ));
        }
        let tokens = x.rows();
        let (out, ob) = self.new_tensor(tokens * gw.rows, vec![tokens, gw.rows])?;
        self.matmul_into(buf(x)?, tokens, gw, ob.bind())?;
        Ok(out)
    }

    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, dim: usize, eps: f32) -> Result<Tensor> {
        groups_of("rms_norm", x, dim)?;
        // One weight slice for every group, or one value per column (each of a
        // row's groups with its own slice).
        let weight_len = match w {
            Some(w) if w.numel() == dim || (w.numel() % dim == 0 && w.numel() == x.cols()) => w.numel(),
            Some(w) => {
                return Err(shape_error("rms_norm", format!("weight {:?} for groups of {dim} in rows of {}", w.shape(), x.cols())))
            }
            None => dim,
        };
        let groups = x.numel() / dim;
        let (out, ob) = self.new_tensor(x.numel(), x.shape().to_vec())?;
        let xb = buf(x)?;
        let wb = match w {
            Some(w) => buf(w)?,
            None => xb,
        };
        let params = [u(groups), u(dim), u(w.is_some() as usize), u(weight_len), f(eps), f(1.0), 0, 0];
        let binds = [(2, xb), (3, ob.bind()), (4, wb)];
        if dim >= WIDE_NORM_DIM {
            self.gpu.dispatch("rms_norm_wide", &params, &binds, Gpu::grid(groups as u64))?;
        } else {
            self.gpu.dispatch("rms_norm", &params, &binds, [self.subgroup_grid(groups, 64), 1, 1])?;
        }
        Ok(out)
    }

    fn rms_norm_gated(&self, x: &Tensor, z: &Tensor, w: &Tensor, dim: usize, eps: f32, act: GateAct) -> Result<Tensor> {
        same_shape("rms_norm_gated", x, z)?;
        groups_of("rms_norm_gated", x, dim)?;
        if w.numel() != dim {
            return Err(shape_error("rms_norm_gated", format!("weight {:?} for groups of {dim}", w.shape())));
        }
        let groups = x.numel() / dim;
        let (out, ob) = self.new_tensor(x.numel(), x.shape().to_vec())?;
        let gate_act = match act {
            GateAct::Silu => 0,
            GateAct::Sigmoid => 1,
        };
        let params = [u(groups), u(dim), 1, u(dim), f(eps), f(1.0), gate_act, 0];
        let grid = [self.subgroup_grid(groups, 64), 1, 1];
        let binds = [(2, buf(x)?), (3, ob.bind()), (4, buf(w)?), (5, buf(z)?)];
        self.gpu.dispatch("rms_norm_gated", &params, &binds, grid)?;
        Ok(out)
    }

    fn l2_normalize(&self, x: &Tensor, dim: usize, eps: f32, scale: f32) -> Result<Tensor> {
        groups_of("l2_normalize", x, dim)?;
        let groups = x.numel() / dim;
        let (out, ob) = self.new_tensor(x.numel(), x.shape().to_vec())?;
        let params = [u(groups), u(dim), 0, u(dim), f(eps), f(scale), 0, 0];
        let grid = [self.subgroup_grid(groups, 64), 1, 1];
        self.gpu.dispatch("l2_normalize", &params, &[(2, buf(x)?), (3, ob.bind())], grid)?;
        Ok(out)
    }

    fn rope(&self, x: &Tensor, head_dim: usize, rotary_dim: usize, theta: f32, start_pos: usize) -> Result<Tensor> {
        groups_of("rope", x, head_dim)?;
        if rotary_dim > head_dim || rotary_dim % 2 != 0 {
            return Err(shape_error("rope", format!("rotary dim {rotary_dim} for head dim {head_dim}")));
        }
        let tokens = x.shape().first().copied().unwrap_or(0).max(1);
        let heads = x.numel() / head_dim / tokens;
        let half = rotary_dim / 2;
        // Angles in f64 on the host, exactly as the CPU backend computes them.
        let inv_freq: Vec<f64> =
            (0..half).map(|i| (theta as f64).powf(-((2 * i) as f64) / rotary_dim as f64)).collect();
        let mut table = Vec::with_capacity(tokens * half * 2);
        for t in 0..tokens {
            let pos = (start_pos + t) as f64;
            for f in &inv_freq {
                table.push((pos * f).cos() as f32);
                table.push((pos * f).sin() as f32);
            }
        }
        let cs = self.gpu.small_input("rope angles", bytemuck::cast_slice(&table))?;
        let n = x.numel();
        let (out, ob) = self.new_tensor(n, x.shape().to_vec())?;
        let params = [u(n), u(heads), u(head_dim), u(half), 0, 0, 0, 0];
        self.elementwise("rope", params, &[(2, buf(x)?), (3, ob.bind()), (4, whole(&cs))], n)?;
        Ok(out)
    }

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize) -> Result<State> {
        let capacity = 256;
        let row = 4 * (kv_heads * head_dim) as u64;
        Ok(State::new(Box::new(GpuKvCache {
            gpu: self.gpu.clone(),
            kv_heads,
            head_dim,
            len: 0,
            capacity,
            keys: self.gpu.zeroed("kv keys", row * capacity as u64),
            values: self.gpu.zeroed("kv values", row * capacity as u64),
        })))
    }

    fn kv_cache_dtype(&self) -> DType {
        DType::F32
    }

    fn kv_len(&self, cache: &State) -> Result<usize> {
        cache.get::<GpuKvCache>().map(|c| c.len).ok_or_else(|| BackendError::Device("not a wgpu KV cache".into()))
    }

    fn kv_truncate(&self, cache: &mut State, len: usize) -> Result<()> {
        let c = cache.get_mut::<GpuKvCache>().ok_or_else(|| BackendError::Device("not a wgpu KV cache".into()))?;
        if len > c.len {
            return Err(shape_error("kv_truncate", format!("to {len} positions of {}", c.len)));
        }
        // Rows past `len` are overwritten by the next append.
        c.len = len;
        Ok(())
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32, selection: Option<&KeySelection>) -> Result<Tensor> {
        let c = cache.get_mut::<GpuKvCache>().ok_or_else(|| BackendError::Device("not a wgpu KV cache".into()))?;
        let (kvh, hd) = (c.kv_heads, c.head_dim);
        let tokens = q.rows();
        if q.cols() != heads * hd || k.cols() != kvh * hd || v.cols() != kvh * hd || k.rows() != tokens
            || v.rows() != tokens || kvh == 0 || heads % kvh != 0
        {
            return Err(shape_error(
                "attention",
                format!("q {:?} k {:?} v {:?} for {heads} heads, {kvh} kv heads of {hd}", q.shape(), k.shape(), v.shape()),
            ));
        }
        if let Some(sel) = selection {
            if sel.block == 0 || sel.per_query == 0 || sel.blocks.len() != tokens * sel.per_query {
                return Err(shape_error(
                    "attention",
                    format!("key selection of {} entries ({} per query) for {tokens} queries", sel.blocks.len(), sel.per_query),
                ));
            }
        }
        if hd > 512 {
            return Err(BackendError::Unsupported(format!("attention head dim {hd} (the kernel takes up to 512)")));
        }
        let row = 4 * (kvh * hd) as u64;
        let past = c.len;
        if past + tokens > c.capacity {
            let capacity = (2 * c.capacity).max(past + tokens);
            if row * capacity as u64 > self.gpu.max_binding() {
                return Err(BackendError::Unsupported(format!(
                    "a KV cache of {capacity} positions exceeds the adapter's storage binding limit"
                )));
            }
            let keys = self.gpu.zeroed("kv keys", row * capacity as u64);
            let values = self.gpu.zeroed("kv values", row * capacity as u64);
            self.gpu.copy(&c.keys, 0, &keys, 0, row * past as u64)?;
            self.gpu.copy(&c.values, 0, &values, 0, row * past as u64)?;
            (c.keys, c.values, c.capacity) = (keys, values, capacity);
        }
        let (kb, vb) = (buf(k)?, buf(v)?);
        self.gpu.copy(kb.buffer, kb.offset, &c.keys, row * past as u64, row * tokens as u64)?;
        self.gpu.copy(vb.buffer, vb.offset, &c.values, row * past as u64, row * tokens as u64)?;
        c.len += tokens;
        let (out, ob) = self.new_tensor(tokens * heads * hd, vec![tokens, heads * hd])?;
        let grid = Gpu::grid((tokens * heads) as u64);
        // A selection whose every query is dense is plain causal attention.
        match selection.filter(|sel| sel.blocks.chunks_exact(sel.per_query).any(|r| r[0] != KeySelection::DENSE)) {
            None => {
                let visible = past + tokens;
                let scratch = self.gpu.alloc(4 * (tokens * heads * visible) as u64)?;
                let params = [u(tokens), u(heads), u(kvh), u(hd), u(past), u(visible), f(scale), 0];
                let binds = [(2, buf(q)?), (3, ob.bind()), (4, whole(&c.keys)), (5, whole(&c.values)), (6, scratch.bind())];
                self.gpu.dispatch("attention", &params, &binds, grid)?;
            }
            Some(sel) => {
                let (words, most_keys) = selection_rows(sel, past, tokens);
                let sel_buf = self.gpu.small_input("key selection", bytemuck::cast_slice(&words))?;
                let scratch = self.gpu.alloc(4 * (tokens * heads * most_keys) as u64)?;
                let params = [
                    u(tokens), u(heads), u(kvh), u(hd), u(past), u(most_keys), f(scale), u(sel.block), u(sel.per_query + 1), 0, 0, 0,
                ];
                let binds =
                    [(2, buf(q)?), (3, ob.bind()), (4, whole(&c.keys)), (5, whole(&c.values)), (6, scratch.bind()), (7, whole(&sel_buf))];
                self.gpu.dispatch("attention_sparse", &params, &binds, grid)?;
            }
        }
        Ok(out)
    }

    fn new_conv_state(&self, channels: usize, kernel: usize, dilation: usize) -> Result<State> {
        if kernel == 0 || dilation == 0 {
            return Err(shape_error("new_conv_state", format!("kernel size {kernel}, dilation {dilation}")));
        }
        let bytes = 4 * ((kernel - 1) * dilation * channels) as u64;
        let window = self.gpu.zeroed("conv window", bytes);
        let spare = self.gpu.zeroed("conv window", bytes);
        Ok(State::new(Box::new(GpuConvState { gpu: self.gpu.clone(), channels, kernel, dilation, window, spare })))
    }

    fn causal_conv1d(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        self.conv(x, w, state, false)
    }

    fn causal_conv1d_silu(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        self.conv(x, w, state, true)
    }

    fn new_recurrent_state(&self, heads: usize, key_dim: usize, value_dim: usize) -> Result<State> {
        if key_dim > 16 * self.gpu.subgroup_min as usize {
            return Err(BackendError::Unsupported(format!(
                "Gated DeltaNet key dim {key_dim} exceeds 16 x the adapter's smallest subgroup ({})",
                self.gpu.subgroup_min
            )));
        }
        let s = self.gpu.zeroed("recurrent state", 4 * (heads * key_dim * value_dim) as u64);
        Ok(State::new(Box::new(GpuRecurrentState { gpu: self.gpu.clone(), heads, key_dim, value_dim, s })))
    }

    fn delta_gates(&self, a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor) -> Result<(Tensor, Tensor)> {
        same_shape("delta_gates", a, b)?;
        let heads = a.cols();
        if a_log.numel() != heads || dt_bias.numel() != heads {
            return Err(shape_error("delta_gates", format!("{heads} heads, A_log {:?}, dt_bias {:?}", a_log.shape(), dt_bias.shape())));
        }
        let n = a.numel();
        let (g, gb) = self.new_tensor(n, a.shape().to_vec())?;
        let (beta, bb) = self.new_tensor(n, b.shape().to_vec())?;
        let binds = [(2, buf(a)?), (4, buf(b)?), (5, buf(a_log)?), (6, buf(dt_bias)?), (3, gb.bind()), (7, bb.bind())];
        self.elementwise("delta_gates", [u(n), u(heads), 0, 0, 0, 0, 0, 0], &binds, n)?;
        Ok((g, beta))
    }

    fn gated_delta(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, key_heads: usize, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<GpuRecurrentState>().ok_or_else(|| BackendError::Device("not a wgpu recurrent state".into()))?;
        let (h, dk, dv) = (st.heads, st.key_dim, st.value_dim);
        let tokens = q.rows();
        if key_heads == 0 || h % key_heads != 0 || q.cols() != key_heads * dk || k.cols() != key_heads * dk
            || v.cols() != h * dv || g.cols() != h || beta.cols() != h || k.rows() != tokens || v.rows() != tokens
        {
            return Err(shape_error(
                "gated_delta",
                format!("q {:?} k {:?} v {:?} g {:?} for {h} heads ({key_heads} key heads) of {dk}/{dv}", q.shape(), k.shape(), v.shape(), g.shape()),
            ));
        }
        let (out, ob) = self.new_tensor(tokens * h * dv, vec![tokens, h * dv])?;
        let params = [u(tokens), u(h), u(key_heads), u(dk), u(dv), 0, 0, 0];
        let binds = [(2, buf(q)?), (4, buf(k)?), (5, buf(v)?), (6, buf(g)?), (7, buf(beta)?), (8, whole(&st.s)), (3, ob.bind())];
        self.gpu.dispatch("gated_delta", &params, &binds, [self.subgroup_grid(h * dv, 64), 1, 1])?;
        Ok(out)
    }

    fn new_expert_pool(&self, layout: &ExpertLayout, slots: usize) -> Result<ExpertPool> {
        let pool = GpuPool::new(&self.gpu, layout.hidden, layout.intermediate, [layout.gate, layout.up, layout.down], slots)?;
        let bytes = pool.bytes();
        Ok(ExpertPool::new(Box::new(pool), *layout, slots, bytes))
    }

    fn write_expert(&self, pool: &mut ExpertPool, slot: usize, e: &HostExpert<'_>) -> Result<()> {
        let p = pool.get::<GpuPool>().ok_or_else(|| BackendError::Device("not a wgpu expert pool".into()))?;
        p.write(&self.gpu, slot, &e.gate, &e.up, &e.down)
    }

    fn moe_expert_outputs(&self, x: &Tensor, pool: &ExpertPool, assignments: &[ExpertAssignment], top_k: usize) -> Result<Tensor> {
        let p = pool.get::<GpuPool>().ok_or_else(|| BackendError::Device("not a wgpu expert pool".into()))?;
        let (tokens, hidden) = (x.rows(), x.cols());
        let inter = p.gate.rows;
        if hidden != p.gate.layout_cols() {
            return Err(shape_error("moe_expert_outputs", format!("x {:?} for experts of hidden size {}", x.shape(), p.gate.layout_cols())));
        }
        for a in assignments {
            if a.slot as usize >= p.slots || a.token as usize >= tokens || a.rank as usize >= top_k {
                return Err(shape_error("moe_expert_outputs", format!("{a:?} with {} slots, {tokens} tokens, top {top_k}", p.slots)));
            }
        }
        let (out, ob) = self.new_tensor(tokens * top_k * hidden, vec![tokens, top_k, hidden])?;
        self.gpu.clear(ob.buffer())?;
        if assignments.is_empty() {
            return Ok(out);
        }
        // Assignments grouped by pool shard, each group one run of the list.
        let mut sorted = assignments.to_vec();
        sorted.sort_by_key(|a| a.slot as usize / p.per_shard);
        let words: Vec<u32> = sorted.iter().flat_map(|a| [a.token, a.rank, a.slot, 0]).collect();
        let asg = self.gpu.small_input("expert assignments", bytemuck::cast_slice(&words))?;
        let n = sorted.len();
        let gate_out = self.gpu.alloc(4 * (n * inter) as u64)?;
        let act = self.gpu.alloc(4 * (n * inter) as u64)?;
        let xb = buf(x)?;
        let mut start = 0;
        while start < n {
            let shard = sorted[start].slot as usize / p.per_shard;
            let mut end = start;
            while end < n && sorted[end].slot as usize / p.per_shard == shard && end - start < gpu::MAX_GROUPS as usize {
                end += 1;
            }
            let slot_base = u(shard * p.per_shard);
            let count = u(end - start);
            let shard_rows = p.shard_slots(shard);
            let run = |entry: &str, m: &weights::PoolMatrix, x_cols: usize, out_cols: usize, binds: &[(u32, Bind<'_>)]| {
                let mut params = m.layout.desc(shard_rows * m.rows).to_vec();
                params.extend([u(m.rows), u(start), slot_base, u(x_cols), u(out_cols), u(top_k), 0, 0]);
                let mut all = vec![(1, whole(&m.buffers[shard])), (6, whole(&m.buffers[shard]))];
                all.extend_from_slice(binds);
                self.gpu.dispatch(entry, &params, &all, [self.subgroup_grid(m.rows.div_ceil(4), 128), count, 1])
            };
            run("moe_gate", &p.gate, hidden, inter, &[(2, xb), (3, gate_out.bind()), (4, whole(&asg))])?;
            run("moe_up", &p.up, hidden, inter, &[(2, xb), (3, act.bind()), (4, whole(&asg)), (5, gate_out.bind())])?;
            run("moe_down", &p.down, inter, hidden, &[(2, act.bind()), (3, ob.bind()), (4, whole(&asg))])?;
            start = end;
        }
        Ok(out)
    }

    fn moe_combine(&self, outputs: &Tensor, weights: &[f32], top_k: usize) -> Result<Tensor> {
        let hidden = outputs.cols();
        let tokens = outputs.rows() / top_k.max(1);
        if weights.len() != tokens * top_k || outputs.rows() != tokens * top_k {
            return Err(shape_error("moe_combine", format!("outputs {:?}, {} weights, top {top_k}", outputs.shape(), weights.len())));
        }
        let wb = self.gpu.small_input("routing weights", bytemuck::cast_slice(weights))?;
        let n = tokens * hidden;
        let (out, ob) = self.new_tensor(n, vec![tokens, hidden])?;
        self.elementwise("moe_combine", [u(n), u(hidden), 0, 0, 0, u(top_k), 0, 0], &[(2, buf(outputs)?), (4, whole(&wb)), (3, ob.bind())], n)?;
        Ok(out)
    }
}

/// A device copy of `b` (recorded in op order, after every earlier write).
fn duplicate_buffer(gpu: &Gpu, b: &wgpu::Buffer, label: &str) -> Result<wgpu::Buffer> {
    let copy = gpu.zeroed(label, b.size());
    gpu.copy(b, 0, &copy, 0, b.size())?;
    Ok(copy)
}

impl DeviceState for GpuKvCache {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(GpuKvCache {
            gpu: self.gpu.clone(),
            keys: duplicate_buffer(&self.gpu, &self.keys, "kv keys")?,
            values: duplicate_buffer(&self.gpu, &self.values, "kv values")?,
            ..*self
        }))
    }

    fn bytes(&self) -> usize {
        (self.keys.size() + self.values.size()) as usize
    }
}

impl DeviceState for GpuConvState {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(GpuConvState {
            gpu: self.gpu.clone(),
            window: duplicate_buffer(&self.gpu, &self.window, "conv window")?,
            spare: self.gpu.zeroed("conv window", self.spare.size()),
            ..*self
        }))
    }

    fn bytes(&self) -> usize {
        (self.window.size() + self.spare.size()) as usize
    }
}

impl DeviceState for GpuRecurrentState {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(GpuRecurrentState {
            gpu: self.gpu.clone(),
            s: duplicate_buffer(&self.gpu, &self.s, "recurrent state")?,
            ..*self
        }))
    }

    fn bytes(&self) -> usize {
        self.s.size() as usize
    }
}
