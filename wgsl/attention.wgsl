// attention: causal grouped-query softmax attention against the KV cache, one
// 256-wide workgroup per (token, head); the new keys/values are already appended.
// Query t (at position past + t) sees cache positions 0..=past + t; head h
// reads kv head h / (heads / kv_heads). Scores go to a scratch row of
// `scratch_stride` floats per (token, head); three phases: scores (one
// subgroup per key, lanes over the head dim, q staged in workgroup memory),
// exponentials and sum, weighted sum of values (one thread per head-dim
// value). Serves decode (tokens = 1) and causal prefill alike; head_dim <= 512.
//
// attention_sparse: the same for QSA key selection; only the selected keys are
// visited. Query t's row of `sel` (`sel_stride` words at t * sel_stride) is
// either [DENSE, ..] (attend causally to every key, as `attention`) or
// [count, b_0 .. b_{count-1}, ..]: `count` distinct blocks of `block` keys,
// each wholly before the query's own block (the host drops UNUSED entries,
// duplicates and blocks that are not), followed by the query's trailing
// partial block, keys ((pos+1)/block)*block ..= pos. Score slot i of the
// scratch row holds key b_{i/block}*block + i%block for i < count*block, then
// the trailing keys in order. A query that sees no key gives zeros.
//
// Bindings: 0 uniform Params; 2 q [tokens, heads*head_dim]; 3 out (read-write,
// same shape); 4 keys, 5 values [positions, kv_heads*head_dim];
// 6 scratch [tokens*heads, scratch_stride] (read-write);
// 7 sel [tokens, sel_stride] u32 (attention_sparse).

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    past: u32,
    scratch_stride: u32,
    scale: f32,
    block: u32,
    sel_stride: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> keys: array<f32>;
@group(0) @binding(5) var<storage, read> values: array<f32>;
@group(0) @binding(6) var<storage, read_write> scratch: array<f32>;
@group(0) @binding(7) var<storage, read> sel: array<u32>;

const DENSE: u32 = 0xfffffffeu;

const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;
var<workgroup> q_sh: array<f32, 512>;

fn reduce_max(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] = max(red[li], red[li + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] = red[li] + red[li + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn attention(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let th = wid.y * nwg.x + wid.x;
    if (th >= p.tokens * p.heads) {
        return;
    }
    let t = th / p.heads;
    let h = th % p.heads;
    let kh = h / (p.heads / p.kv_heads);
    let hd = p.head_dim;
    let kv_cols = p.kv_heads * hd;
    let visible = p.past + t + 1u;
    let qb = (t * p.heads + h) * hd;
    let sb = th * p.scratch_stride;
    for (var d = li; d < hd; d += WG) {
        q_sh[d] = q[qb + d];
    }
    workgroupBarrier();

    for (var j = sg; j < visible; j += nsg) {
        let kb = j * kv_cols + kh * hd;
        var s = 0.0;
        for (var d = lane; d < hd; d += lanes) {
            s += q_sh[d] * keys[kb + d];
        }
        s = subgroupAdd(s);
        if (lane == 0u) {
            scratch[sb + j] = s * p.scale;
        }
    }
    storageBarrier();
    workgroupBarrier();

    var m = -3.0e38;
    for (var j = li; j < visible; j += WG) {
        m = max(m, scratch[sb + j]);
    }
    m = reduce_max(m, li);

    var total = 0.0;
    for (var j = li; j < visible; j += WG) {
        let e = exp(scratch[sb + j] - m);
        scratch[sb + j] = e;
        total += e;
    }
    total = reduce_sum(total, li);
    storageBarrier();

    for (var d = li; d < hd; d += WG) {
        var acc = 0.0;
        for (var j = 0u; j < visible; j++) {
            acc += scratch[sb + j] * values[j * kv_cols + kh * hd + d];
        }
        out[qb + d] = acc / total;
    }
}

@compute @workgroup_size(256)
fn attention_sparse(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let th = wid.y * nwg.x + wid.x;
    if (th >= p.tokens * p.heads) {
        return;
    }
    let t = th / p.heads;
    let h = th % p.heads;
    let kh = h / (p.heads / p.kv_heads);
    let hd = p.head_dim;
    let kv_cols = p.kv_heads * hd;
    let pos = p.past + t;
    let row = t * p.sel_stride;
    // A dense query is the empty block list followed by the "tail" 0..=pos.
    var count = 0u;
    var tail = 0u;
    if (sel[row] != DENSE) {
        count = sel[row];
        tail = (pos + 1u) / p.block * p.block;
    }
    let listed = count * p.block;
    let n_keys = listed + pos + 1u - tail;
    let qb = (t * p.heads + h) * hd;
    let sb = th * p.scratch_stride;
    for (var d = li; d < hd; d += WG) {
        q_sh[d] = q[qb + d];
    }
    workgroupBarrier();

    for (var i = sg; i < n_keys; i += nsg) {
        var j = tail + i - listed;
        if (i < listed) {
            j = sel[row + 1u + i / p.block] * p.block + i % p.block;
        }
        let kb = j * kv_cols + kh * hd;
        var s = 0.0;
        for (var d = lane; d < hd; d += lanes) {
            s += q_sh[d] * keys[kb + d];
        }
        s = subgroupAdd(s);
        if (lane == 0u) {
            scratch[sb + i] = s * p.scale;
        }
    }
    storageBarrier();
    workgroupBarrier();

    var m = -3.0e38;
    for (var i = li; i < n_keys; i += WG) {
        m = max(m, scratch[sb + i]);
    }
    m = reduce_max(m, li);

    var total = 0.0;
    for (var i = li; i < n_keys; i += WG) {
        let e = exp(scratch[sb + i] - m);
        scratch[sb + i] = e;
        total += e;
    }
    total = reduce_sum(total, li);
    storageBarrier();

    for (var d = li; d < hd; d += WG) {
        let vd = kh * hd + d;
        var acc = 0.0;
        var i = 0u;
        for (var e = 0u; e < count; e++) {
            let k0 = sel[row + 1u + e] * p.block;
            for (var o = 0u; o < p.block; o++) {
                acc += scratch[sb + i] * values[(k0 + o) * kv_cols + vd];
                i++;
            }
        }
        for (var j = tail; j <= pos; j++) {
            acc += scratch[sb + i] * values[j * kv_cols + vd];
            i++;
        }
        out[qb + d] = select(acc / total, 0.0, n_keys == 0u);
    }
}
