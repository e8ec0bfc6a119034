// gated_delta_prep, gated_delta_chunks: the gated delta rule in chunked form
// (prefill), appended to gated_delta.wgsl (its Params, bindings and softplus).
// The prompt is cut into chunks of C tokens. With L_t the cumulative log gate
// inside a chunk (G_t = exp(L_t)), k and q at unit norm, and S0 the state
// before the chunk, the pseudo-values u solve
//   u_t = beta_t (v_t - G_t S0 k_t - sum_{s<t} exp(L_t - L_s) (k_s.k_t) u_s),
// so u = T (v - G S0 k) with T = (I + A)^-1 diag(beta), A[t,s] =
// beta_t exp(L_t - L_s) (k_s.k_t) strictly below the diagonal. Then
//   y_t = G_t S0 q_t + sum_{s<=t} exp(L_t - L_s) (k_s.q_t) u_s,
//   S_end = G_C S0 + sum_s exp(L_C - L_s) u_s k_s^T
// (the CPU backend's `chunked_head` computes the same, u by substitution).
//
// gated_delta_prep (one workgroup per chunk of the window and value head, all
// in parallel): the Gram products k k^T and q k^T of the chunk, T and the
// decayed, causal q.k matrix into the record of (chunk, head) in `chunk_data`
// (binding 11), with L and the norm multipliers of k and q. Nothing in it
// depends on the state.
//
// gated_delta_chunks (one workgroup per value head and slice of VS state rows;
// rows of the state are independent given T): the chunks of the window in
// order, the slice of the state in workgroup memory: S0 k and S0 q, u = T(..),
// the outputs, then the state at the chunk's end.
//
// Params.start is the window's first token, Params.chunks its chunks (the
// last may hold fewer than C tokens); a window's prep runs before its chunks.
// Binding 11: chunk_data, (chunks * heads) records of REC floats:
//   [C*C] T, [C*C] the q.k matrix, [C] L, [C] k multipliers, [C] q multipliers.

@group(0) @binding(11) var<storage, read_write> chunk_data: array<f32>;

const C: u32 = 64u;
// Key columns per tile of the Gram products, and the tiles' row stride.
const CK: u32 = 32u;
const CKP: u32 = 33u;
const REC: u32 = 8448u; // 2 * C * C + 4 * C
const QK_AT: u32 = 4096u; // C * C
const L_AT: u32 = 8192u; // 2 * C * C
// State rows per workgroup of gated_delta_chunks, and the row stride of the
// state in workgroup memory: one more than the largest key_dim (128), so that
// the rows of one column fall in different banks.
const VS: u32 = 16u;
const SD: u32 = 129u;

// gated_delta_prep: the k and q tiles ([C, CKP] each), then A and T ([C, C]).
var<workgroup> tile: array<f32, 4224>;
var<workgroup> log_g: array<f32, 64>;
var<workgroup> beta_c: array<f32, 64>;
var<workgroup> k_sq: array<f32, 64>;
var<workgroup> q_sq: array<f32, 64>;

fn chunk_first(j: u32) -> u32 {
    return p.start + j * C;
}

fn key_head(h: u32) -> u32 {
    return h / (p.heads / p.key_heads);
}

@compute @workgroup_size(256)
fn gated_delta_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x % p.heads;
    let j = wid.x / p.heads;
    if (j >= p.chunks) {
        return;
    }
    let first = chunk_first(j);
    let c = min(C, p.tokens - first);
    let dk = p.key_dim;
    let kcols = p.key_heads * dk;
    let kb = key_head(h) * dk;
    if (lid < C) {
        var lg = 0.0;
        var bt = 0.0;
        if (lid < c) {
            let x = g[(first + lid) * p.heads + h];
            let y = beta[(first + lid) * p.heads + h];
            if (p.raw == 1u) {
                lg = -exp(a_log[h]) * softplus(x + dt_bias[h]);
                bt = 1.0 / (1.0 + exp(-y));
            } else {
                lg = log(x);
                bt = y;
            }
        }
        log_g[lid] = lg;
        beta_c[lid] = bt;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0.0;
        for (var t = 0u; t < C; t++) {
            acc += log_g[t];
            log_g[t] = acc;
        }
    }
    // Thread (ti, si) accumulates rows 4ti.. and columns 4si.. of k k^T and q k^T.
    let ti = lid / 16u;
    let si = lid % 16u;
    var kk: array<f32, 16>;
    var qk: array<f32, 16>;
    for (var m = 0u; m < 16u; m++) {
        kk[m] = 0.0;
        qk[m] = 0.0;
    }
    var qq = 0.0;
    for (var e0 = 0u; e0 < dk; e0 += CK) {
        for (var m = 0u; m < 8u; m++) {
            let idx = lid + m * 256u;
            let t = idx / CK;
            let e = e0 + idx % CK;
            var kv = 0.0;
            var qv = 0.0;
            if (t < c && e < dk) {
                let at = (first + t) * kcols + kb + e;
                kv = k[at];
                qv = q[at];
            }
            tile[t * CKP + idx % CK] = kv;
            tile[C * CKP + t * CKP + idx % CK] = qv;
        }
        workgroupBarrier();
        for (var e = 0u; e < CK; e++) {
            var kr: array<f32, 4>;
            var qr: array<f32, 4>;
            var kc: array<f32, 4>;
            for (var a = 0u; a < 4u; a++) {
                kr[a] = tile[(4u * ti + a) * CKP + e];
                qr[a] = tile[C * CKP + (4u * ti + a) * CKP + e];
                kc[a] = tile[(4u * si + a) * CKP + e];
            }
            for (var a = 0u; a < 4u; a++) {
                for (var b = 0u; b < 4u; b++) {
                    kk[a * 4u + b] += kr[a] * kc[b];
                    qk[a * 4u + b] += qr[a] * kc[b];
                }
            }
        }
        if (lid < C) {
            for (var e = 0u; e < CK; e++) {
                let qv = tile[C * CKP + lid * CKP + e];
                qq += qv * qv;
            }
        }
        workgroupBarrier();
    }
    if (ti == si) {
        for (var a = 0u; a < 4u; a++) {
            k_sq[4u * ti + a] = kk[a * 5u];
        }
    }
    if (lid < C) {
        q_sq[lid] = qq;
    }
    workgroupBarrier();
    let base = (j * p.heads + h) * REC;
    // A (strictly lower) into `tile`, the q.k matrix (lower, with the diagonal) out.
    for (var a = 0u; a < 4u; a++) {
        let t = 4u * ti + a;
        for (var b = 0u; b < 4u; b++) {
            let s = 4u * si + b;
            var av = 0.0;
            var qv = 0.0;
            if (s <= t && t < c) {
                let d = exp(log_g[t] - log_g[s]) * k_mul(s);
                qv = d * qk[a * 4u + b] * q_mul(t);
                if (s < t) {
                    av = beta_c[t] * d * kk[a * 4u + b] * k_mul(t);
                }
            }
            tile[t * C + s] = av;
            chunk_data[base + QK_AT + t * C + s] = qv;
        }
    }
    workgroupBarrier();
    // T row by row, in place of A: (I + A) T = diag(beta), T lower triangular.
    for (var t = 0u; t < C; t++) {
        var tv = 0.0;
        if (lid <= t) {
            tv = select(0.0, beta_c[t], lid == t);
            for (var s = lid; s < t; s++) {
                tv -= tile[t * C + s] * tile[s * C + lid];
            }
        }
        workgroupBarrier();
        if (lid < C) {
            tile[t * C + lid] = tv;
        }
        workgroupBarrier();
    }
    for (var m = 0u; m < 16u; m++) {
        let idx = lid + m * 256u;
        chunk_data[base + idx] = tile[idx];
    }
    if (lid < C) {
        chunk_data[base + L_AT + lid] = log_g[lid];
        chunk_data[base + L_AT + C + lid] = k_mul(lid);
        chunk_data[base + L_AT + 2u * C + lid] = q_mul(lid);
    }
}

// The multipliers that bring raw k and q of chunk token t to unit norm (q
// then to q_scale); 1 for prepared inputs.
fn k_mul(t: u32) -> f32 {
    return select(1.0, 1.0 / sqrt(k_sq[t] + p.eps), p.raw == 1u);
}

fn q_mul(t: u32) -> f32 {
    return select(1.0, p.q_scale / sqrt(q_sq[t] + p.eps), p.raw == 1u);
}

// gated_delta_chunks: the state slice [VS, SD]; per chunk S0 q scaled ([C, VS]),
// v - G S0 k (then the update weights of u) and u.
var<workgroup> st_sh: array<f32, 2064>;
var<workgroup> sq_sh: array<f32, 1024>;
var<workgroup> rhs_sh: array<f32, 1024>;
var<workgroup> u_sh: array<f32, 1024>;

@compute @workgroup_size(256)
fn gated_delta_chunks(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let dk = p.key_dim;
    let dv = p.value_dim;
    let slices = (dv + VS - 1u) / VS;
    let h = wid.x / slices;
    let i0 = (wid.x % slices) * VS;
    if (h >= p.heads) {
        return;
    }
    let kcols = p.key_heads * dk;
    let vcols = p.heads * dv;
    let kb = key_head(h) * dk;
    for (var idx = lid; idx < VS * dk; idx += 256u) {
        let i = idx / dk;
        var s = 0.0;
        if (i0 + i < dv) {
            s = state[(h * dv + i0 + i) * dk + idx % dk];
        }
        st_sh[i * SD + idx % dk] = s;
    }
    workgroupBarrier();
    // S0 k (threads 0..127) and S0 q (128..255): rows 4 * (l % 4).. of
    // tokens l / 4 and l / 4 + 32, a key or query element read once for four
    // rows. Then, for u and the outputs, row ri of tokens tg + 16a.
    let use_q = lid >= 128u;
    let l = lid % 128u;
    let r4 = (l % 4u) * 4u;
    let tp = l / 4u;
    let ri = lid % VS;
    let tg = lid / VS;
    let row_ok = i0 + ri < dv;
    // The state update: key element lid % 128 of rows 8 * (lid / 128)...
    let ue = lid % 128u;
    let ui = (lid / 128u) * 8u;
    for (var j = 0u; j < p.chunks; j++) {
        let first = chunk_first(j);
        let c = min(C, p.tokens - first);
        let base = (j * p.heads + h) * REC;
        var acc8: array<f32, 8>;
        for (var m = 0u; m < 8u; m++) {
            acc8[m] = 0.0;
        }
        let at0 = (first + min(tp, c - 1u)) * kcols + kb;
        let at1 = (first + min(tp + 32u, c - 1u)) * kcols + kb;
        for (var e = 0u; e < dk; e++) {
            var x0: f32;
            var x1: f32;
            if (use_q) {
                x0 = q[at0 + e];
                x1 = q[at1 + e];
            } else {
                x0 = k[at0 + e];
                x1 = k[at1 + e];
            }
            for (var b = 0u; b < 4u; b++) {
                let s = st_sh[(r4 + b) * SD + e];
                acc8[b] += s * x0;
                acc8[4u + b] += s * x1;
            }
        }
        for (var a = 0u; a < 2u; a++) {
            let t = tp + 32u * a;
            var gt = 0.0;
            if (t < c) {
                gt = exp(chunk_data[base + L_AT + t]) * chunk_data[base + L_AT + select(C, 2u * C, use_q) + t];
            }
            for (var b = 0u; b < 4u; b++) {
                let row = r4 + b;
                let ok = t < c && i0 + row < dv;
                if (use_q) {
                    sq_sh[t * VS + row] = select(0.0, gt * acc8[4u * a + b], ok);
                } else {
                    var r = 0.0;
                    if (ok) {
                        r = v[(first + t) * vcols + h * dv + i0 + row] - gt * acc8[4u * a + b];
                    }
                    rhs_sh[t * VS + row] = r;
                }
            }
        }
        workgroupBarrier();
        for (var a = 0u; a < 4u; a++) {
            let t = tg + 16u * a;
            var acc = 0.0;
            for (var s = 0u; s < t + 1u; s++) {
                acc += chunk_data[base + t * C + s] * rhs_sh[s * VS + ri];
            }
            u_sh[t * VS + ri] = acc;
        }
        workgroupBarrier();
        let l_end = chunk_data[base + L_AT + c - 1u];
        for (var a = 0u; a < 4u; a++) {
            let t = tg + 16u * a;
            var y = sq_sh[t * VS + ri];
            for (var s = 0u; s < t + 1u; s++) {
                y += chunk_data[base + QK_AT + t * C + s] * u_sh[s * VS + ri];
            }
            var w = 0.0;
            if (t < c) {
                if (row_ok) {
                    out[(first + t) * vcols + h * dv + i0 + ri] = y;
                }
                w = exp(l_end - chunk_data[base + L_AT + t]) * chunk_data[base + L_AT + C + t] * u_sh[t * VS + ri];
            }
            rhs_sh[t * VS + ri] = w;
        }
        workgroupBarrier();
        let g_end = exp(l_end);
        if (ue < dk) {
            for (var b = 0u; b < 8u; b++) {
                acc8[b] = st_sh[(ui + b) * SD + ue] * g_end;
            }
            for (var t = 0u; t < c; t++) {
                let kv = k[(first + t) * kcols + kb + ue];
                for (var b = 0u; b < 8u; b++) {
                    acc8[b] += rhs_sh[t * VS + ui + b] * kv;
                }
            }
            for (var b = 0u; b < 8u; b++) {
                st_sh[(ui + b) * SD + ue] = acc8[b];
            }
        }
        workgroupBarrier();
    }
    for (var idx = lid; idx < VS * dk; idx += 256u) {
        let i = idx / dk;
        if (i0 + i < dv) {
            state[(h * dv + i0 + i) * dk + idx % dk] = st_sh[i * SD + idx % dk];
        }
    }
}
