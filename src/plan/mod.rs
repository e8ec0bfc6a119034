//! The memory planner: how many expert slots to give the pool on this machine.
//!
//! Costs come from the model's own byte sizes ([`ModelCosts`]); the machine's
//! memory from the OS ([`machine`]) or from simulated figures (`doctor
//! --sim-*`). Precedence of explicit knobs: `--experts-per-layer` >
//! `--pool-gb` > `--memory-gb` > auto. Auto may use at most 70% of RAM, the
//! GPU working-set limit less 2 GB and what is reclaimable now less a safety
//! margin. When every expert fits within that, the pool holds them all (the
//! fastest plan: no reads after loading); otherwise it stops at the knee
//! (where more cache stops making decode faster, from the model's hit-rate
//! curve and the machine's rates: [`knee`]) or lower, and never goes
//! below the model's minimum.

pub mod context;
pub mod costs;
pub mod estimate;
pub mod governor;
pub mod hits;
pub mod knee;
pub mod machine;
pub mod rates;
pub mod speeds;

use serde::Serialize;

pub use costs::ModelCosts;
pub use machine::MachineMemory;
pub use rates::{RateCache, RateKeys, Rates};

pub const GB: f64 = 1e9;

/// Share of each layer's experts at which the reference measurements stopped
/// getting faster (the flagship's 33 GB knee: 5.5 GB trunk, caches and KV + 205 of 512
/// experts per layer). The planner derives each model's knee on each machine
/// instead ([`knee`]); the miss probe sizes its pool with this.
pub const KNEE_FRACTION: f64 = 0.40;
/// Experts per layer below which auto never goes (the reference floor).
pub const FLOOR_EXPERTS_PER_LAYER: usize = 14;
/// The runtime itself, thread stacks, read buffers kept for reuse
/// (`ExpertStore::KEEP_READ_BUFFERS`) and allocator slack; the reads in
/// flight and activations come on top (see [`ModelCosts::runtime_bytes`]).
pub const RUNTIME_BASE_BYTES: u64 = 200_000_000;

/// Prompt tokens processed per forward pass during prefill where nothing
/// planned it (the engine's default), and the least a plan gives: the pool is
/// sized with a chunk's activations at this size.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// The longest prefill chunk a plan gives, where memory allows and the
/// planned context is as long. A streaming pool reads a chunk's missed
/// experts once each (expert-major prefill), so fewer, longer chunks read
/// less; past a few thousand tokens a chunk's matmuls gain little.
pub const MAX_PREFILL_CHUNK: usize = 8192;

/// Whether to load the MTP head for speculative decoding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MtpMode {
    /// On when the model has a head and it leaves the pool at least
    /// [`MTP_MIN_EXPERTS_PER_LAYER`] experts per layer.
    #[default]
    Auto,
    On,
    Off,
}

impl std::str::FromStr for MtpMode {
    type Err = String;
    fn from_str(s: &str) -> Result<MtpMode, String> {
        match s {
            "auto" => Ok(MtpMode::Auto),
            "on" => Ok(MtpMode::On),
            "off" => Ok(MtpMode::Off),
            other => Err(format!("'{other}': expected auto, on or off")),
        }
    }
}

/// Auto turns MTP off rather than shrink the pool below this: a verify pass
/// routes two tokens, so a small pool would pay for drafts in expert reads.
pub const MTP_MIN_EXPERTS_PER_LAYER: usize = 2 * FLOOR_EXPERTS_PER_LAYER;

/// Auto turns MTP on only for models whose tokens read at least this many
/// bytes of weights: speculative decoding pays by reading the weights once
/// for two tokens, which saves nothing when they sit in the CPU's caches
/// (measured in BENCHMARKS.md on 12 MB and 1.5 MB models: 0.8x and 0.97x).
pub const MTP_MIN_ACTIVE_BYTES: u64 = 256_000_000;

/// [`MTP_MIN_EXPERTS_PER_LAYER`], or half the experts of a model with few.
fn mtp_min_experts_per_layer(model: &ModelCosts) -> f64 {
    MTP_MIN_EXPERTS_PER_LAYER.min(model.experts_per_layer / 2) as f64
}

/// What the user asked for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanRequest {
    pub experts_per_layer: Option<usize>,
    pub pool_gb: Option<f64>,
    pub memory_gb: Option<f64>,
    /// Tokens of context the KV cache is planned for (with `grow_to`: at least).
    pub context_tokens: usize,
    /// Grow the context past `context_tokens` into the memory left, up to
    /// this many tokens (the model's own context): the default when no
    /// context is asked for. An auto-sized pool gives slots to reach
    /// [`context::AUTO_CONTEXT_FLOOR`].
    pub grow_to: Option<usize>,
    pub mtp: MtpMode,
}

/// The context a plan holds KV for at least when none is asked for.
pub const DEFAULT_PLAN_CONTEXT: usize = 4096;

impl PlanRequest {
    /// Exactly `tokens` of context when given; else at least
    /// [`DEFAULT_PLAN_CONTEXT`], grown to the model's where memory allows.
    pub fn for_context(self, tokens: Option<usize>) -> PlanRequest {
        match tokens {
            Some(n) => PlanRequest { context_tokens: n, grow_to: None, ..self },
            None => PlanRequest { context_tokens: DEFAULT_PLAN_CONTEXT, grow_to: Some(usize::MAX), ..self },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlanMode {
    Auto,
    ExpertsPerLayer,
    PoolGb,
    MemoryGb,
}

impl PlanMode {
    pub fn label(self) -> &'static str {
        match self {
            PlanMode::Auto => "auto",
            PlanMode::ExpertsPerLayer => "--experts-per-layer",
            PlanMode::PoolGb => "--pool-gb",
            PlanMode::MemoryGb => "--memory-gb",
        }
    }
}

/// The outcome: pool size and what to expect.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Plan {
    pub mode: PlanMode,
    /// Why the pool has this size: every expert fits (resident), or the model
    /// is larger than the memory auto may use (streaming), or an explicit knob.
    pub reason: String,
    /// Memory the process is planned to stay within.
    pub target_bytes: u64,
    pub slots: usize,
    pub pool_bytes: u64,
    pub experts_per_layer: f64,
    /// Trunk + pool + KV/state for the planned context + runtime overhead
    /// (the activations of a prefill chunk among it).
    pub peak_bytes: u64,
    /// Prompt tokens per forward pass: as many as the memory left beside
    /// the pool holds the activations of ([`prefill_chunk`]).
    pub prefill_chunk: usize,
    pub min_slots: usize,
    pub total_experts: usize,
    pub expected_decode_tokens_per_second: f64,
    /// The model's timed runs on this machine the estimate came from; none:
    /// the rates ([`speeds`]).
    pub expected_decode_from_runs: Option<estimate::FromRuns>,
    /// Whether the MTP head is loaded (its bytes are in `peak_bytes`).
    pub mtp: bool,
    /// Tokens of context the KV cache is planned for (its bytes are in `peak_bytes`).
    pub context_tokens: usize,
    /// What each token of context costs in KV cache.
    pub kv_bytes_per_token: u64,
    /// Sequences `serve` decodes at once unless `--parallel` or
    /// `OLLAMA_NUM_PARALLEL` says ([`parallel_within`]).
    pub parallel: usize,
    /// What each sequence beyond the first costs: KV for
    /// [`PARALLEL_CONTEXT`] tokens (at most the planned context) and its state.
    pub parallel_sequence_bytes: u64,
    pub notes: Vec<String>,
}

/// Errors a request can hit: explicit sizes that cannot work.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{knob} {value} leaves room for {slots} expert slots, but the model needs at least {min} (one token's experts); the smallest workable setting is about {min_gb:.2} GB of memory")]
    TooSmall { knob: &'static str, value: String, slots: usize, min: usize, min_gb: f64 },
    #[error("{0} must be a positive number")]
    NotPositive(&'static str),
    #[error("--mtp on: this model has no MTP head (mtp.safetensors); use --mtp auto or off")]
    NoMtpHead,
}

fn gb(b: u64) -> f64 {
    b as f64 / GB
}

/// Plans the pool for `model` on `machine`.
pub fn plan(model: &ModelCosts, machine: &MachineMemory, req: &PlanRequest) -> Result<Plan, PlanError> {
    match req.mtp {
        MtpMode::Off => plan_with(model, machine, req, false),
        MtpMode::On if model.mtp_bytes == 0 => Err(PlanError::NoMtpHead),
        MtpMode::On => plan_with(model, machine, req, true),
        MtpMode::Auto if model.mtp_bytes == 0 => plan_with(model, machine, req, false),
        MtpMode::Auto if model.active_bytes_per_token() < MTP_MIN_ACTIVE_BYTES => {
            let mut p = plan_with(model, machine, req, false)?;
            p.notes.push(format!(
                "MTP off: a token reads only {:.0} MB of weights, so verifying two tokens at once saves little \
                 and drafting costs more than it gains (--mtp on forces it)",
                model.active_bytes_per_token() as f64 / 1e6
            ));
            Ok(p)
        }
        MtpMode::Auto => {
            let with = plan_with(model, machine, req, true);
            let all = model.total_experts();
            match with {
                // Holding every expert beats drafting: no head if only that keeps the model resident.
                Ok(p) if p.slots < all && plan_with(model, machine, req, false).is_ok_and(|off| off.slots == all) => {
                    let mut off = plan_with(model, machine, req, false)?;
                    off.notes.push(format!(
                        "MTP off: with its {:.2} GB head not every expert would fit, and holding them all is faster (--mtp on forces it)",
                        gb(model.mtp_bytes)
                    ));
                    Ok(off)
                }
                Ok(p) if p.experts_per_layer >= mtp_min_experts_per_layer(model) => Ok(p),
                _ => {
                    let mut p = plan_with(model, machine, req, false)?;
                    p.notes.push(format!(
                        "MTP off: its {:.2} GB head would leave fewer than {} experts per layer (--mtp on forces it)",
                        gb(model.mtp_bytes),
                        mtp_min_experts_per_layer(model)
                    ));
                    Ok(p)
                }
            }
        }
    }
}

fn plan_with(model: &ModelCosts, machine: &MachineMemory, req: &PlanRequest, mtp: bool) -> Result<Plan, PlanError> {
    let total_experts = model.total_experts();
    let record = model.expert_record_bytes.max(1);
    let head = if mtp { model.mtp_bytes } else { 0 };
    // No more context than the model takes.
    let model_context = model.context_length.unwrap_or(usize::MAX);
    let base_context = req.context_tokens.min(model_context);
    let fixed = model.fixed_bytes(base_context) + model.runtime_bytes(DEFAULT_PREFILL_CHUNK) + head;
    let engine_min = model.engine_min_slots();
    let floor_slots = (FLOOR_EXPERTS_PER_LAYER.max(model.top_k).min(model.experts_per_layer)) * model.moe_layers;
    // A pool of every expert may hold copies of the shared experts too.
    let full_extra = model.full_pool_extra_bytes;
    // A streaming pool also keeps the staging its long calls' other misses run from.
    let staging = model.staging_bytes();
    let bytes_for = |slots: usize| fixed + slots as u64 * record + if slots >= total_experts { full_extra } else { staging };
    let slots_within = |bytes: u64| {
        let n = (bytes.saturating_sub(fixed) / record) as usize;
        if n >= total_experts && bytes >= bytes_for(total_experts) {
            n
        } else {
            ((bytes.saturating_sub(fixed + staging) / record) as usize).min(total_experts.saturating_sub(1))
        }
    };
    let mut notes = Vec::new();
    let mut reason = String::new();

    let (mode, slots, target) = if let Some(n) = req.experts_per_layer {
        if n == 0 {
            return Err(PlanError::NotPositive("--experts-per-layer"));
        }
        let slots = (n.min(model.experts_per_layer)) * model.moe_layers;
        (PlanMode::ExpertsPerLayer, slots, bytes_for(slots))
    } else if let Some(g) = req.pool_gb {
        if !(g > 0.0) {
            return Err(PlanError::NotPositive("--pool-gb"));
        }
        let slots = ((g * GB) as u64 / record) as usize;
        (PlanMode::PoolGb, slots.min(total_experts), bytes_for(slots.min(total_experts)))
    } else if let Some(g) = req.memory_gb {
        if !(g > 0.0) {
            return Err(PlanError::NotPositive("--memory-gb"));
        }
        let target = (g * GB) as u64;
        (PlanMode::MemoryGb, slots_within(target).min(total_experts), target)
    } else {
        let (target, why) = auto_target(model, machine, bytes_for(total_experts), bytes_for(floor_slots), &mut notes, |epl| {
            bytes_for((epl * model.moe_layers).min(total_experts))
        });
        reason = why;
        (PlanMode::Auto, slots_within(target).clamp(floor_slots.min(total_experts), total_experts), target)
    };
    if mode != PlanMode::Auto {
        if slots < engine_min {
            let (knob, value) = match mode {
                PlanMode::ExpertsPerLayer => ("--experts-per-layer", req.experts_per_layer.unwrap_or(0).to_string()),
                PlanMode::PoolGb => ("--pool-gb", format!("{}", req.pool_gb.unwrap_or(0.0))),
                _ => ("--memory-gb", format!("{}", req.memory_gb.unwrap_or(0.0))),
            };
            return Err(PlanError::TooSmall { knob, value, slots, min: engine_min, min_gb: gb(bytes_for(engine_min)) });
        }
        if slots < model.moe_layers * model.top_k.min(model.experts_per_layer) {
            notes.push(format!(
                "{slots} slots are fewer than one token's experts across all MoE layers ({} x {}): \
                 every expert will be read from disk for every token",
                model.moe_layers,
                model.top_k
            ));
        } else if slots < floor_slots {
            notes.push(format!(
                "{} is below the recommended floor of {} experts per layer: expect many expert reads per token",
                mode.label(),
                floor_slots / model.moe_layers.max(1)
            ));
        }
        let margin = 1_500_000_000u64.max(machine.total_ram / 20);
        if bytes_for(slots) > machine.available.saturating_sub(margin) {
            notes.push(format!(
                "the explicit size needs {:.1} GB but only {:.1} GB is reclaimable now; kept as asked (explicit sizes are never changed)",
                gb(bytes_for(slots)),
                gb(machine.available)
            ));
        }
    }
    // The context, then the chunk, grow into what is left of the memory the
    // process may use: the size asked for with --memory-gb, else what auto may use here.
    let limit = if mode == PlanMode::MemoryGb { target } else { auto_limit(machine).0 };
    let (slots, context_tokens) = match req.grow_to {
        Some(most) if most.min(model_context) > base_context => {
            let room = context::ContextRoom {
                base: base_context,
                most: most.min(model_context),
                kv_bytes_per_token: model.kv_bytes_per_token,
                limit,
                may_trade: matches!(mode, PlanMode::Auto | PlanMode::MemoryGb),
                floor_slots: floor_slots.max(engine_min).min(slots),
                record_bytes: record,
            };
            let grown = context::extend(&room, slots, bytes_for);
            notes.extend(grown.note);
            (grown.slots, grown.tokens)
        }
        _ => (slots, base_context),
    };
    let planned = bytes_for(slots) + (context_tokens - base_context) as u64 * model.kv_bytes_per_token;
    let pool_bytes = slots as u64 * record;
    let prefill_chunk = prefill_chunk(model, limit.saturating_sub(planned), context_tokens);
    let peak = planned + (prefill_chunk - DEFAULT_PREFILL_CHUNK) as u64 * model.activation_bytes_per_token();
    let estimate = model.estimate_decode(slots, &machine.rates);
    let (parallel, sequence_bytes) = parallel_within(model, context_tokens, limit.saturating_sub(peak));
    if mode != PlanMode::Auto {
        reason = format!("{} sets the pool: {} of {} experts per layer", mode.label(), slots / model.moe_layers.max(1), model.experts_per_layer);
    }
    Ok(Plan {
        mode,
        reason,
        target_bytes: if mode == PlanMode::MemoryGb || mode == PlanMode::Auto { target } else { peak },
        slots,
        pool_bytes,
        experts_per_layer: slots as f64 / model.moe_layers.max(1) as f64,
        peak_bytes: peak,
        prefill_chunk,
        min_slots: engine_min,
        total_experts,
        expected_decode_tokens_per_second: estimate.tokens_per_second(),
        expected_decode_from_runs: estimate.from_runs,
        mtp,
        context_tokens,
        kv_bytes_per_token: model.kv_bytes_per_token,
        parallel,
        parallel_sequence_bytes: sequence_bytes,
        notes,
    })
}

/// Sequences decoded at once by default where memory allows.
pub const DEFAULT_PARALLEL: usize = 4;

/// Tokens of context each sequence beyond the first is planned for.
pub const PARALLEL_CONTEXT: usize = DEFAULT_PLAN_CONTEXT;

/// The most of [`DEFAULT_PARALLEL`], 2 and 1 sequences whose extra ones
/// (each KV for `context_tokens`, at most [`PARALLEL_CONTEXT`], and its
/// recurrent state) fit in `spare` bytes, and what each extra one costs. A
/// streaming pool takes the memory auto may use, so it decodes one at a time.
pub fn parallel_within(model: &ModelCosts, context_tokens: usize, spare: u64) -> (usize, u64) {
    let each = model.kv_bytes_per_token * context_tokens.min(PARALLEL_CONTEXT) as u64 + model.state_bytes;
    let n = [DEFAULT_PARALLEL, 2, 1].into_iter().find(|&n| (n as u64 - 1) * each <= spare).unwrap_or(1);
    (n, each)
}

/// Prompt tokens per prefill chunk: whole multiples of
/// [`DEFAULT_PREFILL_CHUNK`] from it up to [`MAX_PREFILL_CHUNK`], no longer
/// than the planned context needs, with the activations beyond the smallest
/// chunk's within `spare` bytes.
pub fn prefill_chunk(model: &ModelCosts, spare: u64, context_tokens: usize) -> usize {
    let step = DEFAULT_PREFILL_CHUNK;
    let fits = (spare / model.activation_bytes_per_token().max(1)) as usize;
    let wanted = context_tokens.div_ceil(step) * step;
    let chunk = (step + fits).min(wanted).min(MAX_PREFILL_CHUNK);
    (chunk / step * step).max(step)
}

/// The memory auto may use on `machine`, and what sets it: 70% of RAM, the
/// GPU working set less 2 GB, or what is reclaimable now less a margin.
fn auto_limit(machine: &MachineMemory) -> (u64, String) {
    let mut limit = (0.7 * machine.total_ram as f64) as u64;
    let mut what = format!("70% of {:.1} GB RAM", gb(machine.total_ram));
    if let Some(ws) = machine.gpu_working_set {
        let gpu = ws.saturating_sub(2_000_000_000);
        if gpu < limit {
            (limit, what) = (gpu, format!("the GPU working set of {:.1} GB less 2 GB", gb(ws)));
        }
    }
    let margin = 1_500_000_000u64.max(machine.total_ram / 20);
    let reclaimable = machine.available.saturating_sub(margin);
    if reclaimable < limit {
        (limit, what) = (reclaimable, format!("{:.1} GB reclaimable now, keeping {:.1} GB free", gb(machine.available), gb(margin)));
    }
    (limit, what)
}

/// Auto's target and why: the whole model when every expert fits within
/// [`auto_limit`] (no expert is read after loading, the fastest plan);
/// otherwise the knee, or less when the limit is lower; never below `floor`.
fn auto_target(
    model: &ModelCosts,
    machine: &MachineMemory,
    all: u64,
    floor: u64,
    notes: &mut Vec<String>,
    bytes_for_experts_per_layer: impl Fn(usize) -> u64,
) -> (u64, String) {
    let (limit, what) = auto_limit(machine);
    if all <= limit {
        let why = format!(
            "resident: all {} experts per layer fit ({:.1} GB peak, within {:.1} GB: {what}), so none is read from disk after loading",
            model.experts_per_layer,
            gb(all),
            gb(limit)
        );
        return (all, why);
    }
    let floor_per_layer = FLOOR_EXPERTS_PER_LAYER.max(model.top_k).min(model.experts_per_layer);
    let k = knee::Knee::for_plan(model, &machine.rates, floor_per_layer);
    let knee = bytes_for_experts_per_layer(k.experts_per_layer);
    let mut why = format!(
        "streaming: all {} experts per layer need {:.1} GB, over the {:.1} GB auto may use ({what})",
        model.experts_per_layer,
        gb(all),
        gb(limit)
    );
    let mut target = if knee <= limit {
        let pct = 100.0 * k.experts_per_layer as f64 / model.experts_per_layer.max(1) as f64;
        why += &if k.measured {
            format!(
                "; the pool stops at the knee ({} per layer, {pct:.0}%: ~{:.1}% hits, reads {:.1}% of the compute), \
                 where more cache stops making decode faster",
                k.experts_per_layer,
                100.0 * k.hit_rate,
                100.0 * k.read_share
            )
        } else {
            format!(
                "; the pool stops at the knee ({} per layer, {pct:.0}%: the reference's, until a streaming run \
                 here measures this model's routing), where more cache stopped making decode faster",
                k.experts_per_layer
            )
        };
        knee
    } else if limit >= floor {
        why += "; the pool takes what that leaves";
        limit
    } else {
        why += "; the pool runs at the model's minimum";
        limit
    };
    if target < floor {
        if limit < floor {
            notes.push(format!(
                "auto may use only {:.1} GB ({what}), less than the model's minimum ({:.1} GB); running at the minimum and relying on the OS to page",
                gb(limit),
                gb(floor)
            ));
        }
        target = floor;
    }
    (target, why)
}

impl Plan {
    /// What a context of `tokens` costs beyond the tokens this plan holds KV
    /// for (and, when known, the memory reclaimable now): said where such a
    /// context is refused.
    pub fn context_need(&self, tokens: usize, available: Option<u64>) -> String {
        let per_token = self.kv_bytes_per_token;
        let more = per_token * tokens.saturating_sub(self.context_tokens) as u64;
        let mut s = format!(
            "a context of {tokens} tokens needs {:.2} GB of KV cache, {:.2} GB more than the planned {} (a peak of ~{:.1} GB",
            gb(per_token * tokens as u64),
            gb(more),
            self.context_tokens,
            gb(self.peak_bytes + more)
        );
        if let Some(available) = available {
            s += &format!("; {:.1} GB is reclaimable now", gb(available));
        }
        s + ")"
    }

    /// The banner printed at the start of `run` and `serve`.
    pub fn banner(&self, model: &ModelCosts, machine: &MachineMemory) -> String {
        let mut s = format!("slotstream memory plan ({})\n", self.mode.label());
        s += &format!("  device: {}\n", machine.describe());
        s += &format!("  target: {:.1} GB\n", gb(self.target_bytes));
        s += &format!("  why:    {}\n", self.reason);
        s += &format!(
            "  cache:  ~{:.0} of {} experts per layer, {} slots = {:.2} GB pool\n",
            self.experts_per_layer,
            model.experts_per_layer,
            self.slots,
            gb(self.pool_bytes)
        );
        if model.mtp_bytes > 0 {
            s += &format!(
                "  mtp:    {} ({:.2} GB head)\n",
                if self.mtp { "on, speculative decoding" } else { "off" },
                gb(model.mtp_bytes)
            );
        }
        s += &format!(
            "  prompt: chunks of up to {} tokens ({:.2} GB of activations)\n",
            self.prefill_chunk,
            gb(self.prefill_chunk as u64 * model.activation_bytes_per_token())
        );
        s += &format!(
            "  context: {} tokens ({:.2} GB of KV cache)\n",
            self.context_tokens,
            gb(self.context_tokens as u64 * self.kv_bytes_per_token)
        );
        s += &if self.parallel > 1 {
            format!(
                "  parallel: {} sequences at once (each more {:.2} GB of KV and state)\n",
                self.parallel,
                gb(self.parallel_sequence_bytes)
            )
        } else {
            format!(
                "  parallel: 1 sequence at a time (another's {:.2} GB of KV and state would not fit beside the pool)\n",
                gb(self.parallel_sequence_bytes)
            )
        };
        s += &format!(
            "  expect: peak ~{:.1} GB, decode ~{:.1} tok/s (estimate)",
            gb(self.peak_bytes),
            self.expected_decode_tokens_per_second
        );
        s += &format!("\n  rates:  {}", machine.rates.describe(rates::now_unix()));
        if self.slots < self.total_experts {
            s += &format!("\n  hits:   {}", model.hit_curve.describe(model.pool_share(self.slots)));
            s += &format!("\n  speed:  {}", estimate::FromRuns::describe(self.expected_decode_from_runs.as_ref(), model));
        }
        for n in &self.notes {
            s += &format!("\n  note: {n}");
        }
        s
    }
}

#[cfg(test)]
mod tests;
