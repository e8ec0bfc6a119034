//! The wgpu backend: every op of [`slotstream_backend::Backend`] as a WGSL
//! compute kernel (sources in `wgsl/` at the repository root), on Vulkan
//! (Linux, Windows) or Metal (macOS).
//!
//! Activations, weights, the expert pool and all per-sequence state stay on the GPU. Ops are recorded lazily into
//! one command encoder and submitted when the host needs data back: once per decoded token with a resident pool; a
//! streaming pool also reads each MoE layer's routed ids back. An expert lands after every earlier read of its slot.
//!
//! This file checks each op's inputs (through `slotstream_backend::checks`) and hands it to the typed kernel
//! calls of its family's module (`elementwise.rs`, `norm.rs`, `streams.rs`, `matmul.rs`, `moe.rs`, `attention.rs`
//! and `flash_decode.rs`, `recurrent.rs`); `state.rs` holds the per-sequence state, `gpu.rs` the device and its command recorder,
//! `weights.rs` weights and the pool (`parts.rs` its writes), `diagnostics.rs` hooks for tests and profiling.

mod attention;
mod chosen;
mod device;
mod diagnostics;
mod elementwise;
mod flash_decode;
mod gpu;
pub mod kernels;
mod matmul;
mod moe;
mod norm;
mod options;
mod params;
mod parts;
mod recurrent;
mod state;
mod streams;
mod tensors;
mod weights;

use std::sync::Arc;

use slotstream_backend::{
    checks, shape_error, Backend, BackendError, DeltaInputs, ExpertLayout, ExpertMatrix, ExpertPool, GateAct, Gating, HostExpert, HostMatrix,
    KeySelection, KvCacheType, QkNorm, Result, Rope, Routes, SharedExpert, State, Tensor, Weight, matmul_swiglu_composed,
    moe_shared_composed, route_matmul_composed,
};
use slotstream_backend::chosen::PendingRead;

pub use device::AdapterChoice;
pub use gpu::FamilyTime;
pub use matmul::PREFILL_ROWS_MAX;
pub use recurrent::{CHUNK as GATED_DELTA_CHUNK, CHUNKED_FROM as GATED_DELTA_CHUNKED_FROM};
pub use options::{MatmulMode, Q4Layout, WgpuOptions, INT8_MIN_BYTES};
pub use state::{GpuConvState, GpuKvCache, GpuRecurrentState};
/// The wgpu version this backend is built on (for `device_type` and similar).
pub use wgpu;

use gpu::{whole, Gpu, MAX_GROUPS};
use matmul::MatmulChoice;
use tensors::{buf, f32s, new_tensor, weight};
use weights::{GpuPool, GpuWeight};

/// The wgpu implementation of the backend trait. Clones share the device and
/// its command recorder (so a benchmark can keep a handle for profiling after
/// giving the backend to an engine).
#[derive(Clone)]
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    /// The settings it was built with.
    options: WgpuOptions,
    /// `options.matmul`, or the adapter's default where that is `None`.
    mode: MatmulMode,
}

impl WgpuBackend {
    /// Opens the adapter `choice` selects (see [`AdapterChoice`]) in
    /// [`MatmulMode::Exact`] (see [`WgpuBackend::with_matmul_mode`]), the
    /// other settings from [`WgpuOptions::from_env`].
    pub fn new(choice: &AdapterChoice) -> Result<WgpuBackend> {
        WgpuBackend::with_options(choice, WgpuOptions { matmul: Some(MatmulMode::Exact), ..WgpuOptions::from_env() })
    }

    /// Opens the adapter `choice` selects with `options`.
    pub fn with_options(choice: &AdapterChoice, options: WgpuOptions) -> Result<WgpuBackend> {
        WgpuBackend::open(choice, options, true)
    }

    /// Like [`WgpuBackend::with_options`], but the kernels are compiled
    /// without the bounds checks wgpu adds to every buffer access (for
    /// benchmarking what they cost).
    ///
    /// # Safety
    /// An out-of-bounds index in a kernel then reads or writes arbitrary GPU
    /// memory; only use this with inputs the checked backend has run cleanly.
    pub unsafe fn with_options_unchecked(choice: &AdapterChoice, options: WgpuOptions) -> Result<WgpuBackend> {
        WgpuBackend::open(choice, options, false)
    }

    fn open(choice: &AdapterChoice, options: WgpuOptions, bounds_checks: bool) -> Result<WgpuBackend> {
        WgpuOptions::check_process_env().map_err(BackendError::Unsupported)?;
        let adapter = device::select_adapter(choice)?;
        let gpu = Gpu::open(adapter, &options, bounds_checks)?;
        // Int8 was measured faster on real GPUs; a software rasterizer (tests) stays exact.
        let by_adapter = if gpu.info.device_type == wgpu::DeviceType::Cpu { MatmulMode::Exact } else { MatmulMode::Int8 };
        let mode = options.matmul.unwrap_or(by_adapter);
        Ok(WgpuBackend { gpu: Arc::new(gpu), options, mode })
    }

    /// The same device with matmuls in `mode` (a clone: shares the device,
    /// its pipelines and its command recorder).
    pub fn with_matmul_mode(&self, mode: MatmulMode) -> WgpuBackend {
        WgpuBackend { mode, ..self.clone() }
    }

    /// The same device with int8 mode applied to weights of at least `bytes`
    /// bytes instead of [`INT8_MIN_BYTES`] (tests and benchmarks use 0 to
    /// reach the int8 kernels with small matrices).
    pub fn with_int8_min_bytes(&self, bytes: usize) -> WgpuBackend {
        WgpuBackend { options: WgpuOptions { int8_min_bytes: bytes, ..self.options.clone() }, ..self.clone() }
    }

    pub fn matmul_mode(&self) -> MatmulMode {
        self.mode
    }

    /// The settings this backend was built with (see [`WgpuBackend::matmul_mode`]
    /// for the mode it runs in).
    pub fn options(&self) -> &WgpuOptions {
        &self.options
    }

    fn matmul_choice(&self) -> MatmulChoice {
        MatmulChoice { mode: self.mode, int8_min_bytes: self.options.int8_min_bytes, q4_eight_rows_from: self.options.q4_eight_rows_from }
    }

    /// A new output tensor of `shape`.
    fn output(&self, shape: Vec<usize>) -> Result<(Tensor, Arc<gpu::GpuBuf>)> {
        new_tensor(&self.gpu, shape.iter().product(), shape)
    }
}

fn not_ours(what: &str) -> BackendError {
    BackendError::Device(format!("{what} does not belong to the wgpu backend"))
}

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        self.describe()
    }

    fn device_memory(&self) -> Option<slotstream_backend::DeviceMemory> {
        Some(self.memory_report())
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<Tensor> {
        checks::upload(data.len(), shape)?;
        let b = self.gpu.upload_activation(bytemuck::cast_slice(data))?;
        Ok(Tensor::from_buffer(Arc::new(b), shape.to_vec()))
    }

    fn download(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(f32s(&self.gpu.download(buf(t)?, 4 * t.numel() as u64)?))
    }

    fn prefill_rows_max(&self) -> Option<usize> {
        Some(PREFILL_ROWS_MAX)
    }
    fn keeps_chosen_tokens(&self) -> bool {
        true
    }
    fn choose_greedy(&self, logits: &Tensor) -> Result<Tensor> {
        chosen::choose_greedy(&self.gpu, logits)
    }
    fn embed_chosen(&self, table: &Weight, c: &Tensor) -> Result<Tensor> {
        chosen::embed_chosen(&self.gpu, table, c)
    }
    fn start_reading_chosen(&self, c: &Tensor) -> Result<PendingRead> {
        chosen::start_reading(&self.gpu, c)
    }
    fn finish_reading_chosen(&self, read: PendingRead) -> Result<u32> {
        chosen::finish_reading(&self.gpu, read)
    }

    fn load_weight(&self, m: &HostMatrix<'_>) -> Result<Weight> {
        let w = GpuWeight::upload(&self.gpu, m, self.options.q4_layout)?;
        let bytes = w.bytes;
        Ok(Weight::from_buffer(Arc::new(w), m.experts, m.rows, m.cols, bytes))
    }

    fn slice_cols(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let (rows, cols) = checks::slice_cols(x, start, len)?;
        if start == 0 && len == cols {
            return x.reshape(&[rows, len]);
        }
        if let Some(view) = tensors::column_view(&self.gpu, x, start, len)? {
            return Ok(view);
        }
        let (out, ob) = self.output(vec![rows, len])?;
        elementwise::copy_cols(&self.gpu, buf(x)?, ob.bind(), rows, len, cols, start)?;
        Ok(out)
    }

    fn slice_rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let cols = checks::slice_rows(x, start, len)?;
        let (out, ob) = self.output(vec![len, cols])?;
        let xb = buf(x)?;
        self.gpu.copy(xb.buffer, xb.offset + 4 * (start * cols) as u64, ob.buffer(), 0, 4 * (len * cols) as u64)?;
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Result<Tensor> {
        let shape = checks::stacked_rows(parts)?;
        let (out, ob) = self.output(shape.to_vec())?;
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
        checks::same_shape("add", a, b)?;
        let (out, ob) = self.output(a.shape().to_vec())?;
        elementwise::add(&self.gpu, buf(a)?, buf(b)?, ob.bind(), a.numel())?;
        Ok(out)
    }

    fn sigmoid_mul(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let per_row = checks::gate_per_row("sigmoid_mul", x, gate)?;
        let (out, ob) = self.output(x.shape().to_vec())?;
        elementwise::sigmoid_mul(&self.gpu, buf(x)?, buf(gate)?, ob.bind(), x.numel(), x.cols(), per_row)?;
        Ok(out)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        checks::same_shape("silu_mul", gate, up)?;
        let (out, ob) = self.output(gate.shape().to_vec())?;
        elementwise::silu_mul(&self.gpu, buf(gate)?, buf(up)?, ob.bind(), gate.numel())?;
        Ok(out)
    }

    fn add_sigmoid_mul(&self, y: &Tensor, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        checks::same_shape("add_sigmoid_mul", y, x)?;
        let per_row = checks::gate_per_row("add_sigmoid_mul", x, gate)?;
        let (out, ob) = self.output(x.shape().to_vec())?;
        let (n, cols) = (x.numel(), x.cols());
        elementwise::add_sigmoid_mul(&self.gpu, buf(y)?, buf(x)?, buf(gate)?, ob.bind(), n, cols, per_row)?;
        Ok(out)
    }

    fn matmul_swiglu(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let gw = weight(w)?;
        checks::matmul(x, gw.experts, gw.rows, gw.cols)?;
        let (out, ob) = self.output(vec![x.rows(), gw.rows / 2])?;
        match matmul::matvec_epilogue(&self.gpu, gw, buf(x)?, x.rows(), ob.bind(), matmul::Epilogue::SwiGlu)? {
            Some(()) => Ok(out),
            None => matmul_swiglu_composed(self, x, w),
        }
    }

    fn matmul_gated_add(&self, y: &Tensor, x: &Tensor, w: &Weight, gate: &Tensor) -> Result<Tensor> {
        let gw = weight(w)?;
        checks::matmul(x, gw.experts, gw.rows, gw.cols)?;
        // One kernel for one token with one gate value; the separate ops
        // (which check the shapes) for the rest.
        if y.shape() == [x.rows(), gw.rows] && gate.shape() == [x.rows(), 1] {
            let (out, ob) = self.output(y.shape().to_vec())?;
            let e = matmul::Epilogue::GatedAdd { y: buf(y)?, gate: buf(gate)? };
            if matmul::matvec_epilogue(&self.gpu, gw, buf(x)?, x.rows(), ob.bind(), e)?.is_some() {
                return Ok(out);
            }
        }
        self.add_sigmoid_mul(y, &self.matmul(x, w)?, gate)
    }

    fn silu(&self, x: &Tensor) -> Result<Tensor> {
        let (out, ob) = self.output(x.shape().to_vec())?;
        elementwise::silu(&self.gpu, buf(x)?, ob.bind(), x.numel())?;
        Ok(out)
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        let (out, ob) = self.output(x.shape().to_vec())?;
        elementwise::scale(&self.gpu, buf(x)?, s, ob.bind(), x.numel())?;
        Ok(out)
    }

    fn repeat_cols(&self, x: &Tensor, n: usize) -> Result<Tensor> {
        let (rows, d) = (x.rows(), x.cols());
        let (out, ob) = self.output(vec![rows, n * d])?;
        streams::repeat_cols(&self.gpu, buf(x)?, ob.bind(), rows, d, n)?;
        Ok(out)
    }

    fn sigmoid_weighted_stream_mean(&self, x: &Tensor, w: &Tensor, streams: usize) -> Result<Tensor> {
        let (rows, d) = checks::stream_mean(x, w, streams)?;
        let (out, ob) = self.output(vec![rows, d])?;
        streams::stream_mean(&self.gpu, buf(x)?, buf(w)?, ob.bind(), rows, d, streams)?;
        Ok(out)
    }

    fn add_gated_to_streams(&self, h: &Tensor, x: &Tensor, logits: &Tensor, logit_scale: f32) -> Result<Tensor> {
        let (streams, d) = checks::gated_to_streams(h, x, logits)?;
        let (out, ob) = self.output(h.shape().to_vec())?;
        let (hb, xb, lb) = (buf(h)?, buf(x)?, buf(logits)?);
        streams::add_gated_to_streams(&self.gpu, hb, xb, lb, logit_scale, ob.bind(), h.numel(), d, streams)?;
        Ok(out)
    }

    fn stream_dot_gate(&self, key: &Tensor, query: &Tensor, value: &Tensor, streams: usize) -> Result<Tensor> {
        let (rows, d) = checks::stream_dot_gate(key, query, value, streams)?;
        let (out, ob) = self.output(vec![rows, streams * d])?;
        streams::stream_dot_gate(&self.gpu, buf(key)?, buf(query)?, buf(value)?, ob.bind(), rows, d, streams)?;
        Ok(out)
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        let w = weight(table)?;
        checks::token_ids(ids, w.experts * w.rows)?;
        if ids.len() > MAX_GROUPS as usize {
            return Err(shape_error("embed", format!("{} tokens in one call (at most {MAX_GROUPS})", ids.len())));
        }
        let (out, ob) = self.output(vec![ids.len(), w.cols])?;
        let id_buf = self.gpu.small_input("token ids", bytemuck::cast_slice(ids))?;
        matmul::embed(&self.gpu, w, &id_buf, ids.len(), ob.bind())?;
        Ok(out)
    }

    fn matmul(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let gw = weight(w)?;
        checks::matmul(x, gw.experts, gw.rows, gw.cols)?;
        let tokens = x.rows();
        let (out, ob) = self.output(vec![tokens, gw.rows])?;
        matmul::matmul_into(&self.gpu, &self.matmul_choice(), buf(x)?, tokens, gw, ob.bind())?;
        Ok(out)
    }

    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, dim: usize, eps: f32) -> Result<Tensor> {
        let groups = checks::groups_of("rms_norm", x, dim)?;
        let weight_len = checks::rms_norm_weight(x, w, dim)?;
        let (out, ob) = self.output(x.shape().to_vec())?;
        let wb = w.map(buf).transpose()?;
        norm::rms_norm(&self.gpu, buf(x)?, wb, ob.bind(), groups, dim, weight_len, eps)?;
        Ok(out)
    }

    fn add_rms_norm(&self, x: &Tensor, y: &Tensor, w: &Tensor, dim: usize, eps: f32) -> Result<(Tensor, Tensor)> {
        checks::same_shape("add_rms_norm", x, y)?;
        let groups = checks::groups_of("add_rms_norm", x, dim)?;
        let weight_len = checks::rms_norm_weight(x, Some(w), dim)?;
        let (sum, sb) = self.output(x.shape().to_vec())?;
        let (out, ob) = self.output(x.shape().to_vec())?;
        // A decode step's norm (one token or a batched few) waits for the next op: a routing
        // kernel takes it in, a workgroup per token (the same alone or batched).
        let held = (groups <= moe::ROUTE_NORM_MAX_TOKENS && self.options.fuse_norms)
            .then(|| norm::HeldNorm { x: x.clone(), y: y.clone(), weight: w.clone(), sum: sum.clone(), out: out.clone(), eps });
        norm::add_rms_norm(&self.gpu, buf(x)?, buf(y)?, buf(w)?, sb.bind(), ob.bind(), groups, dim, weight_len, eps, held)?;
        Ok((sum, out))
    }

    fn rms_norm_gated(&self, x: &Tensor, z: &Tensor, w: &Tensor, dim: usize, eps: f32, act: GateAct) -> Result<Tensor> {
        let groups = checks::rms_norm_gated(x, z, w, dim)?;
        let (out, ob) = self.output(x.shape().to_vec())?;
        norm::rms_norm_gated(&self.gpu, buf(x)?, buf(z)?, buf(w)?, ob.bind(), groups, dim, eps, act)?;
        Ok(out)
    }

    fn l2_normalize(&self, x: &Tensor, dim: usize, eps: f32, scale: f32) -> Result<Tensor> {
        let groups = checks::groups_of("l2_normalize", x, dim)?;
        let (out, ob) = self.output(x.shape().to_vec())?;
        norm::l2_normalize(&self.gpu, buf(x)?, ob.bind(), groups, dim, eps, scale)?;
        Ok(out)
    }

    fn rope(&self, x: &Tensor, head_dim: usize, rotary_dim: usize, rope: Rope, start_pos: usize) -> Result<Tensor> {
        let (tokens, heads) = checks::rope(x, head_dim, rotary_dim)?;
        let (out, ob) = self.output(x.shape().to_vec())?;
        let dims = [tokens, heads, head_dim];
        attention::rope(&self.gpu, buf(x)?, ob.bind(), x.numel(), dims, rotary_dim, rope, start_pos)?;
        Ok(out)
    }

    fn rms_norm_rope(&self, x: &Tensor, w: &Tensor, head_dim: usize, eps: f32, rotary_dim: usize, rope: Rope, start_pos: usize)
        -> Result<Tensor> {
        checks::rms_norm_weight(x, Some(w), head_dim)?;
        let heads = checks::groups_of("rms_norm_rope", x, head_dim)? / x.rows().max(1);
        let shaped = x.reshape(&[x.rows(), heads, head_dim])?;
        let (tokens, _) = checks::rope(&shaped, head_dim, rotary_dim)?;
        if w.numel() != head_dim {
            return Err(shape_error("rms_norm_rope", format!("a weight of {} values for heads of {head_dim}", w.numel())));
        }
        let (out, ob) = self.output(vec![tokens, heads, head_dim])?;
        let angles = attention::rope_angles(&self.gpu, tokens, rotary_dim, rope, start_pos)?;
        let dims = [tokens, heads, head_dim];
        norm::rms_norm_rope(&self.gpu, buf(&shaped)?, buf(w)?, whole(&angles), ob.bind(), dims, eps, rotary_dim)?;
        Ok(out)
    }

    fn rms_norm_rope_pair(&self, q: &Tensor, k: &Tensor, weights: [&Tensor; 2], head_dim: usize, eps: [f32; 2], rotary_dim: usize, rope: Rope, start_pos: usize)
        -> Result<(Tensor, Tensor)> {
        norm::rms_norm_rope_pair(&self.gpu, [q, k], weights, head_dim, eps, rotary_dim, rope, start_pos)
    }

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize) -> Result<State> {
        let kind = attention::kv_type(&self.gpu, self.options.kv_cache, self.mode, head_dim);
        Ok(State::new(Box::new(GpuKvCache::new(&self.gpu, kv_heads, head_dim, kind))))
    }

    fn kv_cache_type(&self) -> KvCacheType {
        // The head dim is not known here: what the common head dims get
        // (the memory plan's estimate).
        attention::kv_type(&self.gpu, self.options.kv_cache, self.mode, 128)
    }

    fn kv_len(&self, cache: &State) -> Result<usize> {
        cache.get::<GpuKvCache>().map(|c| c.len).ok_or_else(|| not_ours("the KV cache"))
    }

    fn kv_truncate(&self, cache: &mut State, len: usize) -> Result<()> {
        let c = cache.get_mut::<GpuKvCache>().ok_or_else(|| not_ours("the KV cache"))?;
        checks::kv_truncate(len, c.len)?;
        // Rows past `len` are overwritten by the next append.
        c.len = len;
        Ok(())
    }

    fn kv_reserve(&self, cache: &mut State, positions: usize) -> Result<()> {
        let c = cache.get_mut::<GpuKvCache>().ok_or_else(|| not_ours("the KV cache"))?;
        c.reserve(positions.saturating_sub(c.len))
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32, selection: Option<&KeySelection>) -> Result<Tensor> {
        attention::attention(self, [q, k, v], cache, heads, scale, selection)
    }

    fn attention_qk_norm(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32,
        selection: Option<&KeySelection>, norm: &QkNorm<'_>) -> Result<Tensor> {
        attention::attention_qk_norm(self, [q, k, v], cache, heads, scale, selection, norm)
    }

    fn new_conv_state(&self, channels: usize, kernel: usize, dilation: usize) -> Result<State> {
        checks::conv_state(kernel, dilation)?;
        Ok(State::new(Box::new(GpuConvState::new(&self.gpu, channels, kernel, dilation))))
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
        Ok(State::new(Box::new(GpuRecurrentState::new(&self.gpu, heads, key_dim, value_dim))))
    }

    fn delta_gates(&self, a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor) -> Result<(Tensor, Tensor)> {
        let heads = checks::delta_gates(a, b, a_log, dt_bias)?;
        let (g, gb) = self.output(a.shape().to_vec())?;
        let (beta, bb) = self.output(b.shape().to_vec())?;
        let (ab, bbuf, lb, db) = (buf(a)?, buf(b)?, buf(a_log)?, buf(dt_bias)?);
        elementwise::delta_gates(&self.gpu, ab, bbuf, lb, db, gb.bind(), bb.bind(), a.numel(), heads)?;
        Ok((g, beta))
    }

    fn gated_delta(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, key_heads: usize, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<GpuRecurrentState>().ok_or_else(|| not_ours("the recurrent state"))?;
        let dims = checks::RecurrentDims { heads: st.heads, key_dim: st.key_dim, value_dim: st.value_dim };
        let tokens = checks::gated_delta([q, k, v, g, beta], key_heads, dims)?;
        let (out, ob) = self.output(vec![tokens, st.heads * st.value_dim])?;
        let inputs = [buf(q)?, buf(k)?, buf(v)?, buf(g)?, buf(beta)?];
        recurrent::gated_delta(&self.gpu, st, inputs, None, ob.bind(), tokens, key_heads)?;
        Ok(out)
    }

    fn gated_delta_step(&self, x: DeltaInputs<'_>, key_heads: usize, q_scale: f32, eps: f32, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<GpuRecurrentState>().ok_or_else(|| not_ours("the recurrent state"))?;
        let dims = checks::RecurrentDims { heads: st.heads, key_dim: st.key_dim, value_dim: st.value_dim };
        let tokens = checks::gated_delta([x.q, x.k, x.v, x.a, x.b], key_heads, dims)?;
        checks::delta_gates(x.a, x.b, x.a_log, x.dt_bias)?;
        let (out, ob) = self.output(vec![tokens, st.heads * st.value_dim])?;
        let inputs = [buf(x.q)?, buf(x.k)?, buf(x.v)?, buf(x.a)?, buf(x.b)?];
        let per_head = [buf(x.a_log)?, buf(x.dt_bias)?];
        recurrent::gated_delta(&self.gpu, st, inputs, Some((per_head, q_scale, eps)), ob.bind(), tokens, key_heads)?;
        Ok(out)
    }

    fn routed_experts_many(&self, routes: &[&Routes]) -> Result<Vec<Vec<u32>>> {
        moe::routed_ids(&self.gpu, routes)
    }

    fn route(&self, logits: &Tensor, gating: Gating) -> Result<Routes> {
        let tokens = checks::route(logits, gating)?;
        let (tensor, rb) = self.output(vec![tokens, 2 * gating.top_k])?;
        moe::route(&self.gpu, buf(logits)?, rb.bind(), tokens, gating)?;
        Ok(Routes { tensor, gating })
    }

    fn route_matmul(&self, x: &Tensor, router: &Weight, gating: Gating) -> Result<(Routes, Option<Tensor>)> {
        let gw = weight(router)?;
        checks::matmul(x, gw.experts, gw.rows, gw.cols)?;
        // Routers too large for one workgroup may still route over several.
        let one_workgroup = gw.rows <= self.options.route_rows;
        let wide = !one_workgroup && moe::route_wide(&self.gpu, gw, self.options.route_wide_rows);
        if gw.rows < gating.experts || gating.experts == 0 || gw.rows > moe::ROUTE_MATMUL_MAX_ROWS || !(one_workgroup || wide) {
            return route_matmul_composed(self, x, router, gating);
        }
        checks::gating(gating)?;
        let tokens = x.rows();
        let (tensor, rb) = self.output(vec![tokens, 2 * gating.top_k])?;
        let extra_cols = gw.rows - gating.experts;
        let (extra, eb) = self.output(vec![tokens, extra_cols.max(1)])?;
        let x_bind = buf(x)?;
        let ours = |h: &norm::HeldNorm| buf(&h.out).is_ok_and(|o| o.buffer == x_bind.buffer && o.offset == x_bind.offset);
        if let Some(h) = self.gpu.take_held(|h: &norm::HeldNorm| ours(h) && moe::route_norm_fits(gw, h, wide))? {
            moe::route_norm(&self.gpu, gw, &h, rb.bind(), eb.bind(), gating, wide)?;
            return Ok((Routes { tensor, gating }, (extra_cols > 0).then_some(extra)));
        }
        match one_workgroup.then(|| moe::route_matmul(&self.gpu, gw, buf(x)?, rb.bind(), eb.bind(), tokens, gating)).transpose()? {
            Some(Some(())) => Ok((Routes { tensor, gating }, (extra_cols > 0).then_some(extra))),
            _ => route_matmul_composed(self, x, router, gating),
        }
    }

    fn new_expert_pool(&self, layout: &ExpertLayout, slots: usize, keys: usize) -> Result<ExpertPool> {
        let formats = [layout.gate, layout.up, layout.down];
        let pool = GpuPool::new(&self.gpu, layout.hidden, layout.intermediate, formats, slots, keys, self.options.q4_layout)?;
        let bytes = pool.bytes();
        Ok(ExpertPool::new(Box::new(pool), *layout, slots, keys, bytes))
    }

    fn write_expert(&self, pool: &mut ExpertPool, slot: usize, e: &HostExpert<'_>) -> Result<()> {
        pool.get::<GpuPool>().ok_or_else(|| not_ours("the expert pool"))?.write(&self.gpu, slot, &e.gate, &e.up, &e.down)
    }

    fn write_expert_matrix(&self, pool: &mut ExpertPool, slot: usize, which: ExpertMatrix, m: &HostMatrix<'_>) -> Result<()> {
        pool.get::<GpuPool>().ok_or_else(|| not_ours("the expert pool"))?.write_matrix(&self.gpu, slot, which, m)
    }

    fn map_experts(&self, pool: &mut ExpertPool, entries: &[(u32, Option<u32>)]) -> Result<()> {
        checks::map_experts(entries, pool.keys, pool.slots)?;
        let p = pool.get_mut::<GpuPool>().ok_or_else(|| not_ours("the expert pool"))?;
        let words: Vec<[u32; 2]> = entries.iter().map(|&(k, s)| [k, s.unwrap_or(params::NO_SLOT)]).collect();
        self.gpu.send_pool_writes()?; // pool writes left staged go out before the table names their slots
        moe::map(&self.gpu, &p.table, &words)?;
        p.mapped(&words);
        Ok(())
    }

    fn moe_expert_outputs(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Tensor> {
        let p = pool.get::<GpuPool>().ok_or_else(|| not_ours("the expert pool"))?;
        let (tokens, top_k) = checks::moe_routes(x, p.gate_up.layout_cols(), routes, key_base, pool.keys)?;
        let (out, ob) = self.output(vec![tokens, top_k, x.cols()])?;
        let call = moe::Call::new(p, buf(x)?, buf(&routes.tensor)?, tokens, routes.gating, key_base, self.matmul_choice().coop(&self.gpu));
        moe::expert_outputs(&self.gpu, &call, ob.buffer())?;
        Ok(out)
    }

    fn moe(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Tensor> {
        if let Some(out) = self.moe_fused(x, pool, routes, key_base, None)? {
            return Ok(out);
        }
        if let Some(out) = self.moe_in_parts(x, pool, routes, key_base)? {
            return Ok(out);
        }
        let outputs = self.moe_expert_outputs(x, pool, routes, key_base)?;
        self.moe_combine(&outputs, routes)
    }

    fn moe_shared(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize, shared: &SharedExpert<'_>) -> Result<Tensor> {
        let fused = match shared.key {
            Some(key) => self.moe_fused(x, pool, routes, key_base, Some((key, shared.gate)))?,
            None => None,
        };
        match fused {
            Some(out) => Ok(out),
            None => moe_shared_composed(self, x, pool, routes, key_base, shared),
        }
    }

    fn pools_shared_experts(&self) -> bool {
        self.options.shared_in_pool
    }

    fn moe_combine(&self, outputs: &Tensor, routes: &Routes) -> Result<Tensor> {
        let (tokens, hidden) = checks::moe_combine(outputs, routes)?;
        let (out, ob) = self.output(vec![tokens, hidden])?;
        moe::combine(&self.gpu, buf(outputs)?, buf(&routes.tensor)?, ob.bind(), tokens, hidden, routes.gating.top_k)?;
        Ok(out)
    }
}
