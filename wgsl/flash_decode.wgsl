// flash_decode: one decode step's causal grouped-query attention over a
// long f16 KV cache (keys 0..=past, the fresh one included), split over the
// key range with an online softmax ("flash-decoding"), for the step of one
// token that flash_attention.wgsl's tiles serve poorly: a handful of rows
// (one kv head's query heads) against thousands of keys.
//
// Workgroup g (128 invocations) takes chunk g % splits of the keys, the
// pass (g / splits) % passes over its kv head's query heads (ROWS = 8 rows a
// pass; passes = ceil(group / 8)) and kv head g / (splits * passes). It
// walks its chunk in blocks of BLOCK = 128 keys:
// - scores: eight lanes share a key (key group = subgroup id * lanes / 8 +
//   lane / 8, so the host needs subgroups of 8 or more lanes), lane i of
//   the eight holding 8-value units i, i + 8, .. of the key, read straight
//   from the cache (eight lanes read a key's whole row, coalesced), and the
//   partial dots of all eight rows; three shuffles pass half the rows each
//   way ("transpose-reduce"), so lane i ends with row i's whole dot. The
//   scores go to workgroup memory, [key][row].
// - the block's max and sum of exp per row: invocation k takes key k,
//   reduced over subgroups and then the workgroup; every invocation keeps
//   every row's running max and sum (uniform), and writes its key's weights
//   back over its scores.
// - values: invocation i takes 4-value unit i % (HD / 4) of rows
//   (i / (HD / 4)) * VR .. + VR and every key of the block, sixteen keys'
//   loads issued together, each sixteen before the sixteen before them are
//   summed (the first sixteen before the softmax).
// Three barriers a block and one after it; q (scaled) is staged once.
//
// Output: with one chunk (splits = 1) the normalised rows go to `out`
// [1, heads * HD]; otherwise each workgroup writes the partial [max, sum of
// exp, unnormalised weighted values] of each of its rows to `partials` at
// (head * splits + chunk) * (HD + 2) (flash_attention.wgsl's layout, so that
// its flash_merge can sum them), and with `merge` = 1 the last workgroup of
// each (kv head, pass) to finish sums them itself: it counts itself done in
// `merge_counts[kv head * passes + pass]` and sets the count back to 0
// (attention.wgsl's scheme, Vulkan only: partials are atomics so that the
// last workgroup reads what others wrote, released and acquired by
// storageBarrier).
//
// With `fresh`, the token's key and value rows are in knew / vnew (f32):
// each workgroup whose chunk holds position `past` (one per pass) writes
// them to the cache (rounded to f16; the passes write the same bits) before
// its first block, so that every key and value is read from the cache with
// no branch between the loads: a load behind a per-key branch was issued
// only after the one before had landed.
//
// HD (the head dim, 64, 128 or 256) is an override constant: one pipeline
// per head dim. `tb`, `slices` and `kv` (always 1, f16) of Params are
// flash_attention's; this kernel reads none of them.
//
// Bindings: 0 uniform Params; 2 q [1, heads * HD] (f32); 3 out (same shape);
// 4 keys (eight f16 a vec4 of words), 5 values (four f16 a vec2 of words)
// [positions, kv_heads * HD]; 6 partials (f32 bits in atomics); 8 knew,
// 9 vnew [1, kv_heads * HD]; 13 merge_counts (zero between dispatches).

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    // Cached positions before the token: its own is `past`.
    past: u32,
    tb: u32,
    slices: u32,
    // Chunks of the keys, and keys per chunk (a multiple of BLOCK).
    splits: u32,
    chunk: u32,
    scale: f32,
    fresh: u32,
    kv: u32,
    // 1: the last workgroup of each (kv head, pass) merges the chunks.
    merge: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> keys: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> values: array<vec2<u32>>;
@group(0) @binding(6) var<storage, read_write> partials: array<atomic<u32>>;
@group(0) @binding(8) var<storage, read> knew: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read> vnew: array<vec4<f32>>;
@group(0) @binding(13) var<storage, read_write> merge_counts: array<atomic<u32>>;

override HD: u32 = 128u;
override HD4: u32 = HD / 4u;
// 8-value units of a key row (vec4s of words), per lane of its eight.
override K8: u32 = HD / 8u;
override KU: u32 = HD / 64u;
// Score steps (16 keys each) whose loads are issued together.
override SB: u32 = min(8u, 16u / KU);
// Rows of the values an invocation sums (4-value units over 128 invocations).
override VR: u32 = ROWS * HD4 / WG;
const WG: u32 = 128u;
const ROWS: u32 = 8u;
const BLOCK: u32 = 128u;
// Lanes of a key, and keys a score step covers.
const KL: u32 = 8u;
const STEP: u32 = WG / KL;
// Keys whose value loads an invocation issues together (the block's 128 in
// eight steps, each step's loads out before the step before is summed).
const VB: u32 = 16u;
// Most chunks (the host keeps to it): the merge's weights fit the scores' array.
const MAX_SPLITS: u32 = 128u;
// Invocations of a row in the merge.
const MERGE_LANES: u32 = WG / ROWS;
// Chunks whose partials a merging invocation loads together.
const MERGE_BATCH: u32 = 8u;
// Below any score: exp(NO_SCORE - m) is 0 for every real max m.
const NO_SCORE: f32 = -3.0e38;

// q of the pass's rows, scaled (ROWS * HD4 vec4s at most: HD 256).
var<workgroup> q_sh: array<vec4<f32>, 512>;
// The block's scores, then weights, [key][row]; the merge's weights [row][chunk].
var<workgroup> s_sh: array<f32, 1024>;
// Per subgroup (8 lanes or more: 16 at most) and row: maxima, sums of exp.
var<workgroup> max_sh: array<f32, 128>;
var<workgroup> sum_sh: array<f32, 128>;
var<workgroup> merge_last: u32;

// Eight f16 of four words as two vec4s.
fn unpack8(w: vec4<u32>) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)), vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)));
}

fn pack4(v: vec4<f32>) -> vec2<u32> {
    return vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}

// 8-value unit u of key j of kv head kh, as f16 words.
fn key_unit(j: u32, kh: u32, u: u32) -> vec4<u32> {
    return keys[(j * p.kv_heads + kh) * K8 + u];
}

// 4-value unit u of value row j of kv head kh, as f16 words.
fn value_unit(j: u32, kh: u32, u: u32) -> vec2<u32> {
    return values[(j * p.kv_heads + kh) * HD4 + u];
}

// VB consecutive keys' 4-value unit u from key j on (kv head kh); keys past
// the chunk (`end`) read its last row again, which the softmax weights 0.
fn value_units(j: u32, end: u32, kh: u32, u: u32) -> array<vec2<u32>, VB> {
    var w: array<vec2<u32>, VB>;
    for (var k = 0u; k < VB; k++) {
        w[k] = value_unit(min(j + k, end - 1u), kh, u);
    }
    return w;
}

// The row of the values an invocation's `i`th sum belongs to, picked out of
// `a` (one value per row) with fixed indices only: a register array read at a
// computed index would live in memory.
fn of_row(a: array<f32, ROWS>, r: u32) -> f32 {
    var x = a[0];
    for (var k = 1u; k < ROWS; k++) {
        x = select(x, a[k], r == k);
    }
    return x;
}

// Lane i (of a key's eight) with the eight rows' partial dots `d`: row i's
// whole dot. Each shuffle halves the rows a lane holds, passing the other
// half to the lane that keeps them.
fn transpose_sum(d: array<f32, ROWS>, lane8: u32) -> f32 {
    let h4 = (lane8 & 4u) != 0u;
    var e: array<f32, 4>;
    for (var i = 0u; i < 4u; i++) {
        e[i] = select(d[i], d[i + 4u], h4) + subgroupShuffleXor(select(d[i + 4u], d[i], h4), 4u);
    }
    let h2 = (lane8 & 2u) != 0u;
    var f: array<f32, 2>;
    for (var i = 0u; i < 2u; i++) {
        f[i] = select(e[i], e[i + 2u], h2) + subgroupShuffleXor(select(e[i + 2u], e[i], h2), 2u);
    }
    let h1 = (lane8 & 1u) != 0u;
    return select(f[0], f[1], h1) + subgroupShuffleXor(select(f[1], f[0], h1), 1u);
}

fn put_partial(i: u32, v: f32) {
    atomicStore(&partials[i], bitcast<u32>(v));
}

fn partial(i: u32) -> f32 {
    return bitcast<f32>(atomicLoad(&partials[i]));
}

@compute @workgroup_size(128)
fn flash_decode(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let group = p.heads / p.kv_heads;
    let passes = (group + ROWS - 1u) / ROWS;
    let g = wid.y * nwg.x + wid.x;
    // Uniform per workgroup: the whole workgroup leaves or stays.
    if (g >= p.kv_heads * passes * p.splits) {
        return;
    }
    let c = g % p.splits;
    let ps = (g / p.splits) % passes;
    let kh = g / (p.splits * passes);
    let rows = min(ROWS, group - ps * ROWS);
    let h0 = kh * group + ps * ROWS;
    let j_begin = c * p.chunk;
    let j_end = min(j_begin + p.chunk, p.past + 1u);

    for (var i = li; i < ROWS * HD4; i += WG) {
        let r = i / HD4;
        var v = vec4<f32>(0.0);
        if (r < rows) {
            v = q[(h0 + r) * HD4 + i % HD4] * p.scale;
        }
        q_sh[i] = v;
    }
    if (p.fresh != 0u && p.past >= j_begin && p.past < j_end) {
        for (var u = li; u < K8; u += WG) {
            let i = kh * HD4 + 2u * u;
            keys[(p.past * p.kv_heads + kh) * K8 + u] = vec4<u32>(pack4(knew[i]), pack4(knew[i + 1u]));
        }
        for (var u = li; u < HD4; u += WG) {
            values[(p.past * p.kv_heads + kh) * HD4 + u] = pack4(vnew[kh * HD4 + u]);
        }
    }
    // The fresh rows visible to the workgroup's own loads; q_sh to all.
    storageBarrier();
    workgroupBarrier();

    let lane8 = lane % KL;
    let kg = sg * (lanes / KL) + lane / KL;
    let vu = li % HD4;
    let vr0 = (li / HD4) * VR;
    var m: array<f32, ROWS>;
    var l: array<f32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        m[r] = NO_SCORE;
        l[r] = 0.0;
    }
    var acc: array<vec4<f32>, 4>;
    for (var j0 = j_begin; j0 < j_end; j0 += BLOCK) {
        // Scores, SB steps of 16 keys at a time.
        for (var s0 = 0u; s0 < BLOCK; s0 += SB * STEP) {
            var kw: array<vec4<u32>, 16>;
            for (var s = 0u; s < SB; s++) {
                // Past the chunk: its last key again, masked below.
                let j = min(j0 + s0 + s * STEP + kg, j_end - 1u);
                for (var u = 0u; u < KU; u++) {
                    kw[s * KU + u] = key_unit(j, kh, lane8 + u * KL);
                }
            }
            for (var s = 0u; s < SB; s++) {
                var d: array<f32, ROWS>;
                for (var u = 0u; u < KU; u++) {
                    let k = unpack8(kw[s * KU + u]);
                    let at = 2u * (lane8 + u * KL);
                    for (var r = 0u; r < ROWS; r++) {
                        d[r] += dot(q_sh[r * HD4 + at], k[0]) + dot(q_sh[r * HD4 + at + 1u], k[1]);
                    }
                }
                let key = s0 + s * STEP + kg;
                let score = transpose_sum(d, lane8);
                s_sh[key * ROWS + lane8] = select(NO_SCORE, score, j0 + key < j_end);
            }
        }
        // The first values' loads go out now and land while the block's
        // softmax runs (they do not depend on it).
        var w = value_units(j0, j_end, kh, vu);
        workgroupBarrier();

        // The block's max per row, then each key's weights and their sums.
        var sc: array<f32, ROWS>;
        for (var r = 0u; r < ROWS; r++) {
            sc[r] = s_sh[li * ROWS + r];
            let mx = subgroupMax(sc[r]);
            if (lane == 0u) {
                max_sh[sg * ROWS + r] = mx;
            }
        }
        workgroupBarrier();
        var alpha: array<f32, ROWS>;
        for (var r = 0u; r < ROWS; r++) {
            var bm = NO_SCORE;
            for (var i = 0u; i < nsg; i++) {
                bm = max(bm, max_sh[i * ROWS + r]);
            }
            let mn = max(m[r], bm);
            alpha[r] = exp(m[r] - mn);
            m[r] = mn;
            let e = exp(sc[r] - mn);
            s_sh[li * ROWS + r] = e;
            let se = subgroupAdd(e);
            if (lane == 0u) {
                sum_sh[sg * ROWS + r] = se;
            }
        }
        workgroupBarrier();
        for (var r = 0u; r < ROWS; r++) {
            var t = 0.0;
            for (var i = 0u; i < nsg; i++) {
                t += sum_sh[i * ROWS + r];
            }
            l[r] = l[r] * alpha[r] + t;
        }

        // The weighted values.
        for (var i = 0u; i < VR; i++) {
            acc[i] *= of_row(alpha, vr0 + i);
        }
        for (var k0 = 0u; k0 < BLOCK; k0 += VB) {
            // The next keys' loads go out before these keys are summed (the
            // last step loads its own keys again: they are cached).
            let next = value_units(j0 + min(k0 + VB, BLOCK - VB), j_end, kh, vu);
            for (var u = 0u; u < VB; u++) {
                let v = vec4<f32>(unpack2x16float(w[u].x), unpack2x16float(w[u].y));
                for (var i = 0u; i < VR; i++) {
                    acc[i] += s_sh[(k0 + u) * ROWS + vr0 + i] * v;
                }
            }
            w = next;
        }
        workgroupBarrier();
    }

    if (p.splits == 1u) {
        for (var i = 0u; i < VR; i++) {
            let r = vr0 + i;
            if (r < rows) {
                out[(h0 + r) * HD4 + vu] = acc[i] / of_row(l, r);
            }
        }
        return;
    }
    for (var i = 0u; i < VR; i++) {
        let r = vr0 + i;
        if (r < rows) {
            let b = ((h0 + r) * p.splits + c) * (HD + 2u) + 2u + 4u * vu;
            put_partial(b, acc[i].x);
            put_partial(b + 1u, acc[i].y);
            put_partial(b + 2u, acc[i].z);
            put_partial(b + 3u, acc[i].w);
        }
    }
    for (var r = 0u; r < ROWS; r++) {
        if (li == r && r < rows) {
            let b = ((h0 + r) * p.splits + c) * (HD + 2u);
            put_partial(b, m[r]);
            put_partial(b + 1u, l[r]);
        }
    }
    if (p.merge == 0u) {
        return;
    }
    let mi = kh * passes + ps;
    // Releases this workgroup's partials before it is counted.
    storageBarrier();
    if (li == 0u) {
        merge_last = u32(atomicAdd(&merge_counts[mi], 1u) + 1u == p.splits);
    }
    if (workgroupUniformLoad(&merge_last) == 0u) {
        return;
    }
    // Acquires the other workgroups' partials.
    storageBarrier();
    merge_chunks(h0, rows, li);
    if (li == 0u) {
        atomicStore(&merge_counts[mi], 0u);
    }
}

// The last workgroup's merge of the pass's rows over every chunk: row
// li / MERGE_LANES, its chunks and its 4-value runs shared by MERGE_LANES
// invocations.
fn merge_chunks(h0: u32, rows: u32, li: u32) {
    let r = li / MERGE_LANES;
    let part = li % MERGE_LANES;
    let row = min(r, rows - 1u);
    let base = (h0 + row) * p.splits;
    var mx = NO_SCORE;
    for (var c = part; c < p.splits; c += MERGE_LANES) {
        let mc = partial((base + c) * (HD + 2u));
        s_sh[r * MAX_SPLITS + c] = mc;
        mx = max(mx, mc);
    }
    max_sh[li] = mx;
    workgroupBarrier();
    for (var i = 0u; i < MERGE_LANES; i++) {
        mx = max(mx, max_sh[r * MERGE_LANES + i]);
    }
    var sum = 0.0;
    for (var c = part; c < p.splits; c += MERGE_LANES) {
        let w = exp(s_sh[r * MAX_SPLITS + c] - mx);
        s_sh[r * MAX_SPLITS + c] = w;
        sum += w * partial((base + c) * (HD + 2u) + 1u);
    }
    sum_sh[li] = sum;
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < MERGE_LANES; i++) {
        total += sum_sh[r * MERGE_LANES + i];
    }
    for (var run = part; run < HD4; run += MERGE_LANES) {
        var a = vec4<f32>(0.0);
        for (var c0 = 0u; c0 < p.splits; c0 += MERGE_BATCH) {
            var w: array<f32, MERGE_BATCH>;
            var v: array<vec4<f32>, MERGE_BATCH>;
            for (var u = 0u; u < MERGE_BATCH; u++) {
                // Past the last chunk: the last one again, weighted 0.
                let c = min(c0 + u, p.splits - 1u);
                let o = (base + c) * (HD + 2u) + 2u + 4u * run;
                w[u] = select(0.0, s_sh[r * MAX_SPLITS + c], c0 + u < p.splits);
                v[u] = vec4<f32>(partial(o), partial(o + 1u), partial(o + 2u), partial(o + 3u));
            }
            for (var u = 0u; u < MERGE_BATCH; u++) {
                a += w[u] * v[u];
            }
        }
        if (r < rows) {
            out[(h0 + r) * HD4 + run] = a / total;
        }
    }
}
