// flash_attention: causal grouped-query attention over every key 0..=pos
// (dense; key selections take attention.wgsl), in tiles of keys staged in
// workgroup memory with an online softmax ("flash attention"), for long
// prompts and for decode at long contexts. The new keys and values are
// already in the cache, or (`fresh`, one token) in knew / vnew.
//
// One workgroup takes one kv head, a block of `tb` consecutive tokens and
// one chunk of `chunk` keys: its rows are the tb * group (token, head)
// pairs of that kv head's query heads, so each key and value row it stages
// serves every query head of the group. The 256 invocations form 64 slots of
// 4 lanes (one subgroup holds lanes/4 whole slots; the host needs subgroups
// of at least 4); slot s takes row s % (64 / slices) and key slice
// s / (64 / slices) (keys slice, slice + slices, .. of each tile), so that a
// decode step with few rows still puts every slot to work, and the slots of
// one subgroup read the same keys. Lane l of a slot holds the query's
// and the output's vec4 runs l, l + 4, l + 8, .. (HD/16 of them) in
// registers: a score is four partial dots summed by two subgroup shuffles.
//
// Tiles of BK keys (8 KiB of keys and 8 KiB of values): every invocation
// loads its share of the next tile into registers while the slots work on
// the current one. A row's keys past its own position are masked, and the
// tiles of a workgroup end at its last token's position, so fully masked
// causal blocks are never read. Workgroups of later token blocks (more
// keys) are numbered first.
//
// Output: with one chunk per row (splits = 1), the normalised rows go to
// `out` [tokens, heads * HD]; otherwise each chunk writes the partial
// [max, sum of exp, unnormalised weighted values] of each row to `partials`
// at ((t * heads + h) * splits + chunk) * (HD + 2), as attention.wgsl's
// split kernels do, and its attention_merge sums them. The slices of a row
// are merged within the workgroup first (in workgroup memory, a quarter of
// the head dim at a time).
//
// HD (the head dim) is an override constant: one pipeline per head dim
// (64, 128, 256), so that every register loop has a fixed trip count.
//
// kv_store: the `tokens` key and value rows of knew / vnew [tokens, kv_heads *
// HD] (f32) into the cache at positions past.., one invocation per run of
// four values: a prefill's append to an f16 cache. kv_store_q8: the same
// into a q8 cache, one invocation per 64 values (two blocks).
//
// A q8 cache (`kv` 2, llama.cpp's q8_0) holds each (position, kv head) row
// as HD / 4 words of four int8 values (the lowest byte first), then HD / 64
// words of two f16 scales (the lower half first), one per block of 32
// values: a value is its block's scale times its int8. Only kv_store_q8
// writes one (never `fresh`).
//
// Bindings: 0 uniform Params; 2 q [tokens, heads * HD]; 3 out (same shape);
// 4 keys, 5 values [positions, kv_heads * HD] (read-write: `fresh` writes
// the new row; f32, f16 two to a word or q8, by `kv`); 6 partials (f32);
// 8 knew, 9 vnew [1, kv_heads * HD] (kv_store: [tokens, kv_heads * HD]).

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    // Cached positions before this call's tokens.
    past: u32,
    // Tokens per workgroup.
    tb: u32,
    // Key slices per row (a power of two; rows * slices <= 64).
    slices: u32,
    // Key chunks per (kv head, token block), and keys per chunk (a multiple of BK).
    splits: u32,
    chunk: u32,
    scale: f32,
    // 1: one token whose key and value rows are in knew / vnew (written to
    // the cache at `past` by the workgroup whose chunk holds that position).
    fresh: u32,
    // The cache holds 0: f32; 1: f16 (two per word, the lower half first);
    // 2: q8 (above).
    kv: u32,
    // flash_decode.wgsl's (unused here).
    merge: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;
// The cache in pairs of words: two f32, or four f16 (`kv` 1), or q8 words.
@group(0) @binding(4) var<storage, read_write> keys: array<vec2<u32>>;
@group(0) @binding(5) var<storage, read_write> values: array<vec2<u32>>;
@group(0) @binding(6) var<storage, read_write> partials: array<f32>;
@group(0) @binding(8) var<storage, read> knew: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read> vnew: array<vec4<f32>>;

override HD: u32 = 128u;
// Rows per slot: 2 (prefill with head dims up to 128, slices = 1) gives each
// slot rows s and s + 64, so that every key and value run read from
// workgroup memory feeds two rows.
override ROWS: u32 = 1u;
// One row per slot (decode, and head dims over 128) has the registers to
// keep two tiles' loads in flight: its few rows do little work per tile.
override DEEP: bool = ROWS == 1u;
// vec4 runs per row, and per lane.
const MAX_PER: u32 = 16u;
override HD4: u32 = HD / 4u;
override PER: u32 = HD / 16u;
// Keys per tile; vec4s per tile of keys (and of values); per invocation.
override BK: u32 = 2048u / HD;
const TILE4: u32 = 512u;
const LOADS: u32 = 2u;
const WG: u32 = 256u;
const SLOTS: u32 = 64u;
// Below any score: exp(NO_SCORE - m) is 0 for every real max m.
const NO_SCORE: f32 = -3.0e38;

var<workgroup> k_sh: array<vec4<f32>, TILE4>;
var<workgroup> v_sh: array<vec4<f32>, TILE4>;
// Each slot's running max and sum, for the merge of a row's slices.
var<workgroup> ml_sh: array<vec2<f32>, SLOTS>;

// Word i of the keys or of the values (a q8 cache's).
fn kv_word(is_key: bool, i: u32) -> u32 {
    if (is_key) {
        return keys[i >> 1u][i & 1u];
    }
    return values[i >> 1u][i & 1u];
}

// Words of a q8 cache's (position, kv head) row.
fn q8_row_words() -> u32 {
    return HD4 + HD / 64u;
}

// Row j's vec4 run `col` of kv head kh, keys or values, as the words that
// hold it: four f32 (a fresh row, or an f32 cache), or four f16 in the
// first two, or (q8) the run's four int8, its block's word of scales and
// the shift of its scale in that word. The words are converted only where they are used (`as_run`),
// so that a tile's loads stay in flight while the slots work on the tile
// before (a conversion right after the load would wait for it).
fn kv_words(is_key: bool, j: u32, kh: u32, col: u32) -> vec4<u32> {
    if (is_fresh(j)) {
        let i = (j - p.past) * p.kv_heads * HD4 + kh * HD4 + col;
        if (is_key) {
            return bitcast<vec4<u32>>(knew[i]);
        }
        return bitcast<vec4<u32>>(vnew[i]);
    }
    if (p.kv == 2u) {
        let r = (j * p.kv_heads + kh) * q8_row_words();
        return vec4<u32>(kv_word(is_key, r + col), kv_word(is_key, r + HD4 + col / 16u), 16u * ((col / 8u) % 2u), 0u);
    }
    let i = j * p.kv_heads * HD4 + kh * HD4 + col;
    if (p.kv == 1u) {
        var w = values[i];
        if (is_key) {
            w = keys[i];
        }
        return vec4<u32>(w, 0u, 0u);
    }
    var a = values[2u * i];
    var b = values[2u * i + 1u];
    if (is_key) {
        a = keys[2u * i];
        b = keys[2u * i + 1u];
    }
    return vec4<u32>(a, b);
}

fn is_fresh(j: u32) -> bool {
    return p.fresh != 0u && j >= p.past;
}

// The four values of row j's words from kv_words.
fn as_run(w: vec4<u32>, j: u32) -> vec4<f32> {
    if (p.kv == 2u) {
        let d = unpack2x16float(w.y >> w.z).x;
        let b = bitcast<i32>(w.x);
        return d * vec4<f32>(f32(extractBits(b, 0u, 8u)), f32(extractBits(b, 8u, 8u)), f32(extractBits(b, 16u, 8u)), f32(extractBits(b, 24u, 8u)));
    }
    if (p.kv == 1u && !is_fresh(j)) {
        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    }
    return bitcast<vec4<f32>>(w);
}

// Stores run i (four values) of a key or value row in the cache.
fn store_run(is_key: bool, i: u32, v: vec4<f32>) {
    if (p.kv == 1u) {
        let w = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
        if (is_key) {
            keys[i] = w;
        } else {
            values[i] = w;
        }
        return;
    }
    let u = bitcast<vec4<u32>>(v);
    if (is_key) {
        keys[2u * i] = u.xy;
        keys[2u * i + 1u] = u.zw;
    } else {
        values[2u * i] = u.xy;
        values[2u * i + 1u] = u.zw;
    }
}

// This invocation's share of the tile of keys j0.. (before `end`): vec4
// li + u * WG of its keys and of its values (key (li + u * WG) / HD4, run
// (li + u * WG) % HD4).
fn fetch_tile(kr: ptr<function, array<vec4<u32>, LOADS>>, vr: ptr<function, array<vec4<u32>, LOADS>>, j0: u32, end: u32, kh: u32, li: u32) {
    for (var u = 0u; u < LOADS; u++) {
        let e = li + u * WG;
        let j = j0 + e / HD4;
        if (j < end) {
            (*kr)[u] = kv_words(true, j, kh, e % HD4);
            (*vr)[u] = kv_words(false, j, kh, e % HD4);
        }
    }
}

// The merge area: the two tiles' workgroup memory as one array of 2 * TILE4.
fn put_merge(i: u32, v: vec4<f32>) {
    if (i < TILE4) {
        k_sh[i] = v;
    } else {
        v_sh[i - TILE4] = v;
    }
}

fn get_merge(i: u32) -> vec4<f32> {
    if (i < TILE4) {
        return k_sh[i];
    }
    return v_sh[i - TILE4];
}

// Lane `part` of a slot holds partial dots `d` of four keys (its runs):
// returns key `part`'s whole score, summed over the slot's four lanes in
// three shuffles (each step keeps the half of the keys its lane ends with).
fn spread(d: vec4<f32>, part: u32) -> f32 {
    let hi = (part & 2u) != 0u;
    let x = select(d.xy, d.zw, hi) + subgroupShuffleXor(select(d.zw, d.xy, hi), 2u);
    let lo = (part & 1u) != 0u;
    return select(x.x, x.y, lo) + subgroupShuffleXor(select(x.y, x.x, lo), 1u);
}

// Row r of the workgroup: its token (t) and head (h).
fn row_token(tblock: u32, r: u32) -> u32 {
    return tblock * p.tb + r / (p.heads / p.kv_heads);
}

fn row_head(kh: u32, r: u32) -> u32 {
    let group = p.heads / p.kv_heads;
    return kh * group + r % group;
}

// Writes a row's result: normalised to `out` (one chunk), else as a
// partial; `run` is the vec4 run index of `v` (sum of weighted values).
fn write_run(t: u32, h: u32, c: u32, run: u32, v: vec4<f32>, l: f32) {
    let pair = t * p.heads + h;
    if (p.splits == 1u) {
        out[pair * HD4 + run] = select(v / l, vec4<f32>(0.0), l == 0.0);
        return;
    }
    let b = (pair * p.splits + c) * (HD + 2u) + 2u + run * 4u;
    partials[b] = v.x;
    partials[b + 1u] = v.y;
    partials[b + 2u] = v.z;
    partials[b + 3u] = v.w;
}

fn write_ml(t: u32, h: u32, c: u32, m: f32, l: f32) {
    if (p.splits == 1u) {
        return;
    }
    let b = ((t * p.heads + h) * p.splits + c) * (HD + 2u);
    partials[b] = m;
    partials[b + 1u] = l;
}

@compute @workgroup_size(256)
fn flash_attention(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let group = p.heads / p.kv_heads;
    let tblocks = (p.tokens + p.tb - 1u) / p.tb;
    let g = wid.y * nwg.x + wid.x;
    // Uniform per workgroup: the whole workgroup leaves or stays.
    if (g >= p.kv_heads * tblocks * p.splits) {
        return;
    }
    let c = g % p.splits;
    let kh = (g / p.splits) % p.kv_heads;
    let tblock = tblocks - 1u - g / (p.splits * p.kv_heads);
    let rows = p.tb * group;
    let slot = sg * (lanes / 4u) + lane / 4u;
    let part = lane % 4u;
    // Slot (row, slice) = slice * nr + row: the slots of a subgroup share a
    // slice, so each key run they read from workgroup memory is one broadcast.
    let nr = SLOTS / p.slices;
    let row = slot % nr;
    let slice = slot / nr;
    let t = row_token(tblock, row);
    let h = row_head(kh, row);
    let live = row < rows && t < p.tokens;
    let pos = p.past + t;
    let row2 = row + SLOTS;
    let t2 = row_token(tblock, row2);
    let h2 = row_head(kh, row2);
    let live2 = ROWS == 2u && row2 < rows && t2 < p.tokens;
    let pos2 = p.past + t2;
    let last_t = min(p.tokens, (tblock + 1u) * p.tb) - 1u;
    let n_keys = p.past + last_t + 1u;
    let first = min(c * p.chunk, n_keys);
    let end = min(first + p.chunk, n_keys);

    // With `fresh`: the chunk holding position `past` writes the new rows.
    if (p.fresh != 0u && first <= p.past && p.past < end) {
        for (var i = li; i < HD4; i += WG) {
            let dst = p.past * p.kv_heads * HD4 + kh * HD4 + i;
            store_run(true, dst, knew[kh * HD4 + i]);
            store_run(false, dst, vnew[kh * HD4 + i]);
        }
    }

    var qr: array<vec4<f32>, MAX_PER>;
    var o: array<vec4<f32>, MAX_PER>;
    if (live) {
        let qb = (t * p.heads + h) * HD4;
        for (var i = 0u; i < PER; i++) {
            qr[i] = q[qb + part + 4u * i] * p.scale;
            o[i] = vec4<f32>(0.0);
        }
    }
    var m = NO_SCORE;
    var l = 0.0;
    var q2: array<vec4<f32>, MAX_PER>;
    var o2: array<vec4<f32>, MAX_PER>;
    if (live2) {
        let qb = (t2 * p.heads + h2) * HD4;
        for (var i = 0u; i < PER; i++) {
            q2[i] = q[qb + part + 4u * i] * p.scale;
        }
    }
    var m2 = NO_SCORE;
    var l2 = 0.0;

    // With DEEP, kr2 / vr2 hold the tile after: two tiles' loads in flight.
    var kr: array<vec4<u32>, LOADS>;
    var vr: array<vec4<u32>, LOADS>;
    var kr2: array<vec4<u32>, LOADS>;
    var vr2: array<vec4<u32>, LOADS>;
    fetch_tile(&kr, &vr, first, end, kh, li);
    if (DEEP) {
        fetch_tile(&kr2, &vr2, first + BK, end, kh, li);
    }
    for (var j0 = first; j0 < end; j0 += BK) {
        workgroupBarrier();
        for (var u = 0u; u < LOADS; u++) {
            let j = j0 + (li + u * WG) / HD4;
            k_sh[li + u * WG] = as_run(kr[u], j);
            v_sh[li + u * WG] = as_run(vr[u], j);
        }
        workgroupBarrier();
        if (DEEP) {
            kr = kr2;
            vr = vr2;
            fetch_tile(&kr2, &vr2, j0 + 2u * BK, end, kh, li);
        } else {
            fetch_tile(&kr, &vr, j0 + BK, end, kh, li);
        }
        let n = min(BK, end - j0);
        if (live && p.slices == 1u) {
            for (var k = 0u; k < n; k += 4u) {
                // Keys k .. k + 3 at once: each lane's partial dots of the
                // four, summed over the slot so that lane `part` holds key
                // k + part's score; one max, one rescale and one exp a lane
                // for the four; each key's weight is then read from its lane.
                var d = vec4<f32>(0.0);
                var d2 = vec4<f32>(0.0);
                for (var i = 0u; i < PER; i++) {
                    let r = part + 4u * i;
                    let k0 = k_sh[k * HD4 + r];
                    let k1 = k_sh[(k + 1u) * HD4 + r];
                    let k2 = k_sh[(k + 2u) * HD4 + r];
                    let k3 = k_sh[(k + 3u) * HD4 + r];
                    d += vec4<f32>(dot(qr[i], k0), dot(qr[i], k1), dot(qr[i], k2), dot(qr[i], k3));
                    if (ROWS == 2u) {
                        d2 += vec4<f32>(dot(q2[i], k0), dot(q2[i], k1), dot(q2[i], k2), dot(q2[i], k3));
                    }
                }
                let j = j0 + k + part;
                let ok = vec2<bool>(k + part < n && j <= pos, live2 && k + part < n && j <= pos2);
                let sc = select(vec2<f32>(NO_SCORE), vec2<f32>(spread(d, part), spread(d2, part)), ok);
                var mb = max(sc, subgroupShuffleXor(sc, 1u));
                mb = max(mb, subgroupShuffleXor(mb, 2u));
                if (mb.x > m) {
                    let r = exp(m - mb.x);
                    l *= r;
                    for (var i = 0u; i < PER; i++) {
                        o[i] *= r;
                    }
                    m = mb.x;
                }
                if (ROWS == 2u && mb.y > m2) {
                    let r = exp(m2 - mb.y);
                    l2 *= r;
                    for (var i = 0u; i < PER; i++) {
                        o2[i] *= r;
                    }
                    m2 = mb.y;
                }
                let e = select(vec2<f32>(0.0), exp(sc - vec2<f32>(m, m2)), ok);
                l += e.x;
                l2 += e.y;
                for (var kk = 0u; kk < 4u; kk++) {
                    let ek = subgroupShuffle(e, lane - part + kk);
                    for (var i = 0u; i < PER; i++) {
                        let vv = v_sh[(k + kk) * HD4 + part + 4u * i];
                        o[i] += ek.x * vv;
                        if (ROWS == 2u) {
                            o2[i] += ek.y * vv;
                        }
                    }
                }
            }
        } else if (live) {
            for (var k = slice; k < n; k += p.slices) {
                let kb = k * HD4 + part;
                // Four independent sums per row (a dot's chain of adds is the
                // latency of its products), added at the end.
                var sv = vec4<f32>(0.0);
                var sv2 = vec4<f32>(0.0);
                for (var i = 0u; i < PER; i++) {
                    let kv = k_sh[kb + 4u * i];
                    sv += qr[i] * kv;
                    if (ROWS == 2u) {
                        sv2 += q2[i] * kv;
                    }
                }
                var s = (sv.x + sv.y) + (sv.z + sv.w);
                var s2 = (sv2.x + sv2.y) + (sv2.z + sv2.w);
                // The slot's four lanes run the same keys: its partners.
                s += subgroupShuffleXor(s, 1u);
                s += subgroupShuffleXor(s, 2u);
                if (ROWS == 2u) {
                    s2 += subgroupShuffleXor(s2, 1u);
                    s2 += subgroupShuffleXor(s2, 2u);
                }
                var e = 0.0;
                if (j0 + k <= pos) {
                    if (s > m) {
                        let r = exp(m - s);
                        l *= r;
                        for (var i = 0u; i < PER; i++) {
                            o[i] *= r;
                        }
                        m = s;
                    }
                    e = exp(s - m);
                    l += e;
                }
                var e2 = 0.0;
                if (live2 && j0 + k <= pos2) {
                    if (s2 > m2) {
                        let r = exp(m2 - s2);
                        l2 *= r;
                        for (var i = 0u; i < PER; i++) {
                            o2[i] *= r;
                        }
                        m2 = s2;
                    }
                    e2 = exp(s2 - m2);
                    l2 += e2;
                }
                for (var i = 0u; i < PER; i++) {
                    let vv = v_sh[kb + 4u * i];
                    o[i] += e * vv;
                    if (ROWS == 2u) {
                        o2[i] += e2 * vv;
                    }
                }
            }
        }
    }

    if (p.slices == 1u) {
        // The four-key blocks kept a sum per lane: the slot's total.
        l += subgroupShuffleXor(l, 1u);
        l += subgroupShuffleXor(l, 2u);
        l2 += subgroupShuffleXor(l2, 1u);
        l2 += subgroupShuffleXor(l2, 2u);
        if (live) {
            for (var i = 0u; i < PER; i++) {
                write_run(t, h, c, part + 4u * i, o[i], l);
            }
            if (part == 0u) {
                write_ml(t, h, c, m, l);
            }
        }
        if (live2) {
            for (var i = 0u; i < PER; i++) {
                write_run(t2, h2, c, part + 4u * i, o2[i], l2);
            }
            if (part == 0u) {
                write_ml(t2, h2, c, m2, l2);
            }
        }
        return;
    }

    // Merge each row's slices: every slot's (max, sum), then a quarter of
    // the runs at a time (lane `r` of each slot) through the merge area.
    workgroupBarrier();
    if (part == 0u) {
        ml_sh[slot] = select(vec2<f32>(NO_SCORE, 0.0), vec2<f32>(m, l), live);
    }
    workgroupBarrier();
    var mx = NO_SCORE;

    for (var s2 = 0u; s2 < p.slices; s2++) {
        mx = max(mx, ml_sh[s2 * nr + row].x);
    }
    let f = exp(m - mx);
    let span = rows * PER;
    for (var r = 0u; r < 4u; r++) {
        if (part == r && row < rows) {
            for (var i = 0u; i < PER; i++) {
                put_merge(slot * PER + i, select(vec4<f32>(0.0), o[i] * f, live));
            }
        }
        workgroupBarrier();
        for (var e = li; e < span; e += WG) {
            let rr = e / PER;
            let i = e % PER;
            let tt = row_token(tblock, rr);
            if (tt < p.tokens) {
                var rm = NO_SCORE;
                for (var s2 = 0u; s2 < p.slices; s2++) {
                    rm = max(rm, ml_sh[s2 * nr + rr].x);
                }
                var sum = vec4<f32>(0.0);
                var rl = 0.0;
                for (var s2 = 0u; s2 < p.slices; s2++) {
                    let ml = ml_sh[s2 * nr + rr];
                    rl += ml.y * exp(ml.x - rm);
                    sum += get_merge((s2 * nr + rr) * PER + i);
                }
                let hh = row_head(kh, rr);
                write_run(tt, hh, c, r + 4u * i, sum, rl);
                if (r == 0u && i == 0u) {
                    write_ml(tt, hh, c, rm, rl);
                }
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn kv_store(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * WG + li;
    if (i < p.tokens * p.kv_heads * HD4) {
        store_run(true, p.past * p.kv_heads * HD4 + i, knew[i]);
        store_run(false, p.past * p.kv_heads * HD4 + i, vnew[i]);
    }
}

// Run i of this call's new key or value rows (knew / vnew).
fn new_run(is_key: bool, i: u32) -> vec4<f32> {
    if (is_key) {
        return knew[i];
    }
    return vnew[i];
}

fn put_kv_word(is_key: bool, i: u32, w: u32) {
    if (is_key) {
        keys[i >> 1u][i & 1u] = w;
    } else {
        values[i >> 1u][i & 1u] = w;
    }
}

// Quantizes values 64 * g .. 64 * g + 63 of new row `row` (token * kv_heads +
// kv head) into the cache at position past + token: per block of 32, the
// scale d = (largest magnitude / 127) rounded to f16 and each value as
// round(x / d) in -127..127.
fn store_q8(is_key: bool, row: u32, g: u32) {
    let src = row * HD4 + 16u * g;
    let dst = (p.past * p.kv_heads + row) * q8_row_words();
    var scales = 0u;
    for (var b = 0u; b < 2u; b++) {
        var amax = 0.0;
        for (var r = 0u; r < 8u; r++) {
            let a = abs(new_run(is_key, src + 8u * b + r));
            amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
        }
        let bits = pack2x16float(vec2<f32>(amax / 127.0, 0.0)) & 0xffffu;
        let d = unpack2x16float(bits).x;
        let inv = select(0.0, 1.0 / d, d > 0.0);
        for (var r = 0u; r < 8u; r++) {
            let qv = vec4<i32>(clamp(round(new_run(is_key, src + 8u * b + r) * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
            let u = vec4<u32>(bitcast<vec4<u32>>(qv) & vec4<u32>(0xffu));
            put_kv_word(is_key, dst + 16u * g + 8u * b + r, u.x | (u.y << 8u) | (u.z << 16u) | (u.w << 24u));
        }
        scales |= bits << (16u * b);
    }
    put_kv_word(is_key, dst + HD4 + g, scales);
}

@compute @workgroup_size(256)
fn kv_store_q8(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * WG + li;
    let per = HD / 64u;
    if (i < p.tokens * p.kv_heads * per) {
        store_q8(true, i / per, i % per);
        store_q8(false, i / per, i % per);
    }
}

// flash_merge: sums the chunks' partials of flash_attention (splits > 1)
// into `out`. One workgroup per (token, head) pair and block of MERGE_RUNS
// vec4 runs of the head; its 256 invocations are MERGE_GROUPS groups of
// MERGE_RUNS, group g summing chunks g, g + MERGE_GROUPS, .. of its run, so
// that each invocation has only a few loads to wait for, all issued at once.
// The pair's max and sum of exp come from every invocation's share of the
// chunks, reduced over subgroups and then over the workgroup.
const MERGE_RUNS: u32 = 8u;
const MERGE_GROUPS: u32 = WG / MERGE_RUNS;
// Chunks an invocation loads before it uses any.
const MERGE_LOADS: u32 = 4u;
// Chunks between an invocation's batches of loads.
const MERGE_STEP: u32 = MERGE_GROUPS * MERGE_LOADS;

var<workgroup> merge_red: array<f32, WG>;
var<workgroup> merge_acc: array<vec4<f32>, WG>;

fn partial_ml(pair: u32, c: u32) -> vec2<f32> {
    let b = (pair * p.splits + c) * (HD + 2u);
    return vec2<f32>(partials[b], partials[b + 1u]);
}

// The workgroup's total of `v` (max when `is_max`), through each
// subgroup's first lane.
fn workgroup_reduce(v: f32, is_max: bool, sg: u32, nsg: u32, lane: u32) -> f32 {
    let s = select(subgroupAdd(v), subgroupMax(v), is_max);
    workgroupBarrier();
    if (lane == 0u) {
        merge_red[sg] = s;
    }
    workgroupBarrier();
    var r = merge_red[0];
    for (var i = 1u; i < nsg; i++) {
        r = select(r + merge_red[i], max(r, merge_red[i]), is_max);
    }
    return r;
}

@compute @workgroup_size(256)
fn flash_merge(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let blocks = (HD4 + MERGE_RUNS - 1u) / MERGE_RUNS;
    let g = wid.y * nwg.x + wid.x;
    // Uniform per workgroup: the whole workgroup leaves or stays.
    if (g >= p.tokens * p.heads * blocks) {
        return;
    }
    let pair = g / blocks;
    var mx = NO_SCORE;
    for (var c = li; c < p.splits; c += WG) {
        mx = max(mx, partial_ml(pair, c).x);
    }
    mx = workgroup_reduce(mx, true, sg, nsg, lane);
    var l = 0.0;
    for (var c = li; c < p.splits; c += WG) {
        let ml = partial_ml(pair, c);
        l += ml.y * exp(ml.x - mx);
    }
    l = workgroup_reduce(l, false, sg, nsg, lane);

    let run = (g % blocks) * MERGE_RUNS + li % MERGE_RUNS;
    let group = li / MERGE_RUNS;
    var acc = vec4<f32>(0.0);
    if (run < HD4) {
        for (var c0 = group; c0 < p.splits; c0 += MERGE_STEP) {
            var w: array<f32, MERGE_LOADS>;
            var v: array<vec4<f32>, MERGE_LOADS>;
            for (var u = 0u; u < MERGE_LOADS; u++) {
                // Past the last chunk: the last one again, weighted 0.
                let c = c0 + u * MERGE_GROUPS;
                let b = (pair * p.splits + min(c, p.splits - 1u)) * (HD + 2u);
                w[u] = select(0.0, exp(partials[b] - mx), c < p.splits);
                let o = b + 2u + run * 4u;
                v[u] = vec4<f32>(partials[o], partials[o + 1u], partials[o + 2u], partials[o + 3u]);
            }
            for (var u = 0u; u < MERGE_LOADS; u++) {
                acc += w[u] * v[u];
            }
        }
    }
    merge_acc[li] = acc;
    workgroupBarrier();
    if (li < MERGE_RUNS && run < HD4) {
        var sum = vec4<f32>(0.0);
        for (var i = 0u; i < MERGE_GROUPS; i++) {
            sum += merge_acc[i * MERGE_RUNS + li];
        }
        out[pair * HD4 + run] = select(sum / l, vec4<f32>(0.0), l == 0.0);
    }
}
