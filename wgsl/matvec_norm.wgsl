// matvec_norm: matvec_one.wgsl's one-token product of `x = norm(base + addend)`,
// the norm as norm.wgsl's add_rms_norm (`sum = base + addend`, `x = sum *
// (1 / rms(sum)) * nw`) folded in: every workgroup forms x in workgroup memory
// (`xin`, which dot.wgsl's row products read) before its rows, so the norm
// needs no dispatch of its own; workgroup 0 also writes sum and x, as the norm
// would have, for the ops after the product.
//
// Bindings (besides matvec_one.wgsl's): 10 base, 11 addend, 12 nw [x_cols] f32;
// 13 sum, 14 normed [x_cols] f32 (read-write).

// Runs of four values each invocation keeps in registers: rows of up to
// 4 * 128 * NORM_ROW_RUNS = 3072 values, all of which xin holds.
const NORM_ROW_RUNS: u32 = 6u;

var<workgroup> xin: array<vec4<f32>, 768>;
// One partial sum of squares per subgroup (128 invocations, subgroups of 4 or more).
var<workgroup> norm_partial: array<f32, 32>;

@group(0) @binding(10) var<storage, read> base: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read> addend: array<vec4<f32>>;
@group(0) @binding(12) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(13) var<storage, read_write> sum: array<vec4<f32>>;
@group(0) @binding(14) var<storage, read_write> normed: array<vec4<f32>>;

@compute @workgroup_size(128)
fn matvec_norm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let runs = p.x_cols / 4u;
    // Every load of the row is issued before any is used.
    var v: array<vec4<f32>, 6>;
    var wv: array<vec4<f32>, 6>;
    for (var k = 0u; k < NORM_ROW_RUNS; k++) {
        let i = li + k * 128u;
        if (i < runs) {
            v[k] = base[i] + addend[i];
            wv[k] = nw[i];
        }
    }
    var ss = 0.0;
    for (var k = 0u; k < NORM_ROW_RUNS; k++) {
        if (li + k * 128u < runs) {
            ss += dot(v[k], v[k]);
        }
    }
    let t = subgroupAdd(ss);
    if (lane == 0u) {
        norm_partial[sg] = t;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var k = 0u; k < nsg; k++) {
        total += norm_partial[k];
    }
    let rr = 1.0 / sqrt(total / f32(p.x_cols) + p.eps);
    for (var k = 0u; k < NORM_ROW_RUNS; k++) {
        let i = li + k * 128u;
        if (i < runs) {
            let n = v[k] * rr * wv[k];
            xin[i] = n;
            if (wid.x == 0u) {
                sum[i] = v[k];
                normed[i] = n;
            }
        }
    }
    workgroupBarrier();
    one_token_rows(wid.x, nwg.x, sg, nsg, lane, lanes);
}
