//! The gated delta rule's chunked form (`wgsl/gated_delta_chunked.wgsl`,
//! prompts of `CHUNKED_FROM` tokens and more) against the CPU backend:
//! prepared and raw inputs, prompts that are not a multiple of the chunk,
//! over a thousand tokens, the state carried into a second prompt and into
//! one-token steps (the recurrent kernel), and prompts run in several
//! windows of chunks. Each case also holds the recurrent kernel to the same
//! outputs, so a broken chunked kernel cannot hide behind a broken
//! reference.

mod common;

use common::check::up;
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, DeltaInputs, State, Tensor};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend, GATED_DELTA_CHUNK as CHUNK, GATED_DELTA_CHUNKED_FROM as CHUNKED_FROM};

/// Outputs of the chunked form agree with the CPU backend's within this
/// (relative L2; the two sum in different orders, the GPU through the
/// inverse (I + A)^-1, the CPU by substitution).
const TOL: f64 = 1e-5;

struct Shape {
    heads: usize,
    key_heads: usize,
    dk: usize,
    dv: usize,
}

/// Seeded inputs of `tokens` steps: `[q, k, v, g, beta]` (prepared: unit
/// q and k, gates in (0.7, 0.95)) or `[q, k, v, a, b]` (raw).
fn inputs(rng: &mut Rng, s: &Shape, tokens: usize, raw: bool) -> [Vec<f32>; 5] {
    let mut unit = |n: usize| -> Vec<f32> {
        let mut v = rng.vec(n, 2.0);
        if !raw {
            for row in v.chunks_mut(s.dk) {
                let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
                row.iter_mut().for_each(|x| *x /= norm);
            }
        }
        v
    };
    let (q, k) = (unit(tokens * s.key_heads * s.dk), unit(tokens * s.key_heads * s.dk));
    let v = rng.vec(tokens * s.heads * s.dv, 4.0);
    let (g, beta) = if raw {
        (rng.vec(tokens * s.heads, 6.0), rng.vec(tokens * s.heads, 6.0))
    } else {
        let g = rng.vec(tokens * s.heads, 1.0).iter().map(|x| 0.7 + 0.5 * x.abs()).collect();
        let beta = rng.vec(tokens * s.heads, 1.0).iter().map(|x| 0.5 + x.abs()).collect();
        (g, beta)
    };
    [q, k, v, g, beta]
}

/// One call of the rule on `b` (raw inputs through `gated_delta_step`,
/// with per-head `[a_log, dt_bias]`).
fn step(b: &dyn Backend, s: &Shape, x: &[Vec<f32>; 5], per_head: Option<&[Vec<f32>; 2]>, st: &mut State) -> Tensor {
    let tokens = x[3].len() / s.heads;
    let [q, k, v, g, beta] = x;
    let t = |v: &[f32], cols: usize| up(b, v, &[tokens, cols]);
    let (qt, kt, vt) = (t(q, s.key_heads * s.dk), t(k, s.key_heads * s.dk), t(v, s.heads * s.dv));
    let (gt, bt) = (t(g, s.heads), t(beta, s.heads));
    match per_head {
        None => b.gated_delta(&qt, &kt, &vt, &gt, &bt, s.key_heads, st).expect("gated_delta"),
        Some([a_log, dt_bias]) => {
            let (lt, dtt) = (up(b, a_log, &[s.heads]), up(b, dt_bias, &[s.heads]));
            let x = DeltaInputs { q: &qt, k: &kt, v: &vt, a: &gt, b: &bt, a_log: &lt, dt_bias: &dtt };
            b.gated_delta_step(x, s.key_heads, 0.17, 1e-6, st).expect("gated_delta_step")
        }
    }
}

/// The outputs of a sequence of calls (each continuing from the state the
/// last one left), token-split as `calls` gives them, all concatenated.
fn run(b: &dyn Backend, s: &Shape, calls: &[[Vec<f32>; 5]], per_head: Option<&[Vec<f32>; 2]>) -> Vec<f32> {
    let mut st = b.new_recurrent_state(s.heads, s.dk, s.dv).expect("new_recurrent_state");
    let mut out = Vec::new();
    for x in calls {
        out.extend(b.download(&step(b, s, x, per_head, &mut st)).expect("download"));
    }
    out
}

/// `calls` on the GPU (`g`) agree with the CPU backend, and with the same
/// tokens fed one call per token (the recurrent kernel) on the GPU.
fn compare(g: &WgpuBackend, name: &str, s: &Shape, calls: &[[Vec<f32>; 5]], per_head: Option<&[Vec<f32>; 2]>) {
    let want = run(&CpuBackend::exact(), s, calls, per_head);
    let got = run(g, s, calls, per_head);
    let err = rel_l2(&got, &want);
    assert!(err <= TOL, "{name}: the chunked form differs from the CPU backend, rel L2 {err:.3e} > {TOL:e}");
    // The recurrent kernel, one token per call, on the first prompt.
    let first = &calls[0];
    let tokens = first[3].len() / s.heads;
    let split = |x: &[f32], t: usize| -> Vec<f32> {
        let w = x.len() / tokens;
        x[t * w..(t + 1) * w].to_vec()
    };
    let singles: Vec<[Vec<f32>; 5]> = (0..tokens).map(|t| std::array::from_fn(|i| split(&first[i], t))).collect();
    let stepped = run(g, s, &singles, per_head);
    let err = rel_l2(&got[..stepped.len()], &stepped);
    assert!(err <= TOL, "{name}: the chunked form differs from the recurrent kernel, rel L2 {err:.3e} > {TOL:e}");
}

/// A prompt, a second prompt from its state, then two one-token steps.
fn calls(rng: &mut Rng, s: &Shape, tokens: usize, raw: bool) -> Vec<[Vec<f32>; 5]> {
    vec![inputs(rng, s, tokens, raw), inputs(rng, s, tokens / 2 + 7, raw), inputs(rng, s, 1, raw), inputs(rng, s, 1, raw)]
}

#[test]
fn chunked_form_prepared_inputs() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(31);
    let shapes = [Shape { heads: 4, key_heads: 2, dk: 32, dv: 32 }, Shape { heads: 2, key_heads: 1, dk: 128, dv: 40 }];
    for s in &shapes {
        for tokens in [CHUNKED_FROM, 150, 1100] {
            let c = calls(&mut rng, s, tokens, false);
            compare(g, &format!("prepared dk {} dv {}, {tokens} tokens", s.dk, s.dv), s, &c, None);
        }
    }
}

#[test]
fn chunked_form_raw_inputs() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(32);
    let s = Shape { heads: 4, key_heads: 2, dk: 32, dv: 32 };
    let per_head = [rng.vec(s.heads, 1.0), rng.vec(s.heads, 1.0)];
    for tokens in [3 * CHUNK + 1, 1030] {
        let c = calls(&mut rng, &s, tokens, true);
        compare(g, &format!("raw, {tokens} tokens"), &s, &c, Some(&per_head));
    }
}

/// Prompts longer than a window of chunk records run window after window.
#[test]
fn chunked_form_in_windows() {
    if gpu().is_none() {
        return;
    }
    let g = WgpuBackend::new(&AdapterChoice::allow_software()).expect("opening a second wgpu backend");
    let s = Shape { heads: 4, key_heads: 2, dk: 32, dv: 32 };
    // Two chunks' records of every head per window.
    g.cap_shard_bytes((2 * 4 * (2 * CHUNK * CHUNK + 4 * CHUNK) * s.heads) as u64);
    let mut rng = Rng::new(33);
    let per_head = [rng.vec(s.heads, 1.0), rng.vec(s.heads, 1.0)];
    let c = calls(&mut rng, &s, 5 * CHUNK + 17, true);
    compare(&g, "raw, windows of two chunks", &s, &c, Some(&per_head));
}
