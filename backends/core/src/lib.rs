//! The op-level interface that slotstream's model code is written against.
//!
//! A backend owns every buffer: weights are handed over once as host bytes
//! ([`HostMatrix`]) and come back as opaque [`Weight`] handles; activations are
//! opaque [`Tensor`] handles; per-sequence state (KV caches, convolution and
//! recurrent state) lives in opaque [`State`] objects. Model code describes what
//! to compute and never touches a weight's bytes, so a GPU backend can implement
//! the same trait without the model code changing.
//!
//! Conventions: activations are f32, row-major, the last dimension contiguous.
//! A matrix weight has shape `[experts, rows, cols]` (experts = 1 for a plain
//! linear layer) and `matmul` computes `x @ W^T` like a `Linear` layer.

use std::any::Any;
use std::sync::Arc;

mod attention;
pub mod checks;
mod experts;
pub mod chosen;
mod host;
mod kv_type;
mod memory;
mod rope;
pub mod routing;
pub use attention::{attention_qk_norm_composed, KeySelection, QkNorm};
pub use experts::{add_shared_expert, moe_shared_composed, rows_per_part, ExpertLayout, ExpertMatrix, ExpertPool, Gating, HostExpert, MatrixFormat, Routes, SharedExpert, POOL_WRITE_PART};
pub use host::{DType, HostMatrix, MatrixData};
pub use kv_type::{KvCacheType, Q8_BLOCK};
pub use memory::DeviceMemory;
pub use rope::{Rope, Yarn};

/// Errors a backend reports. Shape errors are bugs in model code or a malformed
/// checkpoint that slipped past the loader; the message says which.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{0}")]
    Unsupported(String),
    #[error("backend failure: {0}")]
    Device(String),
}

pub type Result<T> = std::result::Result<T, BackendError>;

pub fn shape_error(op: &'static str, detail: impl Into<String>) -> BackendError {
    BackendError::Shape { op, detail: detail.into() }
}

/// An activation tensor owned by a backend. Cloning is cheap (shared buffer);
/// [`Tensor::reshape`] changes only the view.
#[derive(Clone)]
pub struct Tensor {
    buffer: Arc<dyn Any + Send + Sync>,
    shape: Vec<usize>,
}

impl Tensor {
    /// Wraps a backend buffer. Only backends call this.
    pub fn from_buffer(buffer: Arc<dyn Any + Send + Sync>, shape: Vec<usize>) -> Self {
        Tensor { buffer, shape }
    }
    pub fn buffer<T: 'static>(&self) -> Option<&T> {
        self.buffer.downcast_ref::<T>()
    }
    /// The backend buffer to write in place, where no other tensor shares
    /// it. Only backends call this.
    pub fn buffer_mut<T: 'static>(&mut self) -> Option<&mut T> {
        Arc::get_mut(&mut self.buffer)?.downcast_mut::<T>()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Size of the last dimension.
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    /// Number of rows when viewed as `[rows, cols]`.
    pub fn rows(&self) -> usize {
        let cols = self.cols();
        if cols == 0 {
            0
        } else {
            self.numel() / cols
        }
    }
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if numel != self.numel() {
            return Err(shape_error(
                "reshape",
                format!("{:?} -> {:?} changes the element count", self.shape, shape),
            ));
        }
        Ok(Tensor { buffer: self.buffer.clone(), shape: shape.to_vec() })
    }
}

/// A weight matrix (or a stack of expert matrices) owned by a backend.
#[derive(Clone)]
pub struct Weight {
    buffer: Arc<dyn Any + Send + Sync>,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// Bytes this weight occupies in the backend (for memory accounting).
    pub bytes: usize,
}

impl Weight {
    pub fn from_buffer(
        buffer: Arc<dyn Any + Send + Sync>,
        experts: usize,
        rows: usize,
        cols: usize,
        bytes: usize,
    ) -> Self {
        Weight { buffer, experts, rows, cols, bytes }
    }
    pub fn buffer<T: 'static>(&self) -> Option<&T> {
        self.buffer.downcast_ref::<T>()
    }
    /// The backend buffer to write in place, where no other tensor shares
    /// it. Only backends call this.
    pub fn buffer_mut<T: 'static>(&mut self) -> Option<&mut T> {
        Arc::get_mut(&mut self.buffer)?.downcast_mut::<T>()
    }
}

/// What every per-sequence state a backend hands out (a KV cache, a
/// convolution window, a recurrent matrix state) can do, whichever device
/// holds it. The owning backend reaches its concrete type through
/// [`State::get`] / [`State::get_mut`].
pub trait DeviceState: AsAny + Send + Sync {
    /// A deep copy (prefix caching, speculative rollback): later updates to
    /// either copy leave the other as it was.
    fn duplicate(&self) -> Result<Box<dyn DeviceState>>;
    /// Bytes the state occupies on its device (for memory accounting).
    fn bytes(&self) -> usize;
}

/// Access to a value's concrete type, implemented for every `'static` type so
/// that a [`DeviceState`] need not write it out.
pub trait AsAny {
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: Any> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Mutable per-sequence state owned by a backend (a KV cache, a convolution
/// window, a recurrent matrix state).
pub struct State {
    inner: Box<dyn DeviceState>,
}

impl State {
    pub fn new(inner: Box<dyn DeviceState>) -> Self {
        State { inner }
    }
    /// The state as the backend's type `T`, or `None` when another backend
    /// (or another kind of state) made it.
    pub fn get<T: 'static>(&self) -> Option<&T> {
        // Through the trait object: `self.inner.as_any()` would name the Box.
        AsAny::as_any(&*self.inner).downcast_ref::<T>()
    }
    pub fn get_mut<T: 'static>(&mut self) -> Option<&mut T> {
        AsAny::as_any_mut(&mut *self.inner).downcast_mut::<T>()
    }
    /// A deep copy of the state (see [`DeviceState::duplicate`]).
    pub fn duplicate(&self) -> Result<State> {
        Ok(State { inner: self.inner.duplicate()? })
    }
    /// Bytes the state occupies on its device.
    pub fn bytes(&self) -> usize {
        self.inner.bytes()
    }
}

/// Activation applied to the gate of [`Backend::rms_norm_gated`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateAct {
    /// `silu(z)` (qwen3_next's gated norm).
    Silu,
    /// `sigmoid(z)` (qwen4_exp, `output_gate_type: sigmoid`).
    Sigmoid,
}

/// The raw inputs of one Gated DeltaNet step ([`Backend::gated_delta_step`]):
/// `q, k: [tokens, key_heads*key_dim]`, `v: [tokens, heads*value_dim]`, the
/// gate projections `a, b: [tokens, heads]` and the per-head `a_log`, `dt_bias`.
#[derive(Clone, Copy)]
pub struct DeltaInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub a_log: &'a Tensor,
    pub dt_bias: &'a Tensor,
}

/// [`Backend::matmul_swiglu`] from the backend's separate ops (its default,
/// and a fused backend's answer for the inputs its kernel does not take).
pub fn matmul_swiglu_composed<B: Backend + ?Sized>(b: &B, x: &Tensor, w: &Weight) -> Result<Tensor> {
    if w.experts != 1 || w.rows % 2 != 0 {
        return Err(shape_error("matmul_swiglu", format!("{} x {} rows are no gate and up halves", w.experts, w.rows)));
    }
    let y = b.matmul(x, w)?;
    let inter = w.rows / 2;
    b.silu_mul(&b.slice_cols(&y, 0, inter)?, &b.slice_cols(&y, inter, inter)?)
}

/// [`Backend::route_matmul`] from `matmul`, `slice_cols` and `route`.
pub fn route_matmul_composed<B: Backend + ?Sized>(b: &B, x: &Tensor, router: &Weight, gating: Gating) -> Result<(Routes, Option<Tensor>)> {
    if router.experts != 1 || router.rows < gating.experts {
        return Err(shape_error("route_matmul", format!("a router of {} rows for {} experts", router.rows, gating.experts)));
    }
    let logits = b.matmul(x, router)?;
    if router.rows == gating.experts {
        return Ok((b.route(&logits, gating)?, None));
    }
    let own = b.slice_cols(&logits, 0, gating.experts)?;
    let extra = b.slice_cols(&logits, gating.experts, router.rows - gating.experts)?;
    Ok((b.route(&own, gating)?, Some(extra)))
}

/// The operations model code needs. Every method is pure with respect to its
/// tensor inputs (new tensors come back) except where a `&mut State` is passed.
pub trait Backend: Send + Sync {
    /// Short name shown in run summaries ("cpu", "wgpu (NVIDIA H200, Vulkan)").
    fn name(&self) -> String;
    // ---- buffers ----
    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<Tensor>;
    fn download(&self, t: &Tensor) -> Result<Vec<f32>>;
    fn load_weight(&self, m: &HostMatrix<'_>) -> Result<Weight>;

    // ---- shape plumbing ----
    /// Columns `[start, start+len)` of `x` viewed as `[rows, cols]`.
    fn slice_cols(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor>;
    /// Rows `[start, start+len)` of `x` viewed as `[rows, cols]`.
    fn slice_rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor>;
    /// Concatenates rows of tensors that share a column count.
    fn concat_rows(&self, parts: &[&Tensor]) -> Result<Tensor>;

    // ---- elementwise ----
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `x * sigmoid(gate)`; `gate` has the shape of `x` or one column per row.
    fn sigmoid_mul(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor>;
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor>;
    fn silu(&self, x: &Tensor) -> Result<Tensor>;
    /// `y + x * sigmoid(gate)` (`gate` as in [`Backend::sigmoid_mul`]): a
    /// gated branch added to a residual in one op; equal to
    /// `add(y, sigmoid_mul(x, gate))`.
    fn add_sigmoid_mul(&self, y: &Tensor, x: &Tensor, gate: &Tensor) -> Result<Tensor>;
    /// `silu(x @ gate^T) * (x @ up^T)` for `w` holding the gate rows, then as
    /// many up rows: a SwiGLU's inputs and activation, which a backend may
    /// compute in one kernel. Equal to `silu_mul` of the two halves of `matmul(x, w)`.
    fn matmul_swiglu(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        matmul_swiglu_composed(self, x, w)
    }
    /// `y + sigmoid(gate) * (x @ w^T)` (`gate` one value per row): a gated
    /// branch's output projection and residual add, which a backend may fuse.
    /// Equal to `add_sigmoid_mul(y, matmul(x, w), gate)`.
    fn matmul_gated_add(&self, y: &Tensor, x: &Tensor, w: &Weight, gate: &Tensor) -> Result<Tensor> {
        self.add_sigmoid_mul(y, &self.matmul(x, w)?, gate)
    }
    /// `x * s`.
    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor>;

    // ---- multi-stream residuals ----
    // A row of `[rows, streams*d]` holds `streams` streams of `d` values side
    // by side; these ops move between one stream and several.

    /// `[rows, d]` -> `[rows, n*d]`: each row repeated `n` times side by side.
    fn repeat_cols(&self, x: &Tensor, n: usize) -> Result<Tensor>;
    /// Collapses `streams` streams to one, `out = (1/streams) sum_s sigmoid(w[s]) * x[s]`
    /// (summed in stream order) for `x, w: [rows, streams*d]`, giving `[rows, d]`.
    fn sigmoid_weighted_stream_mean(&self, x: &Tensor, w: &Tensor, streams: usize) -> Result<Tensor>;
    /// Adds `x: [rows, d]` to every stream of `h: [rows, streams*d]` with a
    /// per-row, per-stream gate: `out[s] = h[s] + 2*sigmoid(logit_scale*logits[s]) * x`
    /// for `logits: [rows, streams]`.
    fn add_gated_to_streams(&self, h: &Tensor, x: &Tensor, logits: &Tensor, logit_scale: f32) -> Result<Tensor>;
    /// Gates `value: [rows, d]` once per stream by how well `key` and `query`
    /// (`[rows, streams*d]`) agree there: `g = key[s].query[s] / sqrt(d)`,
    /// `g = sign(g)*sqrt(max(|g|, 1e-6))` (sign(0) = 0), `out[s] = sigmoid(g) * value`;
    /// gives `[rows, streams*d]`.
    fn stream_dot_gate(&self, key: &Tensor, query: &Tensor, value: &Tensor, streams: usize) -> Result<Tensor>;

    // ---- linear algebra ----
    /// Embedding rows for token ids: `[ids.len(), cols]`.
    fn embed(&self, table: &Weight, ids: &[u32]) -> Result<Tensor>;
    /// `x @ W^T` for `x: [rows, W.cols]` giving `[rows, W.rows]`.
    fn matmul(&self, x: &Tensor, w: &Weight) -> Result<Tensor>;

    // ---- normalisation ----
    /// RMSNorm over groups of `dim` values: `x / rms(x) * w`. The weight has
    /// `dim` values (the same for every group) or one value per column of `x`
    /// (several groups per row, each with its own slice of the weight: the
    /// per-stream norm of multi-stream residuals).
    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, dim: usize, eps: f32)
        -> Result<Tensor>;
    /// `(x + y, rms_norm(x + y, weight))` in one op: a residual add and the
    /// norm that follows it; equal to `add` then `rms_norm`.
    fn add_rms_norm(&self, x: &Tensor, y: &Tensor, weight: &Tensor, dim: usize, eps: f32) -> Result<(Tensor, Tensor)> {
        let sum = self.add(x, y)?;
        let normed = self.rms_norm(&sum, Some(weight), dim, eps)?;
        Ok((sum, normed))
    }
    /// `rms_norm(x) * w * act(z)` over groups of `dim` values.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gated(&self, x: &Tensor, z: &Tensor, weight: &Tensor, dim: usize, eps: f32, act: GateAct)
        -> Result<Tensor>;
    /// Scales each group of `dim` values to unit L2 norm (`x / sqrt(sum x^2 + eps)`),
    /// then multiplies by `scale`.
    fn l2_normalize(&self, x: &Tensor, dim: usize, eps: f32, scale: f32) -> Result<Tensor>;

    // ---- attention ----
    /// Rotary embedding (rotate-half / GPT-NeoX layout) on the first `rotary_dim`
    /// values of each head of `x: [tokens, heads, head_dim]`; token `i` sits at
    /// position `start_pos + i`, its angles [`Rope::table`]'s.
    fn rope(&self, x: &Tensor, head_dim: usize, rotary_dim: usize, rope: Rope, start_pos: usize)
        -> Result<Tensor>;
    /// Per-head RMSNorm (weight of `head_dim` values) and then [`Backend::rope`]
    /// on `x: [tokens, heads*head_dim]`: the q/k norm of attention and its
    /// rotary embedding in one op; equal to `rope(rms_norm(x))`. Returns
    /// `[tokens, heads, head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rope(&self, x: &Tensor, weight: &Tensor, head_dim: usize, eps: f32, rotary_dim: usize, rope: Rope, start_pos: usize)
        -> Result<Tensor> {
        let normed = self.rms_norm(x, Some(weight), head_dim, eps)?;
        let heads = x.cols() / head_dim.max(1);
        self.rope(&normed.reshape(&[x.rows(), heads, head_dim])?, head_dim, rotary_dim, rope, start_pos)
    }
    /// [`Backend::rms_norm_rope`] of the queries `q` and of the keys `k` of
    /// the same tokens (each with its own norm weight and eps) in one op.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rope_pair(&self, q: &Tensor, k: &Tensor, weights: [&Tensor; 2], head_dim: usize, eps: [f32; 2], rotary_dim: usize, rope: Rope, start_pos: usize)
        -> Result<(Tensor, Tensor)> {
        let q = self.rms_norm_rope(q, weights[0], head_dim, eps[0], rotary_dim, rope, start_pos)?;
        let k = self.rms_norm_rope(k, weights[1], head_dim, eps[1], rotary_dim, rope, start_pos)?;
        Ok((q, k))
    }
    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize) -> Result<State>;
    /// How a KV cache of this backend stores keys and values (what a
    /// planner sizes the cache by: `2 * layers * positions *
    /// bytes(kv_heads * head_dim)`).
    fn kv_cache_type(&self) -> KvCacheType;
    /// Number of positions held in a KV cache.
    fn kv_len(&self, cache: &State) -> Result<usize>;
    /// Drops every position from `len` on (speculative decoding's rollback).
    fn kv_truncate(&self, cache: &mut State, len: usize) -> Result<()>;
    /// Room for `positions` positions in all, ahead of the appends that
    /// bring them (a long prompt's cache allocated once, not grown chunk by
    /// chunk); a hint: appends still grow the cache as they need.
    fn kv_reserve(&self, cache: &mut State, positions: usize) -> Result<()> {
        let _ = (cache, positions);
        Ok(())
    }
    /// Appends `k, v: [tokens, kv_heads*head_dim]`, then attends causally:
    /// query `i` (at position `kv_len_before + i`) sees every key up to its own
    /// position, or only the keys `selection` allows it.
    /// `q: [tokens, heads*head_dim]`; returns `[tokens, heads*head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32,
        selection: Option<&KeySelection>) -> Result<Tensor>;
    /// [`Backend::rms_norm_rope_pair`] of the raw `q` and `k` ([`QkNorm`]),
    /// then [`Backend::attention`], in one op: a GPU normalises and rotates
    /// inside its decode attention kernel.
    #[allow(clippy::too_many_arguments)]
    fn attention_qk_norm(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32,
        selection: Option<&KeySelection>, norm: &QkNorm<'_>) -> Result<Tensor> {
        attention_qk_norm_composed(self, q, k, v, cache, heads, scale, selection, norm)
    }

    // ---- convolution and the gated delta rule (linear-attention layers) ----
    /// State of a causal convolution whose taps are `dilation` steps apart.
    fn new_conv_state(&self, channels: usize, kernel: usize, dilation: usize) -> Result<State>;
    /// Causal depthwise convolution over time of `x: [tokens, channels]` with
    /// `weight: [channels, kernel]`: output `t` is `sum_j w[c, j] * in[t - (kernel-1-j)*dilation]`
    /// (tap `kernel-1` multiplies the current input). It continues from (and
    /// updates) the window of the last `(kernel-1)*dilation` inputs in `state`.
    fn causal_conv1d(&self, x: &Tensor, weight: &Tensor, state: &mut State) -> Result<Tensor>;
    /// `silu(causal_conv1d(x, weight, state))` in one op.
    fn causal_conv1d_silu(&self, x: &Tensor, weight: &Tensor, state: &mut State) -> Result<Tensor>;
    fn new_recurrent_state(&self, heads: usize, key_dim: usize, value_dim: usize) -> Result<State>;
    /// Gates from the raw projections: `g = exp(-exp(a_log) * softplus(a + dt_bias))`,
    /// `beta = sigmoid(b)`, all `[tokens, heads]`.
    fn delta_gates(&self, a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor)
        -> Result<(Tensor, Tensor)>;
    /// The gated delta rule over `tokens` steps. `q, k: [tokens, key_heads*key_dim]`,
    /// `v: [tokens, heads*value_dim]`, `g, beta: [tokens, heads]`; value head `h`
    /// reads key head `h / (heads/key_heads)`. Per step and head:
    /// `S = g*S; S += k ⊗ beta*(v - S k); y = S q`. Returns `[tokens, heads*value_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor,
        key_heads: usize, state: &mut State) -> Result<Tensor>;

    /// One Gated DeltaNet step from raw projections: `q` and `k` scaled to
    /// unit L2 norm per key head of `key_dim` (`eps` as in
    /// [`Backend::l2_normalize`]; `q` then multiplied by `q_scale`), the gates
    /// from `a, b` as [`Backend::delta_gates`], then [`Backend::gated_delta`].
    /// Equal to those four ops in sequence.
    fn gated_delta_step(&self, x: DeltaInputs<'_>, key_heads: usize, q_scale: f32, eps: f32, state: &mut State) -> Result<Tensor> {
        let key_dim = x.q.cols() / key_heads.max(1);
        let q = self.l2_normalize(x.q, key_dim, eps, q_scale)?;
        let k = self.l2_normalize(x.k, key_dim, eps, 1.0)?;
        let (g, beta) = self.delta_gates(x.a, x.b, x.a_log, x.dt_bias)?;
        self.gated_delta(&q, &k, x.v, &g, &beta, key_heads, state)
    }

    // ---- mixture of experts ----
    /// Routes every token of `logits: [tokens, gating.experts]` (see [`Gating`]).
    fn route(&self, logits: &Tensor, gating: Gating) -> Result<Routes>;
    /// Routes every token of `x @ router^T`, whose first `gating.experts`
    /// rows are the router; the product's further columns (say, a shared
    /// expert's one-row gate stored after the router) come back as
    /// `[tokens, rows - experts]`. A backend may fuse the product into the
    /// routing. Equal to `route` of the first columns of `matmul(x, router)`.
    fn route_matmul(&self, x: &Tensor, router: &Weight, gating: Gating) -> Result<(Routes, Option<Tensor>)> {
        route_matmul_composed(self, x, router, gating)
    }
    /// Every token's expert ids, `[tokens * top_k]` (best first): what a
    /// streaming pool reads back to fetch its misses.
    fn routed_experts(&self, routes: &Routes) -> Result<Vec<u32>> {
        Ok(routes.ids_of_rows(&self.download(&routes.tensor)?))
    }
    /// [`Backend::routed_experts`] of several routings at once: a GPU
    /// backend reads them back in one round trip (a streaming pool reads a
    /// layer's routes with its guess of the next layer's).
    fn routed_experts_many(&self, routes: &[&Routes]) -> Result<Vec<Vec<u32>>> {
        routes.iter().map(|r| self.routed_experts(r)).collect()
    }
    /// Allocates a pool of `slots` expert records of `layout`, with a slot
    /// table of `keys` entries that all say "not in the pool".
    fn new_expert_pool(&self, layout: &ExpertLayout, slots: usize, keys: usize) -> Result<ExpertPool>;
    /// Copies one expert's weights into slot `slot`. A write need not reach
    /// the pool before the table is next mapped ([`Backend::map_experts`]):
    /// the MoE kernels may read a written slot only after that (a discrete
    /// GPU sends a layer's writes in one submission there).
    fn write_expert(&self, pool: &mut ExpertPool, slot: usize, expert: &HostExpert<'_>) -> Result<()> {
        ExpertMatrix::ALL.into_iter().try_for_each(|which| self.write_expert_matrix(pool, slot, which, expert.matrix(which)))
    }
    /// Copies one of an expert's matrices into slot `slot`: a streamed
    /// expert is written matrix by matrix as its reads land, so that little
    /// is left to write once the last one has.
    fn write_expert_matrix(&self, pool: &mut ExpertPool, slot: usize, which: ExpertMatrix, m: &HostMatrix<'_>) -> Result<()>;
    /// Sets slot table entries `(key, slot)` (`None`: not in the pool), in op
    /// order: MoE calls recorded before see the old table, later ones the new.
    fn map_experts(&self, pool: &mut ExpertPool, entries: &[(u32, Option<u32>)]) -> Result<()>;
    /// Unweighted outputs `down(silu(gate x_t) * up x_t)` of every token's
    /// routed experts, as `[tokens, top_k, hidden]`: row `(token, rank)` holds
    /// the output of expert `key_base + id` from the slot the table gives it,
    /// and is zero when the table has none, so outputs of calls over disjoint
    /// tables add up exactly.
    fn moe_expert_outputs(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Tensor>;
    /// [`Backend::moe_expert_outputs`] gathered into `outputs` (`[tokens,
    /// top_k, hidden]`): the rows whose expert `pool`'s table has are
    /// written, the others kept. A call whose experts sit in several pools
    /// (a streaming pool and the staging its misses run from) collects
    /// their outputs in one tensor. By default a second call's outputs are
    /// added (the rows are disjoint, so the sum is exact).
    fn moe_expert_outputs_into(&self, outputs: Tensor, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Tensor> {
        self.add(&outputs, &self.moe_expert_outputs(x, pool, routes, key_base)?)
    }
    /// `sum_r weight[t, r] * outputs[t, r, :]` with the routes' weights, summed in rank order.
    fn moe_combine(&self, outputs: &Tensor, routes: &Routes) -> Result<Tensor>;
    /// The routed experts' weighted output, `[tokens, hidden]`: equal to
    /// `moe_combine(moe_expert_outputs(..))`, which a backend may fuse.
    fn moe(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Tensor> {
        let outputs = self.moe_expert_outputs(x, pool, routes, key_base)?;
        self.moe_combine(&outputs, routes)
    }
    /// [`Backend::moe`] plus a sigmoid-gated shared expert: equal to
    /// `matmul_gated_add(moe(..), matmul_swiglu(x, gate_up), down, gate)`.
    /// Where the pool also holds the shared expert (under `shared.key`), a
    /// backend may run it in the routed experts' kernels, as one more rank.
    fn moe_shared(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize, shared: &SharedExpert<'_>) -> Result<Tensor> {
        moe_shared_composed(self, x, pool, routes, key_base, shared)
    }
    /// Whether [`Backend::moe_shared`] gains from a copy of the shared expert
    /// in the pool (the caller then reserves a slot and key for it).
    fn pools_shared_experts(&self) -> bool {
        false
    }

    /// The most prompt tokens one forward pass should take on this backend,
    /// if it has a bound of its own: a prefill's chunk stays within it.
    fn prefill_rows_max(&self) -> Option<usize> {
        None
    }

    /// Device memory by use and its high-water mark, for a backend that
    /// keeps its tensors in device memory and counts it.
    fn device_memory(&self) -> Option<DeviceMemory> {
        None
    }

    // ---- tokens chosen on the device (see [`chosen`]) ----
    /// Whether this backend keeps chosen tokens on the device (the methods
    /// below); a backend whose tensors are host memory gains nothing by it.
    fn keeps_chosen_tokens(&self) -> bool {
        false
    }
    /// The greedy token of `logits` (`[1, vocab]`), chosen on the device
    /// and left there.
    fn choose_greedy(&self, _logits: &Tensor) -> Result<Tensor> {
        Err(BackendError::Unsupported(format!("{} keeps no chosen tokens on the device", self.name())))
    }
    /// The embedding row `[1, cols]` of a token [`Backend::choose_greedy`] chose.
    fn embed_chosen(&self, _table: &Weight, _chosen: &Tensor) -> Result<Tensor> {
        Err(BackendError::Unsupported(format!("{} keeps no chosen tokens on the device", self.name())))
    }
    /// Starts reading a chosen token back, after the work recorded so far;
    /// work recorded later does not delay [`Backend::finish_reading_chosen`].
    fn start_reading_chosen(&self, _chosen: &Tensor) -> Result<chosen::PendingRead> {
        Err(BackendError::Unsupported(format!("{} keeps no chosen tokens on the device", self.name())))
    }
    /// The token a started read returns, once the device has chosen it.
    fn finish_reading_chosen(&self, _read: chosen::PendingRead) -> Result<u32> {
        Err(BackendError::Unsupported(format!("{} keeps no chosen tokens on the device", self.name())))
    }

    // ---- state management ----
    /// Deep copy of a state (for prefix caching and speculative rollback).
    fn clone_state(&self, state: &State) -> Result<State> {
        state.duplicate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter(Vec<u32>);

    impl DeviceState for Counter {
        fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
            Ok(Box::new(Counter(self.0.clone())))
        }
        fn bytes(&self) -> usize {
            4 * self.0.len()
        }
    }

    #[test]
    fn state_reaches_its_type_and_duplicates_deeply() {
        let mut st = State::new(Box::new(Counter(vec![1, 2])));
        assert!(st.get::<u32>().is_none(), "a state must not pass for another type");
        let copy = st.duplicate().expect("duplicate");
        st.get_mut::<Counter>().expect("the state's own type").0.push(3);
        assert_eq!(copy.get::<Counter>().map(|c| c.0.clone()), Some(vec![1, 2]), "the copy changed with the original");
        assert_eq!((st.bytes(), copy.bytes()), (12, 8));
    }
}
