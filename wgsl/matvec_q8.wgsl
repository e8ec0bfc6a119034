// matvec_q8: the one-token product of interleaved 4-bit weights (fmt 4, see
// weights.wgsl) with int8-quantized x: the wgpu backend's int8 mode
// (`MatmulMode::Int8`), the same idea as the CPU backend's int8 activations.
//
// With w = s_g * q + b_g per row and group g, and x ~ d * xq per 8 columns,
//   dot(w, x) = sum_words s_g * d * sum_m q_m xq_m + b_g * sum_m x_m,
// the first sum an integer dot product of the word's eight nibbles with eight
// int8 values (two `dot4I8Packed`), the second exact f32 sums of x.
//
// quantize_x8: x (binding 2, `tokens` rows of `x_cols` f32, a multiple of 32)
// to `x_cols / 8` entries a row (binding 5), entry e for columns c = 8e .. 8e + 7:
//   .x  int8 x[c], x[c+2], x[c+4], x[c+6] in bytes 0..3 (the even nibbles of a weight word),
//   .y  int8 x[c+1], x[c+3], x[c+5], x[c+7] (the odd nibbles),
//   .z  the f32 sum of the eight unquantized values (bits),
//   .w  d, the scale of their block of 32 columns (bits): xq = round(x * 127 / max|x|),
//       d = max|x| / 127 over the block (as the CPU backend's q8 and llama.cpp's Q8_0).
// One thread per block of 32 columns.
//
// matvec_q8: `out[out_off + r] = sum_c W[r, c] * x[c]` for one fmt-4 weight
// shard (bindings 1 and 6) and the quantized x (binding 4); one subgroup per
// four rows as matvec's rows4_q4i, grid-stride over rows along x.
//
// Bindings: 0 uniform Params; 1 w, 6 w_words; 2 xin f32; 3 out f32 (read-write);
// 4 xq (read), 5 xq_out (read-write), both `array<vec4<u32>>`.

struct Params {
    w: WeightDesc,
    rows: u32,
    tokens: u32,
    out_cols: u32,
    out_off: u32,
    x_cols: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> xq_out: array<vec4<u32>>;

// Four int8 values (each in -127..127) as the bytes of a u32, value k in byte k.
fn pack_i8(v: vec4<i32>) -> u32 {
    let b = bitcast<vec4<u32>>(v) & vec4<u32>(255u);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

@compute @workgroup_size(64)
fn quantize_x8(@builtin(global_invocation_id) gid: vec3<u32>) {
    let blk = gid.x;
    // Row gid.y of x (`tokens` rows, the entries of each row after the row before).
    let t = gid.y;
    if (blk >= p.x_cols / 32u || t >= max(p.tokens, 1u)) {
        return;
    }
    let xrow = t * (p.x_cols / 4u);
    let qrow = t * (p.x_cols / 8u);
    var v: array<vec4<f32>, 8>;
    var amax = 0.0;
    for (var k = 0u; k < 8u; k++) {
        v[k] = xin[xrow + 8u * blk + k];
        let a = abs(v[k]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    let d = amax / 127.0;
    var inv = 0.0;
    if (amax > 0.0) {
        inv = 127.0 / amax;
    }
    for (var e = 0u; e < 4u; e++) {
        // Columns 8e .. 8e+7 of the block: v[2e] then v[2e + 1].
        let a = v[2u * e];
        let b = v[2u * e + 1u];
        let qa = vec4<i32>(round(a * inv));
        let qb = vec4<i32>(round(b * inv));
        let even = pack_i8(vec4<i32>(qa.x, qa.z, qb.x, qb.z));
        let odd = pack_i8(vec4<i32>(qa.y, qa.w, qb.y, qb.w));
        let sum = (a.x + a.y) + (a.z + a.w) + ((b.x + b.y) + (b.z + b.w));
        xq_out[qrow + 4u * blk + e] = vec4<u32>(even, odd, bitcast<u32>(sum), bitcast<u32>(d));
    }
}

// One word (eight columns) of four rows: `wd` the rows' words, `pv` their
// groups' (scale, bias) pair words, `xe` the quantized x entry of the columns.
fn q4x8_word(acc: vec4<f32>, wd: vec4<u32>, pv: vec4<u32>, xe: vec4<u32>, f16s: bool) -> vec4<f32> {
    let nib = vec4<u32>(0x0F0F0F0Fu);
    let lo = wd & nib;
    let hi = (wd >> vec4<u32>(4u)) & nib;
    let q = vec4<i32>(
        dot4I8Packed(lo.x, xe.x) + dot4I8Packed(hi.x, xe.y),
        dot4I8Packed(lo.y, xe.x) + dot4I8Packed(hi.y, xe.y),
        dot4I8Packed(lo.z, xe.x) + dot4I8Packed(hi.z, xe.y),
        dot4I8Packed(lo.w, xe.x) + dot4I8Packed(hi.w, xe.y),
    );
    let sb = q4i_scale_bias(pv, f16s);
    let dx = bitcast<f32>(xe.w);
    let sx = bitcast<f32>(xe.z);
    return fma(sb.s * dx, vec4<f32>(q), fma(sb.b, vec4<f32>(sx), acc));
}

// The (scale, bias) pair words of group `g` of four rows whose pairs start at words `pb`.
fn q4x8_pairs(pb: vec4<u32>, g: u32) -> vec4<u32> {
    return vec4<u32>(w_words[pb.x + g], w_words[pb.y + g], w_words[pb.z + g], w_words[pb.w + g]);
}

// This lane's partial dot products of four consecutive fmt-4 rows (row0 ..
// row0 + nrows - 1, nrows <= 4; rows past the end repeat the last row and
// their sums are never written) with the quantized x. Lane i takes chunk i
// (then i + lanes, ...); word k of chunk i covers the eight columns from
// 1024j + 8tk + 8v (tile j, lane v, t chunks in the tile), i.e. x entry
// (that column) / 8, which the lanes of a subgroup read contiguously.
fn rows4_q4x8(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let r = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wb = r * chunks;
    let pb = d.scales_off + r * gpr;
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = w[wb.x + i];
        let w1 = w[wb.y + i];
        let w2 = w[wb.z + i];
        let w3 = w[wb.w + i];
        let c = q4i_cols(chunks, i);
        let g = c >> vec4<u32>(gshift);
        let e = c >> vec4<u32>(3u);
        let p0 = q4x8_pairs(pb, g.x);
        let p1 = q4x8_pairs(pb, g.y);
        let p2 = q4x8_pairs(pb, g.z);
        let p3 = q4x8_pairs(pb, g.w);
        acc = q4x8_word(acc, vec4<u32>(w0.x, w1.x, w2.x, w3.x), p0, xq[e.x], f16s);
        acc = q4x8_word(acc, vec4<u32>(w0.y, w1.y, w2.y, w3.y), p1, xq[e.y], f16s);
        acc = q4x8_word(acc, vec4<u32>(w0.z, w1.z, w2.z, w3.z), p2, xq[e.z], f16s);
        acc = q4x8_word(acc, vec4<u32>(w0.w, w1.w, w2.w, w3.w), p3, xq[e.w], f16s);
    }
    return acc;
}

// rows4_q4x8 for up to four tokens at once (matvec_q8_tokens): token t's
// quantized x from entry `qb + t * qstride`. Each chunk's weights and pairs
// are loaded once for every token, and each token's sums are formed by the
// same operations in the same order as rows4_q4x8's.
fn rows4_q4x8_tokens(d: WeightDesc, row0: u32, nrows: u32, qb: u32, qstride: u32, ntok: u32,
    lane: u32, lanes: u32, f16s: bool) -> array<vec4<f32>, 4> {
    var acc: array<vec4<f32>, 4>;
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let r = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wb = r * chunks;
    let pb = d.scales_off + r * gpr;
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = w[wb.x + i];
        let w1 = w[wb.y + i];
        let w2 = w[wb.z + i];
        let w3 = w[wb.w + i];
        let c = q4i_cols(chunks, i);
        let g = c >> vec4<u32>(gshift);
        let e = c >> vec4<u32>(3u);
        let p0 = q4x8_pairs(pb, g.x);
        let p1 = q4x8_pairs(pb, g.y);
        let p2 = q4x8_pairs(pb, g.z);
        let p3 = q4x8_pairs(pb, g.w);
        for (var t = 0u; t < ntok; t++) {
            let q = qb + t * qstride;
            var a = acc[t];
            a = q4x8_word(a, vec4<u32>(w0.x, w1.x, w2.x, w3.x), p0, xq[q + e.x], f16s);
            a = q4x8_word(a, vec4<u32>(w0.y, w1.y, w2.y, w3.y), p1, xq[q + e.y], f16s);
            a = q4x8_word(a, vec4<u32>(w0.z, w1.z, w2.z, w3.z), p2, xq[q + e.z], f16s);
            a = q4x8_word(a, vec4<u32>(w0.w, w1.w, w2.w, w3.w), p3, xq[q + e.w], f16s);
            acc[t] = a;
        }
    }
    return acc;
}

// matvec_q8 for two to eight tokens (workgroup_id.y selects tokens
// 4y..4y+3): out[t, out_off + r], each token's result matvec_q8's for it
// alone, bit for bit.
@compute @workgroup_size(128)
fn matvec_q8_tokens(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let t0 = wid.y * 4u;
    let ntok = min(4u, p.tokens - t0);
    let qstride = p.x_cols / 8u;
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        var part: array<vec4<f32>, 4>;
        if (p.w.scale_kind == 1u) {
            part = rows4_q4x8_tokens(p.w, row0, nrows, t0 * qstride, qstride, ntok, lane, lanes, true);
        } else {
            part = rows4_q4x8_tokens(p.w, row0, nrows, t0 * qstride, qstride, ntok, lane, lanes, false);
        }
        for (var t = 0u; t < 4u; t++) {
            let total = subgroupAdd(part[t]);
            if (lane == 0u && t < ntok) {
                for (var r = 0u; r < nrows; r++) {
                    out[(t0 + t) * p.out_cols + p.out_off + row0 + r] = total[r];
                }
            }
        }
    }
}

@compute @workgroup_size(128)
fn matvec_q8(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        var part: vec4<f32>;
        if (p.w.scale_kind == 1u) {
            part = rows4_q4x8(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows4_q4x8(p.w, row0, nrows, lane, lanes, false);
        }
        let total = subgroupAdd(part);
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                out[p.out_off + row0 + r] = total[r];
            }
        }
    }
}

