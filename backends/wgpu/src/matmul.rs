//! Typed calls of the kernels that read standalone weights (the expert pool's
//! are in `moe.rs`): `wgsl/matvec.wgsl` (a few tokens), `wgsl/matvec_q8.wgsl`
//! (int8 mode), `wgsl/matmul_tiled.wgsl` (prefill) and `wgsl/embed.wgsl`, and
//! the choice between them for one `x @ W^T`.

use slotstream_backend::Result;

use crate::gpu::{whole, Bind, Gpu, GpuBuf, Scratch};
use crate::options::MatmulMode;
use crate::params::{EmbedParams, MatvecParams, MatvecQ8Params, TiledParams};
use crate::weights::{GpuWeight, Shard};

// Bindings shared by the weight-reading kernels (`wgsl/weights.wgsl`): the
// shard as 16-byte words and as single words.
const W: u32 = 1;
pub(crate) const W_WORDS: u32 = 6;
// Bindings of the matvec, matvec_q8 and matmul_tiled kernels.
const X: u32 = 2;
const OUT: u32 = 3;
const XQ: u32 = 4;
const XQ_OUT: u32 = 5;
// matmul_tiled's x again, read as 16-byte words.
const X_VEC4: u32 = 5;
// Bindings of matvec_epilogue (wgsl/matvec.wgsl).
const AUX: u32 = 4;
const GATE: u32 = 5;
// Bindings of embed.wgsl.
pub(crate) const EMBED_OUT: u32 = 3;
const EMBED_IDS: u32 = 4;

/// Tokens up to which a matmul uses the row-per-subgroup matvec kernel;
/// longer inputs use the tiled kernel.
const MATVEC_MAX_TOKENS: usize = 8;

/// How [`matmul_into`] chooses its kernels (from the backend's options).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatmulChoice {
    pub mode: MatmulMode,
    /// Int8 mode applies to weights of at least this many bytes.
    pub int8_min_bytes: usize,
    /// Interleaved 4-bit shards of at least this many rows take eight rows per
    /// subgroup in one-token matvecs.
    pub q4_eight_rows_from: usize,
}

impl MatmulChoice {
    /// Prefill products on the matrix units: in int8 mode only (f16 inputs
    /// are not the exact mode's f32), where the device compiled them.
    pub fn coop(&self, gpu: &Gpu) -> bool {
        self.mode == MatmulMode::Int8 && gpu.coop_matrix
    }
}

/// `tokens` x rows quantized for `matvec_q8` (see `wgsl/matvec_q8.wgsl`):
/// `cols / 8` 16-byte entries a row.
pub(crate) fn quantize_x8(gpu: &Gpu, x: Bind<'_>, tokens: usize, cols: usize) -> Result<GpuBuf> {
    let xq = gpu.alloc_for(Scratch::Matmul, 2 * (tokens * cols) as u64)?;
    let params = MatvecQ8Params { tokens: tokens as u32, x_cols: cols as u32, ..Default::default() };
    gpu.dispatch("quantize_x8", &params, &[(X, x), (XQ_OUT, xq.bind())], [((cols / 32).div_ceil(64)) as u32, tokens as u32, 1])?;
    Ok(xq)
}

/// `out[t, out_off + r] = W[r] . x8[t]` for one interleaved 4-bit shard and
/// quantized x of `tokens` rows (more than one: `matvec_q8_tokens`, each
/// token's result the one-token kernel's).
fn matvec_q8(gpu: &Gpu, s: &Shard, xq: &GpuBuf, out: Bind<'_>, tokens: usize, total_rows: usize, cols: usize) -> Result<()> {
    let params = MatvecQ8Params {
        w: s.desc,
        rows: s.rows as u32,
        tokens: tokens as u32,
        out_cols: total_rows as u32,
        out_off: s.row_start as u32,
        x_cols: cols as u32,
        ..Default::default()
    };
    let groups = [gpu.subgroup_grid(s.rows.div_ceil(4), 128), tokens.div_ceil(4) as u32, 1];
    let binds = [(W, whole(&s.buffer)), (W_WORDS, whole(&s.buffer)), (XQ, xq.bind()), (OUT, out)];
    gpu.dispatch(if tokens == 1 { "matvec_q8" } else { "matvec_q8_tokens" }, &params, &binds, groups)
}

/// `out[t, out_off + r] = W[r] . x[t]` for one shard and up to
/// [`MATVEC_MAX_TOKENS`] tokens.
#[allow(clippy::too_many_arguments)]
fn matvec(gpu: &Gpu, s: &Shard, x: Bind<'_>, out: Bind<'_>, tokens: usize, total_rows: usize, cols: usize, eight_rows_from: usize) -> Result<()> {
    let group_rows = if s.rows >= eight_rows_from { 8 } else { 4 };
    // Four-row quads of interleaved 4-bit rows split over up to four
    // subgroups, one share of the row's 16-byte chunks per lane each; two or
    // more tokens of those rows take matvec_q4_tokens, split the same way, so
    // that each token's result is the one-token kernel's.
    let quads = s.desc.is_interleaved_q4() && group_rows == 4;
    let kernel = match tokens {
        1 if quads => "matvec_q4",
        _ if quads && gpu.matvec_q4_tokens => "matvec_q4_tokens",
        _ => "matvec",
    };
    let parts = if kernel == "matvec" { 1 } else { gpu.row_parts(s.desc.row_words as usize / 4) };
    let params = MatvecParams {
        w: s.desc,
        rows: s.rows as u32,
        tokens: tokens as u32,
        out_cols: total_rows as u32,
        out_off: s.row_start as u32,
        x_cols: cols as u32,
        group_rows: group_rows as u32,
        parts: parts as u32,
        ..Default::default()
    };
    // One token: a subgroup per four rows (eight for interleaved 4-bit; times
    // the parts of a split quad); more: a subgroup per row (per quad and part
    // for matvec_q4_tokens).
    let items = match (tokens, s.desc.is_interleaved_q4()) {
        (1, true) => s.rows.div_ceil(group_rows) * parts,
        (1, false) => s.rows.div_ceil(4),
        _ if kernel == "matvec_q4_tokens" => s.rows.div_ceil(4) * parts,
        _ => s.rows,
    };
    let groups = [gpu.subgroup_grid(items, 128), tokens.div_ceil(4) as u32, 1];
    gpu.dispatch(kernel, &params, &[(W, whole(&s.buffer)), (W_WORDS, whole(&s.buffer)), (X, x), (OUT, out)], groups)
}

/// What `matvec_epilogue` does with a one-token product.
pub(crate) enum Epilogue<'a> {
    /// `out[r] = silu(W[r] . x) * (W[rows/2 + r] . x)`, `r < rows / 2`.
    SwiGlu,
    /// `out[r] = y[r] + (W[r] . x) * sigmoid(gate[0])`.
    GatedAdd { y: Bind<'a>, gate: Bind<'a> },
}

/// A one-token product with its consumer fused in ([`Epilogue`]), for a
/// one-shard weight; `None` (nothing recorded) for the rest.
pub(crate) fn matvec_epilogue(gpu: &Gpu, w: &GpuWeight, x: Bind<'_>, tokens: usize, out: Bind<'_>, e: Epilogue<'_>) -> Result<Option<()>> {
    let [s] = &w.shards[..] else {
        return Ok(None);
    };
    if tokens != 1 || w.experts != 1 || w.cols % 4 != 0 {
        return Ok(None);
    }
    let (code, rows) = match e {
        Epilogue::SwiGlu if w.rows % 2 == 0 => (1, w.rows / 2),
        Epilogue::SwiGlu => return Ok(None),
        Epilogue::GatedAdd { .. } => (2, w.rows),
    };
    let params = MatvecParams {
        w: s.desc,
        rows: rows as u32,
        tokens: 1,
        out_cols: rows as u32,
        x_cols: w.cols as u32,
        group_rows: 4,
        epilogue: code,
        half: rows as u32,
        ..Default::default()
    };
    let groups = [gpu.subgroup_grid(rows.div_ceil(4), 128), 1, 1];
    // Both epilogues' inputs are in the kernel's layout; SwiGLU reads neither.
    let (aux, gate) = match e {
        Epilogue::GatedAdd { y, gate } => (y, gate),
        Epilogue::SwiGlu => (x, x),
    };
    let binds = [(W, whole(&s.buffer)), (W_WORDS, whole(&s.buffer)), (X, x), (OUT, out), (AUX, aux), (GATE, gate)];
    gpu.dispatch("matvec_epilogue", &params, &binds, groups)?;
    Ok(Some(()))
}

/// Prompt tokens per forward pass at most. A chunk's activations grow with
/// it (a MoE call keeps `top_k` hidden-sized rows per token) while the
/// kernels gain little past 2,048 rows: on an H100, A's 8k-token prefill ran
/// 2,353 tok/s in chunks of 2,048 and 2,455 in one of 8,192 (BENCHMARKS.md).
pub const PREFILL_ROWS_MAX: usize = 2048;

/// Rows and tokens (or pairs) of one output tile of `wgsl/matmul_tiled.wgsl`.
pub(crate) const TILE: usize = 64;
/// Rows and tokens of one output tile of its `matmul_wide`.
pub(crate) const WIDE_TILE: usize = 128;
/// Products with at least this many 128 x 128 tiles take `matmul_wide`
/// (twice the multiply-adds per workgroup-memory load); smaller ones keep
/// four times as many 64 x 64 tiles to spread over the GPU's cores.
const WIDE_MIN_TILES: usize = 128;

/// `out[t, out_off + r] = W[r] . x[t]` for one shard and many tokens, in
/// 64 x 64 or 128 x 128 tiles (on the matrix units with `coop`).
fn matmul_tiled(gpu: &Gpu, s: &Shard, x: Bind<'_>, out: Bind<'_>, tokens: usize, total_rows: usize, coop: bool) -> Result<()> {
    let params = TiledParams {
        w: s.desc,
        rows: s.rows as u32,
        tokens: tokens as u32,
        out_cols: total_rows as u32,
        out_off: s.row_start as u32,
        x_cols: s.desc.cols,
        ..Default::default()
    };
    let wide = [s.rows.div_ceil(WIDE_TILE) as u32, tokens.div_ceil(WIDE_TILE) as u32, 1];
    let (entry, tile) = match (wide[0] * wide[1]) as usize {
        _ if coop => ("matmul_coop", WIDE_TILE),
        n if n >= WIDE_MIN_TILES => ("matmul_wide", WIDE_TILE),
        _ => ("matmul_tiled", TILE),
    };
    let groups = [s.rows.div_ceil(tile) as u32, tokens.div_ceil(tile) as u32, 1];
    gpu.dispatch(entry, &params, &[(W_WORDS, whole(&s.buffer)), (X, x), (X_VEC4, x), (OUT, out)], groups)
}

/// `out = x @ W^T` for `x: [tokens, w.cols]`, shard by shard.
pub(crate) fn matmul_into(gpu: &Gpu, choice: &MatmulChoice, x: Bind<'_>, tokens: usize, w: &GpuWeight, out: Bind<'_>) -> Result<()> {
    let total_rows = w.experts * w.rows;
    // Int8 mode: one token (or a batched decode step's few, each then given
    // its one-token result) against a large interleaved 4-bit weight (every
    // shard of a weight has the same layout) quantizes x once for all shards.
    let int8 = choice.mode == MatmulMode::Int8
        && (tokens == 1 || (tokens <= MATVEC_MAX_TOKENS && gpu.matvec_q4_tokens))
        && w.bytes >= choice.int8_min_bytes
        && w.cols % 32 == 0
        && w.shards.iter().all(|s| s.desc.is_interleaved_q4());
    let xq = if int8 { Some(quantize_x8(gpu, x, tokens, w.cols)?) } else { None };
    for s in &w.shards {
        if let Some(xq) = &xq {
            matvec_q8(gpu, s, xq, out, tokens, total_rows, w.cols)?;
        } else if tokens <= MATVEC_MAX_TOKENS {
            matvec(gpu, s, x, out, tokens, total_rows, w.cols, choice.q4_eight_rows_from)?;
        } else {
            matmul_tiled(gpu, s, x, out, tokens, total_rows, choice.coop(gpu))?;
        }
    }
    Ok(())
}

/// Dequantized rows of `table` for token ids `ids` (already uploaded as
/// `id_buf`) into `out: [ids, cols]`, shard by shard.
pub(crate) fn embed(gpu: &Gpu, table: &GpuWeight, id_buf: &wgpu::Buffer, ids: usize, out: Bind<'_>) -> Result<()> {
    for s in &table.shards {
        let params = EmbedParams {
            w: s.desc,
            count: ids as u32,
            row_start: s.row_start as u32,
            shard_rows: s.rows as u32,
            ..Default::default()
        };
        let groups = [table.cols.div_ceil(64) as u32, ids as u32, 1];
        gpu.dispatch("embed", &params, &[(W_WORDS, whole(&s.buffer)), (EMBED_OUT, out), (EMBED_IDS, whole(id_buf))], groups)?;
    }
    Ok(())
}
