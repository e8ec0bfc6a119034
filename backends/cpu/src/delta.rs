//! The gated delta rule, in its recurrent form (one step at a time, used for
//! decode) and its chunked form (blocks of tokens as small matrix products,
//! used for prefill). Both compute the same thing; a test holds them together.
//!
//! Per value head, with state `S: [value_dim, key_dim]`:
//! `S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T`, `y_t = S_t q_t`.

use rayon::prelude::*;
use slotstream_backend::{DeviceState, Result};

/// Gated DeltaNet matrix state, `[heads, value_dim, key_dim]`.
pub struct RecurrentState {
    pub(crate) heads: usize,
    pub(crate) key_dim: usize,
    pub(crate) value_dim: usize,
    pub(crate) s: Vec<f32>,
}

impl RecurrentState {
    pub(crate) fn new(heads: usize, key_dim: usize, value_dim: usize) -> RecurrentState {
        RecurrentState { heads, key_dim, value_dim, s: vec![0.0; heads * key_dim * value_dim] }
    }
}

impl DeviceState for RecurrentState {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(RecurrentState { s: self.s.clone(), ..*self }))
    }

    fn bytes(&self) -> usize {
        4 * self.s.len()
    }
}

pub struct DeltaInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub tokens: usize,
    pub heads: usize,
    pub key_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

/// Prompts at least this long use the chunked form.
const CHUNKED_FROM: usize = 16;
const CHUNK: usize = 64;

/// Runs the rule over all tokens, updating `state` (`[heads, value_dim, key_dim]`)
/// and returning `[tokens, heads*value_dim]`.
pub fn gated_delta(x: &DeltaInputs<'_>, state: &mut [f32]) -> Vec<f32> {
    let chunked = x.tokens >= CHUNKED_FROM;
    gated_delta_with(x, state, chunked)
}

fn gated_delta_with(x: &DeltaInputs<'_>, state: &mut [f32], chunked: bool) -> Vec<f32> {
    let (dk, dv, h) = (x.key_dim, x.value_dim, x.heads);
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(dv * dk)
        .enumerate()
        .map(|(head, s)| {
            let head_in = HeadInputs::gather(x, head);
            #[cfg(target_arch = "x86_64")]
            if crate::matmul::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                return unsafe { head_avx2(&head_in, s, dk, dv, chunked) };
            }
            if chunked {
                chunked_head(&head_in, s, dk, dv)
            } else {
                recurrent_head(&head_in, s, dk, dv)
            }
        })
        .collect();
    let mut out = vec![0.0f32; x.tokens * h * dv];
    for (head, y) in per_head.iter().enumerate() {
        for t in 0..x.tokens {
            out[(t * h + head) * dv..(t * h + head + 1) * dv].copy_from_slice(&y[t * dv..(t + 1) * dv]);
        }
    }
    out
}

/// One value head's inputs, contiguous per token.
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    tokens: usize,
}

impl HeadInputs {
    fn gather(x: &DeltaInputs<'_>, head: usize) -> HeadInputs {
        let (dk, dv) = (x.key_dim, x.value_dim);
        let kh = head / (x.heads / x.key_heads);
        let kcols = x.key_heads * dk;
        let vcols = x.heads * dv;
        let mut hi = HeadInputs {
            q: Vec::with_capacity(x.tokens * dk),
            k: Vec::with_capacity(x.tokens * dk),
            v: Vec::with_capacity(x.tokens * dv),
            g: Vec::with_capacity(x.tokens),
            beta: Vec::with_capacity(x.tokens),
            tokens: x.tokens,
        };
        for t in 0..x.tokens {
            hi.q.extend_from_slice(&x.q[t * kcols + kh * dk..t * kcols + (kh + 1) * dk]);
            hi.k.extend_from_slice(&x.k[t * kcols + kh * dk..t * kcols + (kh + 1) * dk]);
            hi.v.extend_from_slice(&x.v[t * vcols + head * dv..t * vcols + (head + 1) * dv]);
            hi.g.push(x.g[t * x.heads + head]);
            hi.beta.push(x.beta[t * x.heads + head]);
        }
        hi
    }
}

/// Eight independent partial sums (vectorises; a plain iterator sum is one
/// serial chain of adds).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    crate::matmul::dot(a, b)
}

/// Either form compiled with AVX2 and FMA, so the dot products and row
/// updates run eight lanes wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_avx2(x: &HeadInputs, s: &mut [f32], dk: usize, dv: usize, chunked: bool) -> Vec<f32> {
    if chunked {
        chunked_head(x, s, dk, dv)
    } else {
        recurrent_head(x, s, dk, dv)
    }
}

#[inline(always)]
fn recurrent_head(x: &HeadInputs, s: &mut [f32], dk: usize, dv: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; x.tokens * dv];
    for t in 0..x.tokens {
        let (q, k, v) = (&x.q[t * dk..(t + 1) * dk], &x.k[t * dk..(t + 1) * dk], &x.v[t * dv..(t + 1) * dv]);
        let (g, beta) = (x.g[t], x.beta[t]);
        for (i, row) in s.chunks_exact_mut(dk).enumerate() {
            row.iter_mut().for_each(|e| *e *= g);
            let delta = (v[i] - dot(row, k)) * beta;
            row.iter_mut().zip(k).for_each(|(e, k)| *e += k * delta);
            y[t * dv + i] = dot(row, q);
        }
    }
    y
}

/// Chunked form. Within a chunk, with `G_t` the product of the gates up to `t`:
/// `u_t = beta_t (v_t - G_t S_0 k_t - sum_{s<t} (G_t/G_s)(k_s.k_t) u_s)`,
/// `y_t = G_t S_0 q_t + sum_{s<=t} (G_t/G_s)(k_s.q_t) u_s`,
/// `S_end = G_C S_0 + sum_s (G_C/G_s) u_s k_s^T`.
#[inline(always)]
fn chunked_head(x: &HeadInputs, s: &mut [f32], dk: usize, dv: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; x.tokens * dv];
    let mut start = 0;
    while start < x.tokens {
        let c = CHUNK.min(x.tokens - start);
        let k = &x.k[start * dk..(start + c) * dk];
        let q = &x.q[start * dk..(start + c) * dk];
        let v = &x.v[start * dv..(start + c) * dv];
        // Log of the cumulative decay; ratios G_t/G_s = exp(L_t - L_s) stay <= 1.
        let mut log_g = Vec::with_capacity(c);
        let mut acc = 0.0f32;
        for t in 0..c {
            acc += x.g[start + t].ln();
            log_g.push(acc);
        }
        // G_t/G_s for s <= t, each exp computed once (the forward pass, the
        // outputs and the state update all use them).
        let mut dec = vec![0.0f32; c * c];
        for t in 0..c {
            for s_ in 0..=t {
                dec[t * c + s_] = (log_g[t] - log_g[s_]).exp();
            }
        }
        let decay = |t: usize, s_: usize| dec[t * c + s_];
        // S_0 k_t and S_0 q_t for all t: [c, dv].
        let mut s0k = vec![0.0f32; c * dv];
        let mut s0q = vec![0.0f32; c * dv];
        for (i, row) in s.chunks_exact(dk).enumerate() {
            for t in 0..c {
                s0k[t * dv + i] = dot(row, &k[t * dk..(t + 1) * dk]);
                s0q[t * dv + i] = dot(row, &q[t * dk..(t + 1) * dk]);
            }
        }
        // Forward substitution for the pseudo-values u: [c, dv].
        let mut u = vec![0.0f32; c * dv];
        for t in 0..c {
            let gt = log_g[t].exp();
            let beta = x.beta[start + t];
            let kt = &k[t * dk..(t + 1) * dk];
            let mut rhs: Vec<f32> = (0..dv).map(|i| v[t * dv + i] - gt * s0k[t * dv + i]).collect();
            for s_ in 0..t {
                let a = decay(t, s_) * dot(&k[s_ * dk..(s_ + 1) * dk], kt);
                rhs.iter_mut().zip(&u[s_ * dv..(s_ + 1) * dv]).for_each(|(r, u)| *r -= a * u);
            }
            u[t * dv..(t + 1) * dv].iter_mut().zip(&rhs).for_each(|(u, r)| *u = beta * r);
        }
        // Outputs.
        for t in 0..c {
            let gt = log_g[t].exp();
            let qt = &q[t * dk..(t + 1) * dk];
            let out = &mut y[(start + t) * dv..(start + t + 1) * dv];
            out.iter_mut().zip(&s0q[t * dv..(t + 1) * dv]).for_each(|(o, sq)| *o = gt * sq);
            for s_ in 0..=t {
                let a = decay(t, s_) * dot(&k[s_ * dk..(s_ + 1) * dk], qt);
                out.iter_mut().zip(&u[s_ * dv..(s_ + 1) * dv]).for_each(|(o, u)| *o += a * u);
            }
        }
        // State at the end of the chunk.
        let g_end = log_g[c - 1].exp();
        for (i, row) in s.chunks_exact_mut(dk).enumerate() {
            row.iter_mut().for_each(|e| *e *= g_end);
            for s_ in 0..c {
                let w = decay(c - 1, s_) * u[s_ * dv + i];
                row.iter_mut().zip(&k[s_ * dk..(s_ + 1) * dk]).for_each(|(e, k)| *e += w * k);
            }
        }
        start += c;
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_form_equals_recurrent_form() {
        let (tokens, heads, key_heads, dk, dv) = (150, 4, 2, 16, 8);
        let mut seed = 7u64;
        let mut rnd = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let mut unit = |n: usize, groups: usize| -> Vec<f32> {
            let mut v: Vec<f32> = (0..n).map(|_| rnd()).collect();
            for g in v.chunks_mut(n / groups) {
                let norm = g.iter().map(|x| x * x).sum::<f32>().sqrt();
                g.iter_mut().for_each(|x| *x /= norm);
            }
            v
        };
        let q = unit(tokens * key_heads * dk, tokens * key_heads);
        let k = unit(tokens * key_heads * dk, tokens * key_heads);
        let v: Vec<f32> = unit(tokens * heads * dv, 1).iter().map(|x| x * 30.0).collect();
        let g: Vec<f32> = unit(tokens * heads, 1).iter().map(|x| 0.6 + 0.3 * x.abs().min(1.0)).collect();
        let beta: Vec<f32> = unit(tokens * heads, 1).iter().map(|x| 0.5 + 0.4 * x.abs().min(1.0)).collect();
        let x = DeltaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta, tokens, heads, key_heads, key_dim: dk, value_dim: dv };
        let init: Vec<f32> = (0..heads * dk * dv).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
        let (mut s_rec, mut s_chunk) = (init.clone(), init);
        let y_rec = gated_delta_with(&x, &mut s_rec, false);
        let y_chunk = gated_delta_with(&x, &mut s_chunk, true);
        let rel = |a: &[f32], b: &[f32]| {
            let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
            let den: f32 = a.iter().map(|x| x * x).sum();
            (num / den).sqrt()
        };
        assert!(rel(&y_rec, &y_chunk) < 1e-5, "outputs differ: rel L2 {}", rel(&y_rec, &y_chunk));
        assert!(rel(&s_rec, &s_chunk) < 1e-5, "states differ: rel L2 {}", rel(&s_rec, &s_chunk));
    }
}
