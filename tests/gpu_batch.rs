//! Continuous batching on the wgpu backend changes speed, never output: a
//! batched decode step gives each sequence the logits, bit for bit, of its
//! step alone, in the exact mode and in the int8 mode, for the fixture
//! families that batch (lavapipe in CI; SLOTSTREAM_SKIP_GPU_TESTS=1 skips).

mod common;

use slotstream::generate::Engine;
use slotstream::model::{LoadOptions, Logits, SequenceState};
use slotstream::sampling::argmax;
use slotstream_wgpu::{AdapterChoice, MatmulMode, WgpuBackend, WgpuOptions};

const FAMILIES: [&str; 3] = ["qwen3_moe_mlx4", "qwen3_next_mlx4", "qwen3_5_moe_mlx4"];

fn engine(name: &str, matmul: MatmulMode) -> Option<Engine> {
    if std::env::var("SLOTSTREAM_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        return None;
    }
    // Int8 mode on every 4-bit product whatever its size (the fixtures' are small).
    let options = WgpuOptions { matmul: Some(matmul), int8_min_bytes: 0, ..WgpuOptions::from_env() };
    let backend = WgpuBackend::with_options(&AdapterChoice::allow_software(), options)
        .unwrap_or_else(|e| panic!("no GPU adapter: {e} (install mesa-vulkan-drivers, or SLOTSTREAM_SKIP_GPU_TESTS=1)"));
    Some(Engine::load(&common::fixture(name), Box::new(backend), &LoadOptions::default()).unwrap_or_else(|e| panic!("loading {name}: {e:#}")))
}

/// Four different prompts from the fixture's golden prompt.
fn prompts(name: &str) -> Vec<Vec<u32>> {
    let base = common::golden(name).cases.into_iter().map(|c| c.prompt_ids).max_by_key(Vec::len).expect("a golden case");
    (0..4).map(|i| base[i..].iter().chain(&base[..i]).copied().take(base.len() - i).collect()).collect()
}

fn batched_steps_match(name: &str, matmul: MatmulMode) {
    let Some(e) = engine(name, matmul) else { return };
    let b = e.backend.as_ref();
    let prompts = prompts(name);
    let (mut solo, mut batched, mut next): (Vec<SequenceState>, Vec<SequenceState>, Vec<u32>) = (Vec::new(), Vec::new(), Vec::new());
    for p in &prompts {
        let mut s = e.new_state().expect("a state");
        next.push(argmax(&e.prefill(p, &mut s).expect("prefill")));
        batched.push(e.clone_state(&s).expect("a copy"));
        solo.push(s);
    }
    assert!(e.model.batches(&solo[0]), "{name} should batch");
    for step in 0..4 {
        let rows: Vec<Vec<f32>> = solo
            .iter_mut()
            .zip(&next)
            .map(|(s, &t)| b.download(&e.model.forward(b, &[t], s, Logits::Last).expect("a step alone")).expect("download"))
            .collect();
        let mut states: Vec<&mut SequenceState> = batched.iter_mut().collect();
        let all = b.download(&e.model.forward_batch(b, &next, &mut states).expect("a batched step")).expect("download");
        let vocab = all.len() / prompts.len();
        for (i, row) in rows.iter().enumerate() {
            let got = &all[i * vocab..(i + 1) * vocab];
            let same = got.iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name} ({matmul:?}): step {step}, sequence {i}: batched logits differ from its step alone (rel L2 {:.2e})", common::rel_l2(got, row));
        }
        next = rows.iter().map(|r| argmax(r)).collect();
    }
}

#[test]
fn a_batched_step_gives_each_sequence_its_logits_alone_exact() {
    for name in FAMILIES {
        batched_steps_match(name, MatmulMode::Exact);
    }
}

#[test]
fn a_batched_step_gives_each_sequence_its_logits_alone_int8() {
    for name in FAMILIES {
        batched_steps_match(name, MatmulMode::Int8);
    }
}
