//! What a model costs in memory, from its own byte sizes.

use std::path::Path;

use anyhow::Result;
use serde::Serialize;
use slotstream_backend::{DType, KvCacheType, MatrixFormat};

use super::hits::HitRateCurve;
use super::rates::{DiskRates, MissRates};
use super::Rates;
use crate::checkpoint::Checkpoint;
use crate::model::ModelArch;

/// One token's decode time in parts, seconds ([`ModelCosts::decode_time`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeTime {
    /// The token's weights and layers: at the compute rates, or, for a pool
    /// smaller than the model whose decode was timed here, as that
    /// measurement split it ([`ModelCosts::miss_rates_from_decode`]).
    pub compute: f64,
    pub latency: f64,
    pub misses: f64,
}

impl DecodeTime {
    pub fn total(&self) -> f64 {
        self.compute + self.latency + self.misses
    }
}

/// A decode from a pool smaller than the model, as timed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeSample {
    pub seconds_per_token: f64,
    pub hit_rate: f64,
    /// Seconds per token the decode stood waiting on expert reads (and the
    /// uploads done as they landed).
    pub waited_seconds_per_token: f64,
}

/// Per-model memory costs the planner works from.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ModelCosts {
    pub name: String,
    /// Everything resident: embeddings, attention/DeltaNet weights, routers,
    /// shared experts, norms, head.
    pub resident_bytes: u64,
    /// One routed expert's record (gate, up and down with scales and biases).
    pub expert_record_bytes: u64,
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    pub top_k: usize,
    pub hidden_size: usize,
    /// Rows of each routed expert's gate and up projections.
    pub moe_intermediate: usize,
    /// KV cache bytes per token of context (keys and values as the backend
    /// stores them, plus QSA indexer keys).
    pub kv_bytes_per_token: u64,
    /// The longest context the model takes (its config's, YaRN included).
    pub context_length: Option<usize>,
    /// Recurrent and convolution state, independent of context length.
    pub state_bytes: u64,
    /// Other resident caches the model needs (the n-gram row cache).
    pub extra_bytes: u64,
    /// The MTP head's weights (`mtp.safetensors`), 0 without one.
    pub mtp_bytes: u64,
    /// What a pool that holds every expert adds besides their records: the
    /// copies of the shared experts that a backend running them from the pool
    /// keeps there (`Backend::pools_shared_experts`; set by the caller who
    /// knows the backend, [`ModelCosts::shared_expert_bytes`]); else 0.
    pub full_pool_extra_bytes: u64,
    /// How routed experts are stored (`4-bit g64`): the format the backend's
    /// measured weight rate is for.
    #[serde(serialize_with = "serialize_format")]
    pub expert_format: MatrixFormat,
    /// How often a pool smaller than the model finds its experts: fitted to
    /// this model's runs where it has streamed here, else assumed.
    pub hit_curve: HitRateCurve,
}

fn serialize_format<S: serde::Serializer>(format: &MatrixFormat, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&super::rates::format_label(format))
}

/// The format of the first MoE layer's gate projection, in either layout
/// (stacked `switch_mlp`, one tensor per expert, or gate and up fused).
fn expert_format(ck: &Checkpoint, experts: usize, intermediate: usize, hidden: usize) -> Option<MatrixFormat> {
    let fused = ck.names().filter(|n| n.ends_with(".mlp.experts.gate_up_proj")).min();
    if let Some(name) = fused {
        return ck.dense_layout(name, &[experts, 2 * intermediate, hidden]).ok().map(|m| m.format);
    }
    let name = ck.names().filter(|n| ModelArch::is_routed_expert_tensor(n) && n.ends_with(".gate_proj.weight")).min()?;
    let module = name.strip_suffix(".weight")?;
    let lead: &[usize] = if name.contains(".switch_mlp.") { &[experts] } else { &[] };
    ck.matrix_layout(module, lead, intermediate, hidden).ok().map(|m| m.format)
}

impl ModelCosts {
    pub fn total_experts(&self) -> usize {
        self.moe_layers * self.experts_per_layer
    }

    /// Weight bytes one decoded token reads: the resident trunk and its
    /// routed experts.
    pub fn active_bytes_per_token(&self) -> u64 {
        self.resident_bytes + (self.top_k * self.moe_layers) as u64 * self.expert_record_bytes
    }

    pub fn routed_expert_bytes(&self) -> u64 {
        self.total_experts() as u64 * self.expert_record_bytes
    }

    /// The smallest pool the engine can run with: one token's experts.
    pub fn engine_min_slots(&self) -> usize {
        crate::experts::ExpertCache::min_slots(self.top_k)
    }

    /// Runtime memory besides weights, caches and the pool: a fixed base, the
    /// expert reads in flight ([`ModelCosts::reads_in_flight_bytes`]) and the
    /// activations of one prefill chunk of `prefill_chunk` tokens.
    pub fn runtime_bytes(&self, prefill_chunk: usize) -> u64 {
        super::RUNTIME_BASE_BYTES + self.reads_in_flight_bytes() + prefill_chunk as u64 * self.activation_bytes_per_token()
    }

    /// Expert records read but not yet written into their slots: at most a
    /// prompt's staged group and the next one read ahead (a decode's misses
    /// and guesses are fewer). The buffers kept for reuse are in the base.
    pub fn reads_in_flight_bytes(&self) -> u64 {
        self.staging_bytes()
    }

    /// Activations per token of a prefill chunk: about 24 hidden-sized f32
    /// rows through a layer, a MoE call's per-expert outputs (the gathered
    /// rows, each expert's own, and the outputs the call keeps: three
    /// `top_k x hidden` rows) and its experts' intermediate rows (gate, up
    /// and their product: three `top_k x moe_intermediate`).
    pub fn activation_bytes_per_token(&self) -> u64 {
        let hidden_rows = (24 + 3 * self.top_k as u64) * self.hidden_size as u64;
        let expert_rows = 3 * self.top_k as u64 * self.moe_intermediate as u64;
        (hidden_rows + expert_rows) * 4
    }

    /// The staging pool a streaming pool's long calls run their other
    /// misses from (two groups of [`crate::experts::STAGING_GROUP`]).
    pub fn staging_bytes(&self) -> u64 {
        2 * crate::experts::STAGING_GROUP.min(self.experts_per_layer) as u64 * self.expert_record_bytes
    }

    /// Memory that does not depend on the pool size.
    pub fn fixed_bytes(&self, context_tokens: usize) -> u64 {
        self.resident_bytes + self.extra_bytes + self.state_bytes + self.kv_bytes_per_token * context_tokens as u64
    }

    /// A decode-speed estimate for a pool of `slots`: from the model's timed
    /// runs on this machine where they apply, else from the machine's rates
    /// at the hit rate [`ModelCosts::hit_rate`] gives it
    /// ([`ModelCosts::estimate_decode`]). The plan and `doctor` keep the
    /// estimate's source too; the tests need only the speed.
    #[cfg(test)]
    pub fn estimate_decode_tokens_per_second(&self, slots: usize, rates: &Rates) -> f64 {
        self.estimate_decode(slots, rates).tokens_per_second()
    }

    /// One token's decode time at `hit_rate`. Resident (no misses): its
    /// active weights (trunk and routed experts) at the backend's weight rate
    /// and a fixed cost per layer. Streaming: besides, one read latency per
    /// layer that misses any expert (a layer's misses are read together) and
    /// what each missed expert costs; where the model's own decode from a
    /// small pool was timed here, the token's compute and each miss are
    /// priced as that measurement split the decode
    /// ([`ModelCosts::miss_rates_from_decode`]), so that a compute rate
    /// measured later (another model's `--measure`) does not shift its
    /// estimate; else a miss costs its read at the disk's rate.
    pub fn decode_time(&self, hit_rate: f64, rates: &Rates) -> DecodeTime {
        let misses = self.misses_per_token(hit_rate);
        let (compute, miss_seconds) = match &rates.miss {
            Some(m) if misses > 0.0 => (m.rates.token_ms / 1e3, m.rates.miss_ms / 1e3),
            _ => (self.resident_compute_seconds(rates), self.expert_record_bytes as f64 / (rates.disk.read_gbps * 1e9)),
        };
        DecodeTime { compute, latency: self.latency_seconds(hit_rate, &rates.disk), misses: misses * miss_seconds }
    }

    /// A token's weights at the backend's weight rate and its layers' fixed cost.
    fn resident_compute_seconds(&self, rates: &Rates) -> f64 {
        let active = self.top_k as f64 * self.moe_layers as f64 * self.expert_record_bytes as f64;
        let weights = (self.resident_bytes as f64 + active) / (rates.compute.weight_gbps * 1e9);
        weights + self.moe_layers as f64 * rates.compute.layer_overhead_ms / 1e3
    }

    /// One read latency per layer that misses any of its top-k experts.
    fn latency_seconds(&self, hit_rate: f64, disk: &DiskRates) -> f64 {
        let layers_missing = self.moe_layers as f64 * (1.0 - hit_rate.powi(self.top_k.min(64) as i32));
        layers_missing * disk.read_latency_ms / 1e3
    }

    /// Experts one decoded token reads from disk at `hit_rate`.
    pub fn misses_per_token(&self, hit_rate: f64) -> f64 {
        (1.0 - hit_rate) * (self.top_k * self.moe_layers) as f64
    }

    /// How a timed decode from a small pool splits a streaming token at
    /// `rates` (measured with it): its compute is the resident compute at
    /// the compute rates, but no more than the decode spent not waiting on
    /// reads (the rates were measured apart, and the decode cannot have
    /// computed longer than it did not wait); a read latency per layer that
    /// missed; and what is left, per miss, is what a miss costs: the wait on
    /// its read and upload, and the work it adds outside the wait (a streaming
    /// decode's time not waiting grows with its misses: BENCHMARKS.md, "Plan
    /// estimates"). [`ModelCosts::decode_time`] at the decode's hit rate gives
    /// back the decode's time. `None` when the decode missed nothing or its
    /// figures are not times.
    pub fn miss_rates_from_decode(&self, sample: &DecodeSample, rates: &Rates) -> Option<MissRates> {
        let misses = self.misses_per_token(sample.hit_rate);
        let (total, waited) = (sample.seconds_per_token, sample.waited_seconds_per_token);
        if !(misses > 0.0 && total.is_finite() && total > 0.0 && waited.is_finite() && waited >= 0.0) {
            return None;
        }
        let compute = self.resident_compute_seconds(rates).min(total - waited.min(total));
        let latency = self.latency_seconds(sample.hit_rate, &rates.disk);
        let miss = (total - compute - latency).max(0.0) / misses;
        // A latency longer than the time left for it comes out of the compute.
        let token = (total - latency - miss * misses).max(0.0);
        Some(MissRates { miss_ms: miss * 1e3, token_ms: token * 1e3 })
    }

    /// The pool's share of the routed experts.
    pub fn pool_share(&self, slots: usize) -> f64 {
        (slots as f64 / self.total_experts().max(1) as f64).clamp(0.0, 1.0)
    }

    /// The share of expert uses found in a pool of `slots` ([`HitRateCurve`]).
    pub fn hit_rate(&self, slots: usize) -> f64 {
        self.hit_curve.hit_rate(self.pool_share(slots))
    }

    /// Costs of a model directory, from its config and safetensors headers (no
    /// weights are read), for a backend whose KV cache stores `kv`.
    pub fn from_model_dir(dir: &Path, kv: KvCacheType) -> Result<ModelCosts> {
        Self::of(&ModelArch::read(dir)?, kv)
    }

    /// Bytes of the shared experts' projections in the checkpoint `arch`
    /// describes, where they are as wide as its routed experts (those a full
    /// pool may hold a copy of).
    pub fn shared_expert_bytes(arch: &ModelArch) -> Result<u64> {
        let c = &arch.text;
        if c.shared_expert_intermediate_size != c.moe_intermediate_size {
            return Ok(0);
        }
        Ok(arch.open_checkpoint()?.bytes_where(|n| n.contains(".shared_expert.")))
    }

    /// Costs of the checkpoint `arch` describes.
    pub fn of(arch: &ModelArch, kv: KvCacheType) -> Result<ModelCosts> {
        let ck = arch.open_checkpoint()?;
        let c = &arch.text;
        let routed = ck.bytes_where(ModelArch::is_routed_expert_tensor);
        // n-gram rows are streamed too; what stays of them is the bounded row cache.
        let ngram = ck.bytes_where(ModelArch::is_ngram_tensor);
        let resident = ck.bytes_where(|n| !ModelArch::is_streamed_tensor(n));
        let moe_layers = arch.moe_layers();
        let total = (moe_layers * c.num_experts).max(1) as u64;
        let mtp_path = arch.dir.join("mtp.safetensors");
        Ok(ModelCosts {
            name: arch.dir.display().to_string(),
            resident_bytes: resident,
            expert_record_bytes: routed / total,
            moe_layers,
            experts_per_layer: c.num_experts,
            top_k: c.num_experts_per_tok,
            hidden_size: c.hidden_size,
            moe_intermediate: c.moe_intermediate_size,
            kv_bytes_per_token: arch.context_bytes_per_token(kv),
            context_length: arch.context_length().map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            state_bytes: arch.fixed_state_bytes(),
            extra_bytes: if ngram > 0 { crate::model::DEFAULT_NGRAM_CACHE_BYTES as u64 } else { 0 },
            mtp_bytes: if arch.qwen4.is_some() { std::fs::metadata(mtp_path).map(|m| m.len()).unwrap_or(0) } else { 0 },
            full_pool_extra_bytes: 0,
            expert_format: expert_format(&ck, c.num_experts, c.moe_intermediate_size, c.hidden_size)
                .unwrap_or(MatrixFormat::Dense(DType::BF16)),
            hit_curve: HitRateCurve::ASSUMED,
        })
    }

    /// Qwen3.8-Flash-Next 4-bit, from the published checkpoint's tensor table
    /// (../shared/reference/qwen3.8-flash-next; a test re-derives these), with
    /// an f32 KV cache (the GPU backends').
    pub fn flagship() -> ModelCosts {
        Self::flagship_with_kv(KvCacheType::F32)
    }

    /// [`ModelCosts::flagship`] for a backend whose KV cache stores `kv`.
    pub fn flagship_with_kv(kv: KvCacheType) -> ModelCosts {
        ModelCosts {
            name: "qwen3.8-flash-next:4bit".into(),
            // The text trunk; the 0.898 GB vision tower is never loaded and the
            // 32 GB n-gram table is streamed.
            resident_bytes: 2_924_005_400,
            expert_record_bytes: 2_764_800,
            moe_layers: 48,
            experts_per_layer: 512,
            top_k: 10,
            hidden_size: 2560,
            // 3 x 2560 x 640 4-bit values with a bf16 scale and bias per 64: the record's 2,764,800 bytes.
            moe_intermediate: 640,
            // 12 full-attention layers x (K and V x 2 KV heads x 256 as `kv`,
            // plus the QSA indexer's 128-wide raw key and a quarter of a pooled key in f32).
            kv_bytes_per_token: 12 * ((2 * 2 * kv.bytes(256)) as u64 + (128 + 32) * 4),
            context_length: Some(262_144),
            // 36 DeltaNet layers: 48 heads x 128 x 128 f32 state + a 3-step conv window.
            state_bytes: 36 * (48 * 128 * 128 + 3 * (2 * 16 * 128 + 48 * 128)) * 4,
            // The bounded n-gram row cache.
            extra_bytes: crate::model::DEFAULT_NGRAM_CACHE_BYTES as u64,
            // mtp.safetensors, from the pinned manifest.
            mtp_bytes: 1_470_955_171,
            full_pool_extra_bytes: 0,
            expert_format: MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::BF16 },
            hit_curve: HitRateCurve::ASSUMED,
        }
    }
}
