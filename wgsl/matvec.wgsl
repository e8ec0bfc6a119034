// matvec: `out[t, out_off + r] = sum_c W[r, c] * x[t, c]` for one weight shard,
// any storage format (f32/f16/bf16, affine 2/4/8-bit; see weights.wgsl).
// One token (decode): one subgroup per four weight rows, x loaded once per
// chunk for all four (see rows_dot); interleaved 4-bit weights (fmt 4) with
// `group_rows` 8: one subgroup per eight rows (see rows8_q4i). Two to four
// tokens per workgroup row (workgroup_id.y selects tokens 4y..4y+3): one
// subgroup per weight row, each weight byte read once per four tokens.
// Grid-stride over rows along x.
//
// matvec_q4: matvec of one token and interleaved 4-bit weights, four rows
// per quad (rows4_q4i), each quad's chunks shared by `parts` subgroups of the
// workgroup (a shorter chain of loads per lane), summed in order (with
// `parts` 1, rows of up to a subgroup's 32-value chunks, the same loop). Its own
// entry point: the smaller kernel of the one path decode takes ran ~5%
// faster on an H200 than the same path inside matvec.
//
// matvec_q4_tokens: matvec_q4 for two to four tokens at once (workgroup_id.y
// selects tokens 4y..4y+3), each quad's chunks and their scales loaded once
// for every token (rows4_q4i_tokens), split over `parts` subgroups as
// matvec_q4 splits them: a row's result for a token is matvec_q4's for that
// token alone, bit for bit (batched decode changes speed, not output).
//
// matvec_epilogue: one token, one shard, one subgroup per four rows (as
// matvec's small matrices), with the product's consumer in the epilogue:
//   epilogue 1 (SwiGLU): out[r] = silu(W[r] . x) * (W[half + r] . x), r < rows = half
//   epilogue 2 (gated add): out[r] = aux[r] + (W[r] . x) * sigmoid(gate[0])
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (weight shard, see weights.wgsl); 2 xin [tokens, x_cols] f32;
// 3 out [tokens, out_cols] f32 (read-write); 4 aux and 5 gate f32 (matvec_epilogue).

struct Params {
    w: WeightDesc,
    rows: u32,
    tokens: u32,
    out_cols: u32,
    out_off: u32,
    x_cols: u32,
    // Rows per subgroup for one token of interleaved 4-bit weights in matvec
    // (8; matvec_q4 takes four).
    group_rows: u32,
    // matvec_epilogue: 1 SwiGLU, 2 gated add.
    epilogue: u32,
    // matvec_epilogue's SwiGLU: the first up row (= rows).
    half: u32,
    // matvec_q4: subgroups that share a quad's chunks (1, 2 or 4; at most
    // the workgroup's subgroups).
    parts: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> aux: array<f32>;
@group(0) @binding(5) var<storage, read> gate: array<f32>;

// matvec_q4's split quads: each subgroup's partial sums of its quad (and
// matvec_q4_tokens': of its quad for each of four tokens, 4 * sg + t).
var<workgroup> partial4: array<vec4<f32>, 128>;
var<workgroup> partial4t: array<vec4<f32>, 512>;

@compute @workgroup_size(128)
fn matvec_q4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    // `parts` subgroups share a quad (part k takes chunks k*lanes + lane,
    // stepping parts*lanes), so each lane's chain of dependent loads is that
    // much shorter; the parts' sums are added in order.
    let parts = max(1u, min(p.parts, nsg));
    let per_wg = nsg / parts;
    let quads = (p.rows + 3u) / 4u;
    let f16s = p.w.scale_kind == 1u;
    for (var q0 = wid.x * per_wg; q0 < quads; q0 += nwg.x * per_wg) {
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
}

@compute @workgroup_size(128)
fn matvec_q4_tokens(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let parts = max(1u, min(p.parts, nsg));
    let per_wg = nsg / parts;
    let quads = (p.rows + 3u) / 4u;
    let f16s = p.w.scale_kind == 1u;
    let t0 = wid.y * 4u;
    let ntok = min(4u, p.tokens - t0);
    let xstride = p.x_cols / 4u;
    for (var q0 = wid.x * per_wg; q0 < quads; q0 += nwg.x * per_wg) {
        let qi = q0 + sg / parts;
        let part = sg % parts;
        let row0 = qi * 4u;
        var sums: array<vec4<f32>, 4>;
        if (qi < quads && sg < per_wg * parts) {
            sums = rows4_q4i_tokens(p.w, row0, min(4u, p.rows - row0), t0 * xstride, xstride, ntok, part * lanes + lane, parts * lanes, f16s);
        }
        for (var t = 0u; t < 4u; t++) {
            let total = subgroupAdd(sums[t]);
            if (lane == 0u) {
                partial4t[4u * sg + t] = total;
            }
        }
        workgroupBarrier();
        if (part == 0u && lane == 0u && qi < quads && sg < per_wg * parts) {
            for (var t = 0u; t < ntok; t++) {
                var total = partial4t[4u * sg + t];
                for (var k = 1u; k < parts; k++) {
                    total += partial4t[4u * (sg + k) + t];
                }
                for (var r = 0u; r < min(4u, p.rows - row0); r++) {
                    out[(t0 + t) * p.out_cols + p.out_off + row0 + r] = total[r];
                }
            }
        }
        workgroupBarrier();
    }
}

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
    if (p.tokens == 1u && p.w.fmt == 4u) {
        // Interleaved 4-bit, `group_rows` 8 (by option): one subgroup per eight rows.
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

// Four consecutive rows' partial dot products with the one x row, any format.
fn quad_dot(row0: u32, nrows: u32, lane: u32, lanes: u32) -> vec4<f32> {
    if (p.w.fmt == 4u) {
        if (p.w.scale_kind == 1u) {
            return rows4_q4i(p.w, row0, nrows, 0u, lane, lanes, true);
        }
        return rows4_q4i(p.w, row0, nrows, 0u, lane, lanes, false);
    }
    return rows_dot(p.w, row0, nrows, 0u, lane, lanes);
}

@compute @workgroup_size(128)
fn matvec_epilogue(
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
        let a = subgroupAdd(quad_dot(row0, nrows, lane, lanes));
        var b = vec4<f32>(0.0);
        if (p.epilogue == 1u) {
            b = subgroupAdd(quad_dot(p.half + row0, nrows, lane, lanes));
        }
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                let v = a[r];
                if (p.epilogue == 1u) {
                    out[row0 + r] = (v * (1.0 / (1.0 + exp(-v)))) * b[r];
                } else {
                    out[row0 + r] = aux[row0 + r] + v * (1.0 / (1.0 + exp(-gate[0])));
                }
            }
        }
    }
}
