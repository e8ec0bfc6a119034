//! The attention kernels against the CPU backend (the reference), on fixed
//! seeded inputs, plus an insta snapshot of each output (see kernels.rs for
//! the tolerances): the per-head kernels (prefill, split decode, key
//! selections, the query/key norm inside), `flash_attention` in every launch
//! shape, and f16 and q8 KV caches (with key selections too).

mod common;

use common::check::{check, up};
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, KeySelection, KvCacheType, QkNorm, Tensor};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, MatmulMode, WgpuBackend, WgpuOptions};

#[test]
fn attention_prefill_then_decode_gqa() {
    let mut rng = Rng::new(8);
    let (heads, kvh, hd) = (8, 2, 64);
    let steps: Vec<QkStep> = [7usize, 1, 1, 300]
        .iter()
        .map(|&t| (t, rng.vec(t * heads * hd, 2.0), rng.vec(t * kvh * hd, 2.0), rng.vec(t * kvh * hd, 2.0)))
        .collect();
    for (i, _) in steps.iter().enumerate() {
        check(&format!("attention_step{i}"), 2e-5, |b| {
            let mut cache = b.new_kv_cache(kvh, hd).unwrap();
            let mut last = None;
            for (t, q, k, v) in &steps[..=i] {
                let out = b
                    .attention(&up(b, q, &[*t, heads * hd]), &up(b, k, &[*t, kvh * hd]), &up(b, v, &[*t, kvh * hd]), &mut cache, heads, 0.125, None)
                    .unwrap();
                last = Some(out);
            }
            assert_eq!(b.kv_len(&cache).unwrap(), steps[..=i].iter().map(|s| s.0).sum::<usize>());
            last.unwrap()
        });
    }
}

/// QSA key selection: a prefill, two decode steps and a longer chunk, with
/// GQA, dense and selected queries mixed, UNUSED entries and repeated blocks.
#[test]
fn sparse_attention_prefill_then_decode_gqa() {
    let mut rng = Rng::new(19);
    let (heads, kvh, hd, block, per_query) = (8, 2, 64, 4, 5);
    let (dense, unused) = (KeySelection::DENSE, KeySelection::UNUSED);
    let mut past = 0;
    let mut steps = Vec::new();
    for t in [37usize, 1, 1, 150] {
        let mut blocks = Vec::new();
        for pos in past..past + t {
            let own = ((pos + 1) / block) as u32;
            let row: Vec<u32> = match pos {
                // Early positions and every 7th are dense (entries after the marker are ignored).
                p if p < 12 || p % 7 == 0 => [dense, 3, unused, 0, 1].to_vec(),
                // Nothing listed and an empty trailing block: no keys at all.
                39 => vec![unused; per_query],
                // Nothing listed: only the trailing partial block (keys 40, 41).
                41 => vec![unused; per_query],
                // The block ending at the query itself, listed twice.
                47 => [11, unused, 2, 11, 0].to_vec(),
                // Random whole blocks before the query (repeats possible), some UNUSED.
                _ => (0..per_query).map(|_| match rng.bits() % 4 { 0 => unused, r => (rng.bits() + r) % own }).collect(),
            };
            blocks.extend(row);
        }
        let sel = KeySelection { block, per_query, blocks };
        steps.push((t, rng.vec(t * heads * hd, 2.0), rng.vec(t * kvh * hd, 2.0), rng.vec(t * kvh * hd, 2.0), sel));
        past += t;
    }
    for (i, _) in steps.iter().enumerate() {
        check(&format!("attention_sparse_step{i}"), 2e-5, |b| {
            let mut cache = b.new_kv_cache(kvh, hd).unwrap();
            let mut last = None;
            for (t, q, k, v, sel) in &steps[..=i] {
                let (q, k, v) = (up(b, q, &[*t, heads * hd]), up(b, k, &[*t, kvh * hd]), up(b, v, &[*t, kvh * hd]));
                last = Some(b.attention(&q, &k, &v, &mut cache, heads, 0.125, Some(sel)).unwrap());
            }
            last.unwrap()
        });
    }
}

/// Runs attention calls of `steps` (tokens, q, k, v, selection) on one cache
/// and returns the outputs of steps `from..` as one tensor.
fn attention_steps(b: &dyn Backend, [heads, kvh, hd]: [usize; 3], steps: &[AttentionStep], from: usize) -> Tensor {
    let mut cache = b.new_kv_cache(kvh, hd).unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let mut outs = Vec::new();
    for (t, q, k, v, sel) in steps {
        let (q, k, v) = (up(b, q, &[*t, heads * hd]), up(b, k, &[*t, kvh * hd]), up(b, v, &[*t, kvh * hd]));
        outs.push(b.attention(&q, &k, &v, &mut cache, heads, scale, sel.as_ref()).unwrap());
    }
    b.concat_rows(&outs[from..].iter().collect::<Vec<_>>()).unwrap()
}

type AttentionStep = (usize, Vec<f32>, Vec<f32>, Vec<f32>, Option<KeySelection>);

/// Long contexts, where decode splits the key range over workgroups: a
/// 1037-key prefill (one workgroup per query, several key tiles), then one,
/// three and forty queries, whose chunks (32 keys, then 271 keys in two
/// tiles) do not divide the key count; GQA down to one KV head, and head
/// dims that leave threads idle (80), split the keys (128) or exceed the
/// workgroup (320).
#[test]
fn attention_long_context_split_gqa() {
    for (i, dims) in [[8, 1, 128], [4, 2, 80], [2, 1, 320]].into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(40 + i as u64);
        let steps: Vec<AttentionStep> = [1037usize, 1, 3, 40]
            .iter()
            .map(|&t| (t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0), None))
            .collect();
        check(&format!("attention_long_prefill{i}"), 2e-5, |b| attention_steps(b, dims, &steps[..1], 0));
        check(&format!("attention_long_decode{i}"), 2e-5, |b| attention_steps(b, dims, &steps, 1));
    }
}

/// Attention with the query/key norm and rotary embedding folded in
/// (`attention_qk_norm`): a prefill (composed on the GPU too), decode steps
/// (normalised and rotated inside the split attention kernel, which writes
/// the rotated key to the cache), then a short prefill and a decode step that
/// read those cached keys back. Full and partial rotary dims, GQA, head dims
/// of one and two values per thread; head dims of four and eight values per
/// lane (the `_regs` kernels) at subgroups of 8, 16 and 32 lanes.
#[test]
fn attention_with_the_qk_norm_inside() {
    let cases = [([8, 2, 128], 128), ([4, 1, 256], 64), ([2, 1, 320], 160), ([8, 2, 64], 64), ([4, 2, 32], 16)];
    for (i, (dims, rotary)) in cases.into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(90 + i as u64);
        let (qw, kw) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let steps: Vec<QkStep> = [300usize, 1, 1, 1, 3, 1]
            .iter()
            .map(|&t| (t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0)))
            .collect();
        check(&format!("attention_qk_norm{i}"), 2e-5, |b| {
            qk_norm_steps(b, dims, rotary, [&qw, &kw], &steps, 1)
        });
    }
}

/// QSA key selection at a long context: dense and selected queries mixed,
/// so a decode query sees either all 1100+ keys (split in chunks) or eight
/// listed blocks and its trailing partial block (a few chunks, the last
/// short, listed and trailing keys in one chunk), or none.
#[test]
fn sparse_attention_long_context_split() {
    let mut rng = Rng::new(47);
    let dims @ [heads, kvh, hd] = [8, 2, 64];
    let (block, per_query) = (16, 8);
    let mut past = 0;
    let mut steps: Vec<AttentionStep> = Vec::new();
    for t in [1100usize, 1, 1, 4] {
        let mut blocks = Vec::new();
        for pos in past..past + t {
            let own = ((pos + 1) / block) as u32;
            if pos == 1103 {
                // Nothing listed and an empty trailing block: no keys at all, in a split call.
                blocks.extend(std::iter::repeat_n(KeySelection::UNUSED, per_query));
            } else if pos < 4 * block || pos % 5 == 0 {
                blocks.extend([KeySelection::DENSE].into_iter().chain(std::iter::repeat_n(0, per_query - 1)));
            } else {
                blocks.extend((0..per_query).map(|_| rng.bits() % own));
            }
        }
        let sel = KeySelection { block, per_query, blocks };
        steps.push((t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0), Some(sel)));
        past += t;
    }
    check("attention_sparse_long_prefill", 2e-5, |b| attention_steps(b, dims, &steps[..1], 0));
    check("attention_sparse_long_decode", 2e-5, |b| attention_steps(b, dims, &steps, 1));
}

/// `flash_attention` (dense attention of prefills and of long-context decode
/// steps) in every launch shape: query groups of 1, 6, 8 and 12 heads
/// (workgroups of 64, 10, 8 and 5 tokens, some slots idle), head dims 64,
/// 128 and 256, token counts that do not fill the last workgroup, a prefill
/// long enough to be cut into key chunks, a chunk of prompt after a long
/// past (chunks beyond some rows' positions), and decode steps past
/// `FLASH_DECODE_MIN_KEYS` keys (key slices merged in the workgroup, the
/// fresh rows written by the kernel, then read back from the cache). The
/// per-head kernels (`SLOTSTREAM_WGPU_FLASH=0`) give the same outputs.
#[test]
fn flash_attention_every_shape() {
    let Some(_) = gpu() else { return };
    let per_head = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions { flash_attention: false, ..WgpuOptions::from_env() })
        .expect("opening a second wgpu backend");
    let cases = [([4, 4, 64], [300usize, 5, 1, 1]), ([12, 2, 128], [37, 990, 1, 1]), ([16, 2, 256], [1030, 1, 2, 1]), ([24, 2, 64], [700, 400, 1, 3])];
    for (i, (dims, calls)) in cases.into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(140 + i as u64);
        let steps: Vec<AttentionStep> = calls
            .iter()
            .map(|&t| (t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0), None))
            .collect();
        let name = format!("flash_attention{i}");
        check(&name, 2e-5, |b| attention_steps(b, dims, &steps, 0));
        let [flash, plain] = [gpu().expect("a gpu"), &per_head].map(|b| b.download(&attention_steps(b, dims, &steps, 0)).expect("download"));
        let err = rel_l2(&flash, &plain);
        assert!(err <= 2e-5, "{name}: flash attention differs from the per-head kernels, rel L2 {err:.3e}");
    }
}

/// An f16 KV cache (the fast matmul mode's, as on the CPU backend): prefills
/// (`kv_store` rounds the rows), decode steps through the per-head kernels
/// (norm and rotary embedding inside, the fresh rows written as f16) and
/// through `flash_attention` past `FLASH_DECODE_MIN_KEYS` keys, against the
/// CPU backend's f16 cache (the same rounding of every key and value).
#[test]
fn attention_with_an_f16_cache() {
    let Some(_) = gpu() else { return };
    let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions { matmul: Some(MatmulMode::Int8), ..WgpuOptions::from_env() })
        .expect("opening a second wgpu backend");
    let cpu = CpuBackend::with_mode(slotstream_cpu::MatmulMode::Int8);
    assert_eq!((g.kv_cache_type(), cpu.kv_cache_type()), (KvCacheType::F16, KvCacheType::F16));
    for (i, dims) in [[8, 2, 128], [16, 2, 256], [4, 4, 64]].into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(170 + i as u64);
        let (qw, kw) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let steps: Vec<QkStep> = [300usize, 1, 2, 730, 1, 1]
            .iter()
            .map(|&t| (t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0)))
            .collect();
        let run = |b: &dyn Backend| {
            b.download(&qk_norm_steps(b, dims, hd / 2, [&qw, &kw], &steps, 0)).unwrap()
        };
        let err = rel_l2(&run(&g), &run(&cpu));
        assert!(err <= 1e-4, "{dims:?}: an f16 cache on the GPU differs from the CPU backend's, rel L2 {err:.3e}");
    }
}

/// A q8 KV cache (`--kv-cache q8`): `kv_store_q8` quantizes every
/// prefill's and decode step's rows, `flash_attention` reads them in every
/// launch shape (prefills with one and two rows per slot, decode steps in
/// chunks merged by `flash_merge`, head dims 64, 128 and 256), against the
/// CPU backend's q8 cache (the same blocks and scales, so the same values
/// but for a rounding tie) and, looser, the exact f32 cache.
#[test]
fn attention_with_a_q8_cache() {
    let Some(_) = gpu() else { return };
    let q8 = |matmul| WgpuOptions { matmul: Some(matmul), kv_cache: Some(KvCacheType::Q8), ..WgpuOptions::from_env() };
    let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), q8(MatmulMode::Int8)).expect("opening a second wgpu backend");
    let cpu_q8 = CpuBackend::with_options(slotstream_cpu::CpuOptions { kv_cache: Some(KvCacheType::Q8), ..slotstream_cpu::CpuOptions::from_env() });
    let exact = CpuBackend::exact();
    assert_eq!((g.kv_cache_type(), cpu_q8.kv_cache_type()), (KvCacheType::Q8, KvCacheType::Q8));
    for (i, dims) in [[8, 2, 128], [16, 2, 256], [4, 4, 64]].into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(210 + i as u64);
        let (qw, kw) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let steps: Vec<QkStep> = [300usize, 1, 2, 730, 1, 1]
            .iter()
            .map(|&t| (t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0)))
            .collect();
        let run = |b: &dyn Backend| b.download(&qk_norm_steps(b, dims, hd / 2, [&qw, &kw], &steps, 0)).unwrap();
        let (gpu_out, cpu_out, exact_out) = (run(&g), run(&cpu_q8), run(&exact));
        let err = rel_l2(&gpu_out, &cpu_out);
        assert!(err <= 1e-4, "{dims:?}: a q8 cache on the GPU differs from the CPU backend's, rel L2 {err:.3e}");
        let (gpu_err, cpu_err) = (rel_l2(&gpu_out, &exact_out), rel_l2(&cpu_out, &exact_out));
        assert!(gpu_err <= 2e-2 && gpu_err > 1e-4, "{dims:?}: q8 against f32 on the GPU, rel L2 {gpu_err:.3e} (CPU {cpu_err:.3e})");
    }
    // The exact mode keeps f32 unless told otherwise.
    let ge = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions { matmul: Some(MatmulMode::Exact), ..WgpuOptions::from_env() })
        .expect("opening a third wgpu backend");
    assert_eq!(ge.kv_cache_type(), KvCacheType::F32);
}

/// A q8 KV cache with QSA key selections (qwen4_exp's sparse attention),
/// which the per-head kernels read: a prefill (`attention`), decode steps
/// and a short chunk split over the keys (`attention_split`, its `_regs`
/// form, the merge), dense, selected and keyless queries mixed; head dims 64
/// (qwen4_exp's 4 heads over 2 kv heads), 128 and 256, and a query group over
/// 64 heads (which `flash_attention` does not take, dense or not). Also dense
/// attention through the per-head kernels (flash attention off). Against the
/// CPU backend's q8 cache (the same blocks and scales, so the same values)
/// and, looser, the exact f32 cache.
#[test]
fn q8_cache_with_key_selections() {
    let Some(_) = gpu() else { return };
    let q8 = |flash_attention| WgpuOptions { matmul: Some(MatmulMode::Int8), kv_cache: Some(KvCacheType::Q8), flash_attention, ..WgpuOptions::from_env() };
    let gpus = [true, false].map(|flash| WgpuBackend::with_options(&AdapterChoice::allow_software(), q8(flash)).expect("opening a q8 wgpu backend"));
    let cpu_q8 = CpuBackend::with_options(slotstream_cpu::CpuOptions { kv_cache: Some(KvCacheType::Q8), ..slotstream_cpu::CpuOptions::from_env() });
    let exact = CpuBackend::exact();
    assert!(gpus.iter().all(|g| g.kv_cache_type() == KvCacheType::Q8) && cpu_q8.kv_cache_type() == KvCacheType::Q8);
    let profiled = gpus[0].set_profiling(true).is_ok();
    for (i, (dims, block)) in [([4, 2, 64], 4), ([8, 2, 128], 16), ([16, 2, 256], 8), ([72, 1, 64], 4)].into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(230 + i as u64);
        let mut past = 0;
        let mut steps: Vec<AttentionStep> = Vec::new();
        for t in [300usize, 1, 1, 40, 1] {
            let sel = q8_test_selection(&mut rng, past..past + t, block, 6);
            steps.push((t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0), Some(sel)));
            past += t;
        }
        let dense: Vec<AttentionStep> = steps.iter().map(|(t, q, k, v, _)| (*t, q.clone(), k.clone(), v.clone(), None)).collect();
        for (what, steps) in [("selected", &steps), ("dense", &dense)] {
            let run = |b: &dyn Backend| b.download(&attention_steps(b, dims, steps, 0)).unwrap();
            let (cpu_out, exact_out) = (run(&cpu_q8), run(&exact));
            for (g, flash) in gpus.iter().zip(["on", "off"]) {
                let gpu_out = run(g);
                let err = rel_l2(&gpu_out, &cpu_out);
                assert!(err <= 1e-4, "{dims:?}, {what}, flash {flash}: a q8 cache on the GPU differs from the CPU backend's, rel L2 {err:.3e}");
                let gpu_err = rel_l2(&gpu_out, &exact_out);
                assert!(gpu_err <= 2e-2 && gpu_err > 1e-4, "{dims:?}, {what}, flash {flash}: q8 against f32, rel L2 {gpu_err:.3e}");
            }
        }
    }
    if profiled {
        let ran = |name: &str| gpus[0].kernel_profile().iter().find(|(k, _)| k.as_str() == name).map_or(0, |(_, t)| t.dispatches);
        let split = ran("attention_split") + ran("attention_split_regs");
        assert!(ran("attention") > 0 && split > 0, "the per-head kernels did not run: attention {}, split {split}", ran("attention"));
    }
}

/// Key selection rows for positions `range` (blocks of `block`,
/// `per_query` entries): dense for the first two blocks and every fifth
/// position, none at all for position 303 (its trailing block is empty
/// too), else random whole blocks before the query's own, repeats and
/// UNUSED entries included.
fn q8_test_selection(rng: &mut Rng, range: std::ops::Range<usize>, block: usize, per_query: usize) -> KeySelection {
    let mut blocks = Vec::new();
    for pos in range {
        let own = ((pos + 1) / block) as u32;
        if pos == 303 {
            blocks.extend(std::iter::repeat_n(KeySelection::UNUSED, per_query));
        } else if pos < 2 * block || pos % 5 == 0 {
            blocks.extend([KeySelection::DENSE].into_iter().chain(std::iter::repeat_n(0, per_query - 1)));
        } else {
            blocks.extend((0..per_query).map(|_| match rng.bits() % 5 {
                0 => KeySelection::UNUSED,
                _ => rng.bits() % own,
            }));
        }
    }
    KeySelection { block, per_query, blocks }
}

/// Decode steps past `FLASH_DECODE_MIN_KEYS` keys with the query/key norm
/// and rotary embedding (`attention_qk_norm`): one dispatch normalises and
/// rotates q and k, then `flash_attention` writes the fresh rows (full and
/// partial rotary spans); f32 caches. (Folding the norm and rotation into
/// every workgroup of `flash_attention` decoded A at depth 8k 20% slower on
/// an H100, BENCHMARKS.md.)
#[test]
fn flash_attention_with_the_qk_norm_inside() {
    let cases = [([8, 2, 128], 128), ([4, 1, 256], 64), ([8, 2, 64], 32), ([8, 2, 128], 40)];
    for (i, (dims, rotary)) in cases.into_iter().enumerate() {
        let [heads, kvh, hd] = dims;
        let mut rng = Rng::new(190 + i as u64);
        let (qw, kw) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let steps: Vec<QkStep> = [1030usize, 1, 1, 2, 1]
            .iter()
            .map(|&t| (t, rng.vec(t * heads * hd, 3.0), rng.vec(t * kvh * hd, 3.0), rng.vec(t * kvh * hd, 2.0)))
            .collect();
        check(&format!("flash_attention_qk_norm{i}"), 2e-5, |b| {
            qk_norm_steps(b, dims, rotary, [&qw, &kw], &steps, 1)
        });
    }
}

/// Runs `attention_qk_norm` calls of `steps` (tokens, q, k, v) on one cache,
/// with query/key norm weights `qw`, `kw` and `rotary` rotated dims, and
/// returns the outputs of steps `from..` as one tensor.
fn qk_norm_steps(b: &dyn Backend, [heads, kvh, hd]: [usize; 3], rotary: usize, [qw, kw]: [&[f32]; 2], steps: &[QkStep], from: usize) -> Tensor {
    let (qw, kw) = (up(b, qw, &[hd]), up(b, kw, &[hd]));
    let mut cache = b.new_kv_cache(kvh, hd).unwrap();
    let mut start = 0;
    let mut outs = Vec::new();
    for (t, q, k, v) in steps {
        let (q, k, v) = (up(b, q, &[*t, heads * hd]), up(b, k, &[*t, kvh * hd]), up(b, v, &[*t, kvh * hd]));
        let norm = QkNorm { weights: [&qw, &kw], eps: [1e-6, 1e-5], head_dim: hd, rotary_dim: rotary, rope: slotstream_backend::Rope::plain(1e6), start_pos: start };
        outs.push(b.attention_qk_norm(&q, &k, &v, &mut cache, heads, 1.0 / (hd as f32).sqrt(), None, &norm).unwrap());
        start += t;
    }
    b.concat_rows(&outs[from..].iter().collect::<Vec<_>>()).unwrap()
}

type QkStep = (usize, Vec<f32>, Vec<f32>, Vec<f32>);
