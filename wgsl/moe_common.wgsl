// Shared by the MoE kernels (moe.wgsl) and the routing kernels (route.wgsl),
// prepended to both after dot.wgsl: their parameters, the "no slot" marker,
// the per-subgroup partial sums, and the pool rows' dot product. Each kernel
// file declares binding 0 (`p`) and `xin` (binding 2) itself.

struct Params {
    w: WeightDesc,
    rows: u32,
    asg_off: u32,
    slot_base: u32,
    slot_end: u32,
    x_cols: u32,
    out_cols: u32,
    top_k: u32,
    experts: u32,
    key_base: u32,
    normalize: u32,
    n: u32,
    // moe_gate_up: subgroups sharing each of a quad's gate and up rows (0 or
    // 1: one subgroup computes both).
    parts: u32,
    // moe_route_norm: the residual norm's epsilon.
    eps: f32,
    // moe_gate_up, moe_down_combine: the shared expert's slot table key
    // (NO_SLOT: none) and the stride of its gate logits (binding 9).
    shared_key: u32,
    gate_cols: u32,
    // Routing kernels: 1 routes at most one subgroup's width of experts in
    // one subgroup (route_token_lanes).
    route_lanes: u32,
}

const NO_SLOT: u32 = 0xffffffffu;

// Each subgroup's partial sums of one quad of rows (moe_down_combine,
// moe_gate_up, moe_route_matmul).
var<workgroup> partial4: array<vec4<f32>, 256>;

// This lane's partial dot products of four consecutive pool rows with the x
// row at vec4 index `xb`: interleaved 4-bit slots (fmt 4) by rows4_q4i, the
// rest by rows_dot.
fn pool_rows4(d: WeightDesc, row0: u32, nrows: u32, xb: u32, lane: u32, lanes: u32) -> vec4<f32> {
    if (d.fmt == 4u) {
        if (d.scale_kind == 1u) {
            return rows4_q4i(d, row0, nrows, xb, lane, lanes, true);
        }
        return rows4_q4i(d, row0, nrows, xb, lane, lanes, false);
    }
    return rows_dot(d, row0, nrows, xb, lane, lanes);
}
