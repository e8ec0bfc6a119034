// rope: rotate-half (GPT-NeoX) rotary embedding on the first `2*half` values
// of each head; the rest of each head is copied. Angles come from the host as
// a table (cos, sin) per (token, i < half), computed in f64 there.
// One thread per value of x.
//
// Bindings: 0 uniform Params; 2 x [tokens, heads, head_dim]; 3 out (read-write);
// 4 cs [tokens, half, 2] f32.

struct Params {
    n: u32,
    heads: u32,
    head_dim: u32,
    half: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> cs: array<f32>;

@compute @workgroup_size(256)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let idx = (wid.y * nwg.x + wid.x) * 256u + li;
    if (idx >= p.n) {
        return;
    }
    let i = idx % p.head_dim;
    let head_base = idx - i;
    let t = idx / (p.heads * p.head_dim);
    if (i < p.half) {
        let c = cs[(t * p.half + i) * 2u];
        let s = cs[(t * p.half + i) * 2u + 1u];
        out[idx] = x[idx] * c - x[head_base + i + p.half] * s;
    } else if (i < 2u * p.half) {
        let j = i - p.half;
        let c = cs[(t * p.half + j) * 2u];
        let s = cs[(t * p.half + j) * 2u + 1u];
        out[idx] = x[idx] * c + x[head_base + j] * s;
    } else {
        out[idx] = x[idx];
    }
}
