// matvec: `out[t, out_off + r] = sum_c W[r, c] * x[t, c]` for one weight shard,
// any storage format (f32/f16/bf16, affine 2/4/8-bit; see weights.wgsl).
// One token (decode): one subgroup per four weight rows, x loaded once per
// chunk for all four (see rows_dot); interleaved 4-bit weights (fmt 4): one
// subgroup per eight rows (see rows8_q4i), or four for matrices of fewer
// than 8192 rows (rows4_q4i), which need the parallelism more. Two to four tokens per workgroup row
// (workgroup_id.y selects tokens 4y..4y+3): one subgroup per weight row, each
// weight byte read once per four tokens. Grid-stride over rows along x.
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (weight shard, see weights.wgsl); 2 xin [tokens, x_cols] f32;
// 3 out [tokens, out_cols] f32 (read-write).

struct Params {
    w: WeightDesc,
    rows: u32,
    tokens: u32,
    out_cols: u32,
    out_off: u32,
    x_cols: u32,
    // Rows per subgroup for one token of interleaved 4-bit weights (4 or 8).
    group_rows: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(128)
fn matvec(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let t0 = wid.y * 4u;
    let ntok = min(4u, p.tokens - t0);
    let xstride = p.x_cols / 4u;
    if (p.tokens == 1u && p.w.fmt == 4u && p.group_rows == 4u) {
        // Interleaved 4-bit, small matrices: one subgroup per four rows.
        let quads = (p.rows + 3u) / 4u;
        for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
            let row0 = qi * 4u;
            let nrows = min(4u, p.rows - row0);
            var part: vec4<f32>;
            if (p.w.scale_kind == 1u) {
                part = rows4_q4i(p.w, row0, nrows, 0u, lane, lanes, true);
            } else {
                part = rows4_q4i(p.w, row0, nrows, 0u, lane, lanes, false);
            }
            let total = subgroupAdd(part);
            if (lane == 0u) {
                for (var r = 0u; r < nrows; r++) {
                    out[p.out_off + row0 + r] = total[r];
                }
            }
        }
        return;
    }
    if (p.tokens == 1u && p.w.fmt == 4u) {
        // Interleaved 4-bit, large matrices: one subgroup per eight rows.
        let octs = (p.rows + 7u) / 8u;
        for (var oi = wid.x * nsg + sg; oi < octs; oi += nwg.x * nsg) {
            let row0 = oi * 8u;
            let nrows = min(8u, p.rows - row0);
            var part: Acc8;
            if (p.w.scale_kind == 1u) {
                part = rows8_q4i(p.w, row0, nrows, 0u, lane, lanes, true);
            } else {
                part = rows8_q4i(p.w, row0, nrows, 0u, lane, lanes, false);
            }
            let ta = subgroupAdd(part.a);
            let tb = subgroupAdd(part.b);
            if (lane == 0u) {
                for (var r = 0u; r < nrows; r++) {
                    out[p.out_off + row0 + r] = select(tb[r & 3u], ta[r & 3u], r < 4u);
                }
            }
        }
        return;
    }
    if (p.tokens == 1u) {
        let quads = (p.rows + 3u) / 4u;
        for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
            let row0 = qi * 4u;
            let nrows = min(4u, p.rows - row0);
            let total = subgroupAdd(rows_dot(p.w, row0, nrows, 0u, lane, lanes));
            if (lane == 0u) {
                for (var r = 0u; r < nrows; r++) {
                    out[p.out_off + row0 + r] = total[r];
                }
            }
        }
        return;
    }
    for (var row = wid.x * nsg + sg; row < p.rows; row += nwg.x * nsg) {
        let total = subgroupAdd(lane_dot(p.w, row, t0 * xstride, xstride, ntok, lane, lanes));
        if (lane == 0u) {
            for (var t = 0u; t < ntok; t++) {
                out[(t0 + t) * p.out_cols + p.out_off + row] = total[t];
            }
        }
    }
}

// ---- Benchmark variants of the one-token interleaved 4-bit kernel (temporary) ----

fn q4_store8(row0: u32, nrows: u32, part: Acc8, lane: u32) {
    let ta = subgroupAdd(part.a);
    let tb = subgroupAdd(part.b);
    if (lane == 0u) {
        for (var r = 0u; r < nrows; r++) {
            out[p.out_off + row0 + r] = select(tb[r & 3u], ta[r & 3u], r < 4u);
        }
    }
}

fn q4_store4(row0: u32, nrows: u32, part: vec4<f32>, lane: u32) {
    let total = subgroupAdd(part);
    if (lane == 0u) {
        for (var r = 0u; r < nrows; r++) {
            out[p.out_off + row0 + r] = total[r];
        }
    }
}

// Group of each of the four words of lane chunk i.
fn q4i_g(chunks: u32, gshift: u32, i: u32) -> vec4<u32> {
    let j = i >> 5u;
    let v = i & 31u;
    let t = min(32u, chunks - 32u * j);
    let c0 = 1024u * j + 8u * v;
    let c = vec4<u32>(c0, c0 + 8u * t, c0 + 16u * t, c0 + 24u * t);
    return c >> vec4<u32>(gshift);
}

// The four pairs of chunk i when pairs are stored transposed per tile
// (SLOTSTREAM_WGPU_Q4_PAIRS=vec4, cols % 1024 == 0, group size <= 256).
fn q4i_pairs_v(pb: u32, i: u32, gshift: u32) -> vec4<u32> {
    let j = i >> 5u;
    let v = i & 31u;
    return w[(pb + ((1024u * j) >> gshift) + 4u * ((8u * v) >> gshift)) >> 2u];
}

// v1: eight rows, next chunk's weights prefetched.
fn rows8_pf(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
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
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        let x = q4i_x(chunks, gshift, 0u, i);
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

// v2: eight rows, next chunk's weights and pairs prefetched.
fn rows8_pfp(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
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
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    let g = q4i_g(chunks, gshift, f);
    var m0 = q4i_pairs(pa.x, g);
    var m1 = q4i_pairs(pa.y, g);
    var m2 = q4i_pairs(pa.z, g);
    var m3 = q4i_pairs(pa.w, g);
    var m4 = q4i_pairs(pb.x, g);
    var m5 = q4i_pairs(pb.y, g);
    var m6 = q4i_pairs(pb.z, g);
    var m7 = q4i_pairs(pb.w, g);
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let p0 = m0;
        let p1 = m1;
        let p2 = m2;
        let p3 = m3;
        let p4 = m4;
        let p5 = m5;
        let p6 = m6;
        let p7 = m7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        let gn = q4i_g(chunks, gshift, nx);
        m0 = q4i_pairs(pa.x, gn);
        m1 = q4i_pairs(pa.y, gn);
        m2 = q4i_pairs(pa.z, gn);
        m3 = q4i_pairs(pa.w, gn);
        m4 = q4i_pairs(pb.x, gn);
        m5 = q4i_pairs(pb.y, gn);
        m6 = q4i_pairs(pb.z, gn);
        m7 = q4i_pairs(pb.w, gn);
        let x = q4i_x(chunks, gshift, 0u, i);
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

// v3: four rows, next chunk's weights and pairs prefetched.
fn rows4_pfp(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    let g = q4i_g(chunks, gshift, f);
    var m0 = q4i_pairs(pa.x, g);
    var m1 = q4i_pairs(pa.y, g);
    var m2 = q4i_pairs(pa.z, g);
    var m3 = q4i_pairs(pa.w, g);
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let p0 = m0;
        let p1 = m1;
        let p2 = m2;
        let p3 = m3;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        let gn = q4i_g(chunks, gshift, nx);
        m0 = q4i_pairs(pa.x, gn);
        m1 = q4i_pairs(pa.y, gn);
        m2 = q4i_pairs(pa.z, gn);
        m3 = q4i_pairs(pa.w, gn);
        let x = q4i_x(chunks, gshift, 0u, i);
        acc.x += q4i_part(w0, p0, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.y += q4i_part(w1, p1, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.z += q4i_part(w2, p2, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
        acc.w += q4i_part(w3, p3, f16s, x.s0, x.s1, x.s2, x.s3, x.s4, x.s5, x.s6, x.s7, x.sx);
    }
    return acc;
}

// v4: eight rows, pairs as one 16-byte load per row (transposed pairs).
fn rows8_v(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var acc = Acc8(vec4<f32>(0.0), vec4<f32>(0.0));
    if (nrows == 0u) {
        // Never taken: keeps binding 6 in the layout.
        acc.a.x = f32(w_words[0]);
    }
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
        let w0 = w[wa.x + i];
        let w1 = w[wa.y + i];
        let w2 = w[wa.z + i];
        let w3 = w[wa.w + i];
        let w4 = w[wb.x + i];
        let w5 = w[wb.y + i];
        let w6 = w[wb.z + i];
        let w7 = w[wb.w + i];
        let p0 = q4i_pairs_v(pa.x, i, gshift);
        let p1 = q4i_pairs_v(pa.y, i, gshift);
        let p2 = q4i_pairs_v(pa.z, i, gshift);
        let p3 = q4i_pairs_v(pa.w, i, gshift);
        let p4 = q4i_pairs_v(pb.x, i, gshift);
        let p5 = q4i_pairs_v(pb.y, i, gshift);
        let p6 = q4i_pairs_v(pb.z, i, gshift);
        let p7 = q4i_pairs_v(pb.w, i, gshift);
        let x = q4i_x(chunks, gshift, 0u, i);
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

// v5: eight rows, transposed pairs, weights and pairs prefetched.
fn rows8_pfv(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var acc = Acc8(vec4<f32>(0.0), vec4<f32>(0.0));
    if (nrows == 0u) {
        // Never taken: keeps binding 6 in the layout.
        acc.a.x = f32(w_words[0]);
    }
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
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    var m0 = q4i_pairs_v(pa.x, f, gshift);
    var m1 = q4i_pairs_v(pa.y, f, gshift);
    var m2 = q4i_pairs_v(pa.z, f, gshift);
    var m3 = q4i_pairs_v(pa.w, f, gshift);
    var m4 = q4i_pairs_v(pb.x, f, gshift);
    var m5 = q4i_pairs_v(pb.y, f, gshift);
    var m6 = q4i_pairs_v(pb.z, f, gshift);
    var m7 = q4i_pairs_v(pb.w, f, gshift);
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let p0 = m0;
        let p1 = m1;
        let p2 = m2;
        let p3 = m3;
        let p4 = m4;
        let p5 = m5;
        let p6 = m6;
        let p7 = m7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        m0 = q4i_pairs_v(pa.x, nx, gshift);
        m1 = q4i_pairs_v(pa.y, nx, gshift);
        m2 = q4i_pairs_v(pa.z, nx, gshift);
        m3 = q4i_pairs_v(pa.w, nx, gshift);
        m4 = q4i_pairs_v(pb.x, nx, gshift);
        m5 = q4i_pairs_v(pb.y, nx, gshift);
        m6 = q4i_pairs_v(pb.z, nx, gshift);
        m7 = q4i_pairs_v(pb.w, nx, gshift);
        let x = q4i_x(chunks, gshift, 0u, i);
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

@compute @workgroup_size(128)
fn matvec_q4_pf8(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_pf(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_pf(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_pf8p(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_pfp(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_pfp(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_pf4p(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 3u) / 4u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 4u;
        let nrows = min(4u, p.rows - row0);
        var part: vec4<f32>;
        if (p.w.scale_kind == 1u) {
            part = rows4_pfp(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows4_pfp(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store4(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_v8(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_v(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_v(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_pf8v(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_pfv(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_pfv(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

// ---- Diagnostics (temporary) ----

// v6: loads only, the access pattern of rows8_q4i.
fn rows8_load(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32) -> Acc8 {
    let chunks = d.row_words / 4u;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wa = ra * chunks;
    let wb = rb * chunks;
    var h = vec4<u32>(w_words[0]) ^ bitcast<vec4<u32>>(xin[0]);
    for (var i = lane; i < chunks; i += lanes) {
        h ^= w[wa.x + i] ^ w[wa.y + i] ^ w[wa.z + i] ^ w[wa.w + i] ^ w[wb.x + i] ^ w[wb.y + i] ^ w[wb.z + i] ^ w[wb.w + i];
    }
    return Acc8(vec4<f32>(h & vec4<u32>(255u)), vec4<f32>(0.0));
}

// v7: loads only, each subgroup reading its eight rows as one contiguous run
// (eight consecutive 512-byte pieces per iteration).
fn rows8_load_contig(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32) -> Acc8 {
    let chunks = d.row_words / 4u;
    let base = row0 * chunks;
    let n = nrows * chunks;
    var h = vec4<u32>(w_words[0]) ^ bitcast<vec4<u32>>(xin[0]);
    for (var i = lane; i < n; i += 8u * lanes) {
        let l = base + n - 1u;
        h ^= w[min(base + i, l)] ^ w[min(base + i + lanes, l)] ^ w[min(base + i + 2u * lanes, l)] ^ w[min(base + i + 3u * lanes, l)]
            ^ w[min(base + i + 4u * lanes, l)] ^ w[min(base + i + 5u * lanes, l)] ^ w[min(base + i + 6u * lanes, l)] ^ w[min(base + i + 7u * lanes, l)];
    }
    return Acc8(vec4<f32>(h & vec4<u32>(255u)), vec4<f32>(0.0));
}

// v8: the arithmetic of rows8_q4i with weights made up from the index (no weight loads).
fn rows8_alu(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var acc = Acc8(vec4<f32>(0.0), vec4<f32>(0.0));
    if (nrows == 0u) {
        acc.a.x = f32(w[0].x);
    }
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
    let k = vec4<u32>(0x9E3779B9u, 0x85EBCA6Bu, 0xC2B2AE35u, 0x27D4EB2Fu);
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = k * (wa.x + i);
        let w1 = k * (wa.y + i);
        let w2 = k * (wa.z + i);
        let w3 = k * (wa.w + i);
        let w4 = k * (wb.x + i);
        let w5 = k * (wb.y + i);
        let w6 = k * (wb.z + i);
        let w7 = k * (wb.w + i);
        let x = q4i_x(chunks, gshift, 0u, i);
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

// v9: rows8_q4i over values stored tiled by row octets (SLOTSTREAM_WGPU_Q4_TILE8=1:
// tile j of the eight rows of an octet are consecutive 512-byte runs; rows % 8 == 0,
// cols % 1024 == 0): one iteration's eight loads read 4 KB contiguously.
fn rows8_tiled(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var acc = Acc8(vec4<f32>(0.0), vec4<f32>(0.0));
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let base = row0 * chunks;
    let pa = d.scales_off + ra * gpr;
    let pb = d.scales_off + rb * gpr;
    for (var i = lane; i < chunks; i += lanes) {
        let t = base + (i >> 5u) * 256u + (i & 31u);
        let w0 = w[t];
        let w1 = w[t + 32u];
        let w2 = w[t + 64u];
        let w3 = w[t + 96u];
        let w4 = w[t + 128u];
        let w5 = w[t + 160u];
        let w6 = w[t + 192u];
        let w7 = w[t + 224u];
        let x = q4i_x(chunks, gshift, 0u, i);
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

@compute @workgroup_size(128)
fn matvec_q4_load(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        let part = rows8_load(p.w, row0, nrows, lane, lanes);
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_loadc(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        let part = rows8_load_contig(p.w, row0, nrows, lane, lanes);
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_alu(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_alu(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_alu(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_tiled(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_tiled(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_tiled(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

// ---- Word-major variants (temporary): per iteration the weights of all rows
// are loaded, then each of the chunk's four words is finished for every row
// before the next word's x is loaded (fewer live registers). ----

// sum_m q_m * s_m over the eight nibbles of `word`, as one fma chain.
fn q8_chain(word: u32, s0: vec4<f32>, s1: vec4<f32>) -> f32 {
    let m0 = magic4(word);
    let m1 = magic4(word >> 16u);
    var q = m0.x * s0.x;
    q = fma(m0.y, s0.y, q);
    q = fma(m0.z, s0.z, q);
    q = fma(m0.w, s0.w, q);
    q = fma(m1.x, s1.x, q);
    q = fma(m1.y, s1.y, q);
    q = fma(m1.z, s1.z, q);
    q = fma(m1.w, s1.w, q);
    return q;
}

// (scales, biases) of four pair words.
fn sb4(pv: vec4<u32>, f16s: bool) -> array<vec4<f32>, 2> {
    if (f16s) {
        let h0 = unpack2x16float(pv.x);
        let h1 = unpack2x16float(pv.y);
        let h2 = unpack2x16float(pv.z);
        let h3 = unpack2x16float(pv.w);
        return array<vec4<f32>, 2>(vec4<f32>(h0.x, h1.x, h2.x, h3.x), vec4<f32>(h0.y, h1.y, h2.y, h3.y));
    }
    return array<vec4<f32>, 2>(bitcast<vec4<f32>>(pv << vec4<u32>(16u)), bitcast<vec4<f32>>(pv & vec4<u32>(0xffff0000u)));
}

// Word k (columns `col` .. +8) of four rows (words `wd`, pair words `pv`).
fn wm_word4(acc: vec4<f32>, wd: vec4<u32>, pv: vec4<u32>, s0: vec4<f32>, s1: vec4<f32>, sx: f32, f16s: bool) -> vec4<f32> {
    let q = vec4<f32>(q8_chain(wd.x, s0, s1), q8_chain(wd.y, s0, s1), q8_chain(wd.z, s0, s1), q8_chain(wd.w, s0, s1));
    let sb = sb4(pv, f16s);
    return fma(sb[0], q, fma(sb[1], vec4<f32>(sx), acc));
}

fn rows8_wm(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var aa = vec4<f32>(0.0);
    var ab = vec4<f32>(0.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wb = rb * chunks;
    let pb = d.scales_off + rb * gpr;
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = w[wa.x + i];
        let w1 = w[wa.y + i];
        let w2 = w[wa.z + i];
        let w3 = w[wa.w + i];
        let w4 = w[wb.x + i];
        let w5 = w[wb.y + i];
        let w6 = w[wb.z + i];
        let w7 = w[wb.w + i];
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        let g0 = (c0 + 0u * t) >> gshift;
        let pa0 = vec4<u32>(w_words[pa.x + g0], w_words[pa.y + g0], w_words[pa.z + g0], w_words[pa.w + g0]);
        let pb0 = vec4<u32>(w_words[pb.x + g0], w_words[pb.y + g0], w_words[pb.z + g0], w_words[pb.w + g0]);
        let g1 = (c0 + 8u * t) >> gshift;
        let pa1 = vec4<u32>(w_words[pa.x + g1], w_words[pa.y + g1], w_words[pa.z + g1], w_words[pa.w + g1]);
        let pb1 = vec4<u32>(w_words[pb.x + g1], w_words[pb.y + g1], w_words[pb.z + g1], w_words[pb.w + g1]);
        let g2 = (c0 + 16u * t) >> gshift;
        let pa2 = vec4<u32>(w_words[pa.x + g2], w_words[pa.y + g2], w_words[pa.z + g2], w_words[pa.w + g2]);
        let pb2 = vec4<u32>(w_words[pb.x + g2], w_words[pb.y + g2], w_words[pb.z + g2], w_words[pb.w + g2]);
        let g3 = (c0 + 24u * t) >> gshift;
        let pa3 = vec4<u32>(w_words[pa.x + g3], w_words[pa.y + g3], w_words[pa.z + g3], w_words[pa.w + g3]);
        let pb3 = vec4<u32>(w_words[pb.x + g3], w_words[pb.y + g3], w_words[pb.z + g3], w_words[pb.w + g3]);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), pa0, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.x, w5.x, w6.x, w7.x), pb0, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), pa1, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.y, w5.y, w6.y, w7.y), pb1, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), pa2, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.z, w5.z, w6.z, w7.z), pb2, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), pa3, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.w, w5.w, w6.w, w7.w), pb3, s0, s1, sx, f16s);
        }
    }
    return Acc8(aa, ab);
}

fn rows8_wm_pf(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var aa = vec4<f32>(0.0);
    var ab = vec4<f32>(0.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wb = rb * chunks;
    let pb = d.scales_off + rb * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        let g0 = (c0 + 0u * t) >> gshift;
        let pa0 = vec4<u32>(w_words[pa.x + g0], w_words[pa.y + g0], w_words[pa.z + g0], w_words[pa.w + g0]);
        let pb0 = vec4<u32>(w_words[pb.x + g0], w_words[pb.y + g0], w_words[pb.z + g0], w_words[pb.w + g0]);
        let g1 = (c0 + 8u * t) >> gshift;
        let pa1 = vec4<u32>(w_words[pa.x + g1], w_words[pa.y + g1], w_words[pa.z + g1], w_words[pa.w + g1]);
        let pb1 = vec4<u32>(w_words[pb.x + g1], w_words[pb.y + g1], w_words[pb.z + g1], w_words[pb.w + g1]);
        let g2 = (c0 + 16u * t) >> gshift;
        let pa2 = vec4<u32>(w_words[pa.x + g2], w_words[pa.y + g2], w_words[pa.z + g2], w_words[pa.w + g2]);
        let pb2 = vec4<u32>(w_words[pb.x + g2], w_words[pb.y + g2], w_words[pb.z + g2], w_words[pb.w + g2]);
        let g3 = (c0 + 24u * t) >> gshift;
        let pa3 = vec4<u32>(w_words[pa.x + g3], w_words[pa.y + g3], w_words[pa.z + g3], w_words[pa.w + g3]);
        let pb3 = vec4<u32>(w_words[pb.x + g3], w_words[pb.y + g3], w_words[pb.z + g3], w_words[pb.w + g3]);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), pa0, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.x, w5.x, w6.x, w7.x), pb0, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), pa1, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.y, w5.y, w6.y, w7.y), pb1, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), pa2, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.z, w5.z, w6.z, w7.z), pb2, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), pa3, s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.w, w5.w, w6.w, w7.w), pb3, s0, s1, sx, f16s);
        }
    }
    return Acc8(aa, ab);
}

fn rows4_wm(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> vec4<f32> {
    var aa = vec4<f32>(0.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = w[wa.x + i];
        let w1 = w[wa.y + i];
        let w2 = w[wa.z + i];
        let w3 = w[wa.w + i];
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        let g0 = (c0 + 0u * t) >> gshift;
        let pa0 = vec4<u32>(w_words[pa.x + g0], w_words[pa.y + g0], w_words[pa.z + g0], w_words[pa.w + g0]);
        let g1 = (c0 + 8u * t) >> gshift;
        let pa1 = vec4<u32>(w_words[pa.x + g1], w_words[pa.y + g1], w_words[pa.z + g1], w_words[pa.w + g1]);
        let g2 = (c0 + 16u * t) >> gshift;
        let pa2 = vec4<u32>(w_words[pa.x + g2], w_words[pa.y + g2], w_words[pa.z + g2], w_words[pa.w + g2]);
        let g3 = (c0 + 24u * t) >> gshift;
        let pa3 = vec4<u32>(w_words[pa.x + g3], w_words[pa.y + g3], w_words[pa.z + g3], w_words[pa.w + g3]);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), pa0, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), pa1, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), pa2, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), pa3, s0, s1, sx, f16s);
        }
    }
    return aa;
}

fn rows4_wm_pf(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> vec4<f32> {
    var aa = vec4<f32>(0.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        let g0 = (c0 + 0u * t) >> gshift;
        let pa0 = vec4<u32>(w_words[pa.x + g0], w_words[pa.y + g0], w_words[pa.z + g0], w_words[pa.w + g0]);
        let g1 = (c0 + 8u * t) >> gshift;
        let pa1 = vec4<u32>(w_words[pa.x + g1], w_words[pa.y + g1], w_words[pa.z + g1], w_words[pa.w + g1]);
        let g2 = (c0 + 16u * t) >> gshift;
        let pa2 = vec4<u32>(w_words[pa.x + g2], w_words[pa.y + g2], w_words[pa.z + g2], w_words[pa.w + g2]);
        let g3 = (c0 + 24u * t) >> gshift;
        let pa3 = vec4<u32>(w_words[pa.x + g3], w_words[pa.y + g3], w_words[pa.z + g3], w_words[pa.w + g3]);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), pa0, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), pa1, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), pa2, s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), pa3, s0, s1, sx, f16s);
        }
    }
    return aa;
}

@compute @workgroup_size(128)
fn matvec_q4_wm8(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_wm8p(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm_pf(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm_pf(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_wm4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 3u) / 4u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 4u;
        let nrows = min(4u, p.rows - row0);
        var part: vec4<f32>;
        if (p.w.scale_kind == 1u) {
            part = rows4_wm(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows4_wm(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store4(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_wm4p(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 3u) / 4u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 4u;
        let nrows = min(4u, p.rows - row0);
        var part: vec4<f32>;
        if (p.w.scale_kind == 1u) {
            part = rows4_wm_pf(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows4_wm_pf(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store4(row0, nrows, part, lane);
    }
}

fn rows8_wm_pfp(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var aa = vec4<f32>(0.0);
    var ab = vec4<f32>(0.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wb = rb * chunks;
    let pb = d.scales_off + rb * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    let g = q4i_g(chunks, gshift, f);
    var m0 = q4i_pairs(pa.x, g);
    var m1 = q4i_pairs(pa.y, g);
    var m2 = q4i_pairs(pa.z, g);
    var m3 = q4i_pairs(pa.w, g);
    var m4 = q4i_pairs(pb.x, g);
    var m5 = q4i_pairs(pb.y, g);
    var m6 = q4i_pairs(pb.z, g);
    var m7 = q4i_pairs(pb.w, g);
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let p0 = m0;
        let p1 = m1;
        let p2 = m2;
        let p3 = m3;
        let p4 = m4;
        let p5 = m5;
        let p6 = m6;
        let p7 = m7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        let gn = q4i_g(chunks, gshift, nx);
        m0 = q4i_pairs(pa.x, gn);
        m1 = q4i_pairs(pa.y, gn);
        m2 = q4i_pairs(pa.z, gn);
        m3 = q4i_pairs(pa.w, gn);
        m4 = q4i_pairs(pb.x, gn);
        m5 = q4i_pairs(pb.y, gn);
        m6 = q4i_pairs(pb.z, gn);
        m7 = q4i_pairs(pb.w, gn);
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), vec4<u32>(p0.x, p1.x, p2.x, p3.x), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.x, w5.x, w6.x, w7.x), vec4<u32>(p4.x, p5.x, p6.x, p7.x), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), vec4<u32>(p0.y, p1.y, p2.y, p3.y), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.y, w5.y, w6.y, w7.y), vec4<u32>(p4.y, p5.y, p6.y, p7.y), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), vec4<u32>(p0.z, p1.z, p2.z, p3.z), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.z, w5.z, w6.z, w7.z), vec4<u32>(p4.z, p5.z, p6.z, p7.z), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), vec4<u32>(p0.w, p1.w, p2.w, p3.w), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.w, w5.w, w6.w, w7.w), vec4<u32>(p4.w, p5.w, p6.w, p7.w), s0, s1, sx, f16s);
        }
    }
    return Acc8(aa, ab);
}

fn rows8_wm_pfv(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var aa = vec4<f32>(0.0);
    var ab = vec4<f32>(0.0);
    if (nrows == 0u) {
        aa.x = f32(w_words[0]);
    }
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wb = rb * chunks;
    let pb = d.scales_off + rb * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    var m0 = q4i_pairs_v(pa.x, f, gshift);
    var m1 = q4i_pairs_v(pa.y, f, gshift);
    var m2 = q4i_pairs_v(pa.z, f, gshift);
    var m3 = q4i_pairs_v(pa.w, f, gshift);
    var m4 = q4i_pairs_v(pb.x, f, gshift);
    var m5 = q4i_pairs_v(pb.y, f, gshift);
    var m6 = q4i_pairs_v(pb.z, f, gshift);
    var m7 = q4i_pairs_v(pb.w, f, gshift);
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let p0 = m0;
        let p1 = m1;
        let p2 = m2;
        let p3 = m3;
        let p4 = m4;
        let p5 = m5;
        let p6 = m6;
        let p7 = m7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        m0 = q4i_pairs_v(pa.x, nx, gshift);
        m1 = q4i_pairs_v(pa.y, nx, gshift);
        m2 = q4i_pairs_v(pa.z, nx, gshift);
        m3 = q4i_pairs_v(pa.w, nx, gshift);
        m4 = q4i_pairs_v(pb.x, nx, gshift);
        m5 = q4i_pairs_v(pb.y, nx, gshift);
        m6 = q4i_pairs_v(pb.z, nx, gshift);
        m7 = q4i_pairs_v(pb.w, nx, gshift);
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), vec4<u32>(p0.x, p1.x, p2.x, p3.x), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.x, w5.x, w6.x, w7.x), vec4<u32>(p4.x, p5.x, p6.x, p7.x), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), vec4<u32>(p0.y, p1.y, p2.y, p3.y), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.y, w5.y, w6.y, w7.y), vec4<u32>(p4.y, p5.y, p6.y, p7.y), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), vec4<u32>(p0.z, p1.z, p2.z, p3.z), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.z, w5.z, w6.z, w7.z), vec4<u32>(p4.z, p5.z, p6.z, p7.z), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), vec4<u32>(p0.w, p1.w, p2.w, p3.w), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.w, w5.w, w6.w, w7.w), vec4<u32>(p4.w, p5.w, p6.w, p7.w), s0, s1, sx, f16s);
        }
    }
    return Acc8(aa, ab);
}

fn rows4_wm_pfp(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> vec4<f32> {
    var aa = vec4<f32>(0.0);
    var ab = vec4<f32>(0.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    let g = q4i_g(chunks, gshift, f);
    var m0 = q4i_pairs(pa.x, g);
    var m1 = q4i_pairs(pa.y, g);
    var m2 = q4i_pairs(pa.z, g);
    var m3 = q4i_pairs(pa.w, g);
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let p0 = m0;
        let p1 = m1;
        let p2 = m2;
        let p3 = m3;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        let gn = q4i_g(chunks, gshift, nx);
        m0 = q4i_pairs(pa.x, gn);
        m1 = q4i_pairs(pa.y, gn);
        m2 = q4i_pairs(pa.z, gn);
        m3 = q4i_pairs(pa.w, gn);
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), vec4<u32>(p0.x, p1.x, p2.x, p3.x), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), vec4<u32>(p0.y, p1.y, p2.y, p3.y), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), vec4<u32>(p0.z, p1.z, p2.z, p3.z), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), vec4<u32>(p0.w, p1.w, p2.w, p3.w), s0, s1, sx, f16s);
        }
    }
    return aa;
}

fn rows8_wm_v(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var aa = vec4<f32>(0.0);
    var ab = vec4<f32>(0.0);
    if (nrows == 0u) {
        aa.x = f32(w_words[0]);
    }
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wb = rb * chunks;
    let pb = d.scales_off + rb * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        let p0 = q4i_pairs_v(pa.x, i, gshift);
        let p1 = q4i_pairs_v(pa.y, i, gshift);
        let p2 = q4i_pairs_v(pa.z, i, gshift);
        let p3 = q4i_pairs_v(pa.w, i, gshift);
        let p4 = q4i_pairs_v(pb.x, i, gshift);
        let p5 = q4i_pairs_v(pb.y, i, gshift);
        let p6 = q4i_pairs_v(pb.z, i, gshift);
        let p7 = q4i_pairs_v(pb.w, i, gshift);
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), vec4<u32>(p0.x, p1.x, p2.x, p3.x), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.x, w5.x, w6.x, w7.x), vec4<u32>(p4.x, p5.x, p6.x, p7.x), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), vec4<u32>(p0.y, p1.y, p2.y, p3.y), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.y, w5.y, w6.y, w7.y), vec4<u32>(p4.y, p5.y, p6.y, p7.y), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), vec4<u32>(p0.z, p1.z, p2.z, p3.z), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.z, w5.z, w6.z, w7.z), vec4<u32>(p4.z, p5.z, p6.z, p7.z), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), vec4<u32>(p0.w, p1.w, p2.w, p3.w), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.w, w5.w, w6.w, w7.w), vec4<u32>(p4.w, p5.w, p6.w, p7.w), s0, s1, sx, f16s);
        }
    }
    return Acc8(aa, ab);
}

fn rows8_wm_pw(d: WeightDesc, row0: u32, nrows: u32, lane: u32, lanes: u32, f16s: bool) -> Acc8 {
    var aa = vec4<f32>(0.0);
    var ab = vec4<f32>(0.0);
    let ns = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);
    let chunks = d.row_words / 4u;
    let gshift = firstTrailingBit(d.group_size);
    let gpr = d.cols >> gshift;
    let last = row0 + nrows - 1u;
    let ra = vec4<u32>(row0, min(row0 + 1u, last), min(row0 + 2u, last), min(row0 + 3u, last));
    let wa = ra * chunks;
    let pa = d.scales_off + ra * gpr;
    let rb = min(ra + vec4<u32>(4u), vec4<u32>(last));
    let wb = rb * chunks;
    let pb = d.scales_off + rb * gpr;
    let lastc = chunks - 1u;
    let f = min(lane, lastc);
    var n0 = w[wa.x + f];
    var n1 = w[wa.y + f];
    var n2 = w[wa.z + f];
    var n3 = w[wa.w + f];
    var n4 = w[wb.x + f];
    var n5 = w[wb.y + f];
    var n6 = w[wb.z + f];
    var n7 = w[wb.w + f];
    for (var i = lane; i < chunks; i += lanes) {
        let w0 = n0;
        let w1 = n1;
        let w2 = n2;
        let w3 = n3;
        let w4 = n4;
        let w5 = n5;
        let w6 = n6;
        let w7 = n7;
        let nx = min(i + lanes, lastc);
        n0 = w[wa.x + nx];
        n1 = w[wa.y + nx];
        n2 = w[wa.z + nx];
        n3 = w[wa.w + nx];
        n4 = w[wb.x + nx];
        n5 = w[wb.y + nx];
        n6 = w[wb.z + nx];
        n7 = w[wb.w + nx];
        let gi = q4i_g(chunks, gshift, i);
        let p0 = q4i_pairs(pa.x, gi);
        let p1 = q4i_pairs(pa.y, gi);
        let p2 = q4i_pairs(pa.z, gi);
        let p3 = q4i_pairs(pa.w, gi);
        let p4 = q4i_pairs(pb.x, gi);
        let p5 = q4i_pairs(pb.y, gi);
        let p6 = q4i_pairs(pb.z, gi);
        let p7 = q4i_pairs(pb.w, gi);
        let j = i >> 5u;
        let t = min(32u, chunks - 32u * j);
        let c0 = 1024u * j + 8u * (i & 31u);
        {
            let xi = (c0 + 0u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.x, w1.x, w2.x, w3.x), vec4<u32>(p0.x, p1.x, p2.x, p3.x), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.x, w5.x, w6.x, w7.x), vec4<u32>(p4.x, p5.x, p6.x, p7.x), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 8u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.y, w1.y, w2.y, w3.y), vec4<u32>(p0.y, p1.y, p2.y, p3.y), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.y, w5.y, w6.y, w7.y), vec4<u32>(p4.y, p5.y, p6.y, p7.y), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 16u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.z, w1.z, w2.z, w3.z), vec4<u32>(p0.z, p1.z, p2.z, p3.z), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.z, w5.z, w6.z, w7.z), vec4<u32>(p4.z, p5.z, p6.z, p7.z), s0, s1, sx, f16s);
        }
        {
            let xi = (c0 + 24u * t) >> 2u;
            let xa = xin[xi];
            let xb = xin[xi + 1u];
            let sx = dot(xa + xb, vec4<f32>(1.0));
            let s0 = xa * ns;
            let s1 = xb * ns;
            aa = wm_word4(aa, vec4<u32>(w0.w, w1.w, w2.w, w3.w), vec4<u32>(p0.w, p1.w, p2.w, p3.w), s0, s1, sx, f16s);
            ab = wm_word4(ab, vec4<u32>(w4.w, w5.w, w6.w, w7.w), vec4<u32>(p4.w, p5.w, p6.w, p7.w), s0, s1, sx, f16s);
        }
    }
    return Acc8(aa, ab);
}

@compute @workgroup_size(128)
fn matvec_q4_wm8pp(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm_pfp(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm_pfp(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_wm8pv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm_pfv(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm_pfv(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_wm4pp(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 3u) / 4u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 4u;
        let nrows = min(4u, p.rows - row0);
        var part: vec4<f32>;
        if (p.w.scale_kind == 1u) {
            part = rows4_wm_pfp(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows4_wm_pfp(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store4(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_wm8v(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm_v(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm_v(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(256)
fn matvec_q4_wm8p_256(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm_pf(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm_pf(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(64)
fn matvec_q4_wm8p_64(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm_pf(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm_pf(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}

@compute @workgroup_size(128)
fn matvec_q4_wm8pw(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let sets = (p.rows + 7u) / 8u;
    for (var si = wid.x * nsg + sg; si < sets; si += nwg.x * nsg) {
        let row0 = si * 8u;
        let nrows = min(8u, p.rows - row0);
        var part: Acc8;
        if (p.w.scale_kind == 1u) {
            part = rows8_wm_pw(p.w, row0, nrows, lane, lanes, true);
        } else {
            part = rows8_wm_pw(p.w, row0, nrows, lane, lanes, false);
        }
        q4_store8(row0, nrows, part, lane);
    }
}
