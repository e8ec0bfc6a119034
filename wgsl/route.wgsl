// Routing on the device (after moe_common.wgsl; parameters there):
//
//   moe_route:   one workgroup per token: softmax over the token's `experts`
//                router logits (vals), the `top_k` largest kept (highest logit
//                first, ties to the lower id), renormalised when `normalize`;
//                writes routes[t] = top_k ids, then top_k weights (f32 bits).
//   moe_route_matmul: moe_route of the logits x[t] . W (the router's rows, then
//                optional extra rows written to out), in one dispatch.
//   moe_route_norm: moe_route_matmul of norm(base + addend) (the residual add
//                and RMSNorm before the MoE block, with weight nw and `eps`):
//                writes the sum to `sum` and the normed row to xin, which the
//                router's product then reads (so xin is read-write here).
//                An 8-bit affine router multiplies (base + addend) * nw
//                instead, its loads issued with the norm's, and scales the
//                rows by the norm's 1 / rms after.
//   moe_route_norm_q8: moe_route_norm of an 8-bit affine router of at most
//                a subgroup's width of experts (routed in one subgroup).
//   moe_route_norm_wide: moe_route_norm of one token over several workgroups
//                (an 8-bit affine router; Vulkan, see below): workgroup g
//                takes router quads [g * parts, (g + 1) * parts), each forms
//                the norm itself (workgroup 0 writes sum and xin), stores its
//                logits as atomics and counts itself done; the last one
//                routes and sets the count back to zero.
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (the router); 2 xin f32 rows
// of x_cols (read-write); 3 out f32 (extra rows; read-write); 4 routes u32
// [tokens, 2*top_k] (read-write); 9 vals f32 (moe_route's logits);
// moe_route_norm: 10 base, 11 addend [tokens, x_cols], 12 nw [x_cols], 13 sum
// [tokens, x_cols] (read-write); moe_route_norm_wide also 14 logits [experts]
// and 15 counts (word 0: zero between dispatches), both atomics.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read_write> xin: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> routes: array<u32>;
@group(0) @binding(9) var<storage, read> vals: array<f32>;
@group(0) @binding(10) var<storage, read> base: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read> addend: array<vec4<f32>>;
@group(0) @binding(12) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(13) var<storage, read_write> sum: array<vec4<f32>>;
@group(0) @binding(14) var<storage, read_write> logits: array<atomic<u32>>;
@group(0) @binding(15) var<storage, read_write> counts: array<atomic<u32>>;

var<workgroup> chosen: array<u32, 64>;
var<workgroup> chosen_w: array<f32, 64>;
// The token's logits, when there are at most ROW_CACHE experts.
const ROW_CACHE: u32 = 1024u;
var<workgroup> row: array<f32, 1024>;

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
    size: u32,
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
    @builtin(subgroup_size) lanes: u32,
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
    route_token(t, li, cached, Lanes(sg, nsg, lane, lanes));
}

// The router's product and the routing of token t: `row[e]` = router row
// e . x[t] for the first `experts` of the weight's `rows` rows (at most
// ROW_CACHE); the rows after them (a shared expert's gate) go to
// out[t * out_cols + r - experts]. One subgroup per four rows, as matvec.
fn route_product(t: u32, li: u32, sg: u32, nsg: u32, lane: u32, lanes: u32) {
    let quads = (p.rows + 3u) / 4u;
    let xb = t * (p.x_cols / 4u);
    // Subgroups left over from one per quad share a quad's columns: part
    // `part` of `parts` takes chunks part*lanes + lane, stepping parts*lanes.
    let parts = quad_parts(nsg);
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
    route_partials(t, li, parts, 1.0, Lanes(sg, nsg, lane, lanes));
}

// The router's rows from the subgroups' partial sums (`parts` per quad, in
// partial4, visible to the workgroup), times `scale`, then the routing.
fn route_partials(t: u32, li: u32, parts: u32, scale: f32, ln: Lanes) {
    route_logits(t, li, parts, scale);
    if (p.route_lanes != 0u && p.experts <= ln.size) {
        if (ln.sg == 0u) {
            route_token_lanes(t, ln.lane);
        }
        return;
    }
    route_token(t, li, true, ln);
}

// route_partials' rows: the logits to `row` (the extra rows to out), visible
// to the workgroup when it returns.
fn route_logits(t: u32, li: u32, parts: u32, scale: f32) {
    for (var e = li; e < p.rows; e += 256u) {
        let qi = e / 4u;
        var v = 0.0;
        for (var part = 0u; part < parts; part++) {
            v += partial4[qi * parts + part][e % 4u];
        }
        v *= scale;
        if (e < p.experts) {
            row[e] = v;
        } else {
            out[t * p.out_cols + e - p.experts] = v;
        }
    }
    workgroupBarrier();
}

// route_token of at most one subgroup's width of experts (their logits in
// `row`) in subgroup 0 alone, lane e taking expert e: subgroup reductions
// instead of workgroup ones, and each of the top_k lanes writes its rank.
// The same results as route_token: the same max, the same sum (the other
// lanes add zeros there too), the same ranks, the weights summed in rank
// order (NaN logits aside, which tie for a rank there).
fn route_token_lanes(t: u32, lane: u32) {
    let has = lane < p.experts;
    var v = -3.4028235e38;
    if (has) {
        v = row[lane];
    }
    // NaN logits take no part in the max.
    let mx = subgroupMax(select(-3.4028235e38, v, has && v > -3.4028235e38));
    let total = subgroupAdd(select(0.0, exp(v - mx), has));
    var rank = p.top_k;
    if (has) {
        rank = 0u;
        for (var o = 0u; o < p.experts && rank < p.top_k; o++) {
            if (better(row[o], o, v, lane)) {
                rank++;
            }
        }
    }
    let w = exp(v - mx) / total;
    // Lane r < top_k takes rank r's expert ("no expert", weight 0, when NaN
    // logits leave it unfilled).
    var id = NO_SLOT;
    var wr = 0.0;
    for (var o = 0u; o < p.experts; o++) {
        let ro = subgroupShuffle(rank, o);
        let wo = subgroupShuffle(w, o);
        if (ro == lane) {
            id = o;
            wr = wo;
        }
    }
    var sum = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        sum += subgroupShuffle(wr, j);
    }
    if (lane < p.top_k) {
        if (p.normalize != 0u) {
            wr = wr / sum;
        }
        let base = t * 2u * p.top_k;
        routes[base + lane] = id;
        routes[base + p.top_k + lane] = bitcast<u32>(wr);
    }
}

// Subgroups' share of the quads of router rows, as route_product.
fn quad_parts(nsg: u32) -> u32 {
    return max(1u, nsg / ((p.rows + 3u) / 4u));
}

// moe_route_norm's product for an 8-bit affine router: router quads
// [q0, q0 + nq) times the un-normed y = (base + addend) * nw of token t,
// into partial4 (max(1, nsg / nq) subgroups per quad, from index 0).
// The norm's 1 / rms is a common factor of each row's sum, applied after
// (route_partials), so these loads go out with the norm's instead of
// waiting for its reduction.
fn route_product_unscaled(t: u32, sg: u32, nsg: u32, lane: u32, lanes: u32, q0: u32, nq: u32) {
    let d = p.w;
    let parts = max(1u, nsg / nq);
    let xb = t * (p.x_cols / 4u);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    for (var k = sg; k < nq * parts; k += nsg) {
        let row0 = (q0 + k / parts) * 4u;
        let last = min(row0 + 3u, p.rows - 1u);
        let rows = min(vec4<u32>(row0, row0 + 1u, row0 + 2u, row0 + 3u), vec4<u32>(last));
        var acc = vec4<f32>(0.0);
        for (var c = (k % parts) * lanes + lane; c < chunks; c += parts * lanes) {
            let i = xb + c * 4u;
            let n = c * 4u;
            acc += q8_step4(d, rows, chunks, c, (c * 16u) >> gshift, gpr,
                (base[i] + addend[i]) * nw[n], (base[i + 1u] + addend[i + 1u]) * nw[n + 1u],
                (base[i + 2u] + addend[i + 2u]) * nw[n + 2u], (base[i + 3u] + addend[i + 3u]) * nw[n + 3u]);
        }
        let total = subgroupAdd(acc);
        if (lane == 0u) {
            partial4[k] = total;
        }
    }
}

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
    if (t < p.n) {
        route_product(t, li, sg, nsg, lane, lanes);
    }
}

// Runs of four values of a row that each invocation of moe_route_norm keeps
// in registers (rows of up to 4 * 256 * NORM_RUNS values).
const NORM_RUNS: u32 = 4u;

// The residual sum and norm of token t (as norm.wgsl's add_rms_norm), the
// row kept in registers: with nq > 0 the unscaled router product of quads
// [q0, q0 + nq) runs between the row's loads and its reduction, so their
// loads go out together. When `writes`, the sum goes to `sum` and the normed
// row to xin. Returns 1 / rms.
fn route_norm_row(t: u32, li: u32, sg: u32, nsg: u32, lane: u32, lanes: u32, q0: u32, nq: u32, writes: bool) -> f32 {
    let runs = p.x_cols / 4u;
    let rb = t * runs;
    var v: array<vec4<f32>, 4>;
    var wv: array<vec4<f32>, 4>;
    var ss = 0.0;
    for (var k = 0u; k < NORM_RUNS; k++) {
        let i = li + k * 256u;
        if (i < runs) {
            v[k] = base[rb + i] + addend[rb + i];
            wv[k] = nw[i];
        }
    }
    if (nq > 0u) {
        route_product_unscaled(t, sg, nsg, lane, lanes, q0, nq);
    }
    for (var k = 0u; k < NORM_RUNS; k++) {
        let i = li + k * 256u;
        if (i < runs) {
            if (writes) {
                sum[rb + i] = v[k];
            }
            ss += dot(v[k], v[k]);
        }
    }
    let rr = 1.0 / sqrt(reduce_sum(ss, sg, nsg, lane) / f32(p.x_cols) + p.eps);
    if (writes) {
        for (var k = 0u; k < NORM_RUNS; k++) {
            let i = li + k * 256u;
            if (i < runs) {
                xin[rb + i] = v[k] * rr * wv[k];
            }
        }
    }
    return rr;
}

// moe_route_matmul of the normed sum: route_norm_row, then the router's
// product (an 8-bit affine router's, unscaled, inside it; otherwise after,
// reading the normed row back from xin).
@compute @workgroup_size(256)
fn moe_route_norm(
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
    let unscaled = p.w.fmt == 3u && p.w.bits == 8u;
    let quads = (p.rows + 3u) / 4u;
    let rr = route_norm_row(t, li, sg, nsg, lane, lanes, 0u, select(0u, quads, unscaled), true);
    if (unscaled) {
        // reduce_sum's barriers made partial4 visible.
        route_partials(t, li, quad_parts(nsg), rr, Lanes(sg, nsg, lane, lanes));
        return;
    }
    // The normed row, written above, is what the router's product reads.
    storageBarrier();
    workgroupBarrier();
    route_product(t, li, sg, nsg, lane, lanes);
}

// moe_route_norm of an 8-bit affine router of at most a subgroup's width of
// experts, routed in one subgroup: that path alone, a smaller kernel (the
// paths it leaves out made moe_route_norm ~4% slower on an H200).
@compute @workgroup_size(256)
fn moe_route_norm_q8(
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
    let rr = route_norm_row(t, li, sg, nsg, lane, lanes, 0u, (p.rows + 3u) / 4u, true);
    // reduce_sum's barriers made partial4 visible.
    route_logits(t, li, quad_parts(nsg), rr);
    if (sg == 0u) {
        route_token_lanes(t, lane);
    }
}

// Whether this workgroup of moe_route_norm_wide counted itself last.
var<workgroup> route_last: u32;

// moe_route_norm_wide (see the top): the ordering rests on storageBarrier
// having device scope, as naga emits it for Vulkan; Metal runs
// moe_route_norm instead.
@compute @workgroup_size(256)
fn moe_route_norm_wide(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let quads = (p.rows + 3u) / 4u;
    let q0 = wid.x * p.parts;
    let nq = min(p.parts, quads - min(q0, quads));
    if (nq == 0u) {
        return;
    }
    let rr = route_norm_row(0u, li, sg, nsg, lane, lanes, q0, nq, wid.x == 0u);
    // This workgroup's rows: the router's logits, or extra rows (to out).
    let parts = max(1u, nsg / nq);
    for (var e = li; e < nq * 4u; e += 256u) {
        let r = q0 * 4u + e;
        if (r < p.rows) {
            var v = 0.0;
            for (var part = 0u; part < parts; part++) {
                v += partial4[(e / 4u) * parts + part][e % 4u];
            }
            v *= rr;
            if (r < p.experts) {
                atomicStore(&logits[r], bitcast<u32>(v));
            } else {
                out[r - p.experts] = v;
            }
        }
    }
    // Releases this workgroup's logits before it is counted.
    storageBarrier();
    if (li == 0u) {
        route_last = u32(atomicAdd(&counts[0], 1u) + 1u == nwg.x);
    }
    if (workgroupUniformLoad(&route_last) == 0u) {
        return;
    }
    // Acquires the other workgroups' logits.
    storageBarrier();
    for (var e = li; e < p.experts; e += 256u) {
        row[e] = bitcast<f32>(atomicLoad(&logits[e]));
    }
    workgroupBarrier();
    route_token(0u, li, true, Lanes(sg, nsg, lane, lanes));
    if (li == 0u) {
        atomicStore(&counts[0], 0u);
    }
}
