// Normalisation over groups of `dim` values, one subgroup per group
// (grid-stride over groups along workgroup_id.x), except rms_norm_wide.
//   rms_norm:       out = x / sqrt(mean(x^2) + eps) * (has_weight ? w : 1)
//   rms_norm_wide:  the same with one 256-wide workgroup per group (long rows,
//                   few groups: the decoder norms); group = wid.y * nwg.x + wid.x
//   rms_norm_gated: out = act(z) * (x / sqrt(mean(x^2) + eps) * w),
//                   act = silu (gate_act 0) or sigmoid (gate_act 1)
//   l2_normalize:   out = x * scale / sqrt(sum(x^2) + eps)
//   add_rms_norm:   sum = x + z, out = rms_norm(sum) (with the weight), one workgroup per
//                   group as rms_norm_wide; add_rms_norm_1024 the same with 1024-wide
//                   workgroups (long rows: four times fewer loads in a row per thread,
//                   where the adapter allows such workgroups)
//   rms_norm_rope:  n = rms_norm(x) * w per head (group), then rotate-half rotary
//                   embedding of its first 2*half values with the angles of the group's
//                   token (g / heads), as rope.wgsl; and, when groups2 > 0, the same
//                   for a second set (keys: z, weight2, eps2, heads2) into sum
// The weight has `weight_len` values: `dim` (one slice shared by every group)
// or a row's worth (a multiple of dim: the per-stream norm of hyper-connections);
// group g uses w = weight[(g * dim) % weight_len ..][..dim].
//
// Bindings: 0 uniform Params; 2 x [groups * dim]; 3 out (read-write);
// 4 weight [weight_len] (rms_norm, rms_norm_wide, rms_norm_gated);
// 5 z [groups * dim] (rms_norm_gated, add_rms_norm); 6 sum (read-write; add_rms_norm);
// 7 cs [tokens, half, 2] (rms_norm_rope); 8 weight2 (rms_norm_rope's second set).

struct Params {
    groups: u32,
    dim: u32,
    has_weight: u32,
    weight_len: u32,
    eps: f32,
    scale: f32,
    gate_act: u32,
    half: u32,
    heads: u32,
    groups2: u32,
    heads2: u32,
    eps2: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> weight: array<f32>;
@group(0) @binding(5) var<storage, read> z: array<f32>;
@group(0) @binding(6) var<storage, read_write> sum: array<f32>;
@group(0) @binding(7) var<storage, read> cs: array<f32>;
@group(0) @binding(8) var<storage, read> weight2: array<f32>;

fn sum_squares(base: u32, lane: u32, lanes: u32) -> f32 {
    var s = 0.0;
    for (var i = lane; i < p.dim; i += lanes) {
        let v = x[base + i];
        s += v * v;
    }
    return subgroupAdd(s);
}

/// Where group `g`'s slice of the weight starts.
fn weight_base(g: u32) -> u32 {
    return (g * p.dim) % p.weight_len;
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

@compute @workgroup_size(64)
fn rms_norm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    for (var g = wid.x * nsg + sg; g < p.groups; g += nwg.x * nsg) {
        let base = g * p.dim;
        let r = 1.0 / sqrt(sum_squares(base, lane, lanes) / f32(p.dim) + p.eps);
        let wb = weight_base(g);
        for (var i = lane; i < p.dim; i += lanes) {
            var v = x[base + i] * r;
            if (p.has_weight == 1u) {
                v = v * weight[wb + i];
            }
            out[base + i] = v;
        }
    }
}

@compute @workgroup_size(64)
fn rms_norm_gated(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    for (var g = wid.x * nsg + sg; g < p.groups; g += nwg.x * nsg) {
        let base = g * p.dim;
        let r = 1.0 / sqrt(sum_squares(base, lane, lanes) / f32(p.dim) + p.eps);
        let wb = weight_base(g);
        for (var i = lane; i < p.dim; i += lanes) {
            let zv = z[base + i];
            var gate = sigmoid(zv);
            if (p.gate_act == 0u) {
                gate = zv * gate;
            }
            out[base + i] = gate * (x[base + i] * r * weight[wb + i]);
        }
    }
}

@compute @workgroup_size(64)
fn l2_normalize(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    for (var g = wid.x * nsg + sg; g < p.groups; g += nwg.x * nsg) {
        let base = g * p.dim;
        let r = p.scale / sqrt(sum_squares(base, lane, lanes) + p.eps);
        for (var i = lane; i < p.dim; i += lanes) {
            out[base + i] = x[base + i] * r;
        }
    }
}

// One entry per subgroup: up to 1024 invocations in subgroups of 8 or more.
var<workgroup> partial: array<f32, 128>;

// The sum of every invocation's `s` over the workgroup (rms_norm_wide, add_rms_norm).
fn workgroup_sum(s: f32, lane: u32, sg: u32, nsg: u32) -> f32 {
    let t = subgroupAdd(s);
    if (lane == 0u) {
        partial[sg] = t;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var k = 0u; k < nsg; k++) {
        total += partial[k];
    }
    return total;
}

@compute @workgroup_size(256)
fn rms_norm_wide(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let g = wid.y * nwg.x + wid.x;
    if (g >= p.groups) {
        return;
    }
    let base = g * p.dim;
    var s = 0.0;
    for (var i = li; i < p.dim; i += 256u) {
        let v = x[base + i];
        s += v * v;
    }
    let r = 1.0 / sqrt(workgroup_sum(s, lane, sg, nsg) / f32(p.dim) + p.eps);
    let wb = weight_base(g);
    for (var i = li; i < p.dim; i += 256u) {
        var v = x[base + i] * r;
        if (p.has_weight == 1u) {
            v = v * weight[wb + i];
        }
        out[base + i] = v;
    }
}

// Values per invocation that add_rms_norm keeps in registers.
const NORM_SLOTS: u32 = 4u;

// add_rms_norm's group g with `wg` invocations per workgroup. Groups of at
// most NORM_SLOTS * wg values keep them in registers and load the weights with
// them, so the group costs one round of global loads; longer ones read x and
// z again after the sum.
fn add_rms_norm_group(g: u32, li: u32, sg: u32, nsg: u32, lane: u32, wg: u32) {
    let base = g * p.dim;
    let wb = weight_base(g);
    if (p.dim <= NORM_SLOTS * wg) {
        var v: array<f32, 4>;
        var wv: array<f32, 4>;
        var ss = 0.0;
        for (var k = 0u; k < NORM_SLOTS; k++) {
            let i = li + k * wg;
            if (i < p.dim) {
                v[k] = x[base + i] + z[base + i];
                wv[k] = weight[wb + i];
            }
        }
        for (var k = 0u; k < NORM_SLOTS; k++) {
            let i = li + k * wg;
            if (i < p.dim) {
                sum[base + i] = v[k];
                ss += v[k] * v[k];
            }
        }
        let rr = 1.0 / sqrt(workgroup_sum(ss, lane, sg, nsg) / f32(p.dim) + p.eps);
        for (var k = 0u; k < NORM_SLOTS; k++) {
            let i = li + k * wg;
            if (i < p.dim) {
                out[base + i] = v[k] * rr * wv[k];
            }
        }
        return;
    }
    var s = 0.0;
    for (var i = li; i < p.dim; i += wg) {
        let v = x[base + i] + z[base + i];
        sum[base + i] = v;
        s += v * v;
    }
    let r = 1.0 / sqrt(workgroup_sum(s, lane, sg, nsg) / f32(p.dim) + p.eps);
    for (var i = li; i < p.dim; i += wg) {
        out[base + i] = (x[base + i] + z[base + i]) * r * weight[wb + i];
    }
}

@compute @workgroup_size(256)
fn add_rms_norm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let g = wid.y * nwg.x + wid.x;
    if (g < p.groups) {
        add_rms_norm_group(g, li, sg, nsg, lane, 256u);
    }
}

@compute @workgroup_size(1024)
fn add_rms_norm_1024(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let g = wid.y * nwg.x + wid.x;
    if (g < p.groups) {
        add_rms_norm_group(g, li, sg, nsg, lane, 1024u);
    }
}

// rms_norm_rope's input value `i`: q groups read x, k groups (the second
// set, g >= groups) read z.
fn nr_x(second: bool, i: u32) -> f32 {
    if (second) {
        return z[i];
    }
    return x[i];
}

fn nr_w(second: bool, i: u32) -> f32 {
    if (second) {
        return weight2[i];
    }
    return weight[i];
}

@compute @workgroup_size(64)
fn rms_norm_rope(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    for (var g = wid.x * nsg + sg; g < p.groups + p.groups2; g += nwg.x * nsg) {
        let second = g >= p.groups;
        var gl = g;
        var heads = p.heads;
        var eps = p.eps;
        if (second) {
            gl = g - p.groups;
            heads = p.heads2;
            eps = p.eps2;
        }
        let base = gl * p.dim;
        var s = 0.0;
        for (var i = lane; i < p.dim; i += lanes) {
            let v = nr_x(second, base + i);
            s += v * v;
        }
        let r = 1.0 / sqrt(subgroupAdd(s) / f32(p.dim) + eps);
        let t = gl / heads;
        for (var i = lane; i < p.dim; i += lanes) {
            let v = nr_x(second, base + i) * r * nr_w(second, i);
            var o = v;
            if (i < p.half) {
                let j = i + p.half;
                let a = (t * p.half + i) * 2u;
                o = v * cs[a] - nr_x(second, base + j) * r * nr_w(second, j) * cs[a + 1u];
            } else if (i < 2u * p.half) {
                let j = i - p.half;
                let a = (t * p.half + j) * 2u;
                o = v * cs[a] + nr_x(second, base + j) * r * nr_w(second, j) * cs[a + 1u];
            }
            if (second) {
                sum[base + i] = o;
            } else {
                out[base + i] = o;
            }
        }
    }
}
