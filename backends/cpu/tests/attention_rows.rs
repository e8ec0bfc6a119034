//! A query's attention must not depend on how many queries its call has, up
//! to `ROW_EXACT_TOKENS` of them: a verification pass of drafted tokens (MTP)
//! or a short chunk gives each token the bits a one-token decode step gives
//! it, so speculative decoding never changes greedy output. On the int8 path
//! a last-bit difference here became a different int8 rounding of the next
//! matmul's activations, and `bench_mtp ... cpu` produced other tokens.

use slotstream_backend::{Backend, KvCacheType};
use slotstream_cpu::{CpuBackend, CpuOptions, MatmulMode};

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i + seed) * 7919) % 113) as f32 / 40.0 - 1.4).collect()
}

/// `past` positions appended, then `tokens` queries in one call; and the same
/// `tokens` one call each on a second cache. Returns both outputs.
fn one_call_and_one_by_one(b: &CpuBackend, [heads, kvh, hd]: [usize; 3], past: usize, tokens: usize) -> (Vec<f32>, Vec<f32>) {
    let total = past + tokens;
    let (q, k, v) = (values(total * heads * hd, 1), values(total * kvh * hd, 2), values(total * kvh * hd, 3));
    let call = |c: &mut slotstream_backend::State, t0: usize, t1: usize| {
        let o = b
            .attention(
                &b.upload(&q[t0 * heads * hd..t1 * heads * hd], &[t1 - t0, heads * hd]).unwrap(),
                &b.upload(&k[t0 * kvh * hd..t1 * kvh * hd], &[t1 - t0, kvh * hd]).unwrap(),
                &b.upload(&v[t0 * kvh * hd..t1 * kvh * hd], &[t1 - t0, kvh * hd]).unwrap(),
                c,
                heads,
                0.125,
                None,
            )
            .unwrap();
        b.download(&o).unwrap()
    };
    let (mut c1, mut c2) = (b.new_kv_cache(kvh, hd).unwrap(), b.new_kv_cache(kvh, hd).unwrap());
    for c in [&mut c1, &mut c2] {
        if past > 0 {
            call(c, 0, past);
        }
    }
    let all = call(&mut c1, past, total);
    let one: Vec<f32> = (past..total).flat_map(|t| call(&mut c2, t, t + 1)).collect();
    (all, one)
}

#[test]
fn attention_rows_independent_of_token_count() {
    for (matmul, kv) in [(MatmulMode::Exact, KvCacheType::F32), (MatmulMode::Int8, KvCacheType::F16), (MatmulMode::Int8, KvCacheType::F32)] {
        let b = CpuBackend::with_options(CpuOptions { matmul, kv_cache: Some(kv), ..CpuOptions::default() });
        for dims in [[8, 2, 64], [4, 4, 32], [4, 1, 8]] {
            for past in [0, 5, 37] {
                for tokens in [2, 3, 4, 5, 16] {
                    let (all, one) = one_call_and_one_by_one(&b, dims, past, tokens);
                    assert_eq!(all, one, "{matmul:?} {kv:?} cache, [heads, kv heads, head dim] {dims:?}, {past} past, {tokens} queries");
                }
            }
        }
    }
}
