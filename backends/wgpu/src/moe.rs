//! Typed calls of `wgsl/moe.wgsl`: routing in a kernel, the pool's slot
//! table, and the expert FFN `down(silu(gate x) * up x)` of every token's
//! routed experts, straight from the slot pool. Nothing here reads back to
//! the host.

use slotstream_backend::{checks, BackendError, ExpertPool, Gating, Result, Routes, Tensor};

use crate::gpu::{whole, Bind, Gpu, GpuBuf, Scratch, MAX_GROUPS};
use crate::matmul::{TILE, WIDE_TILE};
use crate::norm::HeldNorm;
use crate::params::{MoeParams, TiledParams, NO_SLOT};
use crate::tensors::{buf, f32s};
use crate::{not_ours, WgpuBackend};
use crate::weights::{GpuPool, GpuWeight, PoolMatrix, Shard};

// Bindings.
const W: u32 = 1;
const X: u32 = 2;
const OUT: u32 = 3;
const ROUTES: u32 = 4;
const W_WORDS: u32 = 6;
const TABLE: u32 = 7;
const ENTRIES: u32 = 8;
const VALS: u32 = 9;
// The tiled kernels' x again, read as 16-byte words.
const X_VEC4: u32 = 5;
// Bindings of the tiled kernels (`wgsl/matmul_tiled.wgsl`): the sort buffer
// as moe_sort writes it and as the tiles read it.
const SORT: u32 = 10;
const GROUPS: u32 = 11;

/// Routes `tokens` rows of router logits into `routes: [tokens, 2 * top_k]`.
pub(crate) fn route(gpu: &Gpu, logits: Bind<'_>, routes: Bind<'_>, tokens: usize, g: Gating) -> Result<()> {
    let params = MoeParams {
        experts: g.experts as u32,
        top_k: g.top_k as u32,
        normalize: g.normalize as u32,
        n: tokens as u32,
        ..Default::default()
    };
    gpu.dispatch("moe_route", &params, &[(VALS, logits), (ROUTES, routes)], Gpu::grid(tokens as u64))
}

/// Most tokens [`route_matmul`] takes: each token's router product runs in
/// one workgroup, which suits decode; prefill's many tokens take the tiled
/// matmul and [`route`].
const ROUTE_MATMUL_MAX_TOKENS: usize = 8;
/// Most router rows [`route_matmul`] takes (`moe_route`'s row cache).
pub(crate) const ROUTE_MATMUL_MAX_ROWS: usize = 1024;

/// The one shard of a router the routing kernels take for `tokens` tokens
/// (few tokens, a one-shard router of at most ROUTE_MATMUL_MAX_ROWS rows).
fn router_shard(w: &GpuWeight, tokens: usize) -> Option<&Shard> {
    let [s] = &w.shards[..] else {
        return None;
    };
    (tokens <= ROUTE_MATMUL_MAX_TOKENS && w.experts == 1 && w.rows <= ROUTE_MATMUL_MAX_ROWS && w.cols % 4 == 0).then_some(s)
}

/// The routing kernels' parameters for router shard `s` of `w`.
fn router_params(gpu: &Gpu, s: &Shard, w: &GpuWeight, g: Gating, tokens: usize) -> MoeParams {
    MoeParams {
        route_lanes: gpu.route_lanes as u32,
        w: s.desc,
        rows: w.rows as u32,
        x_cols: w.cols as u32,
        out_cols: (w.rows - g.experts) as u32,
        experts: g.experts as u32,
        top_k: g.top_k as u32,
        normalize: g.normalize as u32,
        n: tokens as u32,
        ..Default::default()
    }
}

/// Routes `tokens` rows of x by the router `w` (its first `g.experts` rows;
/// the product's rows after them go to `extra: [tokens, w.rows - experts]`,
/// bound even when there are none)
/// in one dispatch, for few tokens and a one-shard router; `None` (nothing
/// recorded) otherwise.
pub(crate) fn route_matmul(gpu: &Gpu, w: &GpuWeight, x: Bind<'_>, routes: Bind<'_>, extra: Bind<'_>, tokens: usize, g: Gating) -> Result<Option<()>> {
    let Some(s) = router_shard(w, tokens) else {
        return Ok(None);
    };
    // `vals` (the unfused kernel's logits) is in the layout but never read
    // here; it may not be x, which the routing kernels bind read-write.
    let binds = [(W, whole(&s.buffer)), (W_WORDS, whole(&s.buffer)), (X, x), (ROUTES, routes), (OUT, extra), (VALS, whole(&s.buffer))];
    gpu.dispatch("moe_route_matmul", &router_params(gpu, s, w, g, tokens), &binds, Gpu::grid(tokens as u64))?;
    Ok(Some(()))
}

// Bindings of moe_route_norm (wgsl/route.wgsl).
const NORM_BASE: u32 = 10;
const NORM_ADDEND: u32 = 11;
const NORM_WEIGHT: u32 = 12;
const NORM_SUM: u32 = 13;
/// Longest row moe_route_norm keeps in registers (256 invocations, four runs
/// of four values each).
const ROUTE_NORM_MAX_COLS: usize = 4096;

/// Most tokens whose norm [`route_norm`] takes in (a batched decode step's;
/// the engine batches at most 16 sequences).
pub(crate) const ROUTE_NORM_MAX_TOKENS: usize = 16;

/// Whether [`route_norm`] takes the held norm `h` for routing its tokens by
/// `w` (with `wide`, one token: the wide kernel routes one).
pub(crate) fn route_norm_fits(w: &GpuWeight, h: &HeldNorm, wide: bool) -> bool {
    let rows = h.x.rows();
    router_shard(w, 1).is_some()
        && w.cols <= ROUTE_NORM_MAX_COLS
        && (1..=ROUTE_NORM_MAX_TOKENS).contains(&rows)
        && (rows == 1 || !wide)
        && h.x.shape() == [rows, w.cols]
        && h.weight.numel() == w.cols
}

// Bindings of moe_route_norm_wide: its logits and the cross-workgroup count.
const WIDE_LOGITS: u32 = 14;
const WIDE_COUNTS: u32 = 15;
/// Most workgroups `moe_route_norm_wide` spreads a router over (all count on
/// one word; a few hundred counting cost more than they save).
const ROUTE_WIDE_GROUPS: usize = 32;

/// Whether one-token routing by `w` runs over several workgroups
/// ([`route_norm`] with `wide`): an 8-bit affine router of at least
/// `min_rows` rows (0: never), on a backend that orders memory across
/// workgroups.
pub(crate) fn route_wide(gpu: &Gpu, w: &GpuWeight, min_rows: usize) -> bool {
    let affine8 = router_shard(w, 1).is_some_and(|s| s.desc.fmt == 3 && s.desc.bits == 8);
    min_rows > 0 && w.rows >= min_rows && affine8 && gpu.orders_across_workgroups()
}

/// [`route_matmul`] of `norm(x + y)`, the held `add_rms_norm` `h` in the
/// same dispatch (`moe_route_norm`, a workgroup per token, or for one token
/// `moe_route_norm_wide` when `wide`, which the caller checked with
/// [`route_wide`]): writes its sum and normed rows as the norm would have.
/// The caller checked [`route_norm_fits`].
pub(crate) fn route_norm(gpu: &Gpu, w: &GpuWeight, h: &HeldNorm, routes: Bind<'_>, extra: Bind<'_>, g: Gating, wide: bool) -> Result<()> {
    let Some(s) = router_shard(w, 1) else {
        return Err(BackendError::Device("route_norm: a router the routing kernels do not take".into()));
    };
    let tokens = h.x.rows();
    let params = MoeParams { eps: h.eps, ..router_params(gpu, s, w, g, tokens) };
    let binds = [
        (W, whole(&s.buffer)),
        (W_WORDS, whole(&s.buffer)),
        (X, buf(&h.out)?),
        (ROUTES, routes),
        (OUT, extra),
        (VALS, whole(&s.buffer)),
        (NORM_BASE, buf(&h.x)?),
        (NORM_ADDEND, buf(&h.y)?),
        (NORM_WEIGHT, buf(&h.weight)?),
        (NORM_SUM, buf(&h.sum)?),
    ];
    if !wide {
        // An 8-bit router routed in one subgroup has a kernel of its own,
        // which reads no logits from VALS.
        if s.desc.fmt == 3 && s.desc.bits == 8 && gpu.route_lanes && g.experts <= gpu.subgroup_min as usize {
            let binds: Vec<_> = binds.into_iter().filter(|(b, _)| *b != VALS).collect();
            return gpu.dispatch("moe_route_norm_q8", &params, &binds, [tokens as u32, 1, 1]);
        }
        return gpu.dispatch("moe_route_norm", &params, &binds, [tokens as u32, 1, 1]);
    }
    if tokens != 1 {
        return Err(BackendError::Device(format!("route_norm: the wide routing kernel routes one token, not {tokens}")));
    }
    // Quads of rows per workgroup, and the workgroups that take them all.
    let quads = w.rows.div_ceil(4);
    let per = quads.div_ceil(quads.min(ROUTE_WIDE_GROUPS));
    let logits = gpu.alloc_for(Scratch::Moe, 4 * g.experts.max(1) as u64)?;
    let binds: Vec<_> = binds.into_iter().chain([(WIDE_LOGITS, logits.bind()), (WIDE_COUNTS, whole(&gpu.merge_counts))]).collect();
    let params = MoeParams { parts: per as u32, ..params };
    gpu.dispatch("moe_route_norm_wide", &params, &binds, [quads.div_ceil(per) as u32, 1, 1])
}

/// Every routing's expert ids (best first), read back in one round trip.
pub(crate) fn routed_ids(gpu: &Gpu, routes: &[&Routes]) -> Result<Vec<Vec<u32>>> {
    let srcs = routes.iter().map(|r| Ok((buf(&r.tensor)?, 4 * r.tensor.numel() as u64))).collect::<Result<Vec<_>>>()?;
    let read = gpu.download_many(&srcs)?;
    Ok(routes.iter().zip(read).map(|(r, bytes)| r.ids_of_rows(&f32s(&bytes))).collect())
}

/// Sets slot table entries `(key, slot or NO_SLOT)`, in op order.
pub(crate) fn map(gpu: &Gpu, table: &wgpu::Buffer, entries: &[[u32; 2]]) -> Result<()> {
    for chunk in entries.chunks(64 * MAX_GROUPS as usize) {
        let list = gpu.small_input("slot table entries", bytemuck::cast_slice(chunk))?;
        let params = MoeParams { n: chunk.len() as u32, ..Default::default() };
        let groups = [chunk.len().div_ceil(64) as u32, 1, 1];
        gpu.dispatch("moe_map", &params, &[(TABLE, whole(table)), (ENTRIES, whole(&list))], groups)?;
    }
    Ok(())
}

/// What the FFN kernels of one MoE call share.
pub(crate) struct Call<'a> {
    pub pool: &'a GpuPool,
    pub x: Bind<'a>,
    pub routes: Bind<'a>,
    pub tokens: usize,
    pub gating: Gating,
    pub key_base: usize,
    /// The pool shards holding the layer's experts: the only ones the
    /// kernels run over.
    pub shards: std::ops::Range<usize>,
    /// A shared expert in the pool that [`fused`] runs as one more rank.
    pub shared: Option<SharedRank<'a>>,
    /// Many-token calls' products on the matrix units ([`crate::matmul::MatmulChoice::coop`]).
    pub coop: bool,
}

/// A shared expert held in the pool under slot table key `key`, weighted by
/// `sigmoid(gate[t * gate_cols])` for token t: after the routed ranks of
/// every token, assignment `tokens * top_k + t` is token t's.
pub(crate) struct SharedRank<'a> {
    pub key: usize,
    pub gate: Bind<'a>,
    pub gate_cols: usize,
}

impl<'a> Call<'a> {
    pub fn new(pool: &'a GpuPool, x: Bind<'a>, routes: Bind<'a>, tokens: usize, gating: Gating, key_base: usize, coop: bool) -> Call<'a> {
        let shards = pool.shards_of(key_base, gating.experts);
        Call { pool, x, routes, tokens, gating, key_base, shards, shared: None, coop }
    }

    /// Assignments of the FFN kernels: every token's ranks, then its shared expert's.
    fn assignments(&self) -> usize {
        self.tokens * (self.gating.top_k + self.shared.is_some() as usize)
    }
}

/// `silu(gate x) * up x` of every assignment, `[c.assignments(), inter]`
/// (rows whose expert has no slot are left unwritten: nothing reads them).
fn activations(gpu: &Gpu, c: &Call<'_>) -> Result<GpuBuf> {
    let pool = c.pool;
    let (hidden, inter) = (pool.gate_up.layout_cols(), pool.intermediate);
    let n = c.assignments();
    let act = gpu.alloc_for(Scratch::Moe, 4 * (n * inter).max(1) as u64)?;
    for shard in c.shards.clone() {
        for (start, count) in runs(n) {
            let run = Run { gpu, c, shard, start, count };
            run.dispatch("moe_gate_up", &pool.gate_up, inter, hidden, inter, &[(X, c.x), (OUT, act.bind())])?;
        }
    }
    Ok(act)
}

/// `(start, count)` runs of at most `MAX_GROUPS` of `n` workgroup rows.
fn runs(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).step_by(MAX_GROUPS as usize).map(move |s| (s, (n - s).min(MAX_GROUPS as usize)))
}

/// Tokens from which an MoE call runs as tiles of up to 64 pairs of one
/// expert (`wgsl/matmul_tiled.wgsl`), each pool row read once per tile,
/// instead of one workgroup row per pair.
const TILED_MIN_TOKENS: usize = 9;

/// Unweighted expert outputs into `out: [tokens, top_k, hidden]` (zeroed
/// here: rows whose expert has no slot stay zero).
pub(crate) fn expert_outputs(gpu: &Gpu, c: &Call<'_>, out: &wgpu::Buffer) -> Result<()> {
    gpu.clear(out)?;
    let pool = c.pool;
    let (hidden, inter) = (pool.gate_up.layout_cols(), pool.intermediate);
    let n = c.tokens * c.gating.top_k;
    if n == 0 {
        return Ok(());
    }
    if c.tokens >= TILED_MIN_TOKENS {
        return tiled_outputs(gpu, c, out);
    }
    let act = activations(gpu, c)?;
    for shard in c.shards.clone() {
        for (start, count) in runs(n) {
            let run = Run { gpu, c, shard, start, count };
            run.dispatch("moe_down", &pool.down, hidden, inter, hidden, &[(X, act.bind()), (OUT, whole(out))])?;
        }
    }
    Ok(())
}

/// The weighted sum of the routed experts' outputs (and of the shared
/// expert's, with `c.shared`), `out: [tokens, hidden]`, when the layer's
/// experts are in one pool shard and the call is decode-sized: two
/// dispatches (gate and up, then down with the weighted sum); `None` for a
/// layer across shards, a shared expert in another shard than the layer's
/// or a prefill-sized call (the caller runs [`expert_outputs`] and
/// [`combine`], and the shared expert's own products).
pub(crate) fn fused(gpu: &Gpu, c: &Call<'_>, out: Bind<'_>) -> Result<Option<()>> {
    let pool = c.pool;
    let shared_apart = c.shared.as_ref().is_some_and(|s| pool.shards_of(s.key, 1) != c.shards);
    if c.shards.len() != 1 || shared_apart {
        return Ok(None);
    }
    if c.tokens == 0 {
        return Ok(Some(()));
    }
    if c.tokens >= TILED_MIN_TOKENS {
        return Ok(None);
    }
    let (hidden, inter) = (pool.gate_up.layout_cols(), pool.intermediate);
    let act = activations(gpu, c)?;
    // The shared expert's gate logits where moe_down_combine reads them
    // (otherwise unread, bound to the activations).
    let gate = c.shared.as_ref().map_or(act.bind(), |s| s.gate);
    for (start, count) in runs(c.tokens) {
        let run = Run { gpu, c, shard: c.shards.start, start, count };
        run.dispatch("moe_down_combine", &pool.down, hidden, inter, hidden, &[(X, act.bind()), (OUT, out), (VALS, gate)])?;
    }
    Ok(Some(()))
}

/// [`expert_outputs`] for many tokens: per pool shard, the pairs grouped by
/// expert (`moe_sort`), then gate and up, then down, each over the tile list
/// (`out` is already zeroed).
fn tiled_outputs(gpu: &Gpu, c: &Call<'_>, out: &wgpu::Buffer) -> Result<()> {
    let pool = c.pool;
    let (hidden, inter) = (pool.gate_up.layout_cols(), pool.intermediate);
    let pairs = c.tokens * c.gating.top_k;
    let experts = c.gating.experts;
    // 128 x 128 tiles where an expert gets 128 pairs on average.
    let wide = pairs >= WIDE_TILE * experts;
    let (tile, gate_up, down) = match (wide, c.coop) {
        (true, true) => (WIDE_TILE, "moe_gate_up_coop", "moe_down_coop"),
        (true, false) => (WIDE_TILE, "moe_gate_up_wide", "moe_down_wide"),
        (false, _) => (TILE, "moe_gate_up_tiled", "moe_down_tiled"),
    };
    let max_tiles = pairs.div_ceil(tile) + experts.min(pairs);
    let sort = gpu.alloc_for(Scratch::Moe, 4 * (1 + experts + 2 * max_tiles + pairs) as u64)?;
    let act = gpu.alloc_for(Scratch::Moe, 4 * (pairs * inter) as u64)?;
    let table = whole(&pool.table);
    for shard in c.shards.clone() {
        let base = shard * pool.per_shard;
        let shard_slots = pool.shard_slots(shard);
        let params = |m: &PoolMatrix, rows: usize, x_cols: usize, out_cols: usize| TiledParams {
            w: m.layout.desc(shard_slots * m.rows),
            rows: rows as u32,
            tokens: pairs as u32,
            out_cols: out_cols as u32,
            x_cols: x_cols as u32,
            top_k: c.gating.top_k as u32,
            experts: experts as u32,
            key_base: c.key_base as u32,
            slot_base: base as u32,
            slot_end: (base + shard_slots) as u32,
            max_tiles: max_tiles as u32,
            tile_pairs: tile as u32,
            ..Default::default()
        };
        let sort_params = params(&pool.gate_up, inter, hidden, inter);
        gpu.dispatch("moe_sort", &sort_params, &[(ROUTES, c.routes), (TABLE, table), (SORT, sort.bind())], [1, 1, 1])?;
        let weights = whole(&pool.gate_up.buffers[shard]);
        let binds = [(W_WORDS, weights), (X, c.x), (X_VEC4, c.x), (OUT, act.bind()), (TABLE, table), (GROUPS, sort.bind())];
        // A tile's rows are gate and up rows in turn: half as many of each.
        let groups = [inter.div_ceil(tile / 2) as u32, max_tiles as u32, 1];
        gpu.dispatch(gate_up, &sort_params, &binds, groups)?;
        let weights = whole(&pool.down.buffers[shard]);
        let binds = [(W_WORDS, weights), (X, act.bind()), (X_VEC4, act.bind()), (OUT, whole(out)), (TABLE, table), (GROUPS, sort.bind())];
        let groups = [hidden.div_ceil(tile) as u32, max_tiles as u32, 1];
        gpu.dispatch(down, &params(&pool.down, hidden, inter, hidden), &binds, groups)?;
    }
    Ok(())
}

/// `out[t] = sum_r weight[t, r] * outputs[t, r]` with the routes' weights.
pub(crate) fn combine(gpu: &Gpu, outputs: Bind<'_>, routes: Bind<'_>, out: Bind<'_>, tokens: usize, hidden: usize, top_k: usize) -> Result<()> {
    let params = MoeParams { out_cols: hidden as u32, top_k: top_k as u32, n: (tokens * hidden) as u32, ..Default::default() };
    let groups = Gpu::grid((tokens * hidden).div_ceil(256) as u64);
    gpu.dispatch("moe_combine", &params, &[(VALS, outputs), (ROUTES, routes), (OUT, out)], groups)
}

/// One pool shard's share of a run of assignments.
struct Run<'a> {
    gpu: &'a Gpu,
    c: &'a Call<'a>,
    shard: usize,
    start: usize,
    count: usize,
}

impl Run<'_> {
    /// One kernel over the run's workgroup rows (assignments, or tokens for
    /// `moe_down_combine`) on matrix `m`: `rows` output rows per expert.
    fn dispatch(&self, entry: &str, m: &PoolMatrix, rows: usize, x_cols: usize, out_cols: usize, binds: &[(u32, Bind<'_>)]) -> Result<()> {
        let pool = self.c.pool;
        let base = self.shard * pool.per_shard;
        let shard_slots = pool.shard_slots(self.shard);
        // moe_gate_up: a quad's gate rows and up rows each shared by `parts`
        // subgroups, one share of the row's 16-byte chunks per lane each.
        let parts = match entry {
            // A 16-byte chunk of a 4-bit row holds 32 columns.
            "moe_gate_up" => self.gpu.row_parts(x_cols.div_ceil(32)),
            _ => 1,
        };
        let params = MoeParams {
            w: m.layout.desc(shard_slots * m.rows),
            rows: rows as u32,
            asg_off: self.start as u32,
            slot_base: base as u32,
            slot_end: (base + shard_slots) as u32,
            x_cols: x_cols as u32,
            out_cols: out_cols as u32,
            top_k: self.c.gating.top_k as u32,
            experts: self.c.gating.experts as u32,
            key_base: self.c.key_base as u32,
            parts: parts as u32,
            n: self.c.tokens as u32,
            shared_key: self.c.shared.as_ref().map_or(NO_SLOT, |s| s.key as u32),
            gate_cols: self.c.shared.as_ref().map_or(0, |s| s.gate_cols as u32),
            ..Default::default()
        };
        let table = whole(&pool.table);
        let mut all = vec![(W, whole(&m.buffers[self.shard])), (W_WORDS, whole(&m.buffers[self.shard])), (ROUTES, self.c.routes), (TABLE, table)];
        all.extend_from_slice(binds);
        let quads = rows.div_ceil(4);
        // moe_down_combine: one quad of rows per workgroup (its subgroups share the ranks).
        let x_groups = match entry {
            "moe_down_combine" => quads.min(MAX_GROUPS as usize) as u32,
            "moe_gate_up" if parts > 1 => self.gpu.subgroup_grid(quads * 2 * parts, 128),
            _ => self.gpu.subgroup_grid(quads, 128),
        };
        let groups = [x_groups, self.count as u32, 1];
        self.gpu.dispatch(entry, &params, &all, groups)
    }
}

/// Tokens a part of a split MoE call starts at a multiple of (its rows of
/// x, routes and output then start on 256-byte boundaries).
const PART_ALIGN: usize = 64;

/// What a MoE call of `tokens` tokens runs on: many-token tiles, and wide
/// ones (`tiled_outputs`). A part of a split call must run on the same.
fn kernels_of(tokens: usize, g: Gating) -> (bool, bool) {
    (tokens >= TILED_MIN_TOKENS, tokens * g.top_k >= WIDE_TILE * g.experts)
}

/// Tokens per part when a call of `tokens` is split at `rows`
/// ([`crate::WgpuOptions::moe_rows`]): parts of about equal size, each on the
/// kernels of the whole call; `None`: one part.
pub(crate) fn part_tokens(tokens: usize, rows: usize, g: Gating) -> Option<usize> {
    if rows == 0 || tokens <= rows {
        return None;
    }
    let per = tokens.div_ceil(tokens.div_ceil(rows)).div_ceil(PART_ALIGN) * PART_ALIGN;
    let last = tokens - (tokens - 1) / per * per;
    let whole = kernels_of(tokens, g);
    (per < tokens && kernels_of(per, g) == whole && kernels_of(last, g) == whole).then_some(per)
}

/// Rows `r0..r0 + n` of `row` bytes each of the binding `b`.
fn rows_of(b: Bind<'_>, r0: usize, n: usize, row: usize) -> Bind<'_> {
    Bind { buffer: b.buffer, offset: b.offset + (r0 * row) as u64, size: (n * row) as u64 }
}

impl WgpuBackend {
    /// [`Backend::moe`] in parts of [`part_tokens`] tokens: each part's
    /// expert outputs, then their weighted sum into its rows of the output;
    /// `None` where the call is not split.
    pub(crate) fn moe_in_parts(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize) -> Result<Option<Tensor>> {
        let p = pool.get::<GpuPool>().ok_or_else(|| not_ours("the expert pool"))?;
        let (tokens, k) = checks::moe_routes(x, p.gate_up.layout_cols(), routes, key_base, pool.keys)?;
        let Some(per) = part_tokens(tokens, self.options.moe_rows, routes.gating) else {
            return Ok(None);
        };
        let (hidden, align) = (x.cols(), self.gpu.limits.min_storage_buffer_offset_alignment as usize);
        let (xb, rb) = (buf(x)?, buf(&routes.tensor)?);
        if [xb.offset as usize, rb.offset as usize, per * 4 * hidden, per * 8 * k].iter().any(|b| b % align.max(4) != 0) {
            return Ok(None);
        }
        let (out, ob) = self.output(vec![tokens, hidden])?;
        let coop = self.matmul_choice().coop(&self.gpu);
        for r0 in (0..tokens).step_by(per) {
            let n = per.min(tokens - r0);
            let (xs, rs) = (rows_of(xb, r0, n, 4 * hidden), rows_of(rb, r0, n, 8 * k));
            let outputs = self.gpu.alloc_for(Scratch::Moe, 4 * (n * k * hidden) as u64)?;
            expert_outputs(&self.gpu, &Call::new(p, xs, rs, n, routes.gating, key_base, coop), outputs.buffer())?;
            combine(&self.gpu, outputs.bind(), rs, rows_of(ob.bind(), r0, n, 4 * hidden), n, hidden, k)?;
        }
        Ok(Some(out))
    }

    /// [`Backend::moe`]'s weighted sum (with `shared`: a shared expert's
    /// slot table key and gate logits `[tokens, 1]`, as one more rank) in the
    /// fused kernels, or `None` where they do not take the call.
    pub(crate) fn moe_fused(&self, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize, shared: Option<(usize, &Tensor)>)
        -> Result<Option<Tensor>> {
        let p = pool.get::<GpuPool>().ok_or_else(|| not_ours("the expert pool"))?;
        let (tokens, k) = checks::moe_routes(x, p.gate_up.layout_cols(), routes, key_base, pool.keys)?;
        // Up to 64 ranks, a shared expert the table maps, one gate logit per token.
        if shared.is_some_and(|(key, gate)| !p.maps(key) || k >= 64 || gate.shape() != [tokens, 1]) {
            return Ok(None);
        }
        let (out, ob) = self.output(vec![tokens, x.cols()])?;
        let mut call = Call::new(p, buf(x)?, buf(&routes.tensor)?, tokens, routes.gating, key_base, self.matmul_choice().coop(&self.gpu));
        if let Some((key, gate)) = shared {
            call.shared = Some(SharedRank { key, gate: buf(gate)?, gate_cols: 1 });
        }
        Ok(fused(&self.gpu, &call, ob.bind())?.map(|()| out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_keep_the_kernels_of_the_whole_call() {
        // Qwen3-30B-A3B's trunk with 16 experts (A): 2,048 tokens in two parts.
        let a = Gating { experts: 16, top_k: 8, normalize: true };
        assert_eq!(part_tokens(2048, 1024, a), Some(1024));
        // Three parts of about equal size, starting at multiples of 64.
        assert_eq!(part_tokens(2100, 1024, a), Some(704));
        assert_eq!(part_tokens(1030, 1024, a), Some(576));
        // Not split: off, small enough, or a part would leave the wide tiles
        // (128 experts: 2,048 tokens just reach them, 1,024 do not).
        assert_eq!(part_tokens(2048, 0, a), None);
        assert_eq!(part_tokens(1024, 1024, a), None);
        assert_eq!(part_tokens(2048, 1024, Gating { experts: 128, ..a }), None);
        // Every part covers its rows and the last one is not empty.
        for tokens in [1025, 1500, 2047, 2048, 4097, 8192] {
            let per = part_tokens(tokens, 1024, a).expect("split");
            assert!(per % PART_ALIGN == 0 && per <= 1024 + PART_ALIGN && per < tokens, "{tokens}: {per}");
        }
    }
}

