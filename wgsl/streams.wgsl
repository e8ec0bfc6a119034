// Multi-stream residual ops: a row holds `streams` streams of `d` values side
// by side, `[rows, streams*d]`.
//   repeat_cols:          out[r, s*d + j] = a[r, j]                       (one thread per output)
//   stream_mean:          out[r, j] = (sum_s sigmoid(b[r, s*d + j]) * a[r, s*d + j]) / streams,
//                         summed in stream order                          (one thread per output)
//   add_gated_to_streams: out[r, s*d + j] = a[r, s*d + j] + 2*sigmoid(factor * c[r, s]) * b[r, j]
//                                                                         (one thread per output)
//   stream_dot_gate:      g = (a[r, s*d..][..d] . b[r, s*d..][..d]) * factor (factor = 1/sqrt(d)),
//                         g = sign(g) * sqrt(max(|g|, 1e-6)) (sign(0) = 0, as in the reference),
//                         out[r, s*d + j] = sigmoid(g) * c[r, j]
//                         one subgroup per (row, stream) group, grid-stride over groups
//                         along workgroup_id.x.
// Elementwise kernels index `(workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256
// + local index`, `n` outputs.
//
// Bindings: 0 uniform Params; 2 a (repeat_cols: x [rows, d]; stream_mean: x;
// add_gated_to_streams: h; stream_dot_gate: key); 3 out (read-write); 4 b
// (stream_mean: w; add_gated_to_streams: x [rows, d]; stream_dot_gate: query);
// 5 c (add_gated_to_streams: logits [rows, streams]; stream_dot_gate: value
// [rows, d]). All f32.

struct Params {
    n: u32,
    d: u32,
    streams: u32,
    groups: u32,
    factor: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> b: array<f32>;
@group(0) @binding(5) var<storage, read> c: array<f32>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + li;
}

@compute @workgroup_size(256)
fn repeat_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        let row = p.streams * p.d;
        out[i] = a[(i / row) * p.d + i % p.d];
    }
}

@compute @workgroup_size(256)
fn stream_mean(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        let r = i / p.d;
        let j = i % p.d;
        var acc = 0.0;
        for (var s = 0u; s < p.streams; s++) {
            let k = (r * p.streams + s) * p.d + j;
            acc += sigmoid(b[k]) * a[k];
        }
        out[i] = acc / f32(p.streams);
    }
}

@compute @workgroup_size(256)
fn add_gated_to_streams(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        let row = p.streams * p.d;
        let r = i / row;
        let s = (i % row) / p.d;
        let w = 2.0 * sigmoid(p.factor * c[r * p.streams + s]);
        out[i] = a[i] + w * b[r * p.d + i % p.d];
    }
}

@compute @workgroup_size(64)
fn stream_dot_gate(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    for (var g = wid.x * nsg + sg; g < p.groups; g += nwg.x * nsg) {
        let base = g * p.d;
        var dot = 0.0;
        for (var j = lane; j < p.d; j += lanes) {
            dot += a[base + j] * b[base + j];
        }
        let raw = subgroupAdd(dot) * p.factor;
        let w = sigmoid(sign(raw) * sqrt(max(abs(raw), 1e-6)));
        let vb = (g / p.streams) * p.d;
        for (var j = lane; j < p.d; j += lanes) {
            out[base + j] = w * c[vb + j];
        }
    }
}
