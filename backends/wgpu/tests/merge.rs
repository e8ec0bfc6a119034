//! Split decode attention merged two ways: in the split kernel's last
//! workgroup per (token, head) (`WgpuOptions::merge_in_split`, the default on
//! Vulkan, so lavapipe takes it) and in `attention_merge` (Metal, or the
//! option off). Both against the CPU backend over many calls, so that a
//! merge count left non-zero by one call breaks the next.

mod common;

use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, QkNorm, Tensor};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};

/// Decode steps after a long prefill with the query/key norm inside
/// attention, then plain attention calls of 1, 3 and 20 queries (a split
/// call of several tokens), on one cache each; every output concatenated.
fn decode_steps(b: &dyn Backend, [heads, kvh, hd]: [usize; 3], seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let up = |v: &[f32], shape: &[usize]| b.upload(v, shape).expect("upload");
    let (qw, kw) = (up(&rng.vec(hd, 1.0), &[hd]), up(&rng.vec(hd, 1.0), &[hd]));
    let mut cache = b.new_kv_cache(kvh, hd).expect("kv cache");
    let mut plain = b.new_kv_cache(kvh, hd).expect("kv cache");
    let mut outs: Vec<Tensor> = Vec::new();
    let mut start = 0;
    for t in [300usize, 1, 1, 1, 1] {
        let (q, k, v) = (rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0));
        let (q, k, v) = (up(&q, &[t, heads * hd]), up(&k, &[t, kvh * hd]), up(&v, &[t, kvh * hd]));
        let norm = QkNorm { weights: [&qw, &kw], eps: [1e-6, 1e-5], head_dim: hd, rotary_dim: hd, rope: slotstream_backend::Rope::plain(1e6), start_pos: start };
        let out = b.attention_qk_norm(&q, &k, &v, &mut cache, heads, 1.0 / (hd as f32).sqrt(), None, &norm).expect("attention_qk_norm");
        if t == 1 {
            outs.push(out);
        }
        start += t;
    }
    for t in [300usize, 1, 3, 20, 1] {
        let (q, k, v) = (rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0));
        let (q, k, v) = (up(&q, &[t, heads * hd]), up(&k, &[t, kvh * hd]), up(&v, &[t, kvh * hd]));
        let out = b.attention(&q, &k, &v, &mut plain, heads, 0.125, None).expect("attention");
        if t < 300 {
            outs.push(out);
        }
    }
    outs.iter().flat_map(|o| b.download(o).expect("download")).collect()
}

#[test]
fn split_attention_merged_in_its_last_workgroup_or_by_merge_kernel() {
    if gpu().is_none() {
        return;
    }
    // Both from explicit options, whatever SLOTSTREAM_WGPU_* says.
    let open = |merge_in_split| {
        let options = WgpuOptions { merge_in_split, ..WgpuOptions::default() };
        WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("opening a wgpu backend")
    };
    let (merged, apart) = (open(true), open(false));
    let vulkan = merged.name().to_lowercase().contains("vulkan");
    assert_eq!(merged.merges_in_split(), vulkan, "the split kernel merges on Vulkan only (adapter {})", merged.name());
    assert!(!apart.merges_in_split());
    let cpu = CpuBackend::exact();
    // 32 heads of 128 over 4 kv heads (Qwen3-30B-A3B's attention), few heads
    // of 256 (Qwen3-Next's), whose decode splits into many chunks, and heads
    // of 64, which small subgroups take through the `_regs` kernels.
    for (i, dims) in [[32, 4, 128], [4, 1, 256], [8, 2, 64]].into_iter().enumerate() {
        let want = decode_steps(&cpu, dims, 70 + i as u64);
        let got: Vec<Vec<f32>> = [&merged, &apart].iter().map(|b| decode_steps(*b, dims, 70 + i as u64)).collect();
        for (out, how) in got.iter().zip(["in the split kernel", "by attention_merge"]) {
            let err = rel_l2(out, &want);
            assert!(err <= 2e-5, "{dims:?}, merged {how}: rel L2 {err:.3e} against the CPU backend");
        }
        // The same partials merged by the same code: the same bits.
        assert!(got[0] == got[1], "{dims:?}: merged in the split kernel and by attention_merge differ");
    }
}
