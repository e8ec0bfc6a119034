// attention: causal grouped-query softmax attention against the KV cache,
// split over the key range ("flash-decoding"); the new keys/values are
// already appended. Query t (at position past + t) sees the keys its row of
// `sel` names (below); head h reads kv head h / (heads / kv_heads).
//
// The keys of each (token, head) are cut into `splits` chunks of `chunk`
// keys; workgroup g (256 wide) takes chunk g % splits of pair g / splits and
// walks it in tiles of 256 keys with an online softmax: scores (one subgroup
// per key, lanes over the head dim, q staged in workgroup memory), the tile's
// max and exponentials, then the weighted values (thread d, or threads d,
// hd + d, .. when the head dim leaves threads over, sum a share of the keys).
// `attention` (splits = 1) writes the normalised output; `attention_split`
// writes a partial [max, sum of exp, unnormalised weighted values] per
// workgroup, and `attention_merge` (one workgroup per pair) rescales and sums
// the splits. With `merge` = 1 the split kernels merge too: each workgroup
// counts itself done in `merge_counts[pair]` and the pair's last one merges
// its splits (then sets the count back to 0 for the next dispatch), so decode
// takes one dispatch instead of two. Partials are atomics, so that a
// workgroup reads what others wrote from device-coherent memory; each
// workgroup's stores are released, and the last one's loads acquired, by
// storageBarrier (device scope on Vulkan; the host enables `merge` only
// there). A query that sees no key gives zeros. head_dim <= 512.
//
// Key selection: query t's row of `sel` (`sel_stride` words at t * sel_stride;
// stride 0: one row shared by all) is either [DENSE, ..] (every key
// 0..=pos, plain causal attention) or [count, b_0 .. b_{count-1}, ..]:
// `count` distinct blocks of `block` keys, each wholly before the query's own
// block (the host drops UNUSED entries, duplicates and blocks that are not),
// followed by the query's trailing partial block, keys
// ((pos+1)/block)*block ..= pos. Key slot i (what the chunks cut) is key
// b_{i/block}*block + i%block for i < count*block, then the trailing keys.
//
// With `fresh` (one token, decode), the token's key and value rows are not in
// the cache yet: attention reads them from knew / vnew, and the first chunk's
// workgroup of the first head of each kv group writes them to the cache at
// position `past` (no other workgroup reads that row from the cache), so the
// append costs no copy and no break in the compute pass.
//
// With `rope` (and `fresh`; the entry points attention_rope and
// attention_split_rope, so that the others carry none of its registers;
// head_dim <= 256, the fresh key staged in the upper half of q_sh), q
// and the new key row are raw projections: each
// workgroup normalises its query head and its kv head's new key row (RMSNorm
// with q_weight / k_weight, eps q_eps / k_eps) and rotates their first
// 2*rope_half values (rotate-half rotary embedding with the angles `cs`
// [tokens, rope_half, (cos, sin)]) as it stages them, as norm.wgsl's
// rms_norm_rope does; the fresh key written to the cache is the rotated one.
//
// A q8 cache (`kv` 2) is flash_attention.wgsl's: each (position, kv head)
// row is head_dim / 4 words of four int8 (the lowest byte first), then
// head_dim / 64 words of two f16 scales (the lower half first), one per block
// of 32 values; a value is its block's scale times its int8. The kernels here
// only read one: the host appends a q8 cache's rows through kv_store_q8
// first and never passes `fresh` with it.
//
// Bindings: 0 uniform Params; 2 q [tokens, heads*head_dim]; 3 out (read-write,
// same shape); 4 keys, 5 values [positions, kv_heads*head_dim] (read-write;
// f32, f16 two to a word or q8, by `kv`);
// 6 partials [tokens*heads*splits, head_dim + 2] (f32 bits in atomics;
// attention_split writes, attention_merge reads); 7 sel u32; 8 knew, 9 vnew
// [1, kv_heads*head_dim]; 10 cs, 11 q_weight, 12 k_weight [head_dim] (rope);
// 13 merge_counts, one word per (token, head) pair (all 0 between
// dispatches; `merge`).

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    past: u32,
    chunk: u32,
    scale: f32,
    block: u32,
    sel_stride: u32,
    splits: u32,
    // 1: the one token's key and value rows are in knew / vnew, not yet in
    // the cache; the kernel reads them there and writes them to the cache.
    fresh: u32,
    // 1: q and the fresh key row are normalised and rotated here (see above).
    rope: u32,
    rope_half: u32,
    q_eps: f32,
    k_eps: f32,
    // 1: the split kernels merge the splits themselves (see above).
    merge: u32,
    // The cache holds 0: f32; 1: f16 (two per word, the lower half first);
    // 2: q8 (above).
    kv: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// The cache's words: f32 bits, or two f16 (`kv` 1), or q8 words (`kv` 2).
@group(0) @binding(4) var<storage, read_write> keys: array<u32>;
@group(0) @binding(5) var<storage, read_write> values: array<u32>;
@group(0) @binding(6) var<storage, read_write> partials: array<atomic<u32>>;
@group(0) @binding(7) var<storage, read> sel: array<u32>;
@group(0) @binding(8) var<storage, read> knew: array<f32>;
@group(0) @binding(9) var<storage, read> vnew: array<f32>;
@group(0) @binding(10) var<storage, read> cs: array<f32>;
@group(0) @binding(11) var<storage, read> q_weight: array<f32>;
@group(0) @binding(12) var<storage, read> k_weight: array<f32>;
@group(0) @binding(13) var<storage, read_write> merge_counts: array<atomic<u32>>;

const DENSE: u32 = 0xfffffffeu;
// Below any score: exp(NO_SCORE - m) is 0 for every real max m.
const NO_SCORE: f32 = -3.0e38;

const WG: u32 = 256u;
const TILE: u32 = 256u;
// Keys per batch of value loads in attend_chunk.
const V_BATCH: u32 = 4u;
var<workgroup> q_sh: array<f32, 512>;
var<workgroup> weight_sh: array<f32, 256>;
var<workgroup> key_sh: array<u32, 256>;
// With `rope` (head_dim <= KN): the fresh key row of the workgroup's kv head,
// normalised and rotated, in q_sh[KN..], so that no entry point needs more
// workgroup memory for it.
const KN: u32 = 256u;

// Element `off` (= kv head * head_dim + d) of key row `j` (the fresh row
// from knew, or with `rope` element d of the staged key in q_sh[KN..]).
fn key_at(j: u32, kv_cols: u32, off: u32, d: u32) -> f32 {
    if (p.fresh != 0u && j >= p.past) {
        if (p.rope != 0u) {
            return q_sh[KN + d];
        }
        return knew[(j - p.past) * kv_cols + off];
    }
    return cached(true, j * kv_cols + off);
}

// Element i (row * head_dim + d, row = position * kv_heads + kv head) of
// the cache's keys or values, as f32, f16 (`kv` 1) or q8 (`kv` 2).
fn cached(is_key: bool, i: u32) -> f32 {
    if (p.kv == 2u) {
        return q8_run(is_key, i / p.head_dim, i % p.head_dim)[i % 4u];
    }
    if (p.kv == 1u) {
        return unpack2x16float(cache_word(is_key, i / 2u))[i % 2u];
    }
    return bitcast<f32>(cache_word(is_key, i));
}

fn cache_word(is_key: bool, i: u32) -> u32 {
    if (is_key) {
        return keys[i];
    }
    return values[i];
}

// Values d - d % 4 .. d - d % 4 + 3 of row `row` of a q8 cache (one word of
// int8 and its block's scale).
fn q8_run(is_key: bool, row: u32, d: u32) -> vec4<f32> {
    let hd = p.head_dim;
    let base = row * (hd / 4u + hd / 64u);
    let w = bitcast<i32>(cache_word(is_key, base + d / 4u));
    let scale = unpack2x16float(cache_word(is_key, base + hd / 4u + d / 64u))[(d / 32u) % 2u];
    return scale * vec4<f32>(f32(extractBits(w, 0u, 8u)), f32(extractBits(w, 8u, 8u)), f32(extractBits(w, 16u, 8u)), f32(extractBits(w, 24u, 8u)));
}

// Stores elements i and (when `two`) i + 1 of a key or value row in the
// cache (f16: i even, and both; never q8).
fn store_pair(is_key: bool, i: u32, v: vec2<f32>, two: bool) {
    if (p.kv == 1u) {
        if (is_key) {
            keys[i / 2u] = pack2x16float(v);
        } else {
            values[i / 2u] = pack2x16float(v);
        }
        return;
    }
    if (is_key) {
        keys[i] = bitcast<u32>(v.x);
        if (two) {
            keys[i + 1u] = bitcast<u32>(v.y);
        }
    } else {
        values[i] = bitcast<u32>(v.x);
        if (two) {
            values[i + 1u] = bitcast<u32>(v.y);
        }
    }
}

fn value_at(j: u32, kv_cols: u32, off: u32) -> f32 {
    if (p.fresh != 0u && j >= p.past) {
        return vnew[(j - p.past) * kv_cols + off];
    }
    return cached(false, j * kv_cols + off);
}

// With `fresh`: workgroup g writes the new key and value rows of its kv head
// to the cache when it holds chunk 0 of the first head of the kv group.
fn store_fresh(g: u32, li: u32) {
    if (p.fresh == 0u) {
        return;
    }
    let th = g / p.splits;
    let h = th % p.heads;
    let group = p.heads / p.kv_heads;
    if (g % p.splits != 0u || h % group != 0u) {
        return;
    }
    let t = th / p.heads;
    let kv_cols = p.kv_heads * p.head_dim;
    let src = t * kv_cols + (h / group) * p.head_dim;
    let dst = (p.past + t) * kv_cols + (h / group) * p.head_dim;
    // Two values per thread, so that an f16 word has one writer (f16 caches
    // have head dims of a multiple of four; f32 ones may be odd).
    for (var d2 = li; d2 < (p.head_dim + 1u) / 2u; d2 += WG) {
        let d = 2u * d2;
        let two = d + 1u < p.head_dim;
        let e = min(d + 1u, p.head_dim - 1u);
        if (p.rope != 0u) {
            store_pair(true, dst + d, vec2<f32>(q_sh[KN + d], q_sh[KN + e]), two);
        } else {
            store_pair(true, dst + d, vec2<f32>(knew[src + d], knew[src + e]), two);
        }
        store_pair(false, dst + d, vec2<f32>(vnew[src + d], vnew[src + e]), two);
    }
}

// What one thread needs to normalise and rotate value d of a staged row:
// its weight, and (within the rotary dims) the partner value's index and
// weight and the angle's cos and sin (sign folded in), all loaded before the
// row's norm is known.
struct RopeTerm {
    w: f32,
    // 1 within the rotary dims.
    rotated: u32,
    j: u32,
    wj: f32,
    c: f32,
    s: f32,
}

fn rope_term(second: bool, t: u32, d: u32) -> RopeTerm {
    let half = p.rope_half;
    var term = RopeTerm(0.0, 0u, d, 0.0, 1.0, 0.0);
    term.w = select(q_weight[d], k_weight[d], second);
    if (d < 2u * half) {
        var j = d + half;
        var a = (t * half + d) * 2u;
        var sign = -1.0;
        if (d >= half) {
            j = d - half;
            a = (t * half + j) * 2u;
            sign = 1.0;
        }
        term.rotated = 1u;
        term.j = j;
        term.wj = select(q_weight[j], k_weight[j], second);
        term.c = cs[a];
        term.s = sign * cs[a + 1u];
    }
    return term;
}

// The normalised (1 / rms r) and rotated value of a staged row (raw values
// `own` at d and `other` at the term's partner), as norm.wgsl's rms_norm_rope
// computes it.
fn rope_out(own: f32, other: f32, r: f32, term: RopeTerm) -> f32 {
    let v = own * r * term.w;
    if (term.rotated == 0u) {
        return v;
    }
    return v * term.c + other * r * term.wj * term.s;
}

// The workgroup sums of a and b (two reductions in one: within each
// subgroup, then over the subgroups in workgroup memory; two barriers).
fn reduce_sum2(a: f32, b: f32, sg: u32, nsg: u32, lane: u32) -> vec2<f32> {
    let s = subgroupAdd(vec2<f32>(a, b));
    if (lane == 0u) {
        red[sg] = s.x;
        red[128u + sg] = s.y;
    }
    workgroupBarrier();
    var r = vec2<f32>(red[0], red[128]);
    for (var i = 1u; i < nsg; i++) {
        r += vec2<f32>(red[i], red[128u + i]);
    }
    workgroupBarrier();
    return r;
}

// Stages workgroup g's query head in q_sh and, with `rope`, its kv head's
// fresh key row in q_sh[KN..], both normalised and rotated: thread li owns values
// li and li + WG (head_dim <= KN: li alone), whose weights and angles it loads
// with the row; one reduction gives both norms.
fn stage(g: u32, li: u32, sg: u32, nsg: u32, lane: u32, rope: bool) {
    let th = g / p.splits;
    let t = th / p.heads;
    let h = th % p.heads;
    let kh = h / (p.heads / p.kv_heads);
    let hd = p.head_dim;
    let qb = (t * p.heads + h) * hd;
    let kb = t * p.kv_heads * hd + kh * hd;
    if (!rope) {
        for (var d = li; d < hd; d += WG) {
            q_sh[d] = q[qb + d];
        }
        workgroupBarrier();
        return;
    }
    let d1 = li + WG;
    let own0 = li < hd;
    let own1 = d1 < hd;
    var q0 = 0.0;
    var q1 = 0.0;
    var k0 = 0.0;
    var k1 = 0.0;
    var tq0 = RopeTerm(0.0, 0u, 0u, 0.0, 1.0, 0.0);
    var tq1 = tq0;
    var tk0 = tq0;
    var tk1 = tq0;
    if (own0) {
        q0 = q[qb + li];
        k0 = knew[kb + li];
        tq0 = rope_term(false, t, li);
        tk0 = rope_term(true, t, li);
        q_sh[li] = q0;
        q_sh[KN + li] = k0;
    }
    if (own1) {
        q1 = q[qb + d1];
        k1 = knew[kb + d1];
        tq1 = rope_term(false, t, d1);
        tk1 = rope_term(true, t, d1);
        q_sh[d1] = q1;
        q_sh[KN + d1] = k1;
    }
    // reduce_sum2's first barrier also publishes the raw rows.
    let ss = reduce_sum2(q0 * q0 + q1 * q1, k0 * k0 + k1 * k1, sg, nsg, lane);
    let rq = 1.0 / sqrt(ss.x / f32(hd) + p.q_eps);
    let rk = 1.0 / sqrt(ss.y / f32(hd) + p.k_eps);
    var oq0 = 0.0;
    var oq1 = 0.0;
    var ok0 = 0.0;
    var ok1 = 0.0;
    if (own0) {
        oq0 = rope_out(q0, q_sh[min(tq0.j, hd - 1u)], rq, tq0);
        ok0 = rope_out(k0, q_sh[KN + min(tk0.j, hd - 1u)], rk, tk0);
    }
    if (own1) {
        oq1 = rope_out(q1, q_sh[min(tq1.j, hd - 1u)], rq, tq1);
        ok1 = rope_out(k1, q_sh[KN + min(tk1.j, hd - 1u)], rk, tk1);
    }
    workgroupBarrier();
    if (own0) {
        q_sh[li] = oq0;
        q_sh[KN + li] = ok0;
    }
    if (own1) {
        q_sh[d1] = oq1;
        q_sh[KN + d1] = ok1;
    }
    workgroupBarrier();
}

// One workgroup's share of a (token, head): running max `m`, sum of
// exponentials `l`, and, for this thread, the unnormalised weighted values at
// dims d0 (when d0_valid) and d0 + WG (when d1_valid).
struct Partial {
    m: f32,
    l: f32,
    acc0: f32,
    acc1: f32,
    d0: u32,
    d0_valid: bool,
    d1_valid: bool,
}

fn attend_chunk(g: u32, li: u32, sg: u32, nsg: u32, lane: u32, lanes: u32) -> Partial {
    let th = g / p.splits;
    let c = g % p.splits;
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

    // Threads over (dim, share of the keys): `parts` threads per dim when the
    // head dim is at most half the workgroup.
    let parts = max(1u, WG / hd);
    let d0 = li % hd;
    let part = li / hd;
    let d0_valid = part < parts;
    let d1_valid = li + WG < hd;
    var m = NO_SCORE;
    var l = 0.0;
    var acc0 = 0.0;
    var acc1 = 0.0;
    for (var i0 = first; i0 < end; i0 += TILE) {
        let n = min(TILE, end - i0);
        for (var k = sg; k < n; k += nsg) {
            let i = i0 + k;
            var j = tail + i - listed;
            if (i < listed) {
                j = sel[row + 1u + i / p.block] * p.block + i % p.block;
            }
            let kb = kh * hd;
            var s = 0.0;
            for (var d = lane; d < hd; d += lanes) {
                s += q_sh[d] * key_at(j, kv_cols, kb + d, d);
            }
            s = subgroupAdd(s);
            if (lane == 0u) {
                weight_sh[k] = s * p.scale;
                key_sh[k] = j;
            }
        }
        workgroupBarrier();

        var tile_max = NO_SCORE;
        for (var k = li; k < n; k += WG) {
            tile_max = max(tile_max, weight_sh[k]);
        }
        let m_new = max(m, reduce_max(tile_max, sg, nsg, lane));
        var tile_sum = 0.0;
        for (var k = li; k < n; k += WG) {
            let e = exp(weight_sh[k] - m_new);
            weight_sh[k] = e;
            tile_sum += e;
        }
        // reduce_sum's barriers also publish the exponentials.
        let rescale = exp(m - m_new);
        l = l * rescale + reduce_sum(tile_sum, sg, nsg, lane);
        m = m_new;

        acc0 *= rescale;
        acc1 *= rescale;
        let vb = kh * hd;
        // Values in batches of V_BATCH keys with a fixed inner trip count:
        // a batch's loads are in flight together (sums keep key order).
        if (d0_valid) {
            for (var k0 = part; k0 < n; k0 += V_BATCH * parts) {
                for (var u = 0u; u < V_BATCH; u++) {
                    let k = k0 + u * parts;
                    if (k < n) {
                        acc0 += weight_sh[k] * value_at(key_sh[k], kv_cols, vb + d0);
                    }
                }
            }
        }
        if (d1_valid) {
            for (var k0 = 0u; k0 < n; k0 += V_BATCH) {
                for (var u = 0u; u < V_BATCH; u++) {
                    let k = k0 + u;
                    if (k < n) {
                        acc1 += weight_sh[k] * value_at(key_sh[k], kv_cols, vb + d0 + WG);
                    }
                }
            }
        }
        workgroupBarrier();
    }

    if (parts > 1u) {
        red[li] = select(0.0, acc0, d0_valid);
        workgroupBarrier();
        if (part == 0u) {
            for (var k = 1u; k < parts; k++) {
                acc0 += red[k * hd + d0];
            }
        }
    }
    return Partial(m, l, acc0, acc1, d0, part == 0u, d1_valid);
}

// `attention`: workgroup g's (token, head), normalised output (`rope`: a
// constant per entry point, so the plain kernels carry none of its code).
fn attend_whole(g: u32, li: u32, sg: u32, nsg: u32, lane: u32, lanes: u32, rope: bool) {
    if (g >= p.tokens * p.heads) {
        return;
    }
    stage(g, li, sg, nsg, lane, rope);
    store_fresh(g, li);
    let r = attend_chunk(g, li, sg, nsg, lane, lanes);
    let ob = g * p.head_dim;
    if (r.d0_valid) {
        out[ob + r.d0] = select(r.acc0 / r.l, 0.0, r.l == 0.0);
    }
    if (r.d1_valid) {
        out[ob + r.d0 + WG] = select(r.acc1 / r.l, 0.0, r.l == 0.0);
    }
}

// `attention_split`: workgroup g's chunk of a (token, head), as a partial.
fn attend_split(g: u32, li: u32, sg: u32, nsg: u32, lane: u32, lanes: u32, rope: bool) {
    if (g >= p.tokens * p.heads * p.splits) {
        return;
    }
    stage(g, li, sg, nsg, lane, rope);
    store_fresh(g, li);
    let r = attend_chunk(g, li, sg, nsg, lane, lanes);
    let pb = g * (p.head_dim + 2u);
    if (li == 0u) {
        put_partial(pb, r.m);
        put_partial(pb + 1u, r.l);
    }
    if (r.d0_valid) {
        put_partial(pb + 2u + r.d0, r.acc0);
    }
    if (r.d1_valid) {
        put_partial(pb + 2u + r.d0 + WG, r.acc1);
    }
}

fn put_partial(i: u32, v: f32) {
    atomicStore(&partials[i], bitcast<u32>(v));
}

fn partial(i: u32) -> f32 {
    return bitcast<f32>(atomicLoad(&partials[i]));
}

var<workgroup> merge_last: u32;

// With `merge`, after workgroup g has written its partial: the last
// workgroup of g's pair to finish merges the pair (the others return).
fn merge_if_last(g: u32, li: u32) {
    if (p.merge == 0u || g >= p.tokens * p.heads * p.splits) {
        return;
    }
    let th = g / p.splits;
    // Releases this workgroup's partial before it is counted.
    storageBarrier();
    if (li == 0u) {
        merge_last = u32(atomicAdd(&merge_counts[th], 1u) + 1u == p.splits);
    }
    if (workgroupUniformLoad(&merge_last) == 0u) {
        return;
    }
    // Acquires the other workgroups' partials.
    storageBarrier();
    merge_pair(th, li);
    if (li == 0u) {
        atomicStore(&merge_counts[th], 0u);
    }
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
    attend_whole(wid.y * nwg.x + wid.x, li, sg, nsg, lane, lanes, false);
}

@compute @workgroup_size(256)
fn attention_rope(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    attend_whole(wid.y * nwg.x + wid.x, li, sg, nsg, lane, lanes, true);
}

@compute @workgroup_size(256)
fn attention_split(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let g = wid.y * nwg.x + wid.x;
    attend_split(g, li, sg, nsg, lane, lanes, false);
    merge_if_last(g, li);
}

@compute @workgroup_size(256)
fn attention_split_rope(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let g = wid.y * nwg.x + wid.x;
    attend_split(g, li, sg, nsg, lane, lanes, true);
    merge_if_last(g, li);
}

// attention_merge: one workgroup per (token, head) pair (merge_pair).
// Invocation d merges dim d (and d + WG, ..) over the splits eight at a
// time, with every load of a batch (each split's max, sum and value) issued
// before any is used, rescaling its running sums as the max grows, so a
// pair of up to eight splits costs one round trip to memory.
const MERGE_BATCH: u32 = 8u;

fn merge_pair(th: u32, li: u32) {
    let stride = p.head_dim + 2u;
    let first = th * p.splits * stride;
    for (var d = li; d < p.head_dim; d += WG) {
        var m = NO_SCORE;
        var l = 0.0;
        var acc = 0.0;
        for (var c0 = 0u; c0 < p.splits; c0 += MERGE_BATCH) {
            var ms: array<f32, MERGE_BATCH>;
            var ls: array<f32, MERGE_BATCH>;
            var vs: array<f32, MERGE_BATCH>;
            for (var u = 0u; u < MERGE_BATCH; u++) {
                // Past the last split: the last one again, masked below.
                let b = first + min(c0 + u, p.splits - 1u) * stride;
                ms[u] = partial(b);
                ls[u] = partial(b + 1u);
                vs[u] = partial(b + 2u + d);
            }
            var mx = m;
            for (var u = 0u; u < MERGE_BATCH; u++) {
                if (c0 + u < p.splits) {
                    mx = max(mx, ms[u]);
                }
            }
            let rescale = exp(m - mx);
            l *= rescale;
            acc *= rescale;
            for (var u = 0u; u < MERGE_BATCH; u++) {
                if (c0 + u < p.splits) {
                    let f = exp(ms[u] - mx);
                    l += ls[u] * f;
                    acc += vs[u] * f;
                }
            }
            m = mx;
        }
        out[th * p.head_dim + d] = select(acc / l, 0.0, l == 0.0);
    }
}

@compute @workgroup_size(256)
fn attention_merge(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let th = wid.y * nwg.x + wid.x;
    // Uniform per workgroup: the whole workgroup leaves or stays.
    if (th >= p.tokens * p.heads) {
        return;
    }
    merge_pair(th, li);
}
