//! Decode attention at depth for the CPU backend (issue 46):
//!
//!   cargo run --release -p slotstream-cpu --example attention_bench [depth] [layers] [reps]
//!
//! The attention of bench_peer's model a (16 query heads over 4 KV heads of
//! 64) for one new token after `depth` positions (default 8192), in each of
//! `layers` KV caches (default 8, so the caches come from memory as in real
//! decode). Prints ms per token, the KV bytes read and the rate, for the
//! exact (f32 cache) and int8 (f16 cache) modes and the int8 mode with a
//! q8 cache (`--kv-cache q8`), with a hash of the prefill's
//! and of the decode step's output bits (a change to the kernels that should
//! not change their arithmetic must leave both hashes as they were).
use std::time::Instant;

use slotstream_backend::Backend;
use slotstream_backend::KvCacheType;
use slotstream_cpu::{CpuBackend, CpuOptions, MatmulMode};

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 7919 + seed * 104729) % 997) as f32 / 997.0 - 0.5) * 0.5).collect()
}

/// FNV-1a over the bits of `x`.
fn hash(x: &[f32]) -> u64 {
    x.iter().flat_map(|v| v.to_bits().to_le_bytes()).fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (depth, layers, reps) = (arg(1, 8192), arg(2, 8), arg(3, 10));
    let (heads, kvh, hd) = (16usize, 4usize, 64usize);
    let scale = 1.0 / (hd as f32).sqrt();
    for (mode, kv) in [(MatmulMode::Exact, None), (MatmulMode::Int8, None), (MatmulMode::Int8, Some(KvCacheType::Q8))] {
        let b = CpuBackend::with_options(CpuOptions { matmul: mode, kv_cache: kv, ..CpuOptions::from_env() });
        let kv = b.kv_cache_type();
        // One cache filled by a prefill of one query per KV head (a quarter of
        // the model's work), copied to every layer.
        let mut first = b.new_kv_cache(kvh, hd).expect("cache");
        let chunk = 1024;
        let (mut pos, mut prefill_hash) = (0, 0);
        while pos < depth {
            let n = chunk.min(depth - pos);
            let up = |w: usize, s: usize| b.upload(&values(n * w * hd, pos + s), &[n, w * hd]).expect("upload");
            let out = b.attention(&up(kvh, 1), &up(kvh, 2), &up(kvh, 3), &mut first, kvh, scale, None).expect("prefill");
            prefill_hash ^= hash(&b.download(&out).expect("download"));
            pos += n;
        }
        let mut caches: Vec<_> = (0..layers).map(|_| first.duplicate().expect("duplicate")).collect();
        let q = b.upload(&values(heads * hd, 5), &[1, heads * hd]).expect("upload");
        let k = b.upload(&values(kvh * hd, 6), &[1, kvh * hd]).expect("upload");
        let v = b.upload(&values(kvh * hd, 7), &[1, kvh * hd]).expect("upload");
        let bytes = layers * 2 * (depth + 1) * kvh * b.kv_cache_type().bytes(hd);
        let out = b.attention(&q, &k, &v, &mut caches[0], heads, scale, None).expect("attention");
        let decode_hash = hash(&b.download(&out).expect("download"));
        b.kv_truncate(&mut caches[0], depth).expect("truncate");
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                for c in caches.iter_mut() {
                    std::hint::black_box(b.attention(&q, &k, &v, c, heads, scale, None).expect("attention"));
                    b.kv_truncate(c, depth).expect("truncate");
                }
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        println!(
            "{mode:?}, {kv} cache: depth {depth}, {layers} layers, {:.1} MB of KV: {:.3} ms per token, {:.1} GB/s; output hashes: prefill {prefill_hash:016x}, decode {decode_hash:016x}",
            bytes as f64 / 1e6,
            best * 1e3,
            bytes as f64 / best / 1e9
        );
    }
}
