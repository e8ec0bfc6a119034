// gated_delta: the gated delta rule in recurrent form, all tokens in one
// dispatch. Rows of the state are independent, so one subgroup owns one state
// row (head h, value index i) in registers for the whole call: per token,
//   s *= g;  delta = (v_i - s.k) * beta;  s += delta * k;  y_i = s.q
// Value head h reads key head h / (heads / key_heads). Lanes hold elements
// lane + m*lanes of the row (m < 16, so key_dim <= 16 * subgroup size).
//
// With `raw` = 1 (the backend's gated_delta_step) the inputs are raw: q and k are
// scaled to unit L2 norm per key head here (q then by q_scale), and
// g = exp(-exp(a_log[h]) * softplus(a + dt_bias[h])), beta = sigmoid(b) come from
// the raw gate projections (bindings 6, 7 hold a, b).
//
// Bindings: 0 uniform Params; 2 q, 4 k [tokens, key_heads*key_dim];
// 5 v [tokens, heads*value_dim]; 6 g (or a), 7 beta (or b) [tokens, heads];
// 8 state [heads, value_dim, key_dim] (read-write); 3 out [tokens, heads*value_dim] (read-write);
// 9 a_log, 10 dt_bias [heads] (read when raw). Prompts from a few dozen tokens
// take the chunked form instead (gated_delta_chunked.wgsl, the same bindings).

struct Params {
    tokens: u32,
    heads: u32,
    key_heads: u32,
    key_dim: u32,
    value_dim: u32,
    q_scale: f32,
    eps: f32,
    raw: u32,
    // The chunked entry points' window (gated_delta_chunked.wgsl).
    start: u32,
    chunks: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> k: array<f32>;
@group(0) @binding(5) var<storage, read> v: array<f32>;
@group(0) @binding(6) var<storage, read> g: array<f32>;
@group(0) @binding(7) var<storage, read> beta: array<f32>;
@group(0) @binding(8) var<storage, read_write> state: array<f32>;
@group(0) @binding(9) var<storage, read> a_log: array<f32>;
@group(0) @binding(10) var<storage, read> dt_bias: array<f32>;

fn softplus(v: f32) -> f32 {
    if (v > 20.0) {
        return v;
    }
    return log(1.0 + exp(v));
}

const MAX_PER_LANE: u32 = 16u;

@compute @workgroup_size(64)
fn gated_delta(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let dk = p.key_dim;
    let dv = p.value_dim;
    let kcols = p.key_heads * dk;
    let vcols = p.heads * dv;
    for (var row = wid.x * nsg + sg; row < p.heads * dv; row += nwg.x * nsg) {
        let h = row / dv;
        let i = row % dv;
        let kh = h / (p.heads / p.key_heads);
        var s: array<f32, 16>;
        for (var m = 0u; m < MAX_PER_LANE; m++) {
            let e = lane + m * lanes;
            s[m] = 0.0;
            if (e < dk) {
                s[m] = state[row * dk + e];
            }
        }
        for (var t = 0u; t < p.tokens; t++) {
            var gt = g[t * p.heads + h];
            var bt = beta[t * p.heads + h];
            let kb = t * kcols + kh * dk;
            // Multipliers of k and q: 1 for prepared inputs (exact), their
            // inverse L2 norms for raw ones.
            var rk = 1.0;
            var rq = 1.0;
            if (p.raw == 1u) {
                gt = exp(-exp(a_log[h]) * softplus(gt + dt_bias[h]));
                bt = 1.0 / (1.0 + exp(-bt));
                var kk = 0.0;
                var qq = 0.0;
                for (var m = 0u; m < MAX_PER_LANE; m++) {
                    let e = lane + m * lanes;
                    if (e < dk) {
                        kk += k[kb + e] * k[kb + e];
                        qq += q[kb + e] * q[kb + e];
                    }
                }
                rk = 1.0 / sqrt(subgroupAdd(kk) + p.eps);
                rq = p.q_scale / sqrt(subgroupAdd(qq) + p.eps);
            }
            var sk = 0.0;
            for (var m = 0u; m < MAX_PER_LANE; m++) {
                let e = lane + m * lanes;
                if (e < dk) {
                    s[m] = s[m] * gt;
                    sk += s[m] * (k[kb + e] * rk);
                }
            }
            sk = subgroupAdd(sk);
            let delta = (v[t * vcols + h * dv + i] - sk) * bt;
            var sq = 0.0;
            for (var m = 0u; m < MAX_PER_LANE; m++) {
                let e = lane + m * lanes;
                if (e < dk) {
                    s[m] = s[m] + (k[kb + e] * rk) * delta;
                    sq += s[m] * (q[kb + e] * rq);
                }
            }
            sq = subgroupAdd(sq);
            if (lane == 0u) {
                out[t * vcols + h * dv + i] = sq;
            }
        }
        for (var m = 0u; m < MAX_PER_LANE; m++) {
            let e = lane + m * lanes;
            if (e < dk) {
                state[row * dk + e] = s[m];
            }
        }
    }
}
