//! Prefill-sized products (`--gemm T:K:N,...`): `x [T, K] @ W^T` for a 4-bit
//! affine `W [N, K]` (group 64, bf16 scales, the benchmark models' format),
//! in the CLI's default mode for a GPU; wall and kernel-only TFLOP/s.

use std::time::Instant;

use anyhow::{Context, Result};
use slotstream_backend::Backend;
use slotstream_wgpu::{MatmulMode, WgpuBackend};

use super::{affine_matrix, Lcg};

/// `T:K:N` triples, comma-separated.
pub fn parse_shapes(s: &str) -> Result<Vec<(usize, usize, usize)>> {
    s.split(',')
        .map(|one| {
            let v: Vec<usize> = one.split(':').map(|n| n.trim().parse()).collect::<Result<_, _>>().with_context(|| format!("--gemm {one}: want T:K:N"))?;
            match v[..] {
                [t, k, n] if t > 0 && k > 0 && n > 0 => Ok((t, k, n)),
                _ => anyhow::bail!("--gemm {one}: want three positive numbers T:K:N"),
            }
        })
        .collect()
}

pub fn bench(b: &WgpuBackend, shapes: &[(usize, usize, usize)], reps: usize) -> Result<()> {
    let b = b.with_matmul_mode(MatmulMode::from_env(MatmulMode::Int8));
    for &(tokens, cols, rows) in shapes {
        let mut rng = Lcg(tokens as u64 ^ (rows as u64) << 20);
        let w = b.load_weight(&affine_matrix(&mut rng, 4, rows, cols))?;
        let x = b.upload(&(0..tokens * cols).map(|_| rng.unit()).collect::<Vec<_>>(), &[tokens, cols])?;
        drop(b.matmul(&x, &w)?);
        b.sync()?;
        let t = Instant::now();
        for _ in 0..reps {
            drop(b.matmul(&x, &w)?);
        }
        b.sync()?;
        let wall = t.elapsed().as_secs_f64() / reps as f64;
        b.set_profiling(true)?;
        for _ in 0..reps {
            drop(b.matmul(&x, &w)?);
        }
        b.sync()?;
        let kernel: f64 = b.kernel_profile().iter().map(|(_, t)| t.seconds).sum::<f64>() / reps as f64;
        let kernels: Vec<String> = b.kernel_profile().iter().map(|(name, _)| name.to_string()).collect();
        b.set_profiling(false)?;
        // Against exact mode's f32 products (never the matrix units).
        let got = b.download(&b.matmul(&x, &w)?)?;
        let want = b.with_matmul_mode(MatmulMode::Exact).download(&b.with_matmul_mode(MatmulMode::Exact).matmul(&x, &w)?)?;
        let err = got.iter().zip(&want).map(|(g, w)| ((g - w) as f64).powi(2)).sum::<f64>().sqrt();
        let norm = want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>().sqrt();
        let flops = 2.0 * (tokens * cols * rows) as f64;
        println!(
            "gemm q4 g64 [{tokens} x {cols}] @ [{rows} x {cols}]^T ({}): {:.3} ms wall, {:.1} TFLOP/s wall, {:.1} TFLOP/s kernel-only, rel L2 vs exact {:.2e}",
            kernels.join("+"),
            1e3 * wall,
            flops / wall / 1e12,
            flops / kernel / 1e12,
            err / norm.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}
