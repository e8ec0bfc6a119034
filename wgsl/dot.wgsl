// Row-times-vector products over a weight shard, one subgroup per weight row
// (prepended, after weights.wgsl, to matvec.wgsl, matvec_q8.wgsl and moe.wgsl).
//
// Needs binding 2, `xin: array<vec4<f32>>`, declared by the kernel file: input
// rows of `cols` floats (cols a multiple of 4). Each lane takes every
// `lanes`-th 16-byte chunk of the weight row (one vec4<u32> load), so a
// subgroup reads a row with full-width coalesced loads; the caller sums lanes
// with subgroupAdd.

fn nibbles_lo(word: u32) -> vec4<f32> {
    return vec4<f32>(f32(word & 15u), f32((word >> 4u) & 15u), f32((word >> 8u) & 15u), f32((word >> 12u) & 15u));
}

fn nibbles_hi(word: u32) -> vec4<f32> {
    return vec4<f32>(f32((word >> 16u) & 15u), f32((word >> 20u) & 15u), f32((word >> 24u) & 15u), f32(word >> 28u));
}

fn bytes4(word: u32) -> vec4<f32> {
    return vec4<f32>(f32(word & 255u), f32((word >> 8u) & 255u), f32((word >> 16u) & 255u), f32(word >> 24u));
}

fn crumbs4(word: u32, shift: u32) -> vec4<f32> {
    let v = word >> shift;
    return vec4<f32>(f32(v & 3u), f32((v >> 2u) & 3u), f32((v >> 4u) & 3u), f32((v >> 6u) & 3u));
}

// 2^23 as f32 bits: OR-ing an integer n < 2^23 into its mantissa gives 2^23 + n
// exactly, so subtracting 2^23 converts n without a (slow) int-to-float op.
const MAGIC_BITS: u32 = 0x4B000000u;
const MAGIC: f32 = 8388608.0;

// Nibbles 0..3 of the low 16 bits of `h`, each left in place: q_k * 16^k.
fn magic4(h: u32) -> vec4<f32> {
    let v = vec4<u32>(h & 0xFu, h & 0xF0u, h & 0xF00u, h & 0xF000u);
    return bitcast<vec4<f32>>(v | vec4<u32>(MAGIC_BITS)) - vec4<f32>(MAGIC);
}

// The four bytes of `word` as (q0, q1 * 256, q2, q3 * 256).
fn magic8(word: u32) -> vec4<f32> {
    let hi = word >> 16u;
    let v = vec4<u32>(word & 0xFFu, word & 0xFF00u, hi & 0xFFu, hi & 0xFF00u);
    return bitcast<vec4<f32>>(v | vec4<u32>(MAGIC_BITS)) - vec4<f32>(MAGIC);
}

fn halves(word: u32, kind: u32) -> vec2<f32> {
    if (kind == 1u) {
        return unpack2x16float(word);
    }
    return vec2<f32>(bitcast<f32>(word << 16u), bitcast<f32>(word & 0xffff0000u));
}

// Contribution of chunk `c` (16 bytes, already loaded as `wv`) of weight row
// `row` to its dot product with the x row starting at vec4 index `xr`.
fn chunk_dot(d: WeightDesc, wv: vec4<u32>, c: u32, row: u32, xr: u32) -> f32 {
    let one = vec4<f32>(1.0);
    if (d.fmt == 4u) {
        // Interleaved 4-bit (see weights.wgsl): word k holds 8 columns from
        // 1024j + 8tk + 8v, one group each.
        let j = c >> 5u;
        let v = c & 31u;
        let t = min(32u, d.row_words / 4u - 32u * j);
        var acc = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let col0 = 1024u * j + 8u * (t * k + v);
            let xa = xin[xr + col0 / 4u];
            let xb = xin[xr + col0 / 4u + 1u];
            let qx = dot(nibbles_lo(wv[k]), xa) + dot(nibbles_hi(wv[k]), xb);
            let sb = sb_pair(w_word(d.scales_off + (row * d.cols + col0) / d.group_size), d.scale_kind);
            acc += sb.x * qx + sb.y * dot(xa + xb, one);
        }
        return acc;
    }
    if (d.fmt == 3u) {
        if (d.bits == 4u) {
            // 32 values, all in one quantization group.
            let col0 = c * 32u;
            let g = (row * d.cols + col0) / d.group_size;
            let xi = xr + c * 8u;
            var qx = 0.0;
            var sx = 0.0;
            for (var k = 0u; k < 4u; k++) {
                let xa = xin[xi + 2u * k];
                let xb = xin[xi + 2u * k + 1u];
                qx += dot(nibbles_lo(wv[k]), xa) + dot(nibbles_hi(wv[k]), xb);
                sx += dot(xa + xb, one);
            }
            return w_scale(d, g) * qx + w_bias(d, g) * sx;
        }
        if (d.bits == 8u) {
            let col0 = c * 16u;
            let g = (row * d.cols + col0) / d.group_size;
            let xi = xr + c * 4u;
            var qx = 0.0;
            var sx = 0.0;
            for (var k = 0u; k < 4u; k++) {
                let xa = xin[xi + k];
                qx += dot(bytes4(wv[k]), xa);
                sx += dot(xa, one);
            }
            return w_scale(d, g) * qx + w_bias(d, g) * sx;
        }
        // 2 bits: 16 values per word; a chunk may span two groups of 32.
        var acc = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let col0 = c * 64u + k * 16u;
            let g = (row * d.cols + col0) / d.group_size;
            let xi = xr + c * 16u + k * 4u;
            var qx = 0.0;
            var sx = 0.0;
            for (var m = 0u; m < 4u; m++) {
                let xa = xin[xi + m];
                qx += dot(crumbs4(wv[k], 8u * m), xa);
                sx += dot(xa, one);
            }
            acc += w_scale(d, g) * qx + w_bias(d, g) * sx;
        }
        return acc;
    }
    if (d.fmt == 0u) {
        return dot(bitcast<vec4<f32>>(wv), xin[xr + c]);
    }
    let xi = xr + c * 2u;
    let a = vec4<f32>(halves(wv.x, d.fmt), halves(wv.y, d.fmt));
    let b = vec4<f32>(halves(wv.z, d.fmt), halves(wv.w, d.fmt));
    return dot(a, xin[xi]) + dot(b, xin[xi + 1u]);
}

// This lane's partial dot products of weight row `row` with up to four x rows:
// x row t starts at vec4 index `xbase + t * xstride`.
fn lane_dot(d: WeightDesc, row: u32, xbase: u32, xstride: u32, ntok: u32, lane: u32, lanes: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let chunks = d.row_words / 4u;
    let first = row * chunks;
    for (var c = lane; c < chunks; c += lanes) {
        let wv = w[first + c];
        for (var t = 0u; t < ntok; t++) {
            acc[t] += chunk_dot(d, wv, c, row, xbase + t * xstride);
        }
    }
    return acc;
}

// One 16-byte chunk of a 4-bit row, already loaded, against pre-scaled x
// (s0..s7): the sum of q * x before its group's scale.
fn q4_chunk(wv: vec4<u32>, s0: vec4<f32>, s1: vec4<f32>, s2: vec4<f32>, s3: vec4<f32>,
    s4: vec4<f32>, s5: vec4<f32>, s6: vec4<f32>, s7: vec4<f32>) -> f32 {
    return dot(magic4(wv.x), s0) + dot(magic4(wv.x >> 16u), s1)
        + dot(magic4(wv.y), s2) + dot(magic4(wv.y >> 16u), s3)
        + dot(magic4(wv.z), s4) + dot(magic4(wv.z >> 16u), s5)
        + dot(magic4(wv.w), s6) + dot(magic4(wv.w >> 16u), s7);
}

// One 16-byte chunk of an 8-bit row, already loaded, against pre-scaled x
// (s0..s3).
fn q8_chunk(wv: vec4<u32>, s0: vec4<f32>, s1: vec4<f32>, s2: vec4<f32>, s3: vec4<f32>) -> f32 {
    return dot(magic8(wv.x), s0) + dot(magic8(wv.y), s1) + dot(magic8(wv.z), s2) + dot(magic8(wv.w), s3);
}

// Element g (one per component) of the float array of kind `kind` (0 f32,
// 1 f16, 2 bf16) at word `base`: all four loads are issued before any value
// is used (a load behind a branch on the kind waits for it).
fn packed_floats4(base: u32, g: vec4<u32>, kind: u32) -> vec4<f32> {
    let i = select(g >> vec4<u32>(1u), g, kind == 0u);
    let words = vec4<u32>(w_words[base + i.x], w_words[base + i.y], w_words[base + i.z], w_words[base + i.w]);
    if (kind == 0u) {
        return bitcast<vec4<f32>>(words);
    }
    let h = (words >> ((g & vec4<u32>(1u)) * 16u)) & vec4<u32>(0xffffu);
    if (kind == 1u) {
        return vec4<f32>(unpack2x16float(h.x).x, unpack2x16float(h.y).x, unpack2x16float(h.z).x, unpack2x16float(h.w).x);
    }
    return bitcast<vec4<f32>>(h << vec4<u32>(16u));
}

// Four 8-bit affine rows' chunk `c` (16 columns, group gc) against x0..x3:
// bytes used in place as q * 256^(k % 2) (see magic8), x pre-scaled to match.
fn q8_step4(d: WeightDesc, rows: vec4<u32>, chunks: u32, c: u32, gc: u32, gpr: u32,
    x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> vec4<f32> {
    let byte_scale = vec4<f32>(1.0, 0.00390625, 1.0, 0.00390625);
    let sx = dot(x0 + x1 + x2 + x3, vec4<f32>(1.0));
    let s0 = x0 * byte_scale;
    let s1 = x1 * byte_scale;
    let s2 = x2 * byte_scale;
    let s3 = x3 * byte_scale;
    let k = affine_chunk4(d, rows, chunks, c, gc, gpr);
    let q = vec4<f32>(q8_chunk(k.w0, s0, s1, s2, s3), q8_chunk(k.w1, s0, s1, s2, s3), q8_chunk(k.w2, s0, s1, s2, s3),
        q8_chunk(k.w3, s0, s1, s2, s3));
    return k.s * q + k.b * sx;
}

// Four rows' chunk `c` of an affine (fmt 3) weight: the rows' words, then
// the scale and bias of each row's group, loaded together.
struct AffineChunk4 {
    w0: vec4<u32>,
    w1: vec4<u32>,
    w2: vec4<u32>,
    w3: vec4<u32>,
    s: vec4<f32>,
    b: vec4<f32>,
}

fn affine_chunk4(d: WeightDesc, rows: vec4<u32>, chunks: u32, c: u32, gc: u32, gpr: u32) -> AffineChunk4 {
    let g = rows * gpr + vec4<u32>(gc);
    return AffineChunk4(w[rows.x * chunks + c], w[rows.y * chunks + c], w[rows.z * chunks + c], w[rows.w * chunks + c],
        packed_floats4(d.scales_off, g, d.scale_kind), packed_floats4(d.biases_off, g, d.scale_kind));
}

// This lane's partial dot products of four consecutive weight rows
// (row0 .. row0 + nrows - 1, nrows <= 4) with one x row starting at vec4 index
// `xb`. For 4- and 8-bit weights the x chunk is loaded once and reused for
// the four rows, which keeps x traffic from the caches well under the weight
// stream; other formats fall back to one row at a time.
fn rows_dot(d: WeightDesc, row0: u32, nrows: u32, xb: u32, lane: u32, lanes: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let one = vec4<f32>(1.0);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let groups_per_row = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let rows = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    if (d.fmt == 3u && d.bits == 4u) {
        // x pre-scaled by 16^-k so that nibble k of each 16-bit half can be
        // used in place as q * 16^k (see magic4): no int-to-float conversions.
        let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
        for (var c = lane; c < chunks; c += lanes) {
            let xi = xb + c * 8u;
            let x0 = xin[xi];
            let x1 = xin[xi + 1u];
            let x2 = xin[xi + 2u];
            let x3 = xin[xi + 3u];
            let x4 = xin[xi + 4u];
            let x5 = xin[xi + 5u];
            let x6 = xin[xi + 6u];
            let x7 = xin[xi + 7u];
            let sx = dot(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, one);
            let s0 = x0 * ns;
            let s1 = x1 * ns;
            let s2 = x2 * ns;
            let s3 = x3 * ns;
            let s4 = x4 * ns;
            let s5 = x5 * ns;
            let s6 = x6 * ns;
            let s7 = x7 * ns;
            // Four rows (rows past the end repeat the last row; their sums are
            // never written), every load of the step issued first.
            let k = affine_chunk4(d, rows, chunks, c, (c * 32u) >> gshift, groups_per_row);
            let q = vec4<f32>(q4_chunk(k.w0, s0, s1, s2, s3, s4, s5, s6, s7), q4_chunk(k.w1, s0, s1, s2, s3, s4, s5, s6, s7),
                q4_chunk(k.w2, s0, s1, s2, s3, s4, s5, s6, s7), q4_chunk(k.w3, s0, s1, s2, s3, s4, s5, s6, s7));
            acc += k.s * q + k.b * sx;
        }
        return acc;
    }
    if (d.fmt == 3u && d.bits == 8u) {
        for (var c = lane; c < chunks; c += lanes) {
            let xi = xb + c * 4u;
            acc += q8_step4(d, rows, chunks, c, (c * 16u) >> gshift, groups_per_row, xin[xi], xin[xi + 1u], xin[xi + 2u], xin[xi + 3u]);
        }
        return acc;
    }
    for (var r = 0u; r < 4u; r++) {
        if (r < nrows) {
            acc[r] = lane_dot(d, row0 + r, xb, 0u, 1u, lane, lanes).x;
        }
    }
    return acc;
}

// Eight rows' partial sums (rows past the end repeat the last row; their
// sums are never written).
struct Acc8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

// Four (scale, bias) pair words (f16 pairs, or bf16 with the scale in the
// low half) as f32 scales and biases.
struct ScaleBias {
    s: vec4<f32>,
    b: vec4<f32>,
}

fn q4i_scale_bias(pv: vec4<u32>, f16s: bool) -> ScaleBias {
    if (f16s) {
        let h0 = unpack2x16float(pv.x);
        let h1 = unpack2x16float(pv.y);
        let h2 = unpack2x16float(pv.z);
        let h3 = unpack2x16float(pv.w);
        return ScaleBias(vec4<f32>(h0.x, h1.x, h2.x, h3.x), vec4<f32>(h0.y, h1.y, h2.y, h3.y));
    }
    return ScaleBias(bitcast<vec4<f32>>(pv << vec4<u32>(16u)), bitcast<vec4<f32>>(pv & vec4<u32>(0xffff0000u)));
}

// Columns of the first value of each of the four words of lane chunk `i` of
// an interleaved row of `chunks` chunks: 1024j + 8tk + 8v for word k (tile j,
// lane v, t chunks in the tile).
fn q4i_cols(chunks: u32, i: u32) -> vec4<u32> {
    let j = i >> 5u;
    let t = min(32u, chunks - 32u * j);
    let c0 = 1024u * j + 8u * (i & 31u);
    return vec4<u32>(c0, c0 + 8u * t, c0 + 16u * t, c0 + 24u * t);
}

// One interleaved 4-bit chunk (see weights.wgsl) of one row, already loaded
// (`wv`, and `pv` its four words' (scale, bias) pairs), against the
// pre-scaled x of its four words (s0..s7) and their sums (sx).
fn q4i_part(wv: vec4<u32>, pv: vec4<u32>, f16s: bool,
    s0: vec4<f32>, s1: vec4<f32>, s2: vec4<f32>, s3: vec4<f32>,
    s4: vec4<f32>, s5: vec4<f32>, s6: vec4<f32>, s7: vec4<f32>, sx: vec4<f32>) -> f32 {
    let q = vec4<f32>(
        dot(magic4(wv.x), s0) + dot(magic4(wv.x >> 16u), s1),
        dot(magic4(wv.y), s2) + dot(magic4(wv.y >> 16u), s3),
        dot(magic4(wv.z), s4) + dot(magic4(wv.z >> 16u), s5),
        dot(magic4(wv.w), s6) + dot(magic4(wv.w >> 16u), s7));
    let sb = q4i_scale_bias(pv, f16s);
    return dot(sb.s, q) + dot(sb.b, sx);
}

// The four (scale, bias) pair words of a chunk whose words are in groups `g`
// of the row whose pairs start at word `pb`.
fn q4i_pairs(pb: u32, g: vec4<u32>) -> vec4<u32> {
    return vec4<u32>(w_words[pb + g.x], w_words[pb + g.y], w_words[pb + g.z], w_words[pb + g.w]);
}

// x of one interleaved chunk for the rows*_q4i loops: lane chunk `i`.
struct XChunk {
    s0: vec4<f32>, s1: vec4<f32>, s2: vec4<f32>, s3: vec4<f32>,
    s4: vec4<f32>, s5: vec4<f32>, s6: vec4<f32>, s7: vec4<f32>,
    sx: vec4<f32>,
    g: vec4<u32>,
}

fn q4i_x(chunks: u32, gshift: u32, xb: u32, i: u32) -> XChunk {
    let one = vec4<f32>(1.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let c = q4i_cols(chunks, i);
    let xi = xb + (c >> vec4<u32>(2u));
    let x0 = xin[xi.x];
    let x1 = xin[xi.x + 1u];
    let x2 = xin[xi.y];
    let x3 = xin[xi.y + 1u];
    let x4 = xin[xi.z];
    let x5 = xin[xi.z + 1u];
    let x6 = xin[xi.w];
    let x7 = xin[xi.w + 1u];
    let sx = vec4<f32>(dot(x0 + x1, one), dot(x2 + x3, one), dot(x4 + x5, one), dot(x6 + x7, one));
    return XChunk(x0 * ns, x1 * ns, x2 * ns, x3 * ns, x4 * ns, x5 * ns, x6 * ns, x7 * ns, sx, c >> vec4<u32>(gshift));
}

// This lane's partial dot products of four consecutive interleaved 4-bit rows
// (matvec_q4, the MoE kernels; a quad's chunks may be shared by several
// subgroups through `lane` and `lanes`).
fn rows4_q4i(d: WeightDesc, row0: u32, nrows: u32, xb: u32, lane: u32, lanes: u32, f16s: bool) -> vec4<f32> {
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
        let x = q4i_x(chunks, gshift, xb, i);
        let p0 = q4i_pairs(pb.x, x.g);
        let p1 = q4i_pairs(pb.y, x.g);
        let p2 = q4i_pairs(pb.z, x.g);
        let p3 = q4i_pairs(pb.w, x.g);
        acc.x += q4i_part(w0, p0, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.y += q4i_part(w1, p1, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.z += q4i_part(w2, p2, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.w += q4i_part(w3, p3, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
    }
    return acc;
}

// rows4_q4i for up to four tokens at once (matvec_q4_tokens): the x rows
// start at vec4 `xb` and `xstride` apart. Each chunk's weights and (scale,
// bias) pairs are loaded once for every token, and each token's sums are
// formed by the same operations in the same order as rows4_q4i's, so a
// row's result is the same whatever the number of tokens beside it.
fn rows4_q4i_tokens(d: WeightDesc, row0: u32, nrows: u32, xb: u32, xstride: u32, ntok: u32,
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
        let g = q4i_cols(chunks, i) >> vec4<u32>(gshift);
        let p0 = q4i_pairs(pb.x, g);
        let p1 = q4i_pairs(pb.y, g);
        let p2 = q4i_pairs(pb.z, g);
        let p3 = q4i_pairs(pb.w, g);
        for (var t = 0u; t < ntok; t++) {
            let x = q4i_x(chunks, gshift, xb + t * xstride, i);
            acc[t].x += q4i_part(w0, p0, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
            acc[t].y += q4i_part(w1, p1, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
            acc[t].z += q4i_part(w2, p2, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
            acc[t].w += q4i_part(w3, p3, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        }
    }
    return acc;
}

// This lane's partial dot products of eight consecutive interleaved 4-bit
// rows (row0 .. row0 + nrows - 1, nrows <= 8) with the x row starting at vec4
// index `xb`. Lane i of a subgroup takes chunk i (then i + lanes, ...): with
// 32 lanes that is one tile, whose x the lanes read as one contiguous 1 KB
// run per word, and whose weights they read as one contiguous 512-byte run
// per row. x is loaded once per chunk for all eight rows.
fn rows8_q4i(d: WeightDesc, row0: u32, nrows: u32, xb: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var acc = Acc8(vec4<f32>(0.0), vec4<f32>(0.0));
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wa = ra * chunks;
    let wb = rb * chunks;
    let pa = d.scales_off + ra * gpr;
    let pb = d.scales_off + rb * gpr;
    for (var i = lane; i < chunks; i += lanes) {
        // Every weight load of the chunk is issued before any is used.
        let w0 = w[wa.x + i];
        let w1 = w[wa.y + i];
        let w2 = w[wa.z + i];
        let w3 = w[wa.w + i];
        let w4 = w[wb.x + i];
        let w5 = w[wb.y + i];
        let w6 = w[wb.z + i];
        let w7 = w[wb.w + i];
        let x = q4i_x(chunks, gshift, xb, i);
        let p0 = q4i_pairs(pa.x, x.g);
        let p1 = q4i_pairs(pa.y, x.g);
        let p2 = q4i_pairs(pa.z, x.g);
        let p3 = q4i_pairs(pa.w, x.g);
        let p4 = q4i_pairs(pb.x, x.g);
        let p5 = q4i_pairs(pb.y, x.g);
        let p6 = q4i_pairs(pb.z, x.g);
        let p7 = q4i_pairs(pb.w, x.g);
        acc.a.x += q4i_part(w0, p0, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.a.y += q4i_part(w1, p1, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.a.z += q4i_part(w2, p2, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.a.w += q4i_part(w3, p3, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.b.x += q4i_part(w4, p4, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.b.y += q4i_part(w5, p5, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.b.z += q4i_part(w6, p6, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.b.w += q4i_part(w7, p7, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
    }
    return acc;
}
