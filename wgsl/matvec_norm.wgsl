// matvec_norm: matvec's one-token product of interleaved 4-bit weights
// (q4i_token, matvec_common.wgsl) over norm(base + addend), add_rms_norm's
// residual add and RMSNorm (weight nw, epsilon p.eps) in the same dispatch:
// every workgroup computes the normed row into workgroup memory, where the
// row dots read x (x_at); workgroup 0 also writes the sum and the normed
// row, as the norm would have. One row of at most 4 * XS columns.
//
// Bindings: 0 uniform Params; 1 w and 6 w_words (weight shard, see
// weights.wgsl); 2 xin (not read: dot.wgsl's other row dots name it); 3 out
// f32 (read-write); 7 base, 8 addend, 9 nw [x_cols] f32; 10 sum, 11 normed
// [x_cols] f32 (read-write).

@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> base: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> addend: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> sum: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read_write> normed: array<vec4<f32>>;

const XS: u32 = 1024u;
var<workgroup> xs: array<vec4<f32>, 1024>;
// Each subgroup's share of the sum of squares.
var<workgroup> squares: array<f32, 256>;

// Where dot.wgsl's interleaved row dots read x: the normed row here.
fn x_at(i: u32) -> vec4<f32> {
    return xs[i];
}

@compute @workgroup_size(256)
fn matvec_norm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let runs = min(p.x_cols / 4u, XS);
    var ss = 0.0;
    for (var i = li; i < runs; i += 256u) {
        let v = base[i] + addend[i];
        xs[i] = v;
        ss += dot(v, v);
    }
    let part = subgroupAdd(ss);
    if (lane == 0u) {
        squares[sg] = part;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var k = 0u; k < nsg; k++) {
        total += squares[k];
    }
    let rr = 1.0 / sqrt(total / f32(p.x_cols) + p.eps);
    // Each invocation rescales the entries it wrote.
    for (var i = li; i < runs; i += 256u) {
        let v = xs[i];
        let x = v * rr * nw[i];
        xs[i] = x;
        if (wid.x == 0u) {
            sum[i] = v;
            normed[i] = x;
        }
    }
    workgroupBarrier();
    q4i_token(wid, nwg, sg, nsg, lane, lanes);
}
