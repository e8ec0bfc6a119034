//! The CPU backend: every op of [`slotstream_backend::Backend`] in plain Rust,
//! f32 activations and accumulation, threads from rayon. It is the reference the
//! GPU backend is checked against and the fallback on machines without a GPU.
//!
//! By default ([`CpuBackend::new`]) 4-bit affine weights are multiplied by
//! int8-quantized activations (integer dot products, `q8.rs`; ~1e-3 relative
//! error); [`CpuBackend::exact`] or `SLOTSTREAM_CPU_MATMUL=exact` keeps f32
//! activations everywhere, which the oracle parity tests use.

mod attention;
mod delta;
mod matmul;
mod q8;

use std::sync::Arc;

use rayon::prelude::*;
use slotstream_backend::{
    shape_error, Backend, BackendError, ExpertAssignment, ExpertLayout, ExpertPool, GateAct, HostExpert,
    HostMatrix, KeySelection, Result, State, Tensor, Weight,
};

pub use attention::KvCache;
pub use matmul::{CpuWeight, MatmulMode, Store};

/// Multi-threaded CPU implementation of the backend trait.
pub struct CpuBackend {
    mode: MatmulMode,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The fast backend: 4-bit affine weights use int8 activations
    /// ([`MatmulMode::Int8`]). `SLOTSTREAM_CPU_MATMUL=exact` in the environment
    /// selects [`CpuBackend::exact`] instead.
    pub fn new() -> Self {
        match std::env::var("SLOTSTREAM_CPU_MATMUL").as_deref() {
            Ok("exact") => CpuBackend::exact(),
            _ => CpuBackend::with_mode(MatmulMode::Int8),
        }
    }

    /// f32 activations everywhere: the reference the parity tests compare with
    /// the oracle at 1e-4 relative L2.
    pub fn exact() -> Self {
        CpuBackend::with_mode(MatmulMode::Exact)
    }

    pub fn with_mode(mode: MatmulMode) -> Self {
        CpuBackend { mode }
    }

    pub fn mode(&self) -> MatmulMode {
        self.mode
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

fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(shape_error(op, format!("{:?} vs {:?}", a.shape(), b.shape())));
    }
    Ok(())
}

fn groups_of(op: &'static str, x: &Tensor, dim: usize) -> Result<()> {
    if dim == 0 || x.numel() % dim != 0 {
        return Err(shape_error(op, format!("{:?} is not a whole number of groups of {dim}", x.shape())));
    }
    Ok(())
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


/// The last `(kernel-1)*dilation` inputs of a causal convolution, `[.., channels]`.
pub struct ConvState {
    channels: usize,
    kernel: usize,
    dilation: usize,
    window: Vec<f32>,
}

/// The CPU's expert slot pool: three stacked weights with one matrix per slot.
pub struct CpuExpertPool {
    gate: CpuWeight,
    up: CpuWeight,
    down: CpuWeight,
}

/// Gated DeltaNet matrix state, `[heads, value_dim, key_dim]`.
pub struct RecurrentState {
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    s: Vec<f32>,
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        let m = match self.mode {
            MatmulMode::Exact => "",
            MatmulMode::Int8 => ", int8 activations for 4-bit",
        };
        format!("cpu ({} threads{m})", rayon::current_num_threads())
    }

    fn upload(&self, values: &[f32], shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != values.len() {
            return Err(shape_error("upload", format!("{} values for shape {shape:?}", values.len())));
        }
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
        let (rows, cols) = (x.rows(), x.cols());
        if start + len > cols {
            return Err(shape_error("slice_cols", format!("[{start}, {}) of {cols} columns", start + len)));
        }
        let src = data(x)?;
        let mut out = Vec::with_capacity(rows * len);
        for r in 0..rows {
            out.extend_from_slice(&src[r * cols + start..r * cols + start + len]);
        }
        Ok(tensor(out, vec![rows, len]))
    }

    fn slice_rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let (rows, cols) = (x.rows(), x.cols());
        if start + len > rows {
            return Err(shape_error("slice_rows", format!("[{start}, {}) of {rows} rows", start + len)));
        }
        Ok(tensor(data(x)?[start * cols..(start + len) * cols].to_vec(), vec![len, cols]))
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Result<Tensor> {
        let cols = parts.first().map(|t| t.cols()).unwrap_or(0);
        let mut out = Vec::new();
        for p in parts {
            if p.cols() != cols {
                return Err(shape_error("concat_rows", format!("{} vs {} columns", p.cols(), cols)));
            }
            out.extend_from_slice(data(p)?);
        }
        let rows = out.len() / cols.max(1);
        Ok(tensor(out, vec![rows, cols]))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        same_shape("add", a, b)?;
        let out = data(a)?.iter().zip(data(b)?).map(|(x, y)| x + y).collect();
        Ok(tensor(out, a.shape().to_vec()))
    }

    fn sigmoid_mul(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let (xs, gs) = (data(x)?, data(gate)?);
        let out = if gs.len() == xs.len() {
            xs.iter().zip(gs).map(|(v, g)| v * sigmoid(*g)).collect()
        } else if gs.len() == x.rows() {
            let cols = x.cols();
            xs.iter().enumerate().map(|(i, v)| v * sigmoid(gs[i / cols])).collect()
        } else {
            return Err(shape_error("sigmoid_mul", format!("x {:?}, gate {:?}", x.shape(), gate.shape())));
        };
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape("silu_mul", gate, up)?;
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

    fn hc_mix(&self, normed: &Tensor, mix: &Tensor, streams: usize) -> Result<Tensor> {
        same_shape("hc_mix", normed, mix)?;
        if streams == 0 || normed.cols() % streams != 0 {
            return Err(shape_error("hc_mix", format!("{:?} is not {streams} streams", normed.shape())));
        }
        let (rows, d) = (normed.rows(), normed.cols() / streams);
        let (nd, md) = (data(normed)?, data(mix)?);
        let mut out = vec![0.0f32; rows * d];
        out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            for s in 0..streams {
                let base = r * streams * d + s * d;
                for (j, o) in o.iter_mut().enumerate() {
                    *o += sigmoid(md[base + j]) * nd[base + j];
                }
            }
            o.iter_mut().for_each(|v| *v /= streams as f32);
        });
        Ok(tensor(out, vec![rows, d]))
    }

    fn hc_inject(&self, h: &Tensor, x: &Tensor, logits: &Tensor, logit_scale: f32) -> Result<Tensor> {
        let (rows, streams, d) = (h.rows(), logits.cols(), x.cols());
        if x.rows() != rows || logits.rows() != rows || h.cols() != streams * d {
            return Err(shape_error("hc_inject", format!("h {:?}, x {:?}, logits {:?}", h.shape(), x.shape(), logits.shape())));
        }
        let (xd, ld) = (data(x)?, data(logits)?);
        let mut out = data(h)?.to_vec();
        out.par_chunks_mut(streams * d).enumerate().for_each(|(r, o)| {
            for (s, chunk) in o.chunks_exact_mut(d).enumerate() {
                let w = 2.0 * sigmoid(logit_scale * ld[r * streams + s]);
                chunk.iter_mut().zip(&xd[r * d..(r + 1) * d]).for_each(|(o, x)| *o += w * x);
            }
        });
        Ok(tensor(out, h.shape().to_vec()))
    }

    fn ple_gate(&self, key: &Tensor, query: &Tensor, value: &Tensor, streams: usize) -> Result<Tensor> {
        same_shape("ple_gate", key, query)?;
        let (rows, d) = (value.rows(), value.cols());
        if key.rows() != rows || key.cols() != streams * d {
            return Err(shape_error("ple_gate", format!("key {:?}, value {:?}, {streams} streams", key.shape(), value.shape())));
        }
        let (kd, qd, vd) = (data(key)?, data(query)?, data(value)?);
        let inv_sqrt_d = 1.0 / (d as f32).sqrt();
        let mut out = vec![0.0f32; rows * streams * d];
        out.par_chunks_mut(streams * d).enumerate().for_each(|(r, o)| {
            for (s, chunk) in o.chunks_exact_mut(d).enumerate() {
                let base = r * streams * d + s * d;
                let g = kd[base..base + d].iter().zip(&qd[base..base + d]).map(|(k, q)| k * q).sum::<f32>() * inv_sqrt_d;
                // sign(0) = 0, as in the reference (Rust's signum would give 1).
                let sign = if g > 0.0 { 1.0 } else if g < 0.0 { -1.0 } else { 0.0 };
                let g = sign * g.abs().max(1e-6).sqrt();
                let w = sigmoid(g);
                chunk.iter_mut().zip(&vd[r * d..(r + 1) * d]).for_each(|(o, v)| *o = w * v);
            }
        });
        Ok(tensor(out, vec![rows, streams * d]))
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        let w = weight(table)?;
        let mut out = vec![0.0f32; ids.len() * w.cols];
        for (row, &id) in out.chunks_exact_mut(w.cols).zip(ids) {
            if id as usize >= w.rows {
                return Err(shape_error("embed", format!("token id {id} >= vocabulary size {}", w.rows)));
            }
            w.dequant_row(id as usize, row);
        }
        Ok(tensor(out, vec![ids.len(), w.cols]))
    }

    fn matmul(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let cw = weight(w)?;
        if x.cols() != cw.cols || cw.experts != 1 {
            return Err(shape_error(
                "matmul",
                format!("x {:?} @ W[{} x {} x {}]^T", x.shape(), cw.experts, cw.rows, cw.cols),
            ));
        }
        let tokens = x.rows();
        Ok(tensor(matmul::matmul(data(x)?, tokens, cw, 0, self.mode, true), vec![tokens, cw.rows]))
    }

    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, dim: usize, eps: f32) -> Result<Tensor> {
        groups_of("rms_norm", x, dim)?;
        let wv = match w {
            Some(w) if w.numel() == dim || (w.numel() % dim == 0 && w.numel() == x.cols()) => Some(data(w)?),
            Some(w) => return Err(shape_error("rms_norm", format!("weight {:?} for groups of {dim} in rows of {}", w.shape(), x.cols()))),
            None => None,
        };
        let wlen = wv.map_or(dim, |w| w.len());
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
        same_shape("rms_norm_gated", x, z)?;
        if w.numel() != dim {
            return Err(shape_error("rms_norm_gated", format!("weight {:?} for groups of {dim}", w.shape())));
        }
        let normed = self.rms_norm(x, Some(w), dim, eps)?;
        let gate = match act {
            GateAct::Silu => silu,
            GateAct::Sigmoid => sigmoid,
        };
        let out = data(&normed)?.iter().zip(data(z)?).map(|(n, z)| gate(*z) * n).collect();
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn l2_normalize(&self, x: &Tensor, dim: usize, eps: f32, scale: f32) -> Result<Tensor> {
        groups_of("l2_normalize", x, dim)?;
        let mut out = data(x)?.to_vec();
        let work = out.len();
        for_each_piece(&mut out, dim, work, |_, g| {
            let r = scale / (g.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
            g.iter_mut().for_each(|v| *v *= r);
        });
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn rope(&self, x: &Tensor, head_dim: usize, rotary_dim: usize, theta: f32, start_pos: usize) -> Result<Tensor> {
        groups_of("rope", x, head_dim)?;
        if rotary_dim > head_dim || rotary_dim % 2 != 0 {
            return Err(shape_error("rope", format!("rotary dim {rotary_dim} for head dim {head_dim}")));
        }
        let tokens = x.shape().first().copied().unwrap_or(0);
        let heads_per_token = x.numel() / head_dim / tokens.max(1);
        let half = rotary_dim / 2;
        let inv_freq: Vec<f64> =
            (0..half).map(|i| (theta as f64).powf(-((2 * i) as f64) / rotary_dim as f64)).collect();
        let mut out = data(x)?.to_vec();
        for (t, tok) in out.chunks_exact_mut(heads_per_token * head_dim).enumerate() {
            let pos = (start_pos + t) as f64;
            let cs: Vec<(f32, f32)> =
                inv_freq.iter().map(|f| ((pos * f).cos() as f32, (pos * f).sin() as f32)).collect();
            for head in tok.chunks_exact_mut(head_dim) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
        }
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize) -> Result<State> {
        // f16 rows go with the int8 matmuls; the exact mode keeps f32.
        Ok(State::new(Box::new(KvCache::new(kv_heads, head_dim, self.mode == MatmulMode::Int8))))
    }

    fn kv_len(&self, cache: &State) -> Result<usize> {
        cache.get::<KvCache>().map(|c| c.len()).ok_or_else(|| BackendError::Device("not a CPU KV cache".into()))
    }

    fn kv_truncate(&self, cache: &mut State, len: usize) -> Result<()> {
        let c = cache.get_mut::<KvCache>().ok_or_else(|| BackendError::Device("not a CPU KV cache".into()))?;
        if len > c.len() {
            return Err(shape_error("kv_truncate", format!("to {len} positions of {}", c.len())));
        }
        c.truncate(len);
        Ok(())
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32, selection: Option<&KeySelection>) -> Result<Tensor> {
        let c = cache.get_mut::<KvCache>().ok_or_else(|| BackendError::Device("not a CPU KV cache".into()))?;
        let (kvh, hd) = (c.kv_heads(), c.head_dim());
        let tokens = q.rows();
        if q.cols() != heads * hd || k.cols() != kvh * hd || v.cols() != kvh * hd || k.rows() != tokens || heads % kvh != 0 {
            return Err(shape_error(
                "attention",
                format!("q {:?} k {:?} v {:?} for {heads} heads, {kvh} kv heads of {hd}", q.shape(), k.shape(), v.shape()),
            ));
        }
        if let Some(sel) = selection {
            if sel.block == 0 || sel.per_query == 0 || sel.blocks.len() != tokens * sel.per_query {
                return Err(shape_error("attention", format!("key selection of {} entries ({} per query) for {tokens} queries", sel.blocks.len(), sel.per_query)));
            }
        }
        let past = c.len();
        // The keys each query may see, once per query (not per head).
        let selected: Option<Vec<Vec<usize>>> = selection.map(|sel| (0..tokens).map(|t| sel.keys_of(t, past + t)).collect());
        c.append(data(k)?, data(v)?);
        let out = c.attend(data(q)?, tokens, heads, scale, selected.as_deref());
        Ok(tensor(out, vec![tokens, heads * hd]))
    }

    fn new_conv_state(&self, channels: usize, kernel: usize, dilation: usize) -> Result<State> {
        if kernel == 0 || dilation == 0 {
            return Err(shape_error("new_conv_state", format!("kernel size {kernel}, dilation {dilation}")));
        }
        let window = vec![0.0; (kernel - 1) * dilation * channels];
        Ok(State::new(Box::new(ConvState { channels, kernel, dilation, window })))
    }

    fn causal_conv1d_silu(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        let conv = self.causal_conv1d(x, w, state)?;
        self.silu(&conv)
    }

    fn causal_conv1d(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<ConvState>().ok_or_else(|| BackendError::Device("not a CPU conv state".into()))?;
        let (c, kk, dil) = (st.channels, st.kernel, st.dilation);
        if x.cols() != c || w.numel() != c * kk {
            return Err(shape_error("causal_conv1d", format!("x {:?}, weight {:?}, {c} channels x {kk}", x.shape(), w.shape())));
        }
        let tokens = x.rows();
        let wd = data(w)?;
        // The window followed by the new inputs: [(kernel-1)*dilation+tokens, channels].
        let mut seq = st.window.clone();
        seq.extend_from_slice(data(x)?);
        let mut out = vec![0.0f32; tokens * c];
        for_each_piece(&mut out, c, tokens * c * kk, |t, o| {
            for (ch, o) in o.iter_mut().enumerate() {
                let mut acc = 0.0;
                for j in 0..kk {
                    acc += wd[ch * kk + j] * seq[(t + j * dil) * c + ch];
                }
                *o = acc;
            }
        });
        st.window = seq[tokens * c..].to_vec();
        Ok(tensor(out, vec![tokens, c]))
    }

    fn new_recurrent_state(&self, heads: usize, key_dim: usize, value_dim: usize) -> Result<State> {
        Ok(State::new(Box::new(RecurrentState { heads, key_dim, value_dim, s: vec![0.0; heads * key_dim * value_dim] })))
    }

    fn delta_gates(&self, a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor) -> Result<(Tensor, Tensor)> {
        same_shape("delta_gates", a, b)?;
        let heads = a.cols();
        if a_log.numel() != heads || dt_bias.numel() != heads {
            return Err(shape_error("delta_gates", format!("{heads} heads, A_log {:?}, dt_bias {:?}", a_log.shape(), dt_bias.shape())));
        }
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
        let st = state.get_mut::<RecurrentState>().ok_or_else(|| BackendError::Device("not a CPU recurrent state".into()))?;
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
        let inputs = delta::DeltaInputs {
            q: data(q)?, k: data(k)?, v: data(v)?, g: data(g)?, beta: data(beta)?,
            tokens, heads: h, key_heads, key_dim: dk, value_dim: dv,
        };
        let out = delta::gated_delta(&inputs, &mut st.s);
        Ok(tensor(out, vec![tokens, h * dv]))
    }

    fn new_expert_pool(&self, layout: &ExpertLayout, slots: usize) -> Result<ExpertPool> {
        let (h, i) = (layout.hidden, layout.intermediate);
        let pool = CpuExpertPool {
            gate: CpuWeight::zeros(slots, i, h, layout.gate),
            up: CpuWeight::zeros(slots, i, h, layout.up),
            down: CpuWeight::zeros(slots, h, i, layout.down),
        };
        let bytes = pool.gate.bytes() + pool.up.bytes() + pool.down.bytes();
        Ok(ExpertPool::new(Box::new(pool), *layout, slots, bytes))
    }

    fn write_expert(&self, pool: &mut ExpertPool, slot: usize, e: &HostExpert<'_>) -> Result<()> {
        let p = pool.get_mut::<CpuExpertPool>().ok_or_else(|| BackendError::Device("not a CPU expert pool".into()))?;
        p.gate.write_slot(slot, &e.gate)?;
        p.up.write_slot(slot, &e.up)?;
        p.down.write_slot(slot, &e.down)
    }

    fn moe_expert_outputs(&self, x: &Tensor, pool: &ExpertPool, assignments: &[ExpertAssignment], top_k: usize) -> Result<Tensor> {
        let p = pool.get::<CpuExpertPool>().ok_or_else(|| BackendError::Device("not a CPU expert pool".into()))?;
        let (tokens, hidden) = (x.rows(), x.cols());
        if hidden != p.gate.cols {
            return Err(shape_error("moe_expert_outputs", format!("x {:?} for experts of hidden size {}", x.shape(), p.gate.cols)));
        }
        let xd = data(x)?;
        // Group assignments by slot so each expert's weights are read once per call.
        let mut by_slot: std::collections::BTreeMap<u32, Vec<ExpertAssignment>> = Default::default();
        for a in assignments {
            if a.slot as usize >= pool.slots || a.token as usize >= tokens || a.rank as usize >= top_k {
                return Err(shape_error("moe_expert_outputs", format!("{a:?} with {} slots, {tokens} tokens, top {top_k}", pool.slots)));
            }
            by_slot.entry(a.slot).or_default().push(*a);
        }
        let groups: Vec<(u32, Vec<ExpertAssignment>)> = by_slot.into_iter().collect();
        let run = |(slot, users): &(u32, Vec<ExpertAssignment>), parallel: bool| {
            let s = *slot as usize;
            let xs: Vec<f32> =
                users.iter().flat_map(|a| xd[a.token as usize * hidden..(a.token as usize + 1) * hidden].iter().copied()).collect();
            let n = users.len();
            let g = matmul::matmul(&xs, n, &p.gate, s, self.mode, parallel);
            let u = matmul::matmul(&xs, n, &p.up, s, self.mode, parallel);
            let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
            matmul::matmul(&act, n, &p.down, s, self.mode, parallel)
        };
        // At decode each expert's matrices are small (a few hundred KB): one
        // parallel region over the experts, each computed by one thread, costs
        // far less than three thread-pool round trips per expert.
        let results: Vec<Vec<f32>> = if groups.len() > 1 && rayon::current_num_threads() > 1 {
            groups.par_iter().map(|g| run(g, false)).collect()
        } else {
            groups.iter().map(|g| run(g, true)).collect()
        };
        let mut out = vec![0.0f32; tokens * top_k * hidden];
        for ((_, users), y) in groups.iter().zip(&results) {
            for (i, a) in users.iter().enumerate() {
                let row = a.token as usize * top_k + a.rank as usize;
                out[row * hidden..(row + 1) * hidden].copy_from_slice(&y[i * hidden..(i + 1) * hidden]);
            }
        }
        Ok(tensor(out, vec![tokens, top_k, hidden]))
    }

    fn moe_combine(&self, outputs: &Tensor, weights: &[f32], top_k: usize) -> Result<Tensor> {
        let hidden = outputs.cols();
        let tokens = outputs.rows() / top_k.max(1);
        if weights.len() != tokens * top_k || outputs.rows() != tokens * top_k {
            return Err(shape_error("moe_combine", format!("outputs {:?}, {} weights, top {top_k}", outputs.shape(), weights.len())));
        }
        let od = data(outputs)?;
        let mut out = vec![0.0f32; tokens * hidden];
        for_each_piece(&mut out, hidden, tokens * top_k * hidden, |t, o| {
            for r in 0..top_k {
                let w = weights[t * top_k + r];
                let row = &od[(t * top_k + r) * hidden..(t * top_k + r + 1) * hidden];
                o.iter_mut().zip(row).for_each(|(o, y)| *o += w * y);
            }
        });
        Ok(tensor(out, vec![tokens, hidden]))
    }

    fn clone_state(&self, state: &State) -> Result<State> {
        if let Some(c) = state.get::<KvCache>() {
            return Ok(State::new(Box::new(c.duplicate())));
        }
        if let Some(c) = state.get::<ConvState>() {
            return Ok(State::new(Box::new(ConvState { channels: c.channels, kernel: c.kernel, dilation: c.dilation, window: c.window.clone() })));
        }
        if let Some(r) = state.get::<RecurrentState>() {
            return Ok(State::new(Box::new(RecurrentState { heads: r.heads, key_dim: r.key_dim, value_dim: r.value_dim, s: r.s.clone() })));
        }
        Err(BackendError::Device("state does not belong to the CPU backend".into()))
    }
}
