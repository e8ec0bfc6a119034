// flash_coop: a prompt's causal grouped-query attention over an f16 cache on
// the GPU's matrix units (cooperative 16 x 16 f16 matrices into f32; see
// matmul_coop.wgsl for where they exist), for heads of 128 in groups of at
// 1, 2, 4 or 8 query heads per kv head. flash_attention.wgsl's kernel does decode,
// the exact mode (an f32 cache) and every other shape.
//
// flash_coop_q16 first writes q * scale as f16 (q16), padded with zero rows
// to whole blocks of 128 tokens (the most a workgroup takes). Then one workgroup of flash_coop takes one
// kv head and 16 * 8 / group consecutive tokens; its subgroup s (of eight, 32
// invocations each) takes query head s % group of that kv head and the
// block of 16 tokens s / group, holding the block's q as eight 16 x 16
// matrices and its output as eight f32 accumulators. Keys go in tiles of 32
// up to the workgroup's last position, twice: the first pass finds each
// row's largest score, the second adds exp(score - largest) * value with
// that final largest score, so no accumulator is ever rescaled (the matrix
// units give no access to a row of one). Each tile's scores go through
// workgroup memory, where two invocations a row (16 keys each) mask them
// (keys past a row's position), take the max or the exponentials and their
// sum, and write the weights back as f16 for the products with the values.
// Keys, values and q16 are read as matrices straight from their buffers
// (key runs of 32 bytes; the eight subgroups read the same tiles).
//
// The weights and q are rounded to f16 (q * scale: a relative 2^-11, as the
// cache's keys and values already are), the products summed in f32 in the
// matrix units' order: the int8 mode's attention only (an f16 cache), judged
// like the rest of that mode by perplexity.
//
// Bindings: 0 uniform Params (flash_attention.wgsl's; tokens, heads,
// kv_heads, past, scale are read); 2 q [tokens, heads * 128] f32; 3 out (the
// same shape); 4 keys, 5 values [positions, kv_heads * 128] f16 (a capacity
// of whole 256 positions, so a tile never reads past it); 7 q16
// [tokens rounded up to 128, heads * 128] f16.

enable f16;
enable wgpu_cooperative_matrix;

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    past: u32,
    tb: u32,
    slices: u32,
    splits: u32,
    chunk: u32,
    scale: f32,
    fresh: u32,
    kv: u32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> keys: array<f16>;
@group(0) @binding(5) var<storage, read> values: array<f16>;
@group(0) @binding(7) var<storage, read_write> q16: array<f16>;

const HD: u32 = 128u;
// Keys per tile.
const BC: u32 = 32u;
// Row strides of a subgroup's scores (f32) and weights (f16): 144 and 80
// bytes, whole 16-byte units.
const SS: u32 = 36u;
const PS: u32 = 40u;
const NO_SCORE: f32 = -3.0e38;

// Each subgroup's 16 rows: scores (then two output matrices at a time) and weights.
var<workgroup> s_sh: array<f32, 4608>;
var<workgroup> p_sh: array<f16, 5120>;

@compute @workgroup_size(256)
fn flash_coop_q16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let rows = (p.tokens + 127u) / 128u * 128u * p.heads;
    if (i >= rows * HD) {
        return;
    }
    var v = 0.0;
    if (i < p.tokens * p.heads * HD) {
        v = q[i] * p.scale;
    }
    q16[i] = f16(v);
}

// The scores of the subgroup's 16 rows against keys j0 .. j0 + 32, into its
// part of s_sh (row-major, SS apart).
fn scores(qm: array<coop_mat16x16<f16, A>, 8>, j0: u32, kbase: u32, sbase: u32) {
    let kvs = p.kv_heads * HD;
    var s0 = coop_mat16x16<f32, C>();
    var s1 = coop_mat16x16<f32, C>();
    for (var d = 0u; d < 8u; d++) {
        let k0 = coopLoad<coop_mat16x16<f16, B>>(&keys[j0 * kvs + kbase + 16u * d], kvs);
        let k1 = coopLoad<coop_mat16x16<f16, B>>(&keys[(j0 + 16u) * kvs + kbase + 16u * d], kvs);
        s0 = coopMultiplyAdd(qm[d], k0, s0);
        s1 = coopMultiplyAdd(qm[d], k1, s1);
    }
    coopStoreT(s0, &s_sh[sbase], SS);
    coopStoreT(s1, &s_sh[sbase + 16u], SS);
}

@compute @workgroup_size(256)
fn flash_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let group = p.heads / p.kv_heads;
    let per_wg = 16u * (8u / group);
    let blocks = (p.tokens + per_wg - 1u) / per_wg;
    let g = wid.y * nwg.x + wid.x;
    if (g >= p.kv_heads * blocks) {
        return;
    }
    let kh = g % p.kv_heads;
    // Later blocks (more keys) first.
    let block = blocks - 1u - g / p.kv_heads;
    let wt0 = block * per_wg;
    let n_keys = p.past + min(p.tokens, wt0 + per_wg);
    // This subgroup's head and block of tokens (group divides 8).
    let h = kh * group + sg % group;
    let t0 = wt0 + 16u * (sg / group);
    // This invocation's row and half of each tile's keys.
    let r = lane / 2u;
    let half = lane % 2u;
    let t = t0 + r;
    let pos = p.past + t;
    let sbase = sg * 16u * SS;
    let pbase = sg * 16u * PS;
    let kbase = kh * HD;

    var qm: array<coop_mat16x16<f16, A>, 8>;
    let qrow = p.heads * HD;
    for (var d = 0u; d < 8u; d++) {
        qm[d] = coopLoadT<coop_mat16x16<f16, A>>(&q16[t0 * qrow + h * HD + 16u * d], qrow);
    }

    // Pass 1: each row's largest score.
    var m = NO_SCORE;
    for (var j0 = 0u; j0 < n_keys; j0 += BC) {
        scores(qm, j0, kbase, sbase);
        workgroupBarrier();
        for (var i = 0u; i < 16u; i++) {
            let j = j0 + 16u * half + i;
            if (j <= pos) {
                m = max(m, s_sh[sbase + r * SS + 16u * half + i]);
            }
        }
        workgroupBarrier();
    }
    m = max(m, subgroupShuffleXor(m, 1u));

    // Pass 2: the weights and their sum, and the weighted values.
    let kvs = p.kv_heads * HD;
    var o: array<coop_mat16x16<f32, C>, 8>;
    for (var d = 0u; d < 8u; d++) {
        o[d] = coop_mat16x16<f32, C>();
    }
    var l = 0.0;
    for (var j0 = 0u; j0 < n_keys; j0 += BC) {
        scores(qm, j0, kbase, sbase);
        workgroupBarrier();
        for (var i = 0u; i < 16u; i++) {
            let j = j0 + 16u * half + i;
            var e = 0.0;
            if (j <= pos) {
                e = exp(s_sh[sbase + r * SS + 16u * half + i] - m);
            }
            l += e;
            p_sh[pbase + r * PS + 16u * half + i] = f16(e);
        }
        workgroupBarrier();
        let w0 = coopLoadT<coop_mat16x16<f16, A>>(&p_sh[pbase], PS);
        let w1 = coopLoadT<coop_mat16x16<f16, A>>(&p_sh[pbase + 16u], PS);
        for (var d = 0u; d < 8u; d++) {
            let v0 = coopLoadT<coop_mat16x16<f16, B>>(&values[j0 * kvs + kbase + 16u * d], kvs);
            let v1 = coopLoadT<coop_mat16x16<f16, B>>(&values[(j0 + 16u) * kvs + kbase + 16u * d], kvs);
            o[d] = coopMultiplyAdd(w1, v1, coopMultiplyAdd(w0, v0, o[d]));
        }
        workgroupBarrier();
    }
    l += subgroupShuffleXor(l, 1u);

    // The outputs, 32 columns at a time through the subgroup's scores.
    for (var d = 0u; d < 8u; d += 2u) {
        coopStoreT(o[d], &s_sh[sbase], SS);
        coopStoreT(o[d + 1u], &s_sh[sbase + 16u], SS);
        workgroupBarrier();
        if (t < p.tokens) {
            let at = (t * p.heads + h) * HD + 16u * d + 16u * half;
            for (var i = 0u; i < 16u; i++) {
                out[at + i] = s_sh[sbase + r * SS + 16u * half + i] / l;
            }
        }
        workgroupBarrier();
    }
}
