//! What a missed expert costs a real decode: the model itself decodes a few
//! dozen tokens from a pool of the knee's share (within
//! [`ProbeLimits::miss_pool_bytes`] and [`ProbeLimits::miss_decode_seconds`],
//! after a prompt cut to [`ProbeLimits::miss_prefill_seconds`] of reads),
//! and what each step took beyond its compute (at the compute rates just
//! measured, at most its time not waiting on reads) and its layers' read
//! latencies, per miss, is the miss's cost: its read, the part of its upload
//! the reads in flight did not hide, the slot bookkeeping, the read threads'
//! time on the cores ([`ModelCosts::miss_rates_from_decode`]). Both parts
//! are kept, so that the estimate splits a token as the probe did. Its hit
//! rate is a streaming run's.

use std::ops::ControlFlow;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use slotstream_backend::Backend;

use super::ProbeLimits;
use crate::experts::CacheCounters;
use crate::generate::{Engine, GenerateRequest};
use crate::model::{ExpertSlots, LoadOptions, ModelArch};
use crate::plan::costs::DecodeSample;
use crate::plan::rates::MissRates;
use crate::plan::{ModelCosts, Rates};
use crate::tokenizer::ChatMessage;

/// Decode steps the miss probe times at least.
pub const MIN_MISS_DECODE_STEPS: usize = 4;

/// What the miss probe measured: the model decoding from a small pool.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MissProbe {
    pub rates: MissRates,
    /// The backend it decoded on.
    pub backend: String,
    pub slots: usize,
    pub experts_per_layer: usize,
    pub model_experts_per_layer: usize,
    /// Whether the pool had the knee's share (else the memory bound made it
    /// smaller, and its hit rate says little about the plan's pools).
    pub at_knee: bool,
    /// Decode steps timed (the first token comes from the prefill).
    pub steps: usize,
    /// Tokens of the prompt it prefilled (cut to [`ProbeLimits::miss_prefill_seconds`]).
    pub prompt_tokens: usize,
    pub seconds_per_token: f64,
    pub decode: CacheCounters,
    /// Whether its hit rate was kept for the plan (hits.json).
    pub hits_kept: bool,
}

/// Experts per layer the miss probe's pool holds: the knee's share (where
/// auto stops a model that does not fit), at least the floor and one
/// token's experts, fewer than all; then within `pool_bytes`. `None` when
/// no pool smaller than the model can hold one token's experts. The second
/// value says whether the knee's share was kept.
pub fn miss_probe_pool(costs: &ModelCosts, pool_bytes: u64) -> Option<(usize, bool)> {
    let experts = costs.experts_per_layer;
    let layers = costs.moe_layers.max(1);
    let knee = (experts as f64 * crate::plan::KNEE_FRACTION).ceil() as usize;
    let per_layer = knee.max(crate::plan::FLOOR_EXPERTS_PER_LAYER).min(experts.saturating_sub(1));
    if per_layer < costs.top_k.max(1) {
        return None;
    }
    let within = (pool_bytes / (layers as u64 * costs.expert_record_bytes.max(1))) as usize;
    Some((per_layer.min(within.max(costs.top_k.max(1))), per_layer <= within))
}

/// The probe's prompt, as `run` feeds a user's message: in the model's chat
/// template where it has one (the routing of a chat is what the plan is for).
fn probe_prompt(engine: &Engine) -> Result<String> {
    let text = "Tell me a story about a lighthouse keeper and a storm.";
    if !engine.codec.has_chat_template() {
        return Ok(text.to_string());
    }
    let message = ChatMessage { role: "user".into(), content: text.into() };
    engine.codec.apply_chat_template(&[message], true, None)
}

/// What a streaming token of `arch` costs on `backend`: the model decodes
/// from a pool of [`miss_probe_pool`], split into its compute and what each
/// miss cost at `rates` (just measured; [`ModelCosts::miss_rates_from_decode`]).
pub fn measure_misses(arch: &ModelArch, backend: Box<dyn Backend>, rates: &Rates, limits: &ProbeLimits) -> Result<MissProbe> {
    let costs = ModelCosts::of(arch, backend.kv_cache_type())?;
    let Some((per_layer, at_knee)) = miss_probe_pool(&costs, limits.miss_pool_bytes) else {
        bail!("every expert of a layer is one token's: no pool smaller than the model can run it");
    };
    let slots = per_layer * costs.moe_layers;
    let backend_name = backend.name();
    let options = LoadOptions { expert_slots: ExpertSlots::Count(slots), ..Default::default() }.with_env_overrides()?;
    let engine = Engine::load_arch(arch, backend, &options).context("loading the model to time its misses")?;
    let mut prompt_ids = engine.codec.encode(&probe_prompt(&engine)?, false)?;
    // A large model's prefill from a small pool reads nearly every token's experts: keep as many
    // of the prompt's last tokens (the chat template's assistant header) as the bound allows.
    let keep = prompt_tokens_within(&costs, &rates.disk, limits.miss_prefill_seconds);
    if prompt_ids.len() > keep {
        prompt_ids.drain(..prompt_ids.len() - keep);
    }
    let prompt_tokens = prompt_ids.len();
    let max_tokens = limits.miss_decode_tokens.max(MIN_MISS_DECODE_STEPS + 1);
    let request = GenerateRequest { prompt_ids, max_tokens, sampling: Default::default(), stop: Vec::new(), ignore_eos: true };
    let (mut started, mut tokens) = (None, 0usize);
    let out = engine.generate(&request, |_| {
        let start = *started.get_or_insert_with(Instant::now);
        tokens += 1;
        let out_of_time = tokens > MIN_MISS_DECODE_STEPS && start.elapsed().as_secs_f64() >= limits.miss_decode_seconds;
        if out_of_time {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    let stats = out.stats;
    let steps = stats.generated_tokens.saturating_sub(1);
    let decode = stats.decode_experts;
    if steps == 0 || decode.hits + decode.misses == 0 {
        bail!("the model's decode from {slots} slots ran no step to time");
    }
    let sample = DecodeSample {
        seconds_per_token: stats.decode_seconds / steps as f64,
        hit_rate: decode.hit_rate(),
        waited_seconds_per_token: decode.wait_seconds / steps as f64,
    };
    let Some(miss_rates) = costs.miss_rates_from_decode(&sample, rates) else {
        bail!("the model's decode from {slots} slots found every expert it needed: no miss to time");
    };
    Ok(MissProbe {
        rates: miss_rates,
        backend: backend_name,
        slots,
        experts_per_layer: per_layer,
        model_experts_per_layer: costs.experts_per_layer,
        at_knee,
        steps,
        prompt_tokens,
        seconds_per_token: sample.seconds_per_token,
        decode,
        hits_kept: false,
    })
}

/// Prompt tokens (at least one) whose prefill reads about `seconds` at most
/// from a pool that holds none of their experts: each token's top-k experts
/// in every MoE layer (no more than all of a layer's), at `disk`'s rate,
/// plus one read latency per layer. Any prompt when reading every expert
/// once fits.
pub fn prompt_tokens_within(costs: &ModelCosts, disk: &crate::plan::rates::DiskRates, seconds: f64) -> usize {
    let layers = costs.moe_layers as f64;
    let expert_seconds = costs.expert_record_bytes as f64 / (disk.read_gbps.max(1e-3) * 1e9);
    let budget = seconds - layers * disk.read_latency_ms * 1e-3;
    if layers * costs.experts_per_layer as f64 * expert_seconds <= budget {
        return usize::MAX;
    }
    let per_token = layers * costs.top_k as f64 * expert_seconds;
    if per_token <= 0.0 {
        return usize::MAX;
    }
    ((budget / per_token).floor().max(1.0)).min(usize::MAX as f64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::rates::{ComputeRates, DiskRates};
    use slotstream_backend::KvCacheType;

    /// The knee's share, at least the floor, fewer than all; within the
    /// probe's pool bytes (then not the knee's share, and said so).
    #[test]
    fn the_miss_probe_pool_has_the_knee_share_within_its_memory() {
        let fixture = |name: &str| {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
            ModelCosts::of(&ModelArch::read(&dir).expect("config"), KvCacheType::F32).expect("costs")
        };
        let demo = fixture("tools/demo/model");
        assert_eq!(miss_probe_pool(&demo, 1 << 30), Some((14, true)), "13 of 32 is below the floor of 14");
        let tiny = fixture("tests/fixtures/qwen3_moe_mlx4");
        assert_eq!(miss_probe_pool(&tiny, 1 << 30), Some((7, true)), "8 experts: 7, one fewer than all");
        let mut wide = demo.clone();
        (wide.experts_per_layer, wide.top_k, wide.moe_layers, wide.expert_record_bytes) = (64, 8, 8, 2_654_208);
        assert_eq!(miss_probe_pool(&wide, 1 << 30), Some((26, true)), "the synthetic model: 26 of 64");
        assert_eq!(miss_probe_pool(&wide, 8 * 20 * 2_654_208), Some((20, false)), "20 per layer fit in the bytes");
        assert_eq!(miss_probe_pool(&wide, 1), Some((8, false)), "never below one token's experts");
        wide.top_k = 64;
        assert_eq!(miss_probe_pool(&wide, 1 << 30), None, "every expert is one token's");
    }

    /// The fixture (2 MoE layers x 8 experts, top-2) decoding from 7 per
    /// layer: every step looks up 4 experts, and a miss costs something.
    #[test]
    fn the_miss_probe_times_a_real_decode_within_its_bounds() {
        use crate::plan::rates::RateSource;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_mlx4");
        let arch = ModelArch::read(&dir).expect("fixture config");
        let rates = Rates::unmeasured(
            ComputeRates { weight_gbps: 1000.0, layer_overhead_ms: 0.0 },
            DiskRates { read_gbps: 1.0, read_latency_ms: 0.0 },
            RateSource::Defaults,
        );
        let limits = ProbeLimits { miss_decode_tokens: 12, miss_decode_seconds: 60.0, ..Default::default() };
        let probe = measure_misses(&arch, Box::new(slotstream_cpu::CpuBackend::new()), &rates, &limits).expect("probing");
        assert_eq!((probe.slots, probe.experts_per_layer, probe.at_knee), (14, 7, true), "{probe:?}");
        assert_eq!(probe.steps, 11, "12 tokens, the first from the prefill");
        assert_eq!(probe.decode.hits + probe.decode.misses, 11 * 2 * 2, "{probe:?}");
        assert!(probe.decode.misses > 0 && probe.rates.miss_ms > 0.0 && probe.rates.token_ms > 0.0, "{probe:?}");
        assert!(!probe.hits_kept, "keeping the hit rate is measure_into's");
        let whole = probe.prompt_tokens;
        assert!(whole > 1, "the fixture's small experts fit the prefill bound: {probe:?}");
        let quick = ProbeLimits { miss_decode_seconds: 0.0, miss_prefill_seconds: 0.0, ..limits };
        let probe = measure_misses(&arch, Box::new(slotstream_cpu::CpuBackend::new()), &rates, &quick).expect("probing");
        assert_eq!(probe.steps, MIN_MISS_DECODE_STEPS, "out of time: the fewest steps");
        assert_eq!(probe.prompt_tokens, 1, "no prefill time: the prompt's last token alone");
    }

    /// The flagship's shape (48 MoE layers, top-10 of 512 2.76 MB experts)
    /// at 1.3 GB/s reads ~1 s per prompt token from an empty pool: a 3 s
    /// bound keeps two of them. The demo, and the 1.5 GB synthetic model of
    /// tools/bench_plan.sh (all its experts in 2.3 s at 0.6 GB/s), keep any
    /// prompt.
    #[test]
    fn the_miss_probe_prefill_is_cut_to_its_time() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/demo/model");
        let demo = ModelCosts::of(&ModelArch::read(&dir).expect("config"), KvCacheType::F32).expect("costs");
        let disk = DiskRates { read_gbps: 1.3, read_latency_ms: 0.4 };
        assert_eq!(prompt_tokens_within(&demo, &disk, 3.0), usize::MAX, "61 KB experts");
        let mut synthetic = demo.clone();
        (synthetic.moe_layers, synthetic.experts_per_layer, synthetic.top_k, synthetic.expert_record_bytes) = (8, 64, 8, 2_654_208);
        let slow = DiskRates { read_gbps: 0.6, read_latency_ms: 0.3 };
        assert_eq!(prompt_tokens_within(&synthetic, &slow, 3.0), usize::MAX, "every expert once in 2.3 s");
        assert_eq!(prompt_tokens_within(&synthetic, &slow, 1.0), 3, "0.28 s per token within 1 s");
        let mut flagship = demo.clone();
        (flagship.moe_layers, flagship.experts_per_layer, flagship.top_k, flagship.expert_record_bytes) = (48, 512, 10, 2_764_800);
        // 48 x 10 x 2.76 MB / 1.3 GB/s = 1.02 s per token; 3 s - 48 x 0.4 ms leaves 2.98 s.
        assert_eq!(prompt_tokens_within(&flagship, &disk, 3.0), 2);
        assert_eq!(prompt_tokens_within(&flagship, &disk, 0.0), 1, "at least one token");
        assert_eq!(prompt_tokens_within(&flagship, &DiskRates { read_gbps: 0.0, read_latency_ms: 0.0 }, 3.0), 1, "no rate: one token");
    }
}
