// One token's product `out[out_off + r] = W[r] . x` over a weight shard, any
// storage format (prepended, after weights.wgsl and dot.wgsl, to matvec.wgsl
// and matvec_norm.wgsl, which declare `xin`: in storage for matvec, in
// workgroup memory for matvec_norm). One subgroup per four weight rows, x
// loaded once per chunk for all four (see rows_dot); interleaved 4-bit
// weights (fmt 4): one subgroup per eight rows (see rows8_q4i), or four for
// matrices of fewer than 8192 rows (rows4_q4i), which need the parallelism
// more; with `parts` > 1 a quad's chunks are shared by that many subgroups of
// the workgroup (a shorter chain of loads per lane), summed in order.
// Grid-stride over rows along x.
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (weight shard, see
// weights.wgsl); 3 out [tokens, out_cols] f32 (read-write).

struct Params {
    w: WeightDesc,
    rows: u32,
    tokens: u32,
    out_cols: u32,
    out_off: u32,
    x_cols: u32,
    // Rows per subgroup for one token of interleaved 4-bit weights (4 or 8).
    group_rows: u32,
    // matvec_epilogue: 1 SwiGLU, 2 gated add.
    epilogue: u32,
    // matvec_epilogue's SwiGLU: the first up row (= rows).
    half: u32,
    // One token, interleaved 4-bit, four rows per subgroup: subgroups that
    // share a quad's chunks (1, 2 or 4; at most the workgroup's subgroups).
    parts: u32,
    // matvec_norm: the norm's epsilon.
    eps: f32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// Split quads: each subgroup's partial sums of its quad.
var<workgroup> partial4: array<vec4<f32>, 128>;

// The rows of workgroup `wg` of `nwg` for one token.
fn one_token_rows(wg: u32, nwg: u32, sg: u32, nsg: u32, lane: u32, lanes: u32) {
    if (p.w.fmt == 4u && p.group_rows == 4u && p.parts > 1u) {
        // Interleaved 4-bit, rows of several subgroups' worth of chunks:
        // `parts` subgroups share a quad (part k takes chunks k*lanes + lane,
        // stepping parts*lanes), so each lane's chain of dependent loads is
        // that much shorter; the parts' sums are added in order.
        let parts = min(p.parts, nsg);
        let per_wg = nsg / parts;
        let quads = (p.rows + 3u) / 4u;
        let f16s = p.w.scale_kind == 1u;
        for (var q0 = wg * per_wg; q0 < quads; q0 += nwg * per_wg) {
            let qi = q0 + sg / parts;
            let part = sg % parts;
            let row0 = qi * 4u;
            var sums = vec4<f32>(0.0);
            if (qi < quads && sg < per_wg * parts) {
                sums = rows4_q4i(p.w, row0, min(4u, p.rows - row0), 0u, part * lanes + lane, parts * lanes, f16s);
            }
            let total = subgroupAdd(sums);
            if (lane == 0u) {
                partial4[sg] = total;
            }
            workgroupBarrier();
            if (part == 0u && lane == 0u && qi < quads && sg < per_wg * parts) {
                var t = partial4[sg];
                for (var k = 1u; k < parts; k++) {
                    t += partial4[sg + k];
                }
                for (var r = 0u; r < min(4u, p.rows - row0); r++) {
                    out[p.out_off + row0 + r] = t[r];
                }
            }
            workgroupBarrier();
        }
        return;
    }
    if (p.w.fmt == 4u && p.group_rows == 4u) {
        // Interleaved 4-bit, small matrices: one subgroup per four rows.
        let quads = (p.rows + 3u) / 4u;
        for (var qi = wg * nsg + sg; qi < quads; qi += nwg * nsg) {
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
    if (p.w.fmt == 4u) {
        // Interleaved 4-bit, large matrices: one subgroup per eight rows.
        let octs = (p.rows + 7u) / 8u;
        for (var oi = wg * nsg + sg; oi < octs; oi += nwg * nsg) {
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
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wg * nsg + sg; qi < quads; qi += nwg * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        let total = subgroupAdd(rows_dot(p.w, row0, nrows, 0u, lane, lanes));
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                out[p.out_off + row0 + r] = total[r];
            }
        }
    }
}
