//! The flagship slice's tiny version: `tools/synth.py --family qwen4_exp --tiny` writes the
//! published checkpoint's tensor names, dtypes, quantization overrides and layer pattern
//! (three DeltaNet layers, then QSA; PLE and the n-gram table at layer 1) at toy sizes, with
//! 64 experts and top-10 like the flagship's 512. The large slices the benchmarks stream come
//! from the same code (tools/bench_flagship.sh); this checks what CI can afford: the loader
//! uses every tensor, and the greedy tokens depend neither on the pool's size on `cpu:exact`
//! (cache size changes speed, never output) nor on the backend (lavapipe).
//!
//! The fixture is rebuilt byte for byte by tools/verify.sh:
//!   python3 tools/synth.py --family qwen4_exp --tiny --layers 4 --jobs 2 --router-skew 0.5 \
//!       --shard-gb 0.001 --out tests/fixtures/qwen4_exp_slice_tiny

mod common;

use common::fixture;
use slotstream::generate::{Engine, GenerateOutput, GenerateRequest};
use slotstream::model::qwen4_exp::hyper::HyperResidual;
use slotstream::model::{ExpertSlots, LoadOptions, Mixer};
use slotstream::sampling::SamplingParams;

const NAME: &str = "qwen4_exp_slice_tiny";
/// 4 MoE layers x 64 experts.
const ALL_EXPERTS: usize = 256;
/// Past the indexer's budget (16 keys): the QSA layer's sparse path runs in prefill and decode.
const PROMPT: &str = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer \
                      the slings and arrows of outrageous fortune, or to take arms against a sea of troubles";
const TOKENS: usize = 24;

fn load(backend: Box<dyn slotstream_backend::Backend>, slots: ExpertSlots) -> Engine {
    let name = backend.name();
    let opts = LoadOptions { expert_slots: slots, ..Default::default() };
    Engine::load(&fixture(NAME), backend, &opts).unwrap_or_else(|e| panic!("loading {NAME} on {name}: {e:#}"))
}

fn greedy(e: &Engine) -> GenerateOutput {
    let prompt_ids = e.codec.encode_plain(PROMPT).unwrap();
    assert!(prompt_ids.len() > 20, "the prompt is {} tokens: too short for the sparse QSA path", prompt_ids.len());
    let req = GenerateRequest { prompt_ids, max_tokens: TOKENS, sampling: SamplingParams::default(), stop: vec![], ignore_eos: true };
    e.generate(&req, |_| std::ops::ControlFlow::Continue(())).unwrap()
}

#[test]
fn the_loader_uses_every_tensor_of_the_slice() {
    let e = load(Box::new(slotstream_cpu::CpuBackend::exact()), ExpertSlots::Count(ALL_EXPERTS));
    let m = &e.model;
    assert_eq!(m.unused_tensors, Vec::<String>::new(), "checkpoint tensors the loader never used");
    assert_eq!(m.layers.len(), 4);
    assert_eq!(m.streams, 4, "four hyper-connection streams");
    let attention: Vec<usize> =
        m.layers.iter().enumerate().filter(|(_, l)| matches!(l.mixer, Mixer::Attention(_))).map(|(i, _)| i).collect();
    assert_eq!(attention, vec![3], "every 4th layer is full attention, as in the flagship");
    let ple: Vec<usize> = m
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.residual.as_any().downcast_ref::<HyperResidual>().is_some_and(|h| h.ple.is_some()))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(ple, vec![1], "PLE sits at layer index 1");
    let experts = m.experts.lock().unwrap();
    // gate, up, down: 64 x 64 at 4 bits (2,048 bytes each) plus one bf16 scale and bias per 64.
    assert_eq!(experts.store().record_bytes, 3 * (2048 + 2 * 2 * 64));
}

#[test]
fn greedy_tokens_do_not_depend_on_the_pool_size() {
    let cpu = |slots| load(Box::new(slotstream_cpu::CpuBackend::exact()), slots);
    let (small, all) = (cpu(ExpertSlots::Count(10)), cpu(ExpertSlots::Count(ALL_EXPERTS)));
    let (a, b) = (greedy(&small), greedy(&all));
    assert_eq!(a.generated_ids, b.generated_ids, "10 slots vs every expert resident");
    let (s, r) = (small.expert_stats().unwrap(), all.expert_stats().unwrap());
    assert_eq!(s.slots, 10);
    assert!(s.total.misses > r.total.misses, "the small pool streamed: {} vs {} misses", s.total.misses, r.total.misses);
    let distinct: std::collections::HashSet<_> = a.generated_ids.iter().collect();
    assert!(distinct.len() > 4, "greedy decoding of the slice is not stuck on a few tokens: {:?}", a.generated_ids);
}

#[test]
fn lavapipe_decodes_the_cpu_tokens() {
    if std::env::var("SLOTSTREAM_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("SLOTSTREAM_SKIP_GPU_TESTS=1: skipped");
        return;
    }
    let gpu = slotstream_wgpu::WgpuBackend::new(&slotstream_wgpu::AdapterChoice::allow_software()).unwrap_or_else(|e| {
        panic!(
            "no GPU adapter: {e}\nInstall a Vulkan driver (apt-get install -y mesa-vulkan-drivers; \
             VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json XDG_RUNTIME_DIR=/tmp) \
             or set SLOTSTREAM_SKIP_GPU_TESTS=1"
        )
    });
    let want = greedy(&load(Box::new(slotstream_cpu::CpuBackend::exact()), ExpertSlots::Count(ALL_EXPERTS)));
    let got = greedy(&load(Box::new(gpu), ExpertSlots::Count(10)));
    assert_eq!(got.generated_ids, want.generated_ids, "wgpu (10 slots) vs cpu:exact (every expert resident)");
}
