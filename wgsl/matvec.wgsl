// matvec: `out[t, out_off + r] = sum_c W[r, c] * x[t, c]` for one weight shard,
// any storage format (f32/f16/bf16, affine 2/4/8-bit; see weights.wgsl).
// One token (decode): one subgroup per four weight rows, x loaded once per
// chunk for all four (see rows_dot; interleaved 4-bit weights, fmt 4:
// rows4_q4i). Two to four tokens per workgroup row
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
    _pad0: u32,
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
    if (p.tokens == 1u && p.w.fmt == 4u) {
        // Interleaved 4-bit: one subgroup per four rows.
        let quads = (p.rows + 3u) / 4u;
        for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
            let row0 = qi * 4u;
            let nrows = min(4u, p.rows - row0);
            var part: vec4<f32>;
            if (p.w.scale_kind == 1u) {
                part = rows4_q4i(p.w, row0, nrows, lane, lanes, true);
            } else {
                part = rows4_q4i(p.w, row0, nrows, lane, lanes, false);
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
