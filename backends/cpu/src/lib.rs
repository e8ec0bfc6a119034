//! The CPU backend: every op of [`slotstream_backend::Backend`] in plain Rust,
//! f32 activations and accumulation, threads from rayon. It is the reference the
//! GPU backend is checked against and the fallback on machines without a GPU.
//!
//! By default ([`CpuBackend::new`]) 4-bit affine weights are multiplied by
//! int8-quantized activations (integer dot products, `q8.rs`; ~1e-3 relative
//! error); [`CpuBackend::exact`] ([`MatmulMode::Exact`]) keeps f32
//! activations everywhere, which the oracle parity tests use. The settings
//! are a [`CpuOptions`] value.

mod attention;
mod conv;
mod delta;
mod kv_cache;
mod kv_q8;
mod matmul;
mod moe;
mod options;
#[cfg(target_arch = "x86_64")]
mod q8;
mod streams;
mod weight;

use std::sync::Arc;

use rayon::prelude::*;
use slotstream_backend::{
    checks, routing, Backend, BackendError, ExpertLayout, ExpertMatrix, ExpertPool, GateAct, Gating,
    HostMatrix, KeySelection, KvCacheType, Result, Rope, Routes, State, Tensor, Weight,
};

pub use conv::ConvState;
pub use delta::RecurrentState;
pub use kv_cache::KvCache;
pub use matmul::MatmulMode;
pub use options::{CpuOptions, Int8Kernel};
pub use weight::{CpuWeight, Store};

use matmul::MatmulPlan;

/// Multi-threaded CPU implementation of the backend trait.
pub struct CpuBackend {
    options: CpuOptions,
    /// `options` resolved for this CPU (which int8 kernel it has).
    plan: MatmulPlan,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The backend [`CpuOptions::from_env`] describes: by default the fast
    /// one, where 4-bit affine weights use int8 activations
    /// ([`MatmulMode::Int8`]); `SLOTSTREAM_CPU_MATMUL=exact` selects f32.
    pub fn new() -> Self {
        CpuBackend::with_options(CpuOptions::from_env())
    }

    /// f32 activations everywhere: the reference the parity tests compare with
    /// the oracle at 1e-4 relative L2 (the other settings from the environment).
    pub fn exact() -> Self {
        CpuBackend::with_mode(MatmulMode::Exact)
    }

    /// Matmuls in `mode`, the other settings from the environment.
    pub fn with_mode(mode: MatmulMode) -> Self {
        CpuBackend::with_options(CpuOptions { matmul: mode, ..CpuOptions::from_env() })
    }

    pub fn with_options(options: CpuOptions) -> Self {
        let plan = MatmulPlan::new(&options);
        CpuBackend { options, plan }
    }

    pub fn options(&self) -> &CpuOptions {
        &self.options
    }

    pub fn mode(&self) -> MatmulMode {
        self.options.matmul
    }

    /// The KV cache type asked for: [`CpuOptions::kv_cache`], else f16
    /// with the int8 matmuls and f32 in the exact mode (a cache may still
    /// hold another, [`KvCache::resolve`]).
    fn asked_kv_cache(&self) -> KvCacheType {
        let default = if self.options.matmul == MatmulMode::Int8 { KvCacheType::F16 } else { KvCacheType::F32 };
        self.options.kv_cache.unwrap_or(default)
    }
}

type Buf = Vec<f32>;

/// Work (about one multiply-add per unit) below which an op runs on the
/// calling thread: a round trip through the thread pool costs ~10-20 µs, more
/// than a decode step's norms or short-context attention take.
const PAR_WORK: usize = 1 << 16;

/// `f(index, piece)` over `size`-long pieces of `out`, on the thread pool only
/// when `work` is large enough to pay for it.
fn for_each_piece(out: &mut [f32], size: usize, work: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if work < PAR_WORK || rayon::current_num_threads() == 1 {
        out.chunks_mut(size).enumerate().for_each(|(i, c)| f(i, c));
    } else {
        out.par_chunks_mut(size).enumerate().for_each(|(i, c)| f(i, c));
    }
}

fn data(t: &Tensor) -> Result<&[f32]> {
    t.buffer::<Buf>()
        .map(|v| v.as_slice())
        .ok_or_else(|| BackendError::Device("tensor does not belong to the CPU backend".into()))
}

fn weight(w: &Weight) -> Result<&CpuWeight> {
    w.buffer::<CpuWeight>()
        .ok_or_else(|| BackendError::Device("weight does not belong to the CPU backend".into()))
}

fn tensor(v: Vec<f32>, shape: Vec<usize>) -> Tensor {
    Tensor::from_buffer(Arc::new(v), shape)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

fn softplus(x: f32) -> f32 {
    // log(1 + e^x) without overflow for large x.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}


/// The CPU's expert slot pool: three stacked weights with one matrix per slot.
pub struct CpuExpertPool {
    gate: CpuWeight,
    up: CpuWeight,
    down: CpuWeight,
    /// The slot table: slot of each key, or `NO_SLOT`.
    table: Vec<u32>,
}

const NO_SLOT: u32 = u32::MAX;

fn not_ours(what: &str) -> BackendError {
    BackendError::Device(format!("{what} does not belong to the CPU backend"))
}

fn kv_cache(state: &mut State) -> Result<&mut KvCache> {
    state.get_mut::<KvCache>().ok_or_else(|| not_ours("the KV cache"))
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        let m = match self.options.matmul {
            MatmulMode::Exact => "",
            MatmulMode::Int8 => ", int8 activations for 4-bit",
        };
        // The KV cache's type where --kv-cache chose it.
        let kv = self.options.kv_cache.map_or(String::new(), |_| format!(", {} KV cache", self.kv_cache_type()));
        format!("cpu ({} threads{m}{kv})", rayon::current_num_threads())
    }

    fn upload(&self, values: &[f32], shape: &[usize]) -> Result<Tensor> {
        checks::upload(values.len(), shape)?;
        Ok(tensor(values.to_vec(), shape.to_vec()))
    }

    fn download(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(data(t)?.to_vec())
    }

    fn load_weight(&self, m: &HostMatrix<'_>) -> Result<Weight> {
        m.validate()?;
        let w = CpuWeight::from_host(m);
        let bytes = w.bytes();
        Ok(Weight::from_buffer(Arc::new(w), m.experts, m.rows, m.cols, bytes))
    }

    fn slice_cols(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let (rows, cols) = checks::slice_cols(x, start, len)?;
        let src = data(x)?;
        let mut out = Vec::with_capacity(rows * len);
        for r in 0..rows {
            out.extend_from_slice(&src[r * cols + start..r * cols + start + len]);
        }
        Ok(tensor(out, vec![rows, len]))
    }

    fn slice_rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let cols = checks::slice_rows(x, start, len)?;
        Ok(tensor(data(x)?[start * cols..(start + len) * cols].to_vec(), vec![len, cols]))
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Result<Tensor> {
        let shape = checks::stacked_rows(parts)?;
        let mut out = Vec::with_capacity(shape[0] * shape[1]);
        for p in parts {
            out.extend_from_slice(data(p)?);
        }
        Ok(tensor(out, shape.to_vec()))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        checks::same_shape("add", a, b)?;
        let out = data(a)?.iter().zip(data(b)?).map(|(x, y)| x + y).collect();
        Ok(tensor(out, a.shape().to_vec()))
    }

    fn sigmoid_mul(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let per_row = checks::gate_per_row("sigmoid_mul", x, gate)?;
        let (xs, gs) = (data(x)?, data(gate)?);
        let out = if per_row {
            let cols = x.cols();
            xs.iter().enumerate().map(|(i, v)| v * sigmoid(gs[i / cols])).collect()
        } else {
            xs.iter().zip(gs).map(|(v, g)| v * sigmoid(*g)).collect()
        };
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        checks::same_shape("silu_mul", gate, up)?;
        let out = data(gate)?.iter().zip(data(up)?).map(|(g, u)| silu(*g) * u).collect();
        Ok(tensor(out, gate.shape().to_vec()))
    }

    fn add_sigmoid_mul(&self, y: &Tensor, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let gated = self.sigmoid_mul(x, gate)?;
        self.add(y, &gated)
    }

    fn silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(tensor(data(x)?.iter().map(|v| silu(*v)).collect(), x.shape().to_vec()))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        Ok(tensor(data(x)?.iter().map(|v| v * s).collect(), x.shape().to_vec()))
    }

    fn repeat_cols(&self, x: &Tensor, n: usize) -> Result<Tensor> {
        let d = x.cols();
        let out: Vec<f32> = data(x)?.chunks_exact(d.max(1)).flat_map(|row| (0..n).flat_map(move |_| row.iter().copied())).collect();
        Ok(tensor(out, vec![x.rows(), n * d]))
    }

    fn sigmoid_weighted_stream_mean(&self, x: &Tensor, w: &Tensor, streams: usize) -> Result<Tensor> {
        let (rows, d) = checks::stream_mean(x, w, streams)?;
        Ok(tensor(streams::sigmoid_weighted_mean(data(x)?, data(w)?, rows, d, streams), vec![rows, d]))
    }

    fn add_gated_to_streams(&self, h: &Tensor, x: &Tensor, logits: &Tensor, logit_scale: f32) -> Result<Tensor> {
        let (streams, d) = checks::gated_to_streams(h, x, logits)?;
        let out = streams::add_gated(data(h)?, data(x)?, data(logits)?, logit_scale, streams, d);
        Ok(tensor(out, h.shape().to_vec()))
    }

    fn stream_dot_gate(&self, key: &Tensor, query: &Tensor, value: &Tensor, streams: usize) -> Result<Tensor> {
        let (rows, d) = checks::stream_dot_gate(key, query, value, streams)?;
        let out = streams::dot_gate(data(key)?, data(query)?, data(value)?, rows, d, streams);
        Ok(tensor(out, vec![rows, streams * d]))
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        let w = weight(table)?;
        checks::token_ids(ids, w.experts * w.rows)?;
        let mut out = vec![0.0f32; ids.len() * w.cols];
        for (row, &id) in out.chunks_exact_mut(w.cols).zip(ids) {
            w.dequant_row(id as usize, row);
        }
        Ok(tensor(out, vec![ids.len(), w.cols]))
    }

    fn matmul(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let cw = weight(w)?;
        checks::matmul(x, cw.experts, cw.rows, cw.cols)?;
        let tokens = x.rows();
        Ok(tensor(matmul::matmul(data(x)?, tokens, cw, 0, &self.plan, true), vec![tokens, cw.rows]))
    }

    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, dim: usize, eps: f32) -> Result<Tensor> {
        checks::groups_of("rms_norm", x, dim)?;
        let wlen = checks::rms_norm_weight(x, w, dim)?;
        let wv = w.map(data).transpose()?;
        let mut out = data(x)?.to_vec();
        let work = out.len();
        for_each_piece(&mut out, dim, work, |i, g| {
            let ms = g.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let r = 1.0 / (ms + eps).sqrt();
            match wv {
                Some(wv) => {
                    let start = (i * dim) % wlen;
                    g.iter_mut().zip(&wv[start..start + dim]).for_each(|(v, w)| *v = *v * r * w)
                }
                None => g.iter_mut().for_each(|v| *v *= r),
            }
        });
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn rms_norm_gated(&self, x: &Tensor, z: &Tensor, w: &Tensor, dim: usize, eps: f32, act: GateAct) -> Result<Tensor> {
        checks::rms_norm_gated(x, z, w, dim)?;
        let normed = self.rms_norm(x, Some(w), dim, eps)?;
        let gate = match act {
            GateAct::Silu => silu,
            GateAct::Sigmoid => sigmoid,
        };
        let out = data(&normed)?.iter().zip(data(z)?).map(|(n, z)| gate(*z) * n).collect();
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn l2_normalize(&self, x: &Tensor, dim: usize, eps: f32, scale: f32) -> Result<Tensor> {
        checks::groups_of("l2_normalize", x, dim)?;
        let mut out = data(x)?.to_vec();
        let work = out.len();
        for_each_piece(&mut out, dim, work, |_, g| {
            let r = scale / (g.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
            g.iter_mut().for_each(|v| *v *= r);
        });
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn rope(&self, x: &Tensor, head_dim: usize, rotary_dim: usize, rope: Rope, start_pos: usize) -> Result<Tensor> {
        let (_, heads_per_token) = checks::rope(x, head_dim, rotary_dim)?;
        let mut out = data(x)?.to_vec();
        rope.apply(&mut out, head_dim, heads_per_token, rotary_dim, start_pos);
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize) -> Result<State> {
        Ok(State::new(Box::new(KvCache::new(kv_heads, head_dim, self.asked_kv_cache()))))
    }

    fn kv_cache_type(&self) -> KvCacheType {
        // Every model's head dim is whole q8 blocks (a planner's question).
        KvCache::resolve(self.asked_kv_cache(), slotstream_backend::Q8_BLOCK)
    }

    fn kv_len(&self, cache: &State) -> Result<usize> {
        cache.get::<KvCache>().map(|c| c.len()).ok_or_else(|| not_ours("the KV cache"))
    }

    fn kv_truncate(&self, cache: &mut State, len: usize) -> Result<()> {
        let c = kv_cache(cache)?;
        checks::kv_truncate(len, c.len())?;
        c.truncate(len);
        Ok(())
    }

    fn kv_reserve(&self, cache: &mut State, positions: usize) -> Result<()> {
        kv_cache(cache)?.reserve(positions);
        Ok(())
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32, selection: Option<&KeySelection>) -> Result<Tensor> {
        let c = kv_cache(cache)?;
        let hd = c.head_dim();
        let tokens = checks::attention(q, k, v, heads, c.kv_heads(), hd, selection)?;
        let past = c.len();
        // The keys each query may see, once per query (not per head).
        let selected: Option<Vec<Vec<usize>>> = selection.map(|sel| (0..tokens).map(|t| sel.keys_of(t, past + t)).collect());
        c.append(data(k)?, data(v)?);
        let out = c.attend(data(q)?, tokens, heads, scale, selected.as_deref());
        Ok(tensor(out, vec![tokens, heads * hd]))
    }

    fn new_conv_state(&self, channels: usize, kernel: usize, dilation: usize) -> Result<State> {
        checks::conv_state(kernel, dilation)?;
        Ok(State::new(Box::new(ConvState::new(channels, kernel, dilation))))
    }

    fn causal_conv1d_silu(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        let conv = self.causal_conv1d(x, w, state)?;
        self.silu(&conv)
    }

    fn causal_conv1d(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<ConvState>().ok_or_else(|| not_ours("the convolution state"))?;
        let tokens = checks::causal_conv1d(x, w, st.channels, st.kernel)?;
        let out = st.convolve(data(x)?, data(w)?, tokens);
        Ok(tensor(out, vec![tokens, st.channels]))
    }

    fn new_recurrent_state(&self, heads: usize, key_dim: usize, value_dim: usize) -> Result<State> {
        Ok(State::new(Box::new(RecurrentState::new(heads, key_dim, value_dim))))
    }

    fn delta_gates(&self, a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor) -> Result<(Tensor, Tensor)> {
        let heads = checks::delta_gates(a, b, a_log, dt_bias)?;
        let (al, dt) = (data(a_log)?, data(dt_bias)?);
        let g = data(a)?
            .iter()
            .enumerate()
            .map(|(i, a)| (-al[i % heads].exp() * softplus(a + dt[i % heads])).exp())
            .collect();
        let beta = data(b)?.iter().map(|b| sigmoid(*b)).collect();
        Ok((tensor(g, a.shape().to_vec()), tensor(beta, b.shape().to_vec())))
    }

    fn gated_delta(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, key_heads: usize, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<RecurrentState>().ok_or_else(|| not_ours("the recurrent state"))?;
        let (h, dk, dv) = (st.heads, st.key_dim, st.value_dim);
        let dims = checks::RecurrentDims { heads: h, key_dim: dk, value_dim: dv };
        let tokens = checks::gated_delta([q, k, v, g, beta], key_heads, dims)?;
        let inputs = delta::DeltaInputs {
            q: data(q)?, k: data(k)?, v: data(v)?, g: data(g)?, beta: data(beta)?,
            tokens, heads: h, key_heads, key_dim: dk, value_dim: dv,
        };
        let out = delta::gated_delta(&inputs, &mut st.s);
        Ok(tensor(out, vec![tokens, h * dv]))
    }

    fn route(&self, logits: &Tensor, gating: Gating) -> Result<Routes> {
        let tokens = checks::route(logits, gating)?;
        let rows = routing::route_rows(data(logits)?, gating);
        Ok(Routes { tensor: tensor(rows, vec![tokens, 2 * gating.top_k]), gating })
    }

    fn new_expert_pool(&self, layout: &ExpertLayout, slots: usize, keys: usize) -> Result<ExpertPool> {
        let (h, i) = (layout.hidden, layout.intermediate);
        let pool = CpuExpertPool {
            gate: CpuWeight::zeros(slots, i, h, layout.gate),
            up: CpuWeight::zeros(slots, i, h, layout.up),
            down: CpuWeight::zeros(slots, h, i, layout.down),
            table: vec![NO_SLOT; keys],
        };
        let bytes = pool.gate.bytes() + pool.up.bytes() + pool.down.bytes();
        Ok(ExpertPool::new(Box::new(pool), *layout, slots, keys, bytes))
    }

    fn write_expert_matrix(&self, pool: &mut ExpertPool, slot: usize, which: ExpertMatrix, m: &HostMatrix<'_>) -> Result<()> {
        let p = pool.get_mut::<CpuExpertPool>().ok_or_else(|| not_ours("the expert pool"))?;
        match which {
            ExpertMatrix::Gate => p.gate.write_slot(slot, m, self.options.pool_write_part),
            ExpertMatrix::Up => p.up.write_slot(slot, m, self.options.pool_write_part),
            ExpertMatrix::Down => p.down.write_slot(slot, m, self.options.pool_write_part),
        }
    }

    fn map_experts(&self, pool: &mut ExpertPool, entries: &[(u32, Option<u32>)]) -> Result<()> {
        checks::map_experts(entries, pool.keys, pool.slots)?;
        let p = pool.get_mut::<CpuExpertPool>().ok_or_else(|| not_ours("the expert pool"))?;
        for &(key, slot) in entries {
            p.table[key as usize] = slot.unwrap_or(NO_SLOT);
        }
        Ok(())
    }

    fn moe_expert_outputs(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Tensor> {
        let mut out = vec![0.0f32; x.rows() * routes.gating.top_k * x.cols()];
        moe::expert_outputs(self, x, pool, routes, key_base, &mut out)?;
        Ok(tensor(out, vec![x.rows(), routes.gating.top_k, x.cols()]))
    }

    fn moe_expert_outputs_into(&self, mut outputs: Tensor, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Tensor> {
        let shape = [x.rows(), routes.gating.top_k, x.cols()];
        if outputs.shape() != shape {
            return Err(slotstream_backend::shape_error("moe_expert_outputs_into", format!("outputs {:?}, expected {shape:?}", outputs.shape())));
        }
        if outputs.buffer_mut::<Buf>().is_none() {
            // Shared with another tensor (or not ours): written into a copy.
            outputs = tensor(data(&outputs)?.to_vec(), shape.to_vec());
        }
        let out = outputs.buffer_mut::<Buf>().ok_or_else(|| not_ours("the outputs tensor"))?;
        moe::expert_outputs(self, x, pool, routes, key_base, out)?;
        Ok(outputs)
    }

    fn moe_combine(&self, outputs: &Tensor, routes: &Routes) -> Result<Tensor> {
        let (tokens, hidden) = checks::moe_combine(outputs, routes)?;
        let top_k = routes.gating.top_k;
        let rd = data(&routes.tensor)?;
        let od = data(outputs)?;
        let mut out = vec![0.0f32; tokens * hidden];
        for_each_piece(&mut out, hidden, tokens * top_k * hidden, |t, o| {
            for r in 0..top_k {
                let w = rd[t * 2 * top_k + top_k + r];
                let row = &od[(t * top_k + r) * hidden..(t * top_k + r + 1) * hidden];
                o.iter_mut().zip(row).for_each(|(o, y)| *o += w * y);
            }
        });
        Ok(tensor(out, vec![tokens, hidden]))
    }
}
