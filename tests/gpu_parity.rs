//! The wgpu backend runs the fixture models exactly like the CPU backend:
//! greedy tokens identical to the oracle's (which the CPU backend matches, see
//! parity.rs), last-position logits within the same relative L2 of 1e-4, also
//! with the smallest expert pool (streaming through every slot), and a decode
//! step costs one submission per MoE layer plus one for the logits.
//!
//! Needs a Vulkan (or Metal) device; lavapipe is enough. Without one these
//! tests fail with instructions, unless SLOTSTREAM_SKIP_GPU_TESTS=1.

mod common;

use std::sync::atomic::Ordering;

use common::{check_against_oracle, fixture, golden, run_json_matches_oracle};
use slotstream::generate::Engine;
use slotstream::model::{ExpertSlots, FeedForward, LoadOptions, Logits, SequenceState};
use slotstream::sampling::argmax;
use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};

fn skip() -> bool {
    let skip = std::env::var("SLOTSTREAM_SKIP_GPU_TESTS").is_ok_and(|v| v == "1");
    if skip {
        eprintln!("SLOTSTREAM_SKIP_GPU_TESTS=1: skipping a test that needs a Vulkan or Metal device");
    }
    skip
}

fn gpu_engine(name: &str, slots: ExpertSlots) -> Engine {
    gpu_engine_with(name, slots, WgpuOptions::from_env())
}

fn gpu_engine_with(name: &str, slots: ExpertSlots, options: WgpuOptions) -> Engine {
    let backend = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).unwrap_or_else(|e| {
        panic!(
            "no GPU adapter: {e}\nInstall a Vulkan driver (apt-get install -y mesa-vulkan-drivers; \
             VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json XDG_RUNTIME_DIR=/tmp) \
             or set SLOTSTREAM_SKIP_GPU_TESTS=1"
        )
    });
    Engine::load(&fixture(name), Box::new(backend), &LoadOptions { expert_slots: slots, ..Default::default() })
        .unwrap_or_else(|e| panic!("loading fixture {name} on the wgpu backend: {e:#}"))
}

fn check_fixture(name: &str, slots: ExpertSlots) {
    if skip() {
        return;
    }
    check_against_oracle(&gpu_engine(name, slots), name);
}

#[test]
fn qwen3_moe_hf_bf16_on_wgpu() {
    check_fixture("qwen3_moe_hf", ExpertSlots::All);
}

#[test]
fn qwen3_moe_mlx_4bit_on_wgpu() {
    check_fixture("qwen3_moe_mlx4", ExpertSlots::All);
}

#[test]
fn qwen3_next_hf_bf16_on_wgpu() {
    check_fixture("qwen3_next_hf", ExpertSlots::All);
}

#[test]
fn qwen3_next_mlx_4bit_on_wgpu() {
    check_fixture("qwen3_next_mlx4", ExpertSlots::All);
}

/// YaRN-scaled RoPE (the rotation table from the host, as on the CPU).
#[test]
fn qwen3_moe_yarn_on_wgpu() {
    check_fixture("qwen3_moe_yarn", ExpertSlots::All);
}

/// Qwen3.5: transformers' fused experts streamed through the smallest pool,
/// mlx-lm's 4-bit all resident.
#[test]
fn qwen3_5_moe_on_wgpu() {
    check_fixture("qwen3_5_moe_hf", ExpertSlots::Count(2));
    check_fixture("qwen3_5_moe_mlx4", ExpertSlots::All);
}

/// The smallest pool (one token's experts) streams every expert through the
/// slots, in several batches per prefill layer; output must not change.
#[test]
fn minimum_pool_streams_with_identical_tokens() {
    check_fixture("qwen3_next_mlx4", ExpertSlots::Count(2));
    check_fixture("qwen3_moe_hf", ExpertSlots::Count(2));
}

/// The same through staged pool writes, as on a discrete GPU (unified
/// memory maps the pool instead): each streamed expert goes out in a
/// submission of its own as it is written, while the batch before may still
/// run; output must not change.
#[test]
fn staged_pool_writes_stream_with_identical_tokens() {
    if skip() {
        return;
    }
    let options = WgpuOptions { map_primary: false, ..WgpuOptions::from_env() };
    check_against_oracle(&gpu_engine_with("qwen3_moe_hf", ExpertSlots::Count(2), options), "qwen3_moe_hf");
}

/// Every dispatch a periodic submission of its own, ended and submitted on
/// the submission thread while the next ones are recorded, with pool writes
/// (the smallest pool) and downloads between them: the queue keeps the order,
/// so the tokens are the oracle's.
#[test]
fn every_dispatch_submitted_from_the_submission_thread_keeps_the_order() {
    if skip() {
        return;
    }
    for (name, slots) in [("qwen3_next_mlx4", ExpertSlots::Count(2)), ("qwen3_moe_mlx4", ExpertSlots::All)] {
        let backend = WgpuBackend::new(&AdapterChoice::allow_software()).expect("a GPU adapter (see gpu_engine)");
        assert!(backend.options().submit_thread, "submit_thread is off: this test checks it");
        backend.set_flush_every(1);
        let engine = Engine::load(&fixture(name), Box::new(backend), &LoadOptions { expert_slots: slots, ..Default::default() })
            .unwrap_or_else(|e| panic!("loading fixture {name} on the wgpu backend: {e:#}"));
        check_against_oracle(&engine, name);
    }
}

/// With every expert in the pool, routing and the slot table stay on the
/// GPU: a decode step is recorded and submitted once (for the logits). A
/// streaming pool reads back each MoE layer's routed ids instead of its
/// router logits.
/// Fixture `name` on `backend` with a pool of `slots` (read in full at load
/// when `preload`), its "long" case prefilled: the engine, the sequence,
/// the greedy next token and the number of MoE layers.
fn prefilled(name: &str, backend: WgpuBackend, slots: ExpertSlots, preload: bool) -> (Engine, SequenceState, u32, usize) {
    let opts = LoadOptions { expert_slots: slots, preload_experts: preload, ..LoadOptions::default() };
    let e = Engine::load(&fixture(name), Box::new(backend), &opts).expect("load");
    let case = golden(name).cases.into_iter().find(|c| c.name == "long").expect("long case");
    let mut state = e.new_state().unwrap();
    let next = argmax(&e.prefill(&case.prompt_ids, &mut state).unwrap());
    let moe_layers = e.model.layers.iter().filter(|l| matches!(l.ffn, FeedForward::Moe(_))).count();
    (e, state, next, moe_layers)
}

#[test]
fn resident_decode_submits_once_per_token() {
    if skip() {
        return;
    }
    for name in ["qwen3_next_mlx4", "qwen3_moe_hf"] {
        for (slots, preload) in [(ExpertSlots::All, true), (ExpertSlots::Count(2), false)] {
            let backend = WgpuBackend::new(&AdapterChoice::allow_software()).expect("GPU adapter");
            let submissions = backend.submission_counter();
            let (e, mut state, mut next, moe_layers) = prefilled(name, backend, slots, preload);
            for _ in 0..3 {
                let before = submissions.load(Ordering::Relaxed);
                let t = e.model.forward(e.backend.as_ref(), &[next], &mut state, Logits::Last).unwrap();
                next = argmax(&e.backend.download(&t).unwrap());
                let per_token = (submissions.load(Ordering::Relaxed) - before) as usize;
                if preload {
                    assert_eq!(per_token, 1, "{name}: {per_token} submissions for one decoded token");
                } else {
                    assert!(per_token > moe_layers, "{name}: {per_token} submissions with a streaming pool");
                }
            }
        }
    }
}

/// A streaming decode reads each MoE layer's routed ids back together with
/// its guess of the next layer's experts: one wait per MoE layer, plus one
/// for the logits.
#[test]
fn streaming_decode_reads_back_once_per_moe_layer() {
    if skip() {
        return;
    }
    for name in ["qwen3_next_mlx4", "qwen3_moe_hf"] {
        let backend = WgpuBackend::new(&AdapterChoice::allow_software()).expect("GPU adapter");
        let downloads = backend.download_counter();
        let (e, mut state, mut next, moe_layers) = prefilled(name, backend, ExpertSlots::Count(2), false);
        assert!(moe_layers > 1, "{name}: the test needs a guess of a next MoE layer");
        for _ in 0..3 {
            let before = downloads.load(Ordering::Relaxed);
            let t = e.model.forward(e.backend.as_ref(), &[next], &mut state, Logits::Last).unwrap();
            next = argmax(&e.backend.download(&t).unwrap());
            let per_token = (downloads.load(Ordering::Relaxed) - before) as usize;
            assert_eq!(per_token, moe_layers + 1, "{name}: {per_token} read-backs for one token of {moe_layers} MoE layers");
        }
        // The guesses were read (the combined read ran, not one read per layer without them).
        let read_ahead = e.expert_stats().unwrap().total.read_ahead;
        assert!(read_ahead > 0, "{name}: no guessed expert was read ahead");
    }
}

/// A pool that holds every expert holds each layer's shared expert too (the
/// fixture's is shaped as its routed experts), and a decoded token runs it in
/// the routed experts' kernels: no products of its own. A streaming pool runs
/// it after them, two products per MoE layer; the tokens are the same.
#[test]
fn resident_decode_runs_the_shared_expert_with_the_routed_experts() {
    if skip() {
        return;
    }
    let name = "qwen3_next_mlx4";
    let mut tokens = Vec::new();
    for (slots, preload) in [(ExpertSlots::All, true), (ExpertSlots::Count(4), false)] {
        let backend = WgpuBackend::new(&AdapterChoice::allow_software()).expect("GPU adapter");
        let profile = backend.clone();
        let (e, mut state, mut next, moe_layers) = prefilled(name, backend, slots, preload);
        profile.set_profiling(true).expect("timestamp queries");
        let t = e.model.forward(e.backend.as_ref(), &[next], &mut state, Logits::Last).unwrap();
        next = argmax(&e.backend.download(&t).unwrap());
        let kernels = profile.kernel_profile();
        profile.set_profiling(false).expect("profiling off");
        let own = kernels.iter().find(|(n, _)| n == "matvec_epilogue").map_or(0, |(_, t)| t.dispatches);
        let want = if preload { 0 } else { 2 * moe_layers as u64 };
        assert_eq!(own, want, "{name}, preloaded {preload}: the shared expert's own products: {kernels:?}");
        if !preload {
            // Grown to every expert, the pool holds the shared experts again
            // (in slots of their own: the stats count them apart).
            let all = moe_layers * e.model.arch.text.num_experts;
            let stats = e.resize_expert_pool(all).expect("resize to every expert");
            assert_eq!(stats.slots, all, "{name}");
            let per_slot = stats.pool_bytes / (all + moe_layers);
            assert_eq!(stats.shared_bytes, per_slot * moe_layers, "{name}: one shared expert per MoE layer: {stats:?}");
            let t = e.model.forward(e.backend.as_ref(), &[next], &mut state, Logits::Last).unwrap();
            argmax(&e.backend.download(&t).unwrap());
        }
        tokens.push(next);
    }
    assert_eq!(tokens[0], tokens[1], "{name}: the resident and the streaming pool decode different tokens");
}

/// `slotstream run --backend wgpu:software --json` gives the oracle's (and so
/// the CPU backend's) greedy ids.
#[test]
fn run_with_the_wgpu_backend_returns_the_oracle_greedy_ids() {
    if skip() {
        return;
    }
    for name in ["qwen3_next_mlx4", "qwen3_moe_hf"] {
        let (_, v) = run_json_matches_oracle(name, "wgpu:software");
        assert!(v["backend"].as_str().unwrap_or("").starts_with("wgpu"), "{}", v["backend"]);
    }
}

/// Greedy decoding one token ahead (the pass of token k recorded before token
/// k is read back) gives the tokens decoding without it gives, on an
/// attention model and a recurrent one; a token that ends the output (an
/// end-of-sequence) was fed already, is reported so (`fed_end`), and the state
/// goes on from it as a state fed the same tokens from the start.
#[test]
fn decoding_one_token_ahead_keeps_the_tokens_and_reports_a_fed_end_of_sequence() {
    if skip() {
        return;
    }
    use slotstream::generate::{FinishReason, GenerateRequest};
    use slotstream::sampling::SamplingParams;
    for name in ["qwen3_moe_mlx4", "qwen3_next_mlx4"] {
        let case = golden(name).cases.into_iter().find(|c| c.name == "long").expect("long case");
        let mut e = gpu_engine(name, ExpertSlots::All);
        assert!(e.decode_ahead, "SLOTSTREAM_DECODE_AHEAD=0 turns off what this test checks");
        assert!(e.model.feeds_chosen_tokens(&e.new_state().unwrap()), "{name}: a model whose tokens are not fed ahead");
        let req = |ignore_eos: bool| GenerateRequest {
            prompt_ids: case.prompt_ids.clone(),
            max_tokens: case.greedy_ids.len(),
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos,
        };
        let generate = |e: &Engine, state: &mut slotstream::model::SequenceState, r: &GenerateRequest| {
            e.generate_from(state, r, |_| std::ops::ControlFlow::Continue(())).expect("generate")
        };
        // Ended by length: the state holds all but the last token, as without decoding ahead.
        for ahead in [true, false] {
            e.decode_ahead = ahead;
            let mut state = e.new_state().unwrap();
            let out = generate(&e, &mut state, &req(true));
            assert_eq!(out.generated_ids, case.greedy_ids, "{name}, decoding ahead: {ahead}");
            assert_eq!(state.position, case.prompt_ids.len() + case.greedy_ids.len() - 1, "{name}, decoding ahead: {ahead}");
            assert_eq!(out.fed_end, None);
        }
        // The third greedy token made an end-of-sequence.
        e.decode_ahead = true;
        let eos = case.greedy_ids[2];
        let first = case.greedy_ids.iter().position(|&t| t == eos).expect("present");
        e.codec.eos_ids = vec![eos];
        let mut state = e.new_state().unwrap();
        let out = generate(&e, &mut state, &req(false));
        assert_eq!(out.finish_reason, FinishReason::Stop);
        assert_eq!(out.generated_ids, case.greedy_ids[..first]);
        assert_eq!(out.fed_end, Some(eos), "{name}: the end-of-sequence token was fed ahead");
        let mut held = case.prompt_ids.clone();
        held.extend(&case.greedy_ids[..=first]);
        assert_eq!(out.state_ids(state.position), held, "{name}: the state holds the prompt, the output and its end");
        // Going on from that state matches a fresh state fed the same tokens.
        let mut longer = held.clone();
        longer.push(case.prompt_ids[0]);
        let next = GenerateRequest { prompt_ids: longer, max_tokens: 4, ..req(true) };
        let went_on = generate(&e, &mut state, &next);
        let fresh = generate(&e, &mut e.new_state().unwrap(), &next);
        assert_eq!(went_on.generated_ids, fresh.generated_ids, "{name}");
    }
}

/// A plan's prefill chunk past the wgpu backend's own bound runs in chunks of
/// that bound (`Backend::prefill_rows_max`); the CPU backend takes it whole.
#[test]
fn prefill_chunks_stay_within_the_backend_bound() {
    if skip() {
        return;
    }
    let mut e = gpu_engine("qwen3_moe_mlx4", ExpertSlots::All);
    e.prefill_chunk = 100_000;
    assert_eq!(e.chunk_tokens(), slotstream_wgpu::PREFILL_ROWS_MAX);
    e.prefill_chunk = 300;
    assert_eq!(e.chunk_tokens(), 300);
    let mut cpu = Engine::load(&fixture("qwen3_moe_mlx4"), Box::new(slotstream_cpu::CpuBackend::exact()), &LoadOptions::default()).expect("cpu engine");
    cpu.prefill_chunk = 100_000;
    assert_eq!(cpu.chunk_tokens(), 100_000);
}
