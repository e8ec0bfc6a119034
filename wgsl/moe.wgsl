// Mixture of experts on the device: the pool's slot table, and the expert
// FFN `down(silu(gate x) * up x)` read straight from the slot pool (4-bit
// slots with 16-bit scales interleaved as standalone weights are, see
// weights.wgsl); routing is in route.wgsl. Parameters: moe_common.wgsl.
//
//   moe_map:     table[entries[i].x] = entries[i].y for i < n (the slot table).
//   moe_gate_up: out[a, r] = silu(gate[slot] row r . x[token]) * (up[slot] row r . x[token]),
//                gate and up side by side in one pool matrix: gate rows 0..rows, up rows rows..2*rows;
//                with `parts` > 1, a quad's gate rows and up rows each shared by that many subgroups
//   moe_down:    out[a, r] = down[slot] row r . x[a]  (x = activations)
//   moe_combine: out[t, j] = sum_r weight[t, r] * vals[(t*top_k + r)*out_cols + j], rank order
//   moe_down_combine: out[t, r] = sum_k weight[t, k] * (down[slot of (t, k)] row r . x[t*top_k + k]),
//                plus, with a shared expert, sigmoid(vals[t * gate_cols]) * (its down row r . x[n*top_k + t]),
//                moe_down then moe_combine in one dispatch (one pool shard; workgroup_id.y
//                is the token, each workgroup one quad of rows, its subgroups sharing the ranks)
// For the FFN kernels, assignment a = asg_off + workgroup_id.y < n * top_k
// (n tokens) is token a / top_k's rank a % top_k; its slot is
// table[key_base + id] for the routed id, and the workgroup does nothing when
// that is not a slot of this dispatch's pool shard [slot_base, slot_end) (or
// the id is not an expert). With a shared expert (shared_key is not NO_SLOT),
// assignment n * top_k + t is token t's shared expert, in slot
// table[shared_key]: moe_gate_up computes its activations there and
// moe_down_combine adds it after token t's routed ranks, weighted by
// sigmoid(vals[t * gate_cols]).
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (one pool shard of gate, up or down; slot s of
// the shard is rows [s*rows, (s+1)*rows)); 2 xin f32 rows of x_cols; 3 out f32
// (read-write); 4 routes u32 [tokens, 2*top_k] (as route.wgsl writes them);
// 7 table u32 (read-write for moe_map); 8 entries vec2<u32> (moe_map); 9 vals f32
// (moe_combine's expert outputs).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> routes: array<u32>;
@group(0) @binding(7) var<storage, read_write> table: array<u32>;
@group(0) @binding(8) var<storage, read> entries: array<vec2<u32>>;
@group(0) @binding(9) var<storage, read> vals: array<f32>;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

var<workgroup> wg_slot: u32;
var<workgroup> wg_slots: array<u32, 64>;

@compute @workgroup_size(64)
fn moe_map(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.n) {
        let e = entries[gid.x];
        table[e.x] = e.y;
    }
}

// The token of assignment `a` (a routed rank or a shared expert).
fn assignment_token(a: u32) -> u32 {
    let routed = p.n * p.top_k;
    if (a >= routed) {
        return a - routed;
    }
    return a / p.top_k;
}

// The slot of rank `k` of token `t` (k == top_k: the shared expert), or
// NO_SLOT when it is in no slot of this dispatch's shard.
fn rank_slot(t: u32, k: u32) -> u32 {
    var slot = NO_SLOT;
    if (k < p.top_k) {
        let id = routes[t * 2u * p.top_k + k];
        if (id < p.experts) {
            slot = table[p.key_base + id];
        }
    } else if (p.shared_key != NO_SLOT) {
        slot = table[p.shared_key];
    }
    if (slot < p.slot_base || slot >= p.slot_end) {
        slot = NO_SLOT;
    }
    return slot;
}

// The slot of assignment `a`, local to this dispatch's shard, or NO_SLOT;
// uniform across the workgroup.
fn assignment_slot(a: u32, li: u32) -> u32 {
    if (li == 0u) {
        let t = assignment_token(a);
        wg_slot = rank_slot(t, select(a % p.top_k, p.top_k, a >= p.n * p.top_k));
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
    let xb = assignment_token(a) * (p.x_cols / 4u);
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

// pool_rows4 with one copy of the interleaved product, the scales' kind
// read at run time: moe_down_combine ran 8-15% faster on an H200 with it
// than with pool_rows4's two copies (moe_gate_up slower, so it keeps those).
fn pool_rows4_one(d: WeightDesc, row0: u32, nrows: u32, xb: u32, lane: u32, lanes: u32) -> vec4<f32> {
    if (d.fmt == 4u) {
        return rows4_q4i(d, row0, nrows, xb, lane, lanes, d.scale_kind == 1u);
    }
    return rows_dot(d, row0, nrows, xb, lane, lanes);
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
    // The routed ranks, then the shared expert's.
    let ranks = p.top_k + select(0u, 1u, p.shared_key != NO_SLOT);
    if (li < ranks) {
        wg_slots[li] = rank_slot(t, li);
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
        for (var k = sg; k < ranks; k += nsg) {
            // The same for every invocation of the subgroup (written before the barrier).
            let slot = wg_slots[k];
            if (slot != NO_SLOT) {
                let is_shared = k == p.top_k;
                let a = select(t * p.top_k + k, p.n * p.top_k + t, is_shared);
                let d = subgroupAdd(pool_rows4_one(p.w, (slot - p.slot_base) * p.rows + row0, nrows, a * (p.x_cols / 4u), lane, lanes));
                if (is_shared) {
                    acc += (1.0 / (1.0 + exp(-vals[t * p.gate_cols]))) * d;
                } else {
                    acc += bitcast<f32>(routes[rbase + p.top_k + k]) * d;
                }
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
