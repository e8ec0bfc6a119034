//! Multi-stream residual ops: a row of `[rows, streams*d]` holds `streams`
//! streams of `d` values side by side (see the trait's "multi-stream
//! residuals" section for the math).

use rayon::prelude::*;

use crate::sigmoid;

/// `(1/streams) sum_s sigmoid(w[s]) * x[s]`, summed in stream order: `[rows, d]`.
pub(crate) fn sigmoid_weighted_mean(xd: &[f32], wd: &[f32], rows: usize, d: usize, streams: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * d];
    out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
        for s in 0..streams {
            let base = r * streams * d + s * d;
            for (j, o) in o.iter_mut().enumerate() {
                *o += sigmoid(wd[base + j]) * xd[base + j];
            }
        }
        o.iter_mut().for_each(|v| *v /= streams as f32);
    });
    out
}

/// `h[s] + 2*sigmoid(logit_scale*logits[s]) * x` for every stream `s`.
pub(crate) fn add_gated(h: &[f32], xd: &[f32], ld: &[f32], logit_scale: f32, streams: usize, d: usize) -> Vec<f32> {
    let mut out = h.to_vec();
    out.par_chunks_mut(streams * d).enumerate().for_each(|(r, o)| {
        for (s, chunk) in o.chunks_exact_mut(d).enumerate() {
            let w = 2.0 * sigmoid(logit_scale * ld[r * streams + s]);
            chunk.iter_mut().zip(&xd[r * d..(r + 1) * d]).for_each(|(o, x)| *o += w * x);
        }
    });
    out
}

/// Per stream, `sigmoid(signed_sqrt(key[s].query[s] / sqrt(d))) * value`: `[rows, streams*d]`.
pub(crate) fn dot_gate(kd: &[f32], qd: &[f32], vd: &[f32], rows: usize, d: usize, streams: usize) -> Vec<f32> {
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    let mut out = vec![0.0f32; rows * streams * d];
    out.par_chunks_mut(streams * d).enumerate().for_each(|(r, o)| {
        for (s, chunk) in o.chunks_exact_mut(d).enumerate() {
            let base = r * streams * d + s * d;
            let g = kd[base..base + d].iter().zip(&qd[base..base + d]).map(|(k, q)| k * q).sum::<f32>() * inv_sqrt_d;
            // sign(0) = 0, as in the reference (Rust's signum would give 1).
            let sign = if g > 0.0 { 1.0 } else if g < 0.0 { -1.0 } else { 0.0 };
            let g = sign * g.abs().max(1e-6).sqrt();
            let w = sigmoid(g);
            chunk.iter_mut().zip(&vd[r * d..(r + 1) * d]).for_each(|(o, v)| *o = w * v);
        }
    });
    out
}
