//! A context past 4k tokens: the YaRN fixture (its config takes 8,192) fed
//! a prompt of 4,100 tokens decodes the same greedy ids on the wgpu backend
//! as on `cpu:exact`, with the prompt's logits within the oracle tolerance.
//! On lavapipe (CI) the default mode is `:exact` (f32 matmuls and KV on a
//! software rasterizer), so one run covers both. Prefill takes the engine's
//! default chunk (256): on lavapipe, 2,048-token chunks (what `run` gives a
//! resident wgpu model) took 2.5x as long here.
//!
//! Needs a Vulkan (or Metal) device; lavapipe is enough. Without one the
//! wgpu half fails with instructions, unless SLOTSTREAM_SKIP_GPU_TESTS=1.

mod common;

use common::{case, fixture, greedy_request, rel_l2, wgpu_half, MAX_REL_L2};
use slotstream::generate::Engine;
use slotstream::model::LoadOptions;
use slotstream_backend::Backend;
use slotstream_wgpu::MatmulMode;

const FIXTURE: &str = "qwen3_moe_yarn";
const PROMPT_TOKENS: usize = 4100;
const GENERATED: usize = 16;

/// The fixture's 675-token case, repeated to [`PROMPT_TOKENS`].
fn long_prompt() -> Vec<u32> {
    let text = case(FIXTURE, "beyond").prompt_ids;
    text.iter().copied().cycle().take(PROMPT_TOKENS).collect()
}

/// The next-to-last prompt position's logits and the greedy ids after the prompt.
fn decode(backend: Box<dyn Backend>, prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let name = backend.name();
    let e = Engine::load(&fixture(FIXTURE), backend, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading {FIXTURE} on {name}: {e:#}"));
    assert!(e.context_length() >= PROMPT_TOKENS + GENERATED, "{FIXTURE}'s context is {}", e.context_length());
    // All but the last prompt token (their last logits compared), then the
    // generation feeds the last one and decodes: one prefill per backend.
    let mut state = e.new_state().unwrap();
    let started = std::time::Instant::now();
    let logits = e.prefill(&prompt[..prompt.len() - 1], &mut state).unwrap_or_else(|e| panic!("prefill on {name}: {e:#}"));
    eprintln!("{name}: {} prompt tokens in {:.1}s", prompt.len() - 1, started.elapsed().as_secs_f64());
    let req = greedy_request(prompt, GENERATED);
    let started = std::time::Instant::now();
    let out = e.generate_from(&mut state, &req, |_| std::ops::ControlFlow::Continue(())).unwrap_or_else(|e| panic!("generate on {name}: {e:#}"));
    eprintln!("{name}: {GENERATED} tokens in {:.1}s", started.elapsed().as_secs_f64());
    (logits, out.generated_ids)
}

#[test]
fn a_4k_context_decodes_the_same_on_wgpu_as_on_cpu_exact() {
    let prompt = long_prompt();
    let (cpu_logits, cpu_ids) = decode(Box::new(slotstream_cpu::CpuBackend::exact()), &prompt);
    assert_eq!(cpu_ids.len(), GENERATED);
    let Some(backend) = wgpu_half() else { return };
    let mode = if backend.matmul_mode() == MatmulMode::Exact { "exact" } else { "int8" };
    let (logits, ids) = decode(Box::new(backend), &prompt);
    let err = rel_l2(&logits, &cpu_logits);
    assert!(err <= MAX_REL_L2, "wgpu ({mode}) at {PROMPT_TOKENS} tokens: prompt logits rel L2 {err:.3e} from cpu:exact");
    assert_eq!(ids, cpu_ids, "wgpu ({mode}) at {PROMPT_TOKENS} tokens: greedy ids differ from cpu:exact");
    eprintln!("wgpu ({mode}) at {PROMPT_TOKENS}+{GENERATED} positions: rel L2 {err:.2e}, {GENERATED} greedy ids equal to cpu:exact");
}
