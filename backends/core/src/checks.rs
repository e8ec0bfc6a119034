//! Input checks every backend makes before it computes an op, in one place so
//! that the backends accept exactly the same inputs and say the same thing
//! about the ones they refuse. Each check returns the sizes the op goes on to
//! use; an error names the op and the shapes it was given.

use crate::{shape_error, Gating, KeySelection, Result, Routes, Tensor};

/// `a` and `b` hold the same number of values.
pub fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(shape_error(op, format!("{:?} vs {:?}", a.shape(), b.shape())));
    }
    Ok(())
}

/// `x` is a whole number of groups of `dim` values; returns that number.
pub fn groups_of(op: &'static str, x: &Tensor, dim: usize) -> Result<usize> {
    if dim == 0 || x.numel() % dim != 0 {
        return Err(shape_error(op, format!("{:?} is not a whole number of groups of {dim}", x.shape())));
    }
    Ok(x.numel() / dim)
}

/// `values` fill `shape` exactly.
pub fn upload(values: usize, shape: &[usize]) -> Result<()> {
    if shape.iter().product::<usize>() != values {
        return Err(shape_error("upload", format!("{values} values for shape {shape:?}")));
    }
    Ok(())
}

/// Columns `[start, start+len)` exist in `x`; returns `(rows, cols)` of `x`.
pub fn slice_cols(x: &Tensor, start: usize, len: usize) -> Result<(usize, usize)> {
    let (rows, cols) = (x.rows(), x.cols());
    if start + len > cols {
        return Err(shape_error("slice_cols", format!("[{start}, {}) of {cols} columns", start + len)));
    }
    Ok((rows, cols))
}

/// Rows `[start, start+len)` exist in `x`; returns `cols` of `x`.
pub fn slice_rows(x: &Tensor, start: usize, len: usize) -> Result<usize> {
    let (rows, cols) = (x.rows(), x.cols());
    if start + len > rows {
        return Err(shape_error("slice_rows", format!("[{start}, {}) of {rows} rows", start + len)));
    }
    Ok(cols)
}

/// The parts of a row concatenation share a column count; returns the shape
/// of the stacked result, `[rows, cols]` (`[0, 0]` for no parts).
pub fn stacked_rows(parts: &[&Tensor]) -> Result<[usize; 2]> {
    let cols = parts.first().map(|t| t.cols()).unwrap_or(0);
    if let Some(p) = parts.iter().find(|p| p.cols() != cols) {
        return Err(shape_error("concat_rows", format!("{} vs {} columns", p.cols(), cols)));
    }
    let total: usize = parts.iter().map(|p| p.numel()).sum();
    Ok([total / cols.max(1), cols])
}

/// How a sigmoid gate lines up with `x`: `false` when it has one value per
/// value of `x`, `true` when it has one per row.
pub fn gate_per_row(op: &'static str, x: &Tensor, gate: &Tensor) -> Result<bool> {
    if gate.numel() == x.numel() {
        Ok(false)
    } else if gate.numel() == x.rows() {
        Ok(true)
    } else {
        Err(shape_error(op, format!("x {:?}, gate {:?}", x.shape(), gate.shape())))
    }
}

/// `x @ W^T` for a plain (one-expert) `[rows, cols]` weight.
pub fn matmul(x: &Tensor, experts: usize, rows: usize, cols: usize) -> Result<()> {
    if x.cols() != cols || experts != 1 {
        return Err(shape_error("matmul", format!("x {:?} @ W[{experts} x {rows} x {cols}]^T", x.shape())));
    }
    Ok(())
}

/// Every token id indexes a row of a table of `vocab` rows.
pub fn token_ids(ids: &[u32], vocab: usize) -> Result<()> {
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(shape_error("embed", format!("token id {id} >= vocabulary size {vocab}")));
    }
    Ok(())
}

/// The weight of an RMSNorm over groups of `dim`: `dim` values (one slice for
/// every group) or one per column of `x` (each of a row's groups with its own
/// slice). Returns the weight's length (`dim` without a weight).
pub fn rms_norm_weight(x: &Tensor, weight: Option<&Tensor>, dim: usize) -> Result<usize> {
    match weight {
        Some(w) if w.numel() == dim || (w.numel() % dim == 0 && w.numel() == x.cols()) => Ok(w.numel()),
        Some(w) => Err(shape_error("rms_norm", format!("weight {:?} for groups of {dim} in rows of {}", w.shape(), x.cols()))),
        None => Ok(dim),
    }
}

/// A gated RMSNorm: `z` like `x`, one weight slice of `dim` values.
pub fn rms_norm_gated(x: &Tensor, z: &Tensor, weight: &Tensor, dim: usize) -> Result<usize> {
    same_shape("rms_norm_gated", x, z)?;
    let groups = groups_of("rms_norm_gated", x, dim)?;
    if weight.numel() != dim {
        return Err(shape_error("rms_norm_gated", format!("weight {:?} for groups of {dim}", weight.shape())));
    }
    Ok(groups)
}

/// Rotary embedding of `x: [tokens, heads, head_dim]`; returns `(tokens, heads)`
/// (`tokens` at least 1).
pub fn rope(x: &Tensor, head_dim: usize, rotary_dim: usize) -> Result<(usize, usize)> {
    groups_of("rope", x, head_dim)?;
    if rotary_dim > head_dim || rotary_dim % 2 != 0 {
        return Err(shape_error("rope", format!("rotary dim {rotary_dim} for head dim {head_dim}")));
    }
    let tokens = x.shape().first().copied().unwrap_or(0).max(1);
    Ok((tokens, x.numel() / head_dim / tokens))
}

/// `x, w: [rows, streams*d]` of a stream mean; returns `(rows, d)`.
pub fn stream_mean(x: &Tensor, w: &Tensor, streams: usize) -> Result<(usize, usize)> {
    const OP: &str = "sigmoid_weighted_stream_mean";
    same_shape(OP, x, w)?;
    if streams == 0 || x.cols() % streams != 0 {
        return Err(shape_error(OP, format!("{:?} is not {streams} streams", x.shape())));
    }
    Ok((x.rows(), x.cols() / streams))
}

/// `h: [rows, streams*d]`, `x: [rows, d]`, `logits: [rows, streams]`; returns
/// `(streams, d)`.
pub fn gated_to_streams(h: &Tensor, x: &Tensor, logits: &Tensor) -> Result<(usize, usize)> {
    let (rows, streams, d) = (h.rows(), logits.cols(), x.cols());
    if x.rows() != rows || logits.rows() != rows || h.cols() != streams * d {
        return Err(shape_error(
            "add_gated_to_streams",
            format!("h {:?}, x {:?}, logits {:?}", h.shape(), x.shape(), logits.shape()),
        ));
    }
    Ok((streams, d))
}

/// `key, query: [rows, streams*d]`, `value: [rows, d]`; returns `(rows, d)`.
pub fn stream_dot_gate(key: &Tensor, query: &Tensor, value: &Tensor, streams: usize) -> Result<(usize, usize)> {
    const OP: &str = "stream_dot_gate";
    same_shape(OP, key, query)?;
    let (rows, d) = (value.rows(), value.cols());
    if streams == 0 || key.rows() != rows || key.cols() != streams * d {
        return Err(shape_error(OP, format!("key {:?}, value {:?}, {streams} streams", key.shape(), value.shape())));
    }
    Ok((rows, d))
}

/// Truncating a KV cache of `have` positions to `len`.
pub fn kv_truncate(len: usize, have: usize) -> Result<()> {
    if len > have {
        return Err(shape_error("kv_truncate", format!("to {len} positions of {have}")));
    }
    Ok(())
}

/// Attention inputs against a cache of `kv_heads` heads of `head_dim`:
/// `q: [tokens, heads*head_dim]`, `k, v: [tokens, kv_heads*head_dim]`, and a
/// key selection with one row per query. Returns `tokens`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    selection: Option<&KeySelection>,
) -> Result<usize> {
    let (kvh, hd) = (kv_heads, head_dim);
    let tokens = q.rows();
    if q.cols() != heads * hd
        || k.cols() != kvh * hd
        || v.cols() != kvh * hd
        || k.rows() != tokens
        || v.rows() != tokens
        || kvh == 0
        || heads % kvh != 0
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
    Ok(tokens)
}

/// A causal convolution's kernel size and dilation.
pub fn conv_state(kernel: usize, dilation: usize) -> Result<()> {
    if kernel == 0 || dilation == 0 {
        return Err(shape_error("new_conv_state", format!("kernel size {kernel}, dilation {dilation}")));
    }
    Ok(())
}

/// `x: [tokens, channels]` and `weight: [channels, kernel]` of a causal
/// convolution; returns `tokens`.
pub fn causal_conv1d(x: &Tensor, weight: &Tensor, channels: usize, kernel: usize) -> Result<usize> {
    if x.cols() != channels || weight.numel() != channels * kernel {
        return Err(shape_error(
            "causal_conv1d",
            format!("x {:?}, weight {:?}, {channels} channels x {kernel}", x.shape(), weight.shape()),
        ));
    }
    Ok(x.rows())
}

/// `a, b: [tokens, heads]` and one `a_log`, `dt_bias` value per head; returns `heads`.
pub fn delta_gates(a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor) -> Result<usize> {
    same_shape("delta_gates", a, b)?;
    let heads = a.cols();
    if a_log.numel() != heads || dt_bias.numel() != heads {
        return Err(shape_error(
            "delta_gates",
            format!("{heads} heads, A_log {:?}, dt_bias {:?}", a_log.shape(), dt_bias.shape()),
        ));
    }
    Ok(heads)
}

/// The sizes of a recurrent state, `[heads, value_dim, key_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct RecurrentDims {
    pub heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

/// Gated delta rule inputs against a state of `dims`; returns `tokens`.
pub fn gated_delta(
    [q, k, v, g, beta]: [&Tensor; 5],
    key_heads: usize,
    dims: RecurrentDims,
) -> Result<usize> {
    let RecurrentDims { heads: h, key_dim: dk, value_dim: dv } = dims;
    let tokens = q.rows();
    if key_heads == 0
        || h % key_heads != 0
        || q.cols() != key_heads * dk
        || k.cols() != key_heads * dk
        || v.cols() != h * dv
        || g.cols() != h
        || beta.cols() != h
        || k.rows() != tokens
        || v.rows() != tokens
    {
        return Err(shape_error(
            "gated_delta",
            format!(
                "q {:?} k {:?} v {:?} g {:?} for {h} heads ({key_heads} key heads) of {dk}/{dv}",
                q.shape(),
                k.shape(),
                v.shape(),
                g.shape()
            ),
        ));
    }
    Ok(tokens)
}

/// `logits: [tokens, gating.experts]`, and a top-k the experts can fill;
/// returns the token count.
pub fn route(logits: &Tensor, g: Gating) -> Result<usize> {
    if g.experts == 0 || logits.cols() != g.experts {
        return Err(shape_error("route", format!("logits {:?} for {} experts", logits.shape(), g.experts)));
    }
    gating(g)?;
    Ok(logits.rows())
}

/// A top-k the routing kernels can keep: 1 to [`MAX_TOP_K`], at most the experts.
pub fn gating(g: Gating) -> Result<()> {
    if g.top_k == 0 || g.top_k > g.experts || g.top_k > MAX_TOP_K {
        return Err(shape_error("route", format!("top {} of {} experts (1 to {MAX_TOP_K})", g.top_k, g.experts)));
    }
    Ok(())
}

/// The most experts a token may use (the routing kernels keep them in
/// workgroup memory).
pub const MAX_TOP_K: usize = 64;

/// `x: [tokens, hidden]` against experts of `hidden` columns, routes for the
/// same tokens, and the layer's keys `key_base..key_base + experts` inside a
/// slot table of `keys`; returns `(tokens, top_k)`.
pub fn moe_routes(x: &Tensor, hidden: usize, routes: &Routes, key_base: usize, keys: usize) -> Result<(usize, usize)> {
    let (tokens, k) = (x.rows(), routes.gating.top_k);
    if x.cols() != hidden {
        return Err(shape_error("moe_expert_outputs", format!("x {:?} for experts of hidden size {hidden}", x.shape())));
    }
    if routes.tensor.shape() != [tokens, 2 * k] {
        return Err(shape_error("moe_expert_outputs", format!("routes {:?} for {tokens} tokens, top {k}", routes.tensor.shape())));
    }
    if key_base + routes.gating.experts > keys {
        return Err(shape_error(
            "moe_expert_outputs",
            format!("experts {key_base}..{} past a slot table of {keys}", key_base + routes.gating.experts),
        ));
    }
    Ok((tokens, k))
}

/// Slot table entries inside a table of `keys` and a pool of `slots`.
pub fn map_experts(entries: &[(u32, Option<u32>)], keys: usize, slots: usize) -> Result<()> {
    if let Some(e) = entries.iter().find(|(k, s)| *k as usize >= keys || s.is_some_and(|s| s as usize >= slots)) {
        return Err(shape_error("map_experts", format!("entry {e:?} in a table of {keys} keys over {slots} slots")));
    }
    Ok(())
}

/// `outputs: [tokens, top_k, hidden]` for the routes' tokens; returns
/// `(tokens, hidden)`.
pub fn moe_combine(outputs: &Tensor, routes: &Routes) -> Result<(usize, usize)> {
    let (hidden, k, tokens) = (outputs.cols(), routes.gating.top_k, routes.tokens());
    if outputs.rows() != tokens * k || routes.tensor.cols() != 2 * k {
        return Err(shape_error("moe_combine", format!("outputs {:?}, routes {:?}, top {k}", outputs.shape(), routes.tensor.shape())));
    }
    Ok((tokens, hidden))
}
