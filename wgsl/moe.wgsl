// Mixture of experts on the device: routing, the pool's slot table, and the
// expert FFN `down(silu(gate x) * up x)` read straight from the slot pool
// (4-bit slots with 16-bit scales interleaved as standalone weights are, see
// weights.wgsl).
//
//   moe_route:   one workgroup per token: softmax over the token's `experts`
//                router logits (vals), the `top_k` largest kept (highest logit
//                first, ties to the lower id), renormalised when `normalize`;
//                writes routes[t] = top_k ids, then top_k weights (f32 bits).
//   moe_route_matmul: moe_route of the logits x[t] . W (the router's rows, then
//                optional extra rows written to out), in one dispatch.
//   moe_map:     table[entries[i].x] = entries[i].y for i < n (the slot table).
//   moe_gate_up: out[a, r] = silu(gate[slot] row r . x[token]) * (up[slot] row r . x[token]),
//                gate and up side by side in one pool matrix: gate rows 0..rows, up rows rows..2*rows;
//                with `parts` > 1, a quad's gate rows and up rows each shared by that many subgroups
//   moe_down:    out[a, r] = down[slot] row r . x[a]  (x = activations)
//   moe_combine: out[t, j] = sum_r weight[t, r] * vals[(t*top_k + r)*out_cols + j], rank order
//   moe_down_combine: out[t, r] = sum_k weight[t, k] * (down[slot of (t, k)] row r . x[t*top_k + k]),
//                moe_down then moe_combine in one dispatch (one pool shard; workgroup_id.y
//                is the token, each workgroup one quad of rows, its subgroups sharing the ranks)
// For the FFN kernels, assignment a = asg_off + workgroup_id.y is token
// a / top_k's rank a % top_k; its slot is table[key_base + id] for the routed
// id, and the workgroup does nothing when that is not a slot of this dispatch's
// pool shard [slot_base, slot_end) (or the id is not an expert).
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (one pool shard of gate, up or down; slot s of
// the shard is rows [s*rows, (s+1)*rows)); 2 xin f32 rows of x_cols; 3 out f32
// (read-write); 4 routes u32 [tokens, 2*top_k]; 5 aux f32 (moe_up);
// 7 table u32 (read-write for moe_map); 8 entries vec2<u32> (moe_map); 9 vals f32
// (moe_route's logits, moe_combine's expert outputs).

struct Params {
    w: WeightDesc,
    rows: u32,
    asg_off: u32,
    slot_base: u32,
    slot_end: u32,
    x_cols: u32,
    out_cols: u32,
    top_k: u32,
    experts: u32,
    key_base: u32,
    normalize: u32,
    n: u32,
    // moe_gate_up: subgroups sharing each of a quad's gate and up rows (0 or
    // 1: one subgroup computes both).
    parts: u32,
}

const NO_SLOT: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> routes: array<u32>;
@group(0) @binding(7) var<storage, read_write> table: array<u32>;
@group(0) @binding(8) var<storage, read> entries: array<vec2<u32>>;
@group(0) @binding(9) var<storage, read> vals: array<f32>;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

var<workgroup> chosen: array<u32, 64>;
var<workgroup> chosen_w: array<f32, 64>;
var<workgroup> wg_slot: u32;
// moe_route: the token's logits, when there are at most ROW_CACHE experts.
const ROW_CACHE: u32 = 1024u;
var<workgroup> row: array<f32, 1024>;
var<workgroup> wg_slots: array<u32, 64>;
// moe_down_combine: each subgroup's weighted partial sums of one quad of rows.
var<workgroup> partial4: array<vec4<f32>, 256>;

// This lane's partial dot products of four consecutive pool rows with the x
// row at vec4 index `xb`: interleaved 4-bit slots (fmt 4) by rows4_q4i, the
// rest by rows_dot.
fn pool_rows4(d: WeightDesc, row0: u32, nrows: u32, xb: u32, lane: u32, lanes: u32) -> vec4<f32> {
    if (d.fmt == 4u) {
        if (d.scale_kind == 1u) {
            return rows4_q4i(d, row0, nrows, xb, lane, lanes, true);
        }
        return rows4_q4i(d, row0, nrows, xb, lane, lanes, false);
    }
    return rows_dot(d, row0, nrows, xb, lane, lanes);
}

fn logit(t: u32, e: u32) -> f32 {
    return vals[t * p.experts + e];
}

// Whether candidate (v, i) beats (v0, i0): a real id beats none, then the
// larger value, then the lower id.
fn better(v: f32, i: u32, v0: f32, i0: u32) -> bool {
    if (i == NO_SLOT) {
        return false;
    }
    return i0 == NO_SLOT || v > v0 || (v == v0 && i < i0);
}

// Routes token `t` from its logits: in `row` when `cached` (at most
// ROW_CACHE experts), else in `vals`.
fn lg(t: u32, e: u32, cached: bool) -> f32 {
    if (cached) {
        return row[e];
    }
    return logit(t, e);
}

// Subgroup ids and sizes of the routing entry points, for route_token.
struct Lanes {
    sg: u32,
    nsg: u32,
    lane: u32,
}

fn route_token(t: u32, li: u32, cached: bool, ln: Lanes) {
    // Softmax denominator: max, then the sum of exp(l - max). NaN logits
    // take no part in the max.
    var m = -3.4028235e38;
    for (var e = li; e < p.experts; e += 256u) {
        let v = lg(t, e, cached);
        if (v > m) {
            m = v;
        }
    }
    let mx = reduce_max(m, ln.sg, ln.nsg, ln.lane);
    var s = 0.0;
    for (var e = li; e < p.experts; e += 256u) {
        s += exp(lg(t, e, cached) - mx);
    }
    let total = reduce_sum(s, ln.sg, ln.nsg, ln.lane);
    if (li < p.top_k) {
        // Stays "no expert" where NaN logits leave a rank unfilled.
        chosen[li] = NO_SLOT;
        chosen_w[li] = 0.0;
    }
    workgroupBarrier();
    // Each expert's rank is the number of experts that beat it (a strict
    // order: larger logit, then lower id), so the top k place themselves.
    for (var e = li; e < p.experts; e += 256u) {
        let v = lg(t, e, cached);
        var rank = 0u;
        for (var o = 0u; o < p.experts && rank < p.top_k; o++) {
            if (better(lg(t, o, cached), o, v, e)) {
                rank++;
            }
        }
        if (rank < p.top_k) {
            chosen[rank] = e;
            chosen_w[rank] = exp(v - mx) / total;
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        var sum = 0.0;
        for (var j = 0u; j < p.top_k; j++) {
            sum += chosen_w[j];
        }
        let base = t * 2u * p.top_k;
        for (var j = 0u; j < p.top_k; j++) {
            var wj = chosen_w[j];
            if (p.normalize != 0u) {
                wj = wj / sum;
            }
            routes[base + j] = chosen[j];
            routes[base + p.top_k + j] = bitcast<u32>(wj);
        }
    }
}

@compute @workgroup_size(256)
fn moe_route(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let t = wid.y * nwg.x + wid.x;
    if (t >= p.n) {
        return;
    }
    let cached = p.experts <= ROW_CACHE;
    for (var e = li; e < min(p.experts, ROW_CACHE); e += 256u) {
        row[e] = logit(t, e);
    }
    workgroupBarrier();
    route_token(t, li, cached, Lanes(sg, nsg, lane));
}

// The router's product and the routing in one dispatch: `row[e]` = router
// row e . x[t] for the first `experts` of the weight's `rows` rows (at most
// ROW_CACHE); the rows after them (a shared expert's gate) go to
// out[t * out_cols + r - experts]. One subgroup per four rows, as matvec.
@compute @workgroup_size(256)
fn moe_route_matmul(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let t = wid.y * nwg.x + wid.x;
    if (t >= p.n) {
        return;
    }
    let quads = (p.rows + 3u) / 4u;
    let xb = t * (p.x_cols / 4u);
    // Subgroups left over from one per quad share a quad's columns: part
    // `part` of `parts` takes chunks part*lanes + lane, stepping parts*lanes.
    let parts = max(1u, nsg / quads);
    for (var k = sg; k < quads * parts; k += nsg) {
        let qi = k / parts;
        let part = k % parts;
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        let total = subgroupAdd(pool_rows4(p.w, row0, nrows, xb, part * lanes + lane, parts * lanes));
        if (lane == 0u) {
            partial4[k] = total;
        }
    }
    workgroupBarrier();
    for (var e = li; e < p.rows; e += 256u) {
        let qi = e / 4u;
        var v = 0.0;
        for (var part = 0u; part < parts; part++) {
            v += partial4[qi * parts + part][e % 4u];
        }
        if (e < p.experts) {
            row[e] = v;
        } else {
            out[t * p.out_cols + e - p.experts] = v;
        }
    }
    workgroupBarrier();
    route_token(t, li, true, Lanes(sg, nsg, lane));
}

@compute @workgroup_size(64)
fn moe_map(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.n) {
        let e = entries[gid.x];
        table[e.x] = e.y;
    }
}

// The slot of assignment `a`, local to this dispatch's shard, or NO_SLOT;
// uniform across the workgroup.
fn assignment_slot(a: u32, li: u32) -> u32 {
    if (li == 0u) {
        let t = a / p.top_k;
        let id = routes[t * 2u * p.top_k + a % p.top_k];
        var slot = NO_SLOT;
        if (id < p.experts) {
            slot = table[p.key_base + id];
        }
        if (slot < p.slot_base || slot >= p.slot_end) {
            slot = NO_SLOT;
        }
        wg_slot = slot;
    }
    let slot = workgroupUniformLoad(&wg_slot);
    if (slot == NO_SLOT) {
        return NO_SLOT;
    }
    return slot - p.slot_base;
}

@compute @workgroup_size(128)
fn moe_gate_up(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let a = p.asg_off + wid.y;
    let slot = assignment_slot(a, li);
    if (slot == NO_SLOT) {
        return;
    }
    let xb = (a / p.top_k) * (p.x_cols / 4u);
    let base = slot * 2u * p.rows;
    let quads = (p.rows + 3u) / 4u;
    if (p.parts > 1u && nsg >= 4u) {
        // A quad's gate rows and its up rows each go to `parts` subgroups
        // (part k takes chunks k*lanes + lane), so no lane walks the two
        // products one after the other; sums are added in part order.
        let parts = min(p.parts, nsg / 2u);
        let per_quad = 2u * parts;
        let per_wg = nsg / per_quad;
        let k = sg % per_quad;
        let up = k / parts;
        let part = k % parts;
        for (var q0 = wid.x * per_wg; q0 < quads; q0 += nwg.x * per_wg) {
            let qi = q0 + sg / per_quad;
            let row0 = qi * 4u;
            let in_use = qi < quads && sg < per_wg * per_quad;
            var sums = vec4<f32>(0.0);
            if (in_use) {
                sums = pool_rows4(p.w, base + up * p.rows + row0, min(4u, p.rows - row0), xb, part * lanes + lane, parts * lanes);
            }
            let total = subgroupAdd(sums);
            if (lane == 0u) {
                partial4[sg] = total;
            }
            workgroupBarrier();
            if (k == 0u && lane == 0u && in_use) {
                var g = partial4[sg];
                var u = partial4[sg + parts];
                for (var j = 1u; j < parts; j++) {
                    g += partial4[sg + j];
                    u += partial4[sg + parts + j];
                }
                for (var r = 0u; r < min(4u, p.rows - row0); r++) {
                    out[a * p.rows + row0 + r] = silu(g[r]) * u[r];
                }
            }
            workgroupBarrier();
        }
        return;
    }
    for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        let g = subgroupAdd(pool_rows4(p.w, base + row0, nrows, xb, lane, lanes));
        let u = subgroupAdd(pool_rows4(p.w, base + p.rows + row0, nrows, xb, lane, lanes));
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                out[a * p.rows + row0 + r] = silu(g[r]) * u[r];
            }
        }
    }
}

@compute @workgroup_size(128)
fn moe_down(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let a = p.asg_off + wid.y;
    let slot = assignment_slot(a, li);
    if (slot == NO_SLOT) {
        return;
    }
    let xb = a * (p.x_cols / 4u);
    let base = slot * p.rows;
    let dst = a * p.out_cols;
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        let total = subgroupAdd(pool_rows4(p.w, base + row0, nrows, xb, lane, lanes));
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                out[dst + row0 + r] = total[r];
            }
        }
    }
}

@compute @workgroup_size(256)
fn moe_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    if (i < p.n) {
        let t = i / p.out_cols;
        let j = i % p.out_cols;
        var acc = 0.0;
        for (var r = 0u; r < p.top_k; r++) {
            let wr = bitcast<f32>(routes[t * 2u * p.top_k + p.top_k + r]);
            let k = (t * p.top_k + r) * p.out_cols + j;
            acc += wr * vals[k];
        }
        out[i] = acc;
    }
}

// 256 wide: with 32-lane subgroups, one rank per subgroup for a top-8.
@compute @workgroup_size(256)
fn moe_down_combine(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let t = p.asg_off + wid.y;
    let rbase = t * 2u * p.top_k;
    if (li < p.top_k) {
        let id = routes[rbase + li];
        var slot = NO_SLOT;
        if (id < p.experts) {
            slot = table[p.key_base + id];
        }
        if (slot < p.slot_base || slot >= p.slot_end) {
            slot = NO_SLOT;
        }
        wg_slots[li] = slot;
    }
    workgroupBarrier();
    // One quad of output rows per workgroup; its subgroups share the ranks
    // (subgroup s takes ranks s, s + nsg, ...) and their weighted partial
    // sums are added in subgroup order.
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wid.x; qi < quads; qi += nwg.x) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        var acc = vec4<f32>(0.0);
        for (var k = sg; k < p.top_k; k += nsg) {
            // The same for every invocation of the subgroup (written before the barrier).
            let slot = wg_slots[k];
            if (slot != NO_SLOT) {
                let a = t * p.top_k + k;
                let d = subgroupAdd(pool_rows4(p.w, (slot - p.slot_base) * p.rows + row0, nrows, a * (p.x_cols / 4u), lane, lanes));
                acc += bitcast<f32>(routes[rbase + p.top_k + k]) * d;
            }
        }
        if (lane == 0u) {
            partial4[sg] = acc;
        }
        workgroupBarrier();
        if (li == 0u) {
            var total = vec4<f32>(0.0);
            for (var j = 0u; j < nsg; j++) {
                total += partial4[j];
            }
            for (var r = 0u; r < nrows; r++) {
                out[t * p.out_cols + row0 + r] = total[r];
            }
        }
        workgroupBarrier();
    }
}
