// Elementwise ops, one thread per output value; element index
// `(workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256 + local index`.
//   add:         out = a + b
//   sigmoid_mul: out = a * sigmoid(b[i]) (b same shape) or sigmoid(b[i / cols]) (one per row, b_per_row = 1)
//   add_sigmoid_mul: out = c + a * sigmoid(b[i]) (b as in sigmoid_mul)
//   silu_mul:    out = silu(a) * b
//   silu:        out = silu(a)
//   scale:       out = a * factor
//   copy_cols:   out[r, c] = a[r * src_cols + start + c] for c < cols (slice_cols)
//   delta_gates: out = exp(-exp(c[h]) * softplus(a + d[h])), out2 = sigmoid(b), h = i % cols
//
// Bindings: 0 uniform Params; 2 a; 3 out (read-write); 4 b; 5 c; 6 d; 7 out2 (read-write).
// All f32; `n` is the number of output values.

struct Params {
    n: u32,
    cols: u32,
    src_cols: u32,
    start: u32,
    b_per_row: u32,
    _pad1: u32,
    factor: f32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> b: array<f32>;
@group(0) @binding(5) var<storage, read> c: array<f32>;
@group(0) @binding(6) var<storage, read> d: array<f32>;
@group(0) @binding(7) var<storage, read_write> out2: array<f32>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn silu(v: f32) -> f32 {
    return v * sigmoid(v);
}

fn softplus(v: f32) -> f32 {
    if (v > 20.0) {
        return v;
    }
    return log(1.0 + exp(v));
}

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + li;
}

@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        out[i] = a[i] + b[i];
    }
}

@compute @workgroup_size(256)
fn sigmoid_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        var j = i;
        if (p.b_per_row == 1u) {
            j = i / p.cols;
        }
        out[i] = a[i] * sigmoid(b[j]);
    }
}

@compute @workgroup_size(256)
fn add_sigmoid_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        var j = i;
        if (p.b_per_row == 1u) {
            j = i / p.cols;
        }
        out[i] = c[i] + a[i] * sigmoid(b[j]);
    }
}

@compute @workgroup_size(256)
fn silu_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        out[i] = silu(a[i]) * b[i];
    }
}

@compute @workgroup_size(256)
fn silu_only(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        out[i] = silu(a[i]);
    }
}

@compute @workgroup_size(256)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        out[i] = a[i] * p.factor;
    }
}

@compute @workgroup_size(256)
fn copy_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        let r = i / p.cols;
        out[i] = a[r * p.src_cols + p.start + i % p.cols];
    }
}

@compute @workgroup_size(256)
fn delta_gates(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i < p.n) {
        let h = i % p.cols;
        out[i] = exp(-exp(c[h]) * softplus(a[i] + d[h]));
        out2[i] = sigmoid(b[i]);
    }
}
