//! Typed calls of `wgsl/conv.wgsl` and `wgsl/gated_delta.wgsl`: the causal
//! convolution with its carried window and the gated delta rule, the two
//! state-carrying ops of linear-attention layers (states in `state.rs`).

use slotstream_backend::{checks, Result, State, Tensor};

use crate::gpu::{whole, Bind, Gpu, Scratch};
use crate::params::{ConvParams, GatedDeltaParams};
use crate::state::{GpuConvState, GpuRecurrentState};
use crate::tensors::buf;
use crate::{not_ours, WgpuBackend};

// Bindings of conv.wgsl.
const CONV_X: u32 = 2;
const CONV_OUT: u32 = 3;
const CONV_WEIGHT: u32 = 4;
const CONV_WINDOW: u32 = 5;
const CONV_NEW_WINDOW: u32 = 6;

// Bindings of gated_delta.wgsl.
const Q: u32 = 2;
const OUT: u32 = 3;
const K: u32 = 4;
const V: u32 = 5;
const G: u32 = 6;
const BETA: u32 = 7;
const STATE: u32 = 8;
const A_LOG: u32 = 9;
const DT_BIAS: u32 = 10;
const CHUNK_DATA: u32 = 11;

/// Tokens per chunk of the chunked form (`C` in `gated_delta_chunked.wgsl`).
pub const CHUNK: usize = 64;
/// Prompts at least this long take the chunked form; shorter ones (and
/// decode) the recurrent kernel, whose cost grows with the tokens but which
/// has no fixed cost of two dispatches and a solve per chunk.
pub const CHUNKED_FROM: usize = 64;
/// Largest key head the chunked form holds (its state rows in workgroup memory).
const CHUNKED_MAX_KEY_DIM: usize = 128;
/// State rows per workgroup of `gated_delta_chunks` (`VS`).
const CHUNK_ROWS: usize = 16;
/// Floats of one (chunk, head) record in the chunk buffer (`REC`).
const CHUNK_RECORD: usize = 2 * CHUNK * CHUNK + 4 * CHUNK;
/// Most bytes of chunk records at a time: longer prompts run in windows of
/// chunks, each window's preparation then its chunks.
const CHUNK_BYTES_MAX: usize = 64 << 20;
/// Workgroup memory the chunked kernels need (`gated_delta_chunks`'s arrays).
const CHUNKED_SHARED_BYTES: u32 = 4 * (CHUNK_ROWS as u32 * 129 + 3 * 1024);

/// `out = conv(x)` (then `silu` when `silu`) continuing from the window of
/// `st`, which then holds the latest inputs.
pub(crate) fn causal_conv1d(
    gpu: &Gpu,
    st: &mut GpuConvState,
    x: Bind<'_>,
    weight: Bind<'_>,
    out: Bind<'_>,
    tokens: usize,
    silu: bool,
) -> Result<()> {
    let (c, kk, dil) = (st.channels, st.kernel, st.dilation);
    let n = tokens * c;
    // The window's values, written into the spare buffer in the same dispatch.
    let hist = (kk - 1) * dil * c;
    let params = ConvParams {
        tokens: tokens as u32,
        channels: c as u32,
        kernel: kk as u32,
        n: n as u32,
        dilation: dil as u32,
        act: silu as u32,
        window_n: hist as u32,
        ..Default::default()
    };
    let (window, spare) = (whole(&st.window), whole(&st.spare));
    let binds = [(CONV_X, x), (CONV_OUT, out), (CONV_WEIGHT, weight), (CONV_WINDOW, window), (CONV_NEW_WINDOW, spare)];
    gpu.dispatch("conv1d", &params, &binds, Gpu::grid(((n + hist) as u64).div_ceil(256)))?;
    if hist > 0 {
        std::mem::swap(&mut st.window, &mut st.spare);
    }
    Ok(())
}

/// The gated delta rule over `tokens` steps, updating `st`. `[q, k, v, g, beta]`
/// as the trait's `gated_delta` takes them; with `raw`, the trait's
/// `gated_delta_step` inputs instead (`q, k` not yet normalised, the raw gate
/// projections `a, b` in place of `g, beta`) plus `[a_log, dt_bias]`, `q_scale`
/// and `eps`.
pub(crate) fn gated_delta(
    gpu: &Gpu,
    st: &GpuRecurrentState,
    [q, k, v, g, beta]: [Bind<'_>; 5],
    raw: Option<([Bind<'_>; 2], f32, f32)>,
    out: Bind<'_>,
    tokens: usize,
    key_heads: usize,
) -> Result<()> {
    // Prepared inputs bind g and beta where the per-head vectors would go (unread).
    let ([a_log, dt_bias], q_scale, eps) = raw.unwrap_or(([g, beta], 1.0, 0.0));
    let params = GatedDeltaParams {
        tokens: tokens as u32,
        heads: st.heads as u32,
        key_heads: key_heads as u32,
        key_dim: st.key_dim as u32,
        value_dim: st.value_dim as u32,
        q_scale,
        eps,
        raw: raw.is_some() as u32,
        ..Default::default()
    };
    let binds = [(Q, q), (K, k), (V, v), (G, g), (BETA, beta), (A_LOG, a_log), (DT_BIAS, dt_bias), (STATE, whole(&st.s)), (OUT, out)];
    if chunked(gpu, st, tokens) {
        return gated_delta_chunked(gpu, st, &params, &binds);
    }
    gpu.dispatch("gated_delta", &params, &binds, [gpu.subgroup_grid(st.heads * st.value_dim, 64), 1, 1])
}

/// Whether `tokens` steps of `st` take the chunked form.
fn chunked(gpu: &Gpu, st: &GpuRecurrentState, tokens: usize) -> bool {
    let limits = &gpu.limits;
    tokens >= CHUNKED_FROM
        && (1..=CHUNKED_MAX_KEY_DIM).contains(&st.key_dim)
        && limits.max_compute_workgroup_storage_size >= CHUNKED_SHARED_BYTES
        && limits.max_compute_invocations_per_workgroup >= 256
}

/// The chunked form (`wgsl/gated_delta_chunked.wgsl`): per window of chunks,
/// the state-free part of every chunk in parallel, then the chunks in order.
fn gated_delta_chunked(gpu: &Gpu, st: &GpuRecurrentState, params: &GatedDeltaParams, binds: &[(u32, Bind<'_>)]) -> Result<()> {
    let (tokens, heads) = (params.tokens as usize, st.heads);
    let record_bytes = 4 * CHUNK_RECORD * heads;
    let cap = CHUNK_BYTES_MAX.min(gpu.max_shard() as usize);
    let window = (cap / record_bytes).max(1).min(tokens.div_ceil(CHUNK));
    let data = gpu.alloc_for(Scratch::Recurrent, (window * record_bytes) as u64)?;
    // Each entry point binds what it reads (its layout is its own).
    let bound = |used: &[u32]| -> Vec<(u32, Bind<'_>)> {
        binds.iter().copied().filter(|(i, _)| used.contains(i)).chain([(CHUNK_DATA, data.bind())]).collect()
    };
    let prep = bound(&[Q, K, G, BETA, A_LOG, DT_BIAS]);
    let run = bound(&[Q, K, V, STATE, OUT]);
    let slices = st.value_dim.div_ceil(CHUNK_ROWS);
    for start in (0..tokens).step_by(window * CHUNK) {
        let chunks = (tokens - start).div_ceil(CHUNK).min(window);
        let p = GatedDeltaParams { start: start as u32, chunks: chunks as u32, ..*params };
        gpu.dispatch("gated_delta_prep", &p, &prep, [(chunks * heads) as u32, 1, 1])?;
        gpu.dispatch("gated_delta_chunks", &p, &run, [(heads * slices) as u32, 1, 1])?;
    }
    Ok(())
}

impl WgpuBackend {
    /// `causal_conv1d`, then `silu` when `silu`.
    pub(crate) fn conv(&self, x: &Tensor, w: &Tensor, state: &mut State, silu: bool) -> Result<Tensor> {
        let st = state.get_mut::<GpuConvState>().ok_or_else(|| not_ours("the convolution state"))?;
        let tokens = checks::causal_conv1d(x, w, st.channels, st.kernel)?;
        let (out, ob) = self.output(vec![tokens, st.channels])?;
        causal_conv1d(&self.gpu, st, buf(x)?, buf(w)?, ob.bind(), tokens, silu)?;
        Ok(out)
    }
}
