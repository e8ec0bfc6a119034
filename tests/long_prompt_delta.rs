//! Prompts past a thousand tokens on the Gated DeltaNet fixtures: qwen3_next
//! and qwen3_5_moe fed 1,100 tokens (17 chunks of the wgpu backend's chunked
//! gated delta rule and a partial one, in one prefill call) decode the same
//! greedy ids on the wgpu backend as on `cpu:exact`, with the prompt's
//! logits within the oracle tolerance. The decode steps after the prompt
//! take the recurrent kernel from the state the chunked form left.
//!
//! Needs a Vulkan (or Metal) device; lavapipe is enough. Without one the
//! test fails with instructions, unless SLOTSTREAM_SKIP_GPU_TESTS=1.

mod common;

use common::{case, fixture, greedy_request, rel_l2, wgpu_half, MAX_REL_L2};
use slotstream::generate::Engine;
use slotstream::model::LoadOptions;
use slotstream_backend::Backend;

const PROMPT_TOKENS: usize = 1100;
const GENERATED: usize = 8;

/// The fixture's long case, repeated to [`PROMPT_TOKENS`].
fn long_prompt(name: &str) -> Vec<u32> {
    case(name, "long").prompt_ids.iter().copied().cycle().take(PROMPT_TOKENS).collect()
}

/// The next-to-last prompt position's logits and the greedy ids after the prompt.
fn decode(name: &str, backend: Box<dyn Backend>, prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let on = backend.name();
    let e = Engine::load(&fixture(name), backend, &LoadOptions::default()).unwrap_or_else(|e| panic!("loading {name} on {on}: {e:#}"));
    let mut state = e.new_state().unwrap();
    let logits = e.prefill(&prompt[..prompt.len() - 1], &mut state).unwrap_or_else(|e| panic!("prefill of {name} on {on}: {e:#}"));
    let req = greedy_request(prompt, GENERATED);
    let out = e.generate_from(&mut state, &req, |_| std::ops::ControlFlow::Continue(())).unwrap_or_else(|e| panic!("generate of {name} on {on}: {e:#}"));
    (logits, out.generated_ids)
}

fn check(name: &str) {
    let prompt = long_prompt(name);
    let (cpu_logits, cpu_ids) = decode(name, Box::new(slotstream_cpu::CpuBackend::exact()), &prompt);
    assert_eq!(cpu_ids.len(), GENERATED);
    let Some(backend) = wgpu_half() else { return };
    let (logits, ids) = decode(name, Box::new(backend), &prompt);
    let err = rel_l2(&logits, &cpu_logits);
    assert!(err <= MAX_REL_L2, "{name} at {PROMPT_TOKENS} tokens: prompt logits rel L2 {err:.3e} from cpu:exact");
    assert_eq!(ids, cpu_ids, "{name} at {PROMPT_TOKENS} tokens: greedy ids differ from cpu:exact");
}

#[test]
fn qwen3_next_long_prompt_on_wgpu_as_on_cpu_exact() {
    check("qwen3_next_mlx4");
}

#[test]
fn qwen3_5_moe_long_prompt_on_wgpu_as_on_cpu_exact() {
    check("qwen3_5_moe_mlx4");
}
