// matvec: `out[t, out_off + r] = sum_c W[r, c] * x[t, c]` for one weight shard,
// any storage format (f32/f16/bf16, affine 2/4/8-bit; see weights.wgsl). One
// token (decode): matvec_one.wgsl's rows. Two to four tokens per workgroup row
// (workgroup_id.y selects tokens 4y..4y+3): one subgroup per weight row, each
// weight byte read once per four tokens. Grid-stride over rows along x.
//
// matvec_epilogue: one token, one shard, one subgroup per four rows (as
// matvec's small matrices), with the product's consumer in the epilogue:
//   epilogue 1 (SwiGLU): out[r] = silu(W[r] . x) * (W[half + r] . x), r < rows = half
//   epilogue 2 (gated add): out[r] = aux[r] + (W[r] . x) * sigmoid(gate[0])
//
// Bindings (besides matvec_one.wgsl's): 2 xin [tokens, x_cols] f32; 4 aux and
// 5 gate f32 (matvec_epilogue).

@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> aux: array<f32>;
@group(0) @binding(5) var<storage, read> gate: array<f32>;

@compute @workgroup_size(128)
fn matvec(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    if (p.tokens == 1u) {
        one_token_rows(wid.x, nwg.x, sg, nsg, lane, lanes);
        return;
    }
    let t0 = wid.y * 4u;
    let ntok = min(4u, p.tokens - t0);
    let xstride = p.x_cols / 4u;
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
