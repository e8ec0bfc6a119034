//! A prompt's attention (`--attn T:H:KVH,...`): T tokens of H query heads of
//! 128 over KVH kv heads, causal, into a fresh f16 cache (int8 mode), on this
//! backend and on one without the matrix units (`wgsl/flash_coop.wgsl`
//! against `flash_attention.wgsl`): each one's kernel-only time and TFLOP/s
//! (QK and PV, the causal half), and the outputs' relative L2 distance.

use anyhow::{Context, Result};
use slotstream_backend::Backend;
use slotstream_wgpu::{MatmulMode, WgpuBackend};

use super::Lcg;

const HEAD_DIM: usize = 128;

/// `T:H:KVH` triples, comma-separated.
pub fn parse_shapes(s: &str) -> Result<Vec<(usize, usize, usize)>> {
    super::gemm::parse_shapes(s).context("--attn wants T:H:KVH")
}

/// Output and kernel seconds of one attention call of a fresh cache.
fn attend(b: &WgpuBackend, x: [&[f32]; 3], tokens: usize, heads: usize, kv_heads: usize) -> Result<(Vec<f32>, f64, Vec<String>)> {
    let q = b.upload(x[0], &[tokens, heads * HEAD_DIM])?;
    let k = b.upload(x[1], &[tokens, kv_heads * HEAD_DIM])?;
    let v = b.upload(x[2], &[tokens, kv_heads * HEAD_DIM])?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    // A warm-up call, then one timed by kernel.
    drop(b.attention(&q, &k, &v, &mut b.new_kv_cache(kv_heads, HEAD_DIM)?, heads, scale, None)?);
    b.sync()?;
    b.set_profiling(true)?;
    let out = b.attention(&q, &k, &v, &mut b.new_kv_cache(kv_heads, HEAD_DIM)?, heads, scale, None)?;
    b.sync()?;
    let profile = b.kernel_profile();
    b.set_profiling(false)?;
    let attention: Vec<_> = profile.iter().filter(|(name, _)| name.contains("flash") || name.contains("attention")).collect();
    let seconds = attention.iter().map(|(_, t)| t.seconds).sum();
    Ok((b.download(&out)?, seconds, attention.iter().map(|(name, _)| name.clone()).collect()))
}

pub fn bench(b: &WgpuBackend, without: &WgpuBackend, shapes: &[(usize, usize, usize)]) -> Result<()> {
    let (b, without) = (b.with_matmul_mode(MatmulMode::Int8), without.with_matmul_mode(MatmulMode::Int8));
    for &(tokens, heads, kv_heads) in shapes {
        let mut rng = Lcg(tokens as u64 ^ (heads as u64) << 24);
        let mut draw = |n: usize| (0..n).map(|_| 2.0 * rng.unit()).collect::<Vec<f32>>();
        let (q, k, v) = (draw(tokens * heads * HEAD_DIM), draw(tokens * kv_heads * HEAD_DIM), draw(tokens * kv_heads * HEAD_DIM));
        let (got, s1, k1) = attend(&b, [&q, &k, &v], tokens, heads, kv_heads)?;
        let (want, s0, k0) = attend(&without, [&q, &k, &v], tokens, heads, kv_heads)?;
        let err = got.iter().zip(&want).map(|(g, w)| ((g - w) as f64).powi(2)).sum::<f64>().sqrt();
        let norm = want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>().sqrt();
        let flops = 2.0 * 2.0 * (tokens * tokens / 2 * heads * HEAD_DIM) as f64;
        println!(
            "attention {tokens} tokens, {heads}/{kv_heads} heads of {HEAD_DIM}: {} {:.2} ms ({:.1} TFLOP/s) against {} {:.2} ms ({:.1} TFLOP/s), rel L2 {:.2e}",
            k1.join("+"),
            1e3 * s1,
            flops / s1 / 1e12,
            k0.join("+"),
            1e3 * s0,
            flops / s0 / 1e12,
            err / norm.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}
