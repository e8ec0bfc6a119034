//! `flash_decode` (a decode step over a long f16 KV cache): every launch shape
//! against the CPU backend's f16 cache (the same rounding of every key and
//! value): query groups of 1, 4, 8, 12 and 16 heads (one pass of eight rows,
//! some idle, or two), head dims 64, 128 and 256, chunks of one block merged
//! in the last workgroup, and (head dims 128 and 256) merged by `flash_merge`
//! or one chunk of many blocks alone; a fresh key alone in its block.

mod common;

use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, KvCacheType};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, MatmulMode, WgpuBackend, WgpuOptions};

/// Prefill then one-token steps, each step's output kept.
fn decode_steps(b: &dyn Backend, [heads, kvh, hd]: [usize; 3], steps: &[(usize, Vec<f32>, Vec<f32>, Vec<f32>)]) -> Vec<f32> {
    let mut cache = b.new_kv_cache(kvh, hd).expect("a KV cache");
    let mut outs = Vec::new();
    for (t, q, k, v) in steps {
        let [q, k, v] = [(q, heads), (k, kvh), (v, kvh)].map(|(x, n)| b.upload(x, &[*t, n * hd]).expect("upload"));
        let out = b.attention(&q, &k, &v, &mut cache, heads, 1.0 / (hd as f32).sqrt(), None).expect("attention");
        if *t == 1 {
            outs.extend(b.download(&out).expect("download"));
        }
    }
    outs
}

fn backend(options: WgpuOptions) -> WgpuBackend {
    let options = WgpuOptions { matmul: Some(MatmulMode::Int8), ..options };
    WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("opening a wgpu backend")
}

fn dispatches(b: &WgpuBackend, prefix: &str) -> u64 {
    b.kernel_profile().iter().filter(|(k, _)| k.starts_with(prefix)).map(|(_, t)| t.dispatches).sum()
}

#[test]
fn flash_decode_every_shape() {
    let Some(_) = gpu() else { return };
    let fast = backend(WgpuOptions::from_env());
    let (lanes, _) = fast.subgroup_sizes();
    if lanes < 8 {
        eprintln!("subgroups of {lanes} lanes: flash_decode needs 8 or more");
        return;
    }
    let variants = [
        ("merged by flash_merge", backend(WgpuOptions { merge_in_split: false, ..WgpuOptions::from_env() })),
        ("one chunk", backend(WgpuOptions { flash_workgroups: 1, ..WgpuOptions::from_env() })),
    ];
    let cpu = CpuBackend::with_mode(slotstream_cpu::MatmulMode::Int8);
    assert_eq!((fast.kv_cache_type(), cpu.kv_cache_type()), (KvCacheType::F16, KvCacheType::F16));
    let cases = [[8, 2, 128], [12, 1, 64], [16, 2, 256], [4, 4, 64], [16, 1, 64]];
    for (i, dims) in cases.into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(300 + i as u64);
        // 1,151 keys and more: past FLASH_DECODE_MIN_KEYS, fresh keys inside
        // a block, then (1,281 = 10 x 128 + 1) alone in the last chunk.
        let steps: Vec<_> = [1150usize, 1, 1, 127, 1, 1]
            .iter()
            .map(|&t| (t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0)))
            .collect();
        let want = decode_steps(&cpu, dims, &steps);
        let got = decode_steps(&fast, dims, &steps);
        let err = rel_l2(&got, &want);
        assert!(err <= 1e-4, "{dims:?}: flash_decode differs from the CPU backend's f16 cache, rel L2 {err:.3e}");
        // Profiled (where the adapter times dispatches): the same bits, and
        // each decode step one flash_decode dispatch, merged in the kernel
        // where workgroups may hand partials to each other.
        let plain_merge = &variants[0].1;
        if i == 0 && fast.set_profiling(true).is_ok() && plain_merge.set_profiling(true).is_ok() {
            assert_eq!(decode_steps(&fast, dims, &steps), got, "{dims:?}: profiled");
            decode_steps(plain_merge, dims, &steps);
            assert_eq!(dispatches(&fast, "flash_decode"), 4, "{dims:?}: every decode step takes flash_decode");
            // The prefills' flash_merge dispatches are the same on both.
            let more = dispatches(plain_merge, "flash_merge") - dispatches(&fast, "flash_merge");
            assert_eq!(more, if fast.merges_in_split() { 4 } else { 0 }, "{dims:?}: decode steps merged by flash_merge");
            for b in [&fast, plain_merge] {
                b.set_profiling(false).expect("profiling off");
            }
        }
        for (name, b) in variants.iter().filter(|_| i == 0 || i == 2) {
            let err = rel_l2(&decode_steps(b, dims, &steps), &got);
            assert!(err <= 1e-5, "{dims:?}, {name}: rel L2 {err:.3e} against chunks merged in the kernel");
        }
    }
}
