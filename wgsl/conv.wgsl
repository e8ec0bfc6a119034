// Causal depthwise convolution over time with a carried window; taps are
// `dilation` steps apart, so the window holds the last hist = (kernel-1)*dilation
// inputs.
//   conv1d: out[t, c] = sum_j w[c, j] * seq[t + j*dilation, c], seq = window ++ x,
//           then silu(out) when act = 1, one thread per output value; the
//           threads after those write the window the next call continues
//           from, new_window[r, c] = seq[tokens + r, c] for r < hist
//           (window_n = hist * channels values; a buffer apart from window)
//
// Bindings: 0 uniform Params; 2 x [tokens, channels]; 3 out [tokens, channels]
// (read-write); 4 w [channels, kernel]; 5 window [hist, channels];
// 6 new_window [hist, channels] (read-write).

struct Params {
    tokens: u32,
    channels: u32,
    kernel: u32,
    n: u32,
    dilation: u32,
    // conv1d: 1 applies silu to the output (causal_conv1d_silu).
    act: u32,
    window_n: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> w: array<f32>;
@group(0) @binding(5) var<storage, read> window: array<f32>;
@group(0) @binding(6) var<storage, read_write> new_window: array<f32>;

fn seq(r: u32, c: u32) -> f32 {
    let hist = (p.kernel - 1u) * p.dilation;
    if (r < hist) {
        return window[r * p.channels + c];
    }
    return x[(r - hist) * p.channels + c];
}

@compute @workgroup_size(256)
fn conv1d(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    if (i >= p.n) {
        let j = i - p.n;
        if (j < p.window_n) {
            new_window[j] = seq(p.tokens + j / p.channels, j % p.channels);
        }
        return;
    }
    let t = i / p.channels;
    let c = i % p.channels;
    var acc = 0.0;
    for (var j = 0u; j < p.kernel; j++) {
        acc += w[c * p.kernel + j] * seq(t + j * p.dilation, c);
    }
    if (p.act == 1u) {
        // silu as in elementwise.wgsl.
        acc = acc * (1.0 / (1.0 + exp(-acc)));
    }
    out[i] = acc;
}
