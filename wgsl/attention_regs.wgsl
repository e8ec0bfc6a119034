// attention_split_regs, attention_split_rope_regs: attention_split and
// attention_split_rope (appended to attention.wgsl, same Params and
// bindings, same partials, same merge) for chunks small enough to hold in registers:
// at most REG_KEYS keys per subgroup and a head dim of four or eight values
// per lane. Subgroup s takes keys first + s + u*nsg (u < REG_KEYS), lane l
// dims 4l..4l+3 (and 4*lanes + 4l.. for the second run of eight per lane).
// Every key and value load is issued before the query is staged, so a chunk
// costs one round trip to memory where attention_split waits for the staged
// query before its key loads and for the softmax before its value loads.
// Scores, exponentials and weighted values stay in registers; the
// subgroups' weighted sums are added in subgroup order in workgroup memory.
// Other chunks (larger, or head dims of another shape) take attend_split.

const REG_KEYS: u32 = 4u;
// Each subgroup's weighted values (WG / lanes subgroups x head_dim / 4 runs of
// four; at most 512 for head dims up to 8 values per lane).
var<workgroup> acc_sh: array<vec4<f32>, 512>;

// One key slot of a subgroup: its key and value runs, and whether it is a
// key of the chunk.
struct KeyRegs {
    k0: vec4<f32>,
    k1: vec4<f32>,
    v0: vec4<f32>,
    v1: vec4<f32>,
    j: u32,
    valid: bool,
}

fn row4(buf_keys: bool, j: u32, at: u32) -> vec4<f32> {
    if (p.fresh != 0u && j >= p.past) {
        let i = (j - p.past) * p.kv_heads * p.head_dim + at;
        if (buf_keys) {
            return vec4<f32>(knew[i], knew[i + 1u], knew[i + 2u], knew[i + 3u]);
        }
        return vec4<f32>(vnew[i], vnew[i + 1u], vnew[i + 2u], vnew[i + 3u]);
    }
    let i = j * p.kv_heads * p.head_dim + at;
    if (p.kv == 2u) {
        return q8_run(buf_keys, i / p.head_dim, i % p.head_dim);
    }
    if (p.kv == 1u) {
        // `at` is a multiple of four: two whole words.
        var w = vec2<u32>(values[i / 2u], values[i / 2u + 1u]);
        if (buf_keys) {
            w = vec2<u32>(keys[i / 2u], keys[i / 2u + 1u]);
        }
        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    }
    if (buf_keys) {
        return bitcast<vec4<f32>>(vec4<u32>(keys[i], keys[i + 1u], keys[i + 2u], keys[i + 3u]));
    }
    return bitcast<vec4<f32>>(vec4<u32>(values[i], values[i + 1u], values[i + 2u], values[i + 3u]));
}

// Key slot `i` of the query's key list (see attention.wgsl's selection), its
// key and value runs at dims `d0` and `d1` (second run when `two`).
fn key_regs(i: u32, end: u32, row: u32, listed: u32, tail: u32, kb: u32, d0: u32, d1: u32, two: bool) -> KeyRegs {
    var r = KeyRegs(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), 0u, false);
    if (i >= end) {
        return r;
    }
    var j = tail + i - listed;
    if (i < listed) {
        j = sel[row + 1u + i / p.block] * p.block + i % p.block;
    }
    r.j = j;
    r.valid = true;
    r.k0 = row4(true, j, kb + d0);
    r.v0 = row4(false, j, kb + d0);
    if (two) {
        r.k1 = row4(true, j, kb + d1);
        r.v1 = row4(false, j, kb + d1);
    }
    return r;
}

// The scaled score of a key slot (NO_SCORE when it holds no key); the fresh
// key of a `rope` kernel is the staged one in q_sh[KN..].
fn slot_score(r: KeyRegs, qa: vec4<f32>, qb: vec4<f32>, d0: u32, d1: u32, two: bool) -> f32 {
    var ka = r.k0;
    var kb = r.k1;
    if (p.rope != 0u && p.fresh != 0u && r.j >= p.past) {
        ka = vec4<f32>(q_sh[KN + d0], q_sh[KN + d0 + 1u], q_sh[KN + d0 + 2u], q_sh[KN + d0 + 3u]);
        if (two) {
            kb = vec4<f32>(q_sh[KN + d1], q_sh[KN + d1 + 1u], q_sh[KN + d1 + 2u], q_sh[KN + d1 + 3u]);
        }
    }
    let s = subgroupAdd(dot(qa, ka) + dot(qb, kb)) * p.scale;
    return select(NO_SCORE, s, r.valid);
}

fn attend_split_regs(g: u32, li: u32, sg: u32, nsg: u32, lane: u32, lanes: u32, rope: bool) {
    if (g >= p.tokens * p.heads * p.splits) {
        return;
    }
    let hd = p.head_dim;
    let th = g / p.splits;
    let c = g % p.splits;
    let t = th / p.heads;
    let pos = p.past + t;
    let row = t * p.sel_stride;
    var count = 0u;
    var tail = 0u;
    // Block 0 is plain causal attention (selections have blocks of at
    // least one key): no selection row to wait for.
    if (p.block != 0u && sel[row] != DENSE) {
        count = sel[row];
        tail = (pos + 1u) / p.block * p.block;
    }
    let listed = count * p.block;
    let n_keys = listed + pos + 1u - tail;
    let first = min(c * p.chunk, n_keys);
    let end = min(first + p.chunk, n_keys);
    let two = hd == 8u * lanes;
    if ((hd != 4u * lanes && !two) || end - first > REG_KEYS * nsg) {
        attend_split(g, li, sg, nsg, lane, lanes, rope);
        return;
    }
    let kb = ((th % p.heads) / (p.heads / p.kv_heads)) * hd;
    let d0 = 4u * lane;
    let d1 = 4u * lanes + 4u * lane;
    let i0 = first + sg;
    let r0 = key_regs(i0, end, row, listed, tail, kb, d0, d1, two);
    let r1 = key_regs(i0 + nsg, end, row, listed, tail, kb, d0, d1, two);
    let r2 = key_regs(i0 + 2u * nsg, end, row, listed, tail, kb, d0, d1, two);
    let r3 = key_regs(i0 + 3u * nsg, end, row, listed, tail, kb, d0, d1, two);
    stage(g, li, sg, nsg, lane, rope);
    store_fresh(g, li);

    let qa = vec4<f32>(q_sh[d0], q_sh[d0 + 1u], q_sh[d0 + 2u], q_sh[d0 + 3u]);
    var qb = vec4<f32>(0.0);
    if (two) {
        qb = vec4<f32>(q_sh[d1], q_sh[d1 + 1u], q_sh[d1 + 2u], q_sh[d1 + 3u]);
    }
    let s0 = slot_score(r0, qa, qb, d0, d1, two);
    let s1 = slot_score(r1, qa, qb, d0, d1, two);
    let s2 = slot_score(r2, qa, qb, d0, d1, two);
    let s3 = slot_score(r3, qa, qb, d0, d1, two);
    let m = reduce_max(max(max(s0, s1), max(s2, s3)), sg, nsg, lane);
    let e = vec4<f32>(
        select(0.0, exp(s0 - m), r0.valid),
        select(0.0, exp(s1 - m), r1.valid),
        select(0.0, exp(s2 - m), r2.valid),
        select(0.0, exp(s3 - m), r3.valid));
    // Every lane of a subgroup holds its slots' exponentials: lane 0 counts them.
    let l = reduce_sum(select(0.0, (e.x + e.y) + (e.z + e.w), lane == 0u), sg, nsg, lane);
    let runs = hd / 4u;
    acc_sh[sg * runs + lane] = ((e.x * r0.v0 + e.y * r1.v0) + e.z * r2.v0) + e.w * r3.v0;
    if (two) {
        acc_sh[sg * runs + lanes + lane] = ((e.x * r0.v1 + e.y * r1.v1) + e.z * r2.v1) + e.w * r3.v1;
    }
    workgroupBarrier();
    let pb = g * (hd + 2u);
    if (li == 0u) {
        put_partial(pb, m);
        put_partial(pb + 1u, l);
    }
    if (li < runs) {
        var total = acc_sh[li];
        for (var s = 1u; s < nsg; s++) {
            total += acc_sh[s * runs + li];
        }
        let o = pb + 2u + 4u * li;
        put_partial(o, total.x);
        put_partial(o + 1u, total.y);
        put_partial(o + 2u, total.z);
        put_partial(o + 3u, total.w);
    }
}

@compute @workgroup_size(256)
fn attention_split_regs(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let g = wid.y * nwg.x + wid.x;
    attend_split_regs(g, li, sg, nsg, lane, lanes, false);
    merge_if_last(g, li);
}

@compute @workgroup_size(256)
fn attention_split_rope_regs(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let g = wid.y * nwg.x + wid.x;
    attend_split_regs(g, li, sg, nsg, lane, lanes, true);
    merge_if_last(g, li);
}
