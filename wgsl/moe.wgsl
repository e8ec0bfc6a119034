// Expert FFN over pool slot indices: `down(silu(gate x) * up x)` for each
// (token, rank, slot) assignment, one subgroup per four weight rows (see
// rows_dot), one workgroup row (workgroup_id.y) per assignment. Three dispatches per pool shard:
//   moe_gate:   out[a, r] = gate[slot] row r . x[token]
//   moe_up:     out[a, r] = silu(aux[a, r]) * (up[slot] row r . x[token])
//   moe_down:   out[token*top_k + rank, r] = down[slot] row r . x[a]  (x = activations)
// `a` = asg_off + workgroup_id.y indexes the call's assignment list.
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (one pool shard of gate, up or down; slot s of
// the shard is rows [s*rows, (s+1)*rows)); 2 xin f32 rows of x_cols; 3 out f32
// (read-write); 4 asg array<vec4<u32>> (token, rank, slot, 0); 5 aux f32 (moe_up).

struct Params {
    w: WeightDesc,
    rows: u32,
    asg_off: u32,
    slot_base: u32,
    x_cols: u32,
    out_cols: u32,
    top_k: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> asg: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> aux: array<f32>;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}


@compute @workgroup_size(128)
fn moe_gate(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let a = p.asg_off + wid.y;
    let e = asg[a];
    let xstride = p.x_cols / 4u;
    let base = (e.z - p.slot_base) * p.rows;
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        let total = subgroupAdd(rows_dot(p.w, base + row0, nrows, e.x * xstride, lane, lanes));
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                out[a * p.rows + row0 + r] = total[r];
            }
        }
    }
}

@compute @workgroup_size(128)
fn moe_up(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let a = p.asg_off + wid.y;
    let e = asg[a];
    let xstride = p.x_cols / 4u;
    let base = (e.z - p.slot_base) * p.rows;
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        let total = subgroupAdd(rows_dot(p.w, base + row0, nrows, e.x * xstride, lane, lanes));
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                let i = a * p.rows + row0 + r;
                out[i] = silu(aux[i]) * total[r];
            }
        }
    }
}

@compute @workgroup_size(128)
fn moe_down(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let a = p.asg_off + wid.y;
    let e = asg[a];
    let xstride = p.x_cols / 4u;
    let base = (e.z - p.slot_base) * p.rows;
    let dst = (e.x * p.top_k + e.y) * p.out_cols;
    let quads = (p.rows + 3u) / 4u;
    for (var qi = wid.x * nsg + sg; qi < quads; qi += nwg.x * nsg) {
        let row0 = qi * 4u;
        let nrows = min(4u, p.rows - row0);
        let total = subgroupAdd(rows_dot(p.w, base + row0, nrows, a * xstride, lane, lanes));
        if (lane == 0u) {
            for (var r = 0u; r < nrows; r++) {
                out[dst + row0 + r] = total[r];
            }
        }
    }
}
