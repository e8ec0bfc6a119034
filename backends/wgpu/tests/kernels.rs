//! Every kernel against the CPU backend (the reference), on fixed seeded
//! inputs, plus an insta snapshot of each kernel's output.
//!
//! Tolerance: relative L2 error 1e-5 (2e-5 where long reductions are summed in
//! a different order). Both backends compute in f32 from the same stored
//! weights; only summation order differs, which moves results by ~1e-7
//! relative per reduction. Snapshots hold the length, the L2 norm (3
//! decimals) and the first 24 values of each output rounded to 4 significant
//! digits, well above that noise; a kernel change that reorders sums can still
//! flip a last digit, and is accepted (`cargo insta accept` or
//! INSTA_UPDATE=always) once the comparison with the CPU backend passes.

mod common;

use common::check::{affine, check, format_name, matrix, up, TOL};
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, DType, GateAct, MatrixFormat, Rope, Tensor, Yarn};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, MatmulMode, WgpuBackend, WgpuOptions};

#[test]
fn matmul_all_formats_decode_and_prefill() {
    let formats = [
        MatrixFormat::Dense(DType::F32),
        MatrixFormat::Dense(DType::F16),
        MatrixFormat::Dense(DType::BF16),
        affine(4, 32),
        affine(4, 64),
        affine(4, 128),
        affine(8, 32),
        affine(8, 64),
        affine(8, 128),
        affine(2, 64),
        MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::F16 },
        MatrixFormat::Affine { bits: 8, group_size: 64, scale_dtype: DType::F32 },
    ];
    for format in formats {
        let mut rng = Rng::new(11);
        let (rows, cols) = (72, 256);
        let m = matrix(&mut rng, format, 1, rows, cols);
        // 1 and 3 tokens take the matvec kernel, 37 the tiled prefill kernel.
        for tokens in [1usize, 3, 37] {
            let x = rng.vec(tokens * cols, 2.0);
            check(&format!("matmul_{}_t{tokens}", format_name(format)), TOL, |b| {
                let w = b.load_weight(&m).expect("load_weight");
                b.matmul(&up(b, &x, &[tokens, cols]), &w).expect("matmul")
            });
        }
    }
}

/// The dense prefill products over several tiles in both directions, with
/// partial tiles of rows and tokens, and (f16 weights, 264 columns) a last
/// slice half past the matrix: 200 x 150 in 64 x 64 tiles (`matmul_tiled`),
/// 1000 x 2040 in 128 of 128 x 128 (`matmul_wide`).
#[test]
fn matmul_tiled_many_tiles() {
    let formats = [(affine(4, 32), 288), (MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::F16 }, 320), (MatrixFormat::Dense(DType::F16), 264)];
    for ((format, cols), (rows, tokens)) in formats.into_iter().flat_map(|f| [(f, (200, 150)), (f, (1000, 2040))]) {
        let mut rng = Rng::new(23);
        let m = matrix(&mut rng, format, 1, rows, cols);
        let x = rng.vec(tokens * cols, 2.0);
        check(&format!("matmul_tiled_{}_c{cols}_{rows}x{tokens}", format_name(format)), TOL, |b| {
            let w = b.load_weight(&m).expect("load_weight");
            b.matmul(&up(b, &x, &[tokens, cols]), &w).expect("matmul")
        });
    }
}

/// One-token products of interleaved 4-bit weights take eight rows per
/// subgroup only from `q4_eight_rows_from` rows on (by default never): a
/// second backend with that option at 1 reaches the kernel.
#[test]
fn matvec_eight_rows_per_subgroup() {
    if gpu().is_none() {
        return;
    }
    let options = WgpuOptions { matmul: Some(MatmulMode::Exact), q4_eight_rows_from: 1, ..WgpuOptions::default() };
    let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("opening a second wgpu backend");
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(21);
    for format in [affine(4, 64), MatrixFormat::Affine { bits: 4, group_size: 32, scale_dtype: DType::F16 }] {
        // 75 rows: the last subgroup's eight rows are partly past the end.
        let (rows, cols) = (75, 512);
        let m = matrix(&mut rng, format, 1, rows, cols);
        let x = rng.vec(cols, 2.0);
        let run = |b: &dyn Backend| {
            let w = b.load_weight(&m).expect("load_weight");
            b.download(&b.matmul(&up(b, &x, &[1, cols]), &w).expect("matmul")).expect("download")
        };
        let err = rel_l2(&run(&g), &run(&cpu));
        assert!(err <= TOL, "{}: eight-row matvec differs from CPU, rel L2 {err:.3e}", format_name(format));
    }
}

/// Rows longer than the workgroup-memory x stage (4096 columns) read x from
/// global memory instead.
#[test]
fn matvec_long_rows() {
    for format in [affine(4, 64), affine(8, 128)] {
        let mut rng = Rng::new(17);
        let (rows, cols) = (10, 8192);
        let m = matrix(&mut rng, format, 1, rows, cols);
        let x = rng.vec(cols, 2.0);
        check(&format!("matvec_long_{}", format_name(format)), TOL, |b| {
            let w = b.load_weight(&m).expect("load_weight");
            b.matmul(&up(b, &x, &[1, cols]), &w).expect("matmul")
        });
    }
}

/// 4-bit rows are stored interleaved in tiles of 1024 columns; a row of 1280
/// ends in a partial tile of 256, and 5 rows leave the last row octet short.
#[test]
fn matvec_partial_tile() {
    let mut rng = Rng::new(19);
    let (rows, cols) = (13, 1280);
    let m = matrix(&mut rng, affine(4, 64), 1, rows, cols);
    for tokens in [1usize, 2, 9] {
        let x = rng.vec(tokens * cols, 2.0);
        check(&format!("matvec_partial_tile_t{tokens}"), TOL, |b| {
            let w = b.load_weight(&m).expect("load_weight");
            b.matmul(&up(b, &x, &[tokens, cols]), &w).expect("matmul")
        });
    }
    let m16 = matrix(&mut rng, MatrixFormat::Affine { bits: 4, group_size: 128, scale_dtype: DType::F16 }, 1, rows, cols);
    let x = rng.vec(cols, 2.0);
    check("matvec_partial_tile_f16_scales", TOL, |b| {
        let w = b.load_weight(&m16).expect("load_weight");
        b.matmul(&up(b, &x, &[1, cols]), &w).expect("matmul")
    });
    check("embed_partial_tile", 0.0, |b| {
        let w = b.load_weight(&m).expect("load_weight");
        b.embed(&w, &[12, 0, 5]).expect("embed")
    });
}

/// A SwiGLU's gate/up product with its activation, and a gated branch's
/// output product with its residual add (`matvec_epilogue` for one token of
/// a one-shard weight; the separate ops for more tokens), against the CPU's
/// composition of the separate ops. 68 and 102 output rows: the last
/// subgroup's quad is partial; the gate is a one-column slice of a wider row,
/// as a shared expert's gate after the router.
#[test]
fn matmul_epilogues() {
    let mut rng = Rng::new(29);
    let (rows, cols, out_rows, inner) = (68, 256, 102, 128);
    for format in [affine(4, 64), affine(8, 64), MatrixFormat::Dense(DType::BF16)] {
        let gate_up = matrix(&mut rng, format, 1, 2 * rows, cols);
        let down = matrix(&mut rng, format, 1, out_rows, inner);
        for tokens in [1usize, 3] {
            let x = rng.vec(tokens * cols, 2.0);
            let act = rng.vec(tokens * inner, 2.0);
            let (y, gate_row) = (rng.vec(tokens * out_rows, 2.0), rng.vec(tokens * 5, 3.0));
            check(&format!("matmul_swiglu_{}_t{tokens}", format_name(format)), TOL, |b| {
                let w = b.load_weight(&gate_up).expect("load_weight");
                b.matmul_swiglu(&up(b, &x, &[tokens, cols]), &w).expect("matmul_swiglu")
            });
            check(&format!("matmul_gated_add_{}_t{tokens}", format_name(format)), TOL, |b| {
                let w = b.load_weight(&down).expect("load_weight");
                let gate = b.slice_cols(&up(b, &gate_row, &[tokens, 5]), 4, 1).expect("slice_cols");
                b.matmul_gated_add(&up(b, &y, &[tokens, out_rows]), &up(b, &act, &[tokens, inner]), &w, &gate).expect("matmul_gated_add")
            });
        }
    }
}

#[test]
fn embed_rows_dequantized() {
    for format in [affine(4, 64), affine(8, 32), MatrixFormat::Dense(DType::BF16)] {
        let mut rng = Rng::new(5);
        let m = matrix(&mut rng, format, 1, 50, 128);
        check(&format!("embed_{}", format_name(format)), 0.0, |b| {
            let w = b.load_weight(&m).expect("load_weight");
            b.embed(&w, &[3, 49, 0, 3]).expect("embed")
        });
    }
}

#[test]
fn elementwise_ops() {
    let mut rng = Rng::new(3);
    let (a, bv, row_gate) = (rng.vec(6 * 40, 4.0), rng.vec(6 * 40, 4.0), rng.vec(6, 4.0));
    check("add", 0.0, |b| b.add(&up(b, &a, &[6, 40]), &up(b, &bv, &[6, 40])).unwrap());
    check("sigmoid_mul", TOL, |b| b.sigmoid_mul(&up(b, &a, &[6, 40]), &up(b, &bv, &[6, 40])).unwrap());
    check("sigmoid_mul_per_row", TOL, |b| b.sigmoid_mul(&up(b, &a, &[6, 40]), &up(b, &row_gate, &[6, 1])).unwrap());
    check("silu_mul", TOL, |b| b.silu_mul(&up(b, &a, &[6, 40]), &up(b, &bv, &[6, 40])).unwrap());
    check("silu", TOL, |b| b.silu(&up(b, &a, &[6, 40])).unwrap());
    check("scale", 0.0, |b| b.scale(&up(b, &a, &[6, 40]), -0.37).unwrap());
    check("slice_cols", 0.0, |b| b.slice_cols(&up(b, &a, &[6, 40]), 7, 20).unwrap());
    check("slice_rows", 0.0, |b| b.slice_rows(&up(b, &a, &[6, 40]), 2, 3).unwrap());
    check("add_sigmoid_mul", TOL, |b| {
        b.add_sigmoid_mul(&up(b, &bv, &[6, 40]), &up(b, &a, &[6, 40]), &up(b, &row_gate, &[6, 1])).unwrap()
    });
    // One-row slices (views on wgpu where aligned, copies otherwise) fed to
    // ops, including a slice of a slice and a one-column gate.
    check("one_row_slice_views", TOL, |b| {
        let x = up(b, &a, &[1, 240]);
        let (g, u) = (b.slice_cols(&x, 0, 96).unwrap(), b.slice_cols(&x, 96, 96).unwrap());
        let inner = b.slice_cols(&u, 16, 32).unwrap();
        let gate = b.slice_cols(&x, 237, 1).unwrap();
        let odd = b.slice_cols(&x, 5, 7).unwrap();
        let y = b.silu_mul(&g, &u).unwrap();
        let z = b.add_sigmoid_mul(&b.slice_cols(&y, 0, 32).unwrap(), &inner, &gate).unwrap();
        let w = b.download(&b.slice_cols(&x, 192, 48).unwrap()).unwrap();
        let w = up(b, &w, &[1, 48]);
        let odd = b.download(&odd).unwrap();
        let odd = up(b, &odd, &[1, 7]);
        let flat: Vec<&Tensor> = vec![&y, &z, &w, &odd];
        let parts: Vec<Vec<f32>> = flat.iter().map(|t| b.download(t).unwrap()).collect();
        let all: Vec<f32> = parts.concat();
        let n = all.len();
        up(b, &all, &[1, n])
    });
    check("concat_rows", 0.0, |b| {
        let (x, y) = (up(b, &a, &[6, 40]), up(b, &bv, &[6, 40]));
        b.concat_rows(&[&x, &y]).unwrap()
    });
    let (al, dt) = (rng.vec(40, 2.0), rng.vec(40, 2.0));
    check("delta_gates_g", TOL, |b| {
        b.delta_gates(&up(b, &a, &[6, 40]), &up(b, &bv, &[6, 40]), &up(b, &al, &[40]), &up(b, &dt, &[40])).unwrap().0
    });
    check("delta_gates_beta", TOL, |b| {
        b.delta_gates(&up(b, &a, &[6, 40]), &up(b, &bv, &[6, 40]), &up(b, &al, &[40]), &up(b, &dt, &[40])).unwrap().1
    });
}

#[test]
fn normalisation() {
    let mut rng = Rng::new(9);
    let (x, z, w) = (rng.vec(5 * 256, 3.0), rng.vec(5 * 256, 3.0), rng.vec(256, 2.0));
    check("rms_norm", TOL, |b| b.rms_norm(&up(b, &x, &[5, 256]), Some(&up(b, &w, &[256])), 256, 1e-6).unwrap());
    check("rms_norm_heads_no_weight", TOL, |b| b.rms_norm(&up(b, &x, &[5, 256]), None, 64, 1e-6).unwrap());
    check("rms_norm_gated", TOL, |b| {
        b.rms_norm_gated(&up(b, &x, &[5, 256]), &up(b, &z, &[5, 256]), &up(b, &w[..64], &[64]), 64, 1e-6, GateAct::Silu).unwrap()
    });
    let (xw, ww) = (rng.vec(3 * 2048, 3.0), rng.vec(2048, 2.0));
    check("rms_norm_wide", TOL, |b| b.rms_norm(&up(b, &xw, &[3, 2048]), Some(&up(b, &ww, &[2048])), 2048, 1e-6).unwrap());
    check("rms_norm_wide_no_weight", TOL, |b| b.rms_norm(&up(b, &xw, &[3, 2048]), None, 1024, 1e-6).unwrap());
    // One weight value per column: each group of a row with its own slice
    // (the per-stream norm of multi-stream residuals), subgroup and wide kernels.
    check("rms_norm_per_stream", TOL, |b| b.rms_norm(&up(b, &x, &[5, 256]), Some(&up(b, &w, &[256])), 64, 1e-6).unwrap());
    check("rms_norm_wide_per_stream", TOL, |b| {
        b.rms_norm(&up(b, &xw, &[3, 2048]), Some(&up(b, &ww, &[2048])), 1024, 1e-6).unwrap()
    });
    check("rms_norm_gated_sigmoid", TOL, |b| {
        b.rms_norm_gated(&up(b, &x, &[5, 256]), &up(b, &z, &[5, 256]), &up(b, &w[..64], &[64]), 64, 1e-6, GateAct::Sigmoid).unwrap()
    });
    check("l2_normalize", TOL, |b| b.l2_normalize(&up(b, &x, &[5, 256]), 32, 1e-6, 0.17).unwrap());
    // The residual add and the norm after it, both outputs (sum rows, then normed rows).
    let yw = rng.vec(3 * 2048, 3.0);
    check("add_rms_norm", TOL, |b| {
        let (sum, normed) = b.add_rms_norm(&up(b, &xw, &[3, 2048]), &up(b, &yw, &[3, 2048]), &up(b, &ww, &[2048]), 2048, 1e-6).unwrap();
        b.concat_rows(&[&sum, &normed]).unwrap()
    });
    // Rows past the kernel's registers (4096 values) take its loop.
    let (xl, yl, wl) = (rng.vec(2 * 4352, 3.0), rng.vec(2 * 4352, 3.0), rng.vec(4352, 2.0));
    check("add_rms_norm_long_rows", TOL, |b| {
        let (sum, normed) = b.add_rms_norm(&up(b, &xl, &[2, 4352]), &up(b, &yl, &[2, 4352]), &up(b, &wl, &[4352]), 4352, 1e-6).unwrap();
        b.concat_rows(&[&sum, &normed]).unwrap()
    });
}

#[test]
fn multi_stream_residual_ops() {
    let mut rng = Rng::new(14);
    let (rows, streams, d) = (5, 4, 96);
    let x = rng.vec(rows * d, 3.0);
    let h = rng.vec(rows * streams * d, 3.0);
    let mix = rng.vec(rows * streams * d, 6.0);
    let logits = rng.vec(rows * streams, 4.0);
    let sd = [rows, streams * d];
    check("repeat_cols", 0.0, |b| b.repeat_cols(&up(b, &x, &[rows, d]), streams).unwrap());
    check("sigmoid_weighted_stream_mean", TOL, |b| b.sigmoid_weighted_stream_mean(&up(b, &h, &sd), &up(b, &mix, &sd), streams).unwrap());
    check("add_gated_to_streams", TOL, |b| b.add_gated_to_streams(&up(b, &h, &sd), &up(b, &x, &[rows, d]), &up(b, &logits, &[rows, streams]), 0.7).unwrap());
    // Stream 2 of every row has a tiny key: |g| falls below the 1e-6 floor.
    let mut key = rng.vec(rows * streams * d, 2.0);
    for r in 0..rows {
        key[(r * streams + 2) * d..(r * streams + 3) * d].iter_mut().for_each(|v| *v *= 1e-5);
    }
    let query = rng.vec(rows * streams * d, 2.0);
    check("stream_dot_gate", TOL, |b| b.stream_dot_gate(&up(b, &key, &sd), &up(b, &query, &sd), &up(b, &x, &[rows, d]), streams).unwrap());
}

#[test]
fn rope_partial_and_full() {
    let mut rng = Rng::new(4);
    let x = rng.vec(3 * 4 * 64, 2.0);
    check("rope_partial", TOL, |b| b.rope(&up(b, &x, &[3, 4, 64]), 64, 16, Rope::plain(1e7), 1000).unwrap());
    check("rope_full", TOL, |b| b.rope(&up(b, &x, &[3, 4, 64]), 64, 64, Rope::plain(1e6), 5).unwrap());
    // YaRN: blended frequencies and cos/sin scaled by the attention factor.
    let yarn = Yarn { factor: 4.0, original_context: 256.0, beta_fast: 32.0, beta_slow: 1.0, attention_factor: 1.2, truncate: true };
    let yarn = Rope { theta: 1e6, yarn: Some(yarn) };
    check("rope_yarn_partial", TOL, |b| b.rope(&up(b, &x, &[3, 4, 64]), 64, 32, yarn, 3000).unwrap());
    // The q/k norm and the rotation in one op.
    let w = rng.vec(64, 1.0);
    check("rms_norm_rope_partial", TOL, |b| b.rms_norm_rope(&up(b, &x, &[3, 256]), &up(b, &w, &[64]), 64, 1e-6, 16, Rope::plain(1e7), 1000).unwrap());
    check("rms_norm_rope_full", TOL, |b| b.rms_norm_rope(&up(b, &x, &[3, 256]), &up(b, &w, &[64]), 64, 1e-6, 64, Rope::plain(1e6), 5).unwrap());
    // Queries and keys (fewer heads, their own weight and eps) in one op;
    // the keys are a column slice of the same rows, as from a fused projection.
    let wk = rng.vec(64, 1.0);
    let qk = rng.vec(3 * 384, 2.0);
    check("rms_norm_rope_pair", TOL, |b| {
        let t = up(b, &qk, &[3, 384]);
        let (q, k) = (b.slice_cols(&t, 0, 256).unwrap(), b.slice_cols(&t, 256, 128).unwrap());
        let (q, k) = b.rms_norm_rope_pair(&q, &k, [&up(b, &w, &[64]), &up(b, &wk, &[64])], 64, [1e-6, 1e-5], 32, Rope::plain(1e6), 7).unwrap();
        let (q, k) = (q.reshape(&[3, 256]).unwrap(), k.reshape(&[3, 128]).unwrap());
        b.concat_rows(&[&q.reshape(&[12, 64]).unwrap(), &k.reshape(&[6, 64]).unwrap()]).unwrap()
    });
}

#[test]
fn causal_conv_carries_window() {
    let mut rng = Rng::new(6);
    let (c, k) = (48, 4);
    let w = rng.vec(c * k, 1.0);
    let parts: Vec<(usize, Vec<f32>)> = [5usize, 1, 2].iter().map(|&t| (t, rng.vec(t * c, 2.0))).collect();
    check("causal_conv1d", TOL, |b| {
        let mut st = b.new_conv_state(c, k, 1).unwrap();
        let wt = up(b, &w, &[c, k]);
        let outs: Vec<Tensor> = parts.iter().map(|(t, x)| b.causal_conv1d(&up(b, x, &[*t, c]), &wt, &mut st).unwrap()).collect();
        let cloned = b.clone_state(&st).unwrap();
        let mut st2 = cloned;
        let extra = b.causal_conv1d(&up(b, &parts[0].1, &[5, c]), &wt, &mut st2).unwrap();
        let all: Vec<&Tensor> = outs.iter().chain(std::iter::once(&extra)).collect();
        b.concat_rows(&all).unwrap()
    });
}

#[test]
fn causal_conv_silu_fused() {
    let mut rng = Rng::new(16);
    let (c, k) = (48, 4);
    let w = rng.vec(c * k, 1.0);
    let parts: Vec<(usize, Vec<f32>)> = [5usize, 1, 2].iter().map(|&t| (t, rng.vec(t * c, 2.0))).collect();
    check("causal_conv1d_silu", TOL, |b| {
        let mut st = b.new_conv_state(c, k, 1).unwrap();
        let wt = up(b, &w, &[c, k]);
        let outs: Vec<Tensor> =
            parts.iter().map(|(t, x)| b.causal_conv1d_silu(&up(b, x, &[*t, c]), &wt, &mut st).unwrap()).collect();
        let all: Vec<&Tensor> = outs.iter().collect();
        b.concat_rows(&all).unwrap()
    });
}

#[test]
fn dilated_causal_conv_carries_window() {
    let mut rng = Rng::new(16);
    // Taps 3 steps apart: the window holds the last 9 inputs, more than most calls bring.
    let (c, k, dilation) = (40, 4, 3);
    let w = rng.vec(c * k, 1.0);
    let parts: Vec<(usize, Vec<f32>)> = [5usize, 1, 2, 13, 1].iter().map(|&t| (t, rng.vec(t * c, 2.0))).collect();
    check("causal_conv1d_dilated", TOL, |b| {
        let mut st = b.new_conv_state(c, k, dilation).unwrap();
        let wt = up(b, &w, &[c, k]);
        let outs: Vec<Tensor> = parts.iter().map(|(t, x)| b.causal_conv1d(&up(b, x, &[*t, c]), &wt, &mut st).unwrap()).collect();
        let mut st2 = b.clone_state(&st).unwrap();
        let extra = b.causal_conv1d(&up(b, &parts[2].1, &[2, c]), &wt, &mut st2).unwrap();
        let all: Vec<&Tensor> = outs.iter().chain(std::iter::once(&extra)).collect();
        b.concat_rows(&all).unwrap()
    });
}

#[test]
fn gated_delta_rule_recurrent() {
    let mut rng = Rng::new(12);
    let (heads, key_heads, dk, dv) = (4, 2, 32, 32);
    for tokens in [1usize, 20] {
        let mut unit = |n: usize, d: usize| -> Vec<f32> {
            let mut v = rng.vec(n, 1.0);
            for g in v.chunks_mut(d) {
                let norm = g.iter().map(|x| x * x).sum::<f32>().sqrt();
                g.iter_mut().for_each(|x| *x /= norm);
            }
            v
        };
        let q = unit(tokens * key_heads * dk, dk);
        let k = unit(tokens * key_heads * dk, dk);
        let v = rng.vec(tokens * heads * dv, 4.0);
        let g: Vec<f32> = rng.vec(tokens * heads, 1.0).iter().map(|x| 0.7 + 0.5 * x.abs()).collect();
        let beta: Vec<f32> = rng.vec(tokens * heads, 1.0).iter().map(|x| 0.5 + x.abs()).collect();
        check(&format!("gated_delta_t{tokens}"), 2e-5, |b| {
            let mut st = b.new_recurrent_state(heads, dk, dv).unwrap();
            let run = |st: &mut slotstream_backend::State| {
                b.gated_delta(
                    &up(b, &q, &[tokens, key_heads * dk]),
                    &up(b, &k, &[tokens, key_heads * dk]),
                    &up(b, &v, &[tokens, heads * dv]),
                    &up(b, &g, &[tokens, heads]),
                    &up(b, &beta, &[tokens, heads]),
                    key_heads,
                    st,
                )
                .unwrap()
            };
            let first = run(&mut st);
            // A second call continues from the carried state.
            let second = run(&mut st);
            b.concat_rows(&[&first, &second]).unwrap()
        });
    }
}

/// The whole step from raw projections (L2 norms and gates inside the
/// kernel) against the CPU backend's four separate ops.
#[test]
fn gated_delta_step_from_raw_inputs() {
    let mut rng = Rng::new(13);
    let (heads, key_heads, dk, dv) = (4, 2, 32, 32);
    for tokens in [1usize, 20] {
        let q = rng.vec(tokens * key_heads * dk, 2.0);
        let k = rng.vec(tokens * key_heads * dk, 2.0);
        let v = rng.vec(tokens * heads * dv, 4.0);
        let (a, bb) = (rng.vec(tokens * heads, 3.0), rng.vec(tokens * heads, 3.0));
        let (a_log, dt_bias) = (rng.vec(heads, 1.0), rng.vec(heads, 1.0));
        check(&format!("gated_delta_step_t{tokens}"), 2e-5, |b| {
            let mut st = b.new_recurrent_state(heads, dk, dv).unwrap();
            let t = |v: &[f32], cols: usize| up(b, v, &[v.len() / cols, cols]);
            let (qt, kt, vt, at, bt) = (t(&q, key_heads * dk), t(&k, key_heads * dk), t(&v, heads * dv), t(&a, heads), t(&bb, heads));
            let (lt, dtt) = (up(b, &a_log, &[heads]), up(b, &dt_bias, &[heads]));
            let x = slotstream_backend::DeltaInputs { q: &qt, k: &kt, v: &vt, a: &at, b: &bt, a_log: &lt, dt_bias: &dtt };
            let first = b.gated_delta_step(x, key_heads, 0.17, 1e-6, &mut st).unwrap();
            let second = b.gated_delta_step(x, key_heads, 0.17, 1e-6, &mut st).unwrap();
            b.concat_rows(&[&first, &second]).unwrap()
        });
    }
}

#[test]
fn backend_name_reports_upload_path() {
    let Some(g) = gpu() else { return };
    let name = g.name();
    assert!(name.starts_with("wgpu ("), "{name}");
    let path = if g.uses_mapped_primary_buffers() { "mapped primary buffers" } else { "staging uploads" };
    assert!(name.contains(path), "name '{name}' should say '{path}'");
}


/// Batched decode: two to eight tokens against interleaved 4-bit rows
/// (`matvec_q4_tokens`) give each token exactly the one-token kernel's
/// result (`matvec_q4`), bit for bit, so that a sequence's text does not
/// depend on the sequences decoded beside it; 70 rows leave a partial quad,
/// 1280 columns a partial tile, and 4096 columns split a quad over subgroups.
#[test]
fn batched_tokens_match_one_token_bit_for_bit() {
    let Some(g) = gpu() else { return };
    let cpu = CpuBackend::exact();
    let formats = [affine(4, 32), affine(4, 64), affine(4, 128), MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::F16 }];
    for (format, cols) in formats.into_iter().zip([1280, 2048, 4096, 1280]) {
        let mut rng = Rng::new(23);
        let rows = 70;
        let m = matrix(&mut rng, format, 1, rows, cols);
        let (w, cw) = (g.load_weight(&m).expect("load_weight"), cpu.load_weight(&m).expect("load_weight"));
        for tokens in [2usize, 3, 4, 5, 8] {
            let x = rng.vec(tokens * cols, 2.0);
            let batched = g.download(&g.matmul(&up(g, &x, &[tokens, cols]), &w).expect("matmul")).expect("download");
            for t in 0..tokens {
                let row = &x[t * cols..(t + 1) * cols];
                let alone = g.download(&g.matmul(&up(g, row, &[1, cols]), &w).expect("matmul")).expect("download");
                let got = &batched[t * rows..(t + 1) * rows];
                assert!(
                    got.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} x {cols}, token {t} of {tokens}: batched differs from alone (rel L2 {:.2e})",
                    format_name(format),
                    rel_l2(got, &alone)
                );
            }
            let want = cpu.download(&cpu.matmul(&up(&cpu, &x, &[tokens, cols]), &cw).expect("matmul")).expect("download");
            assert!(rel_l2(&batched, &want) <= TOL, "{} x {cols}, {tokens} tokens against the CPU", format_name(format));
        }
    }
}
