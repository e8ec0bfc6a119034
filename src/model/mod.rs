//! Model architectures. Each family lives in its own file and turns a
//! checkpoint into a [`DecoderModel`]; [`load`] picks the family from
//! `config.json`'s `model_type`.

pub mod config;
pub mod hyper;
pub mod layers;
pub mod mtp;
pub mod ngram;
pub mod qsa;
mod qwen3_moe;
mod qwen3_next;
mod qwen4_exp;

use std::path::Path;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, State, Tensor, Weight};

use crate::checkpoint::{Checkpoint, QuantConfig};
use crate::experts::{ExpertCache, ExpertStore};
use hyper::{HyperMixer, Ple, PleState};
use layers::{Attention, DeltaState, GatedDeltaNet, Mlp, MoeBlock, RmsNorm};
use qsa::IndexerState;

/// Token mixer of one decoder layer.
pub enum Mixer {
    Attention(Attention),
    Delta(GatedDeltaNet),
}

/// Feed-forward of one decoder layer.
pub enum FeedForward {
    Dense(Mlp),
    Moe(MoeBlock),
}

/// How a layer's blocks are wrapped around the residual stream.
pub enum Residual {
    /// `h += mixer(norm(h)); h += ffn(norm(h))` (qwen3_moe, qwen3_next).
    PreNorm { input: RmsNorm, post: RmsNorm },
    /// Hyper-connections (qwen4_exp): the hidden state is several parallel
    /// streams; each block reads a gated mix of them and is added back to
    /// every stream with its own weight.
    Hyper { attn: HyperMixer, mlp: HyperMixer },
}

pub struct DecoderLayer {
    pub residual: Residual,
    /// Per-layer n-gram embedding added to the streams before the mixer (qwen4_exp).
    pub ple: Option<Ple>,
    pub mixer: Mixer,
    pub ffn: FeedForward,
}

/// Per-layer state of one sequence.
pub enum LayerState {
    /// KV cache, plus the QSA indexer's keys when the layer has an indexer.
    Attention(State, Option<IndexerState>),
    Delta(DeltaState),
}

/// The parts of a sequence's state that cannot be cut back to an earlier
/// position (recurrent and convolution state), saved before a speculative
/// forward pass; KV caches and indexer keys are truncated instead.
pub struct Snapshot {
    position: usize,
    delta: Vec<Option<DeltaState>>,
    ple: Vec<PleState>,
}

/// Everything a sequence carries between forward calls.
pub struct SequenceState {
    pub layers: Vec<LayerState>,
    /// State of each PLE layer, in layer order.
    pub ple: Vec<PleState>,
    /// The MTP head's state, when the model has the head loaded.
    pub mtp: Option<mtp::MtpState>,
    /// Tokens consumed so far.
    pub position: usize,
}

/// What turns the last hidden state into the input of `lm_head`.
pub enum Head {
    /// A final RMSNorm.
    Norm(RmsNorm),
    /// The hyper-connection collapse of the streams (it carries the final norm).
    Hyper(HyperMixer),
}

/// A decoder-only MoE transformer: embeddings, layers, final norm, head.
pub struct DecoderModel {
    pub model_type: String,
    pub embed: Weight,
    /// Parallel residual streams (1 except with hyper-connections).
    pub streams: usize,
    pub layers: Vec<DecoderLayer>,
    pub head: Head,
    pub lm_head: Weight,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The routed experts of every MoE layer, streamed into a slot pool.
    pub experts: Mutex<ExpertCache>,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Bytes of everything resident besides the expert pool.
    pub resident_bytes: usize,
    /// Checkpoint tensors the loader did not use (a mismatch to look into).
    pub unused_tensors: Vec<String>,
    /// The multi-token-prediction head, when loaded (qwen4_exp's `mtp.safetensors`).
    pub mtp: Option<mtp::MtpHead>,
}

pub(crate) fn experts_lock(m: &Mutex<ExpertCache>) -> Result<std::sync::MutexGuard<'_, ExpertCache>> {
    m.lock().map_err(|_| anyhow::anyhow!("the expert cache was poisoned by an earlier failure"))
}

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

/// Runs `f` on a thread of the compute pool (rayon's global pool, which the
/// CPU backend splits its work over). A forward pass issues dozens of parallel
/// operations; started from a thread outside the pool, each one would hand its
/// work over and sleep until it is done (two context switches, and one thread
/// more than cores while the pool spins). From a pool thread the work is
/// shared by work-stealing instead. Called from a pool thread, `f` just runs.
pub fn on_compute_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

impl DecoderModel {
    pub fn new_state(&self, b: &dyn Backend) -> Result<SequenceState> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => Ok(LayerState::Attention(a.new_state(b)?, a.indexer.as_ref().map(|_| IndexerState::default()))),
                Mixer::Delta(d) => d.new_state(b).map(LayerState::Delta),
            })
            .collect::<Result<Vec<_>>>()?;
        let ple = self.layers.iter().filter_map(|l| l.ple.as_ref()).map(|p| p.new_state(b)).collect::<Result<Vec<_>>>()?;
        let mtp = self.mtp.as_ref().map(|m| m.new_state(b)).transpose()?;
        Ok(SequenceState { layers, ple, mtp, position: 0 })
    }

    /// Runs `ids` through the model, extending `state`; returns logits
    /// `[1 or ids.len(), vocab]`.
    pub fn forward(&self, b: &dyn Backend, ids: &[u32], state: &mut SequenceState, which: Logits) -> Result<Tensor> {
        if ids.is_empty() {
            bail!("forward called with no tokens");
        }
        // The expert cache is locked before the pool is entered: a pool
        // thread waiting inside one pass may pick up another caller's pass,
        // which must not then block on a lock held further down its own stack.
        let mut guard = experts_lock(&self.experts)?;
        let experts = &mut *guard;
        on_compute_threads(|| {
            let x = self.hidden_locked(b, ids, state, experts)?;
            let x = if which == Logits::Last && ids.len() > 1 { b.slice_rows(&x, ids.len() - 1, 1)? } else { x };
            let x = self.collapse(b, &x)?;
            Ok(b.matmul(&x, &self.lm_head)?)
        })
    }

    /// Runs the layers over `ids`, extending `state`; returns the last hidden
    /// state `[ids.len(), streams*hidden]` before the head.
    pub fn hidden(&self, b: &dyn Backend, ids: &[u32], state: &mut SequenceState) -> Result<Tensor> {
        let mut guard = experts_lock(&self.experts)?;
        let experts = &mut *guard;
        on_compute_threads(|| self.hidden_locked(b, ids, state, experts))
    }

    fn hidden_locked(&self, b: &dyn Backend, ids: &[u32], state: &mut SequenceState, experts: &mut ExpertCache) -> Result<Tensor> {
        if ids.is_empty() {
            bail!("forward called with no tokens");
        }
        let mut x = b.embed(&self.embed, ids)?;
        if self.streams > 1 {
            x = b.repeat_cols(&x, self.streams)?;
        }
        let ple_layers: Vec<&Ple> = self.layers.iter().filter_map(|l| l.ple.as_ref()).collect();
        if ple_layers.len() != state.ple.len() {
            bail!("the sequence state has {} PLE states for {} PLE layers", state.ple.len(), ple_layers.len());
        }
        let start = state.position;
        std::thread::scope(|scope| -> Result<()> {
            // N-gram rows depend on the token ids alone: read them while the
            // layers before the PLE layer run.
            let mut fetches = ple_layers
                .iter()
                .zip(&state.ple)
                .map(|(p, ps)| {
                    let context = ps.context.clone();
                    scope.spawn(move || p.fetch(ids, &context))
                })
                .collect::<Vec<_>>()
                .into_iter();
            let mut ple_states = state.ple.iter_mut();
            for (i, (layer, st)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
                let ple = match &layer.ple {
                    Some(p) => {
                        let fetched = fetches.next().context("internal: a PLE fetch is missing")?;
                        let emb = fetched.join().map_err(|_| anyhow::anyhow!("the n-gram row reader panicked"))??;
                        Some((p, emb, ple_states.next().context("sequence state has too few PLE states")?))
                    }
                    None => None,
                };
                x = layer_forward(b, layer, &x, ids, start, st, ple, experts).with_context(|| format!("layer {i}"))?;
            }
            Ok(())
        })?;
        state.position += ids.len();
        Ok(x)
    }

    /// Row-cache counters of the PLE layers' n-gram tables (`None` without PLE).
    pub fn ngram_stats(&self) -> Option<ngram::NgramStats> {
        let mut all: Option<ngram::NgramStats> = None;
        for p in self.layers.iter().filter_map(|l| l.ple.as_ref()) {
            let s = p.store.stats();
            let t = all.get_or_insert_with(Default::default);
            t.hits += s.hits;
            t.misses += s.misses;
            t.bytes_read += s.bytes_read;
            t.cached_rows += s.cached_rows;
            t.capacity_rows += s.capacity_rows;
        }
        all
    }

    /// The final norm (or stream collapse) that feeds `lm_head`.
    pub fn collapse(&self, b: &dyn Backend, h: &Tensor) -> Result<Tensor> {
        match &self.head {
            Head::Norm(n) => n.forward(b, h),
            Head::Hyper(m) => Ok(m.mix(b, h)?.0),
        }
    }

    /// Saves what [`DecoderModel::rollback`] needs to return `s` to its current position.
    pub fn snapshot(&self, b: &dyn Backend, s: &SequenceState) -> Result<Snapshot> {
        let delta = s
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Delta(d) => {
                    Ok(Some(DeltaState { conv: b.clone_state(&d.conv)?, recurrent: b.clone_state(&d.recurrent)? }))
                }
                LayerState::Attention(..) => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let ple = s.ple.iter().map(|p| p.clone_with(b)).collect::<Result<Vec<_>>>()?;
        Ok(Snapshot { position: s.position, delta, ple })
    }

    /// Returns `s` to where it was when `snap` was taken.
    pub fn rollback(&self, b: &dyn Backend, s: &mut SequenceState, snap: Snapshot) -> Result<()> {
        for ((layer, st), saved) in self.layers.iter().zip(s.layers.iter_mut()).zip(snap.delta) {
            match (st, saved) {
                (LayerState::Delta(d), Some(saved)) => *d = saved,
                (LayerState::Attention(cache, idx), None) => {
                    b.kv_truncate(cache, snap.position)?;
                    if let (Some(idx), Mixer::Attention(a)) = (idx, &layer.mixer) {
                        if let Some(ix) = &a.indexer {
                            idx.truncate(snap.position, ix.head_dim, ix.ratio);
                        }
                    }
                }
                _ => bail!("a snapshot does not match the sequence state"),
            }
        }
        s.ple = snap.ple;
        s.position = snap.position;
        Ok(())
    }

    pub(crate) fn clone_layer_state(&self, b: &dyn Backend, l: &LayerState) -> Result<LayerState> {
        Ok(match l {
            LayerState::Attention(c, idx) => LayerState::Attention(b.clone_state(c)?, idx.clone()),
            LayerState::Delta(d) => {
                LayerState::Delta(DeltaState { conv: b.clone_state(&d.conv)?, recurrent: b.clone_state(&d.recurrent)? })
            }
        })
    }

    /// Deep copy of a sequence's state.
    pub fn clone_state(&self, b: &dyn Backend, s: &SequenceState) -> Result<SequenceState> {
        let layers = s.layers.iter().map(|l| self.clone_layer_state(b, l)).collect::<Result<Vec<_>>>()?;
        let ple = s.ple.iter().map(|p| p.clone_with(b)).collect::<Result<Vec<_>>>()?;
        let mtp = s.mtp.as_ref().map(|m| m.clone_with(b, self)).transpose()?;
        Ok(SequenceState { layers, ple, mtp, position: s.position })
    }
}

/// One decoder layer over `x` (`[tokens, streams*hidden]`); `ids` are the
/// tokens of this call, the first at position `start`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_forward(
    b: &dyn Backend,
    layer: &DecoderLayer,
    x: &Tensor,
    ids: &[u32],
    start: usize,
    st: &mut LayerState,
    ple: Option<(&Ple, Vec<f32>, &mut PleState)>,
    experts: &mut ExpertCache,
) -> Result<Tensor> {
    let mut mixer = |input: &Tensor| -> Result<Tensor> {
        match (&layer.mixer, &mut *st) {
            (Mixer::Attention(a), LayerState::Attention(cache, idx)) => a.forward(b, input, cache, idx.as_mut(), start),
            (Mixer::Delta(d), LayerState::Delta(ds)) => d.forward(b, input, ds),
            _ => bail!("sequence state does not match the layer kind"),
        }
    };
    let ffn = |input: &Tensor, experts: &mut ExpertCache| -> Result<Tensor> {
        match &layer.ffn {
            FeedForward::Dense(m) => m.forward(b, input),
            FeedForward::Moe(m) => m.forward(b, input, experts),
        }
    };
    match &layer.residual {
        Residual::PreNorm { input, post } => {
            let h = b.add(x, &mixer(&input.forward(b, x)?)?)?;
            let ff = ffn(&post.forward(b, &h)?, experts)?;
            Ok(b.add(&h, &ff)?)
        }
        Residual::Hyper { attn, mlp } => {
            let mut h = x.clone();
            if let Some((p, emb, ps)) = ple {
                h = b.add(&h, &p.forward(b, &h, ids, emb, ps)?)?;
            }
            h = attn.apply(b, &h, &mut mixer)?;
            mlp.apply(b, &h, &mut |input| ffn(input, experts))
        }
    }
}

/// How a checkpoint stores its experts and norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// transformers: one tensor per expert (`mlp.experts.{e}.gate_proj`).
    HuggingFace,
    /// mlx-lm: experts stacked (`mlp.switch_mlp.gate_proj`).
    Mlx,
}

impl Layout {
    /// Decided from the first MoE layer's tensor names.
    pub fn detect(ck: &Checkpoint, moe_layer: Option<usize>) -> Result<Layout> {
        let Some(l) = moe_layer else { return Ok(Layout::Mlx) };
        let p = format!("model.layers.{l}.mlp");
        if ck.has(&format!("{p}.switch_mlp.gate_proj.weight")) {
            Ok(Layout::Mlx)
        } else if ck.has(&format!("{p}.experts.0.gate_proj.weight")) {
            Ok(Layout::HuggingFace)
        } else {
            bail!(
                "cannot find layer {l}'s experts in {}: expected '{p}.switch_mlp.gate_proj.weight' (mlx-lm) \
                 or '{p}.experts.0.gate_proj.weight' (transformers)",
                ck.dir.display()
            )
        }
    }
}

/// How many expert slots to give the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertSlots {
    /// One slot per expert of every layer: nothing is ever evicted.
    All,
    /// A fixed number of slots (at least one token's experts).
    Count(usize),
}

/// Options for [`load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub expert_slots: ExpertSlots,
    /// Load the MTP head when the checkpoint has one.
    pub mtp: bool,
    /// Bound of the dequantized n-gram row cache (qwen4_exp's PLE).
    pub ngram_cache_bytes: usize,
    /// When the pool has a slot for every expert, read them all at load, so
    /// that a resident model's first tokens wait on no reads.
    pub preload_experts: bool,
}

/// Default bound of the n-gram row cache.
pub const DEFAULT_NGRAM_CACHE_BYTES: usize = 64 << 20;

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { expert_slots: ExpertSlots::All, mtp: false, ngram_cache_bytes: DEFAULT_NGRAM_CACHE_BYTES, preload_experts: false }
    }
}

/// Puts a family's loaded parts together, with the expert pool.
#[allow(clippy::too_many_arguments)]
pub(crate) fn assemble(
    b: &dyn Backend,
    ck: &Checkpoint,
    c: &config::MoeConfig,
    layout: Layout,
    trunk: Trunk,
    layers: Vec<DecoderLayer>,
    moe_prefixes: &[String],
    opts: &LoadOptions,
) -> Result<DecoderModel> {
    let experts = Mutex::new(expert_cache(b, ck, layout, moe_prefixes, c, opts)?);
    Ok(DecoderModel {
        model_type: c.model_type.clone(),
        embed: trunk.embed,
        layers,
        streams: trunk.streams,
        head: trunk.head,
        lm_head: trunk.lm_head,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        experts,
        top_k: c.num_experts_per_tok,
        resident_bytes: ck.bytes_where(|n| !crate::experts::is_streamed_tensor(n)) as usize,
        unused_tensors: ck.unused(),
        mtp: None,
    })
}

/// Locates the routed experts of `moe_prefixes` and creates the slot pool.
pub(crate) fn expert_cache(
    b: &dyn Backend,
    ck: &Checkpoint,
    layout: Layout,
    moe_prefixes: &[String],
    c: &config::MoeConfig,
    opts: &LoadOptions,
) -> Result<ExpertCache> {
    let store = ExpertStore::new(ck, moe_prefixes, layout == Layout::Mlx, c.num_experts, c.hidden_size, c.moe_intermediate_size)?;
    let total = moe_prefixes.len() * c.num_experts;
    let slots = match opts.expert_slots {
        ExpertSlots::All => total,
        ExpertSlots::Count(n) => {
            let min = ExpertCache::min_slots(c.num_experts_per_tok);
            if n < min {
                bail!("an expert pool of {n} slots is too small: one token uses {min} experts");
            }
            n.min(total)
        }
    };
    let mut cache = ExpertCache::new(b, store, slots.max(1))?;
    if opts.preload_experts && slots >= total {
        cache.load_all(b)?;
    }
    Ok(cache)
}

/// Reads `config.json`, opens the checkpoint and builds the model on `backend`.
pub fn load(dir: &Path, backend: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {} (is {} a model directory?)", config_path.display(), dir.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", config_path.display()))?;
    check_model_type(&config, &config_path)?;
    let model_type = config.get("model_type").and_then(|m| m.as_str()).unwrap_or("");
    let quant = QuantConfig::from_config(&config).with_context(|| format!("in {}", config_path.display()))?;
    let ck = Checkpoint::open(dir, quant)?;
    let result = match model_type {
        "qwen3_moe" => qwen3_moe::load(&config, &ck, backend, opts),
        "qwen4_exp" => qwen4_exp::load(&config, ck, backend, opts),
        _ => qwen3_next::load(&config, &ck, backend, opts),
    };
    result.with_context(|| format!("loading the {model_type} model in {}", dir.display()))
}

/// Fails with a clear message unless `config.json` names a family we run.
pub fn check_model_type(config: &serde_json::Value, config_path: &Path) -> Result<()> {
    match config.get("model_type").and_then(|m| m.as_str()).unwrap_or("") {
        "qwen3_moe" | "qwen3_next" | "qwen4_exp" => Ok(()),
        "" => bail!("{} has no 'model_type'", config_path.display()),
        other => bail!(
            "model_type '{other}' in {} is not supported (supported: qwen3_moe, qwen3_next, qwen4_exp)",
            config_path.display()
        ),
    }
}

/// The parts every family shares: embeddings, final norm, head.
pub(crate) struct Trunk {
    pub embed: Weight,
    pub streams: usize,
    pub head: Head,
    pub lm_head: Weight,
}

pub(crate) fn load_trunk(
    b: &dyn Backend,
    ck: &Checkpoint,
    c: &config::MoeConfig,
    norm_shift: f32,
) -> Result<Trunk> {
    let (v, h) = (c.vocab_size, c.hidden_size);
    let embed = layers::linear(b, ck, "model.embed_tokens", v, h)?;
    let lm_head = if c.tie_word_embeddings || !ck.has("lm_head.weight") {
        if !c.tie_word_embeddings {
            bail!("the checkpoint has no 'lm_head.weight' and config.json does not set tie_word_embeddings");
        }
        embed.clone()
    } else {
        layers::linear(b, ck, "lm_head", v, h)?
    };
    let final_norm = RmsNorm { weight: layers::vector(b, ck, "model.norm.weight", h, norm_shift)?, eps: c.rms_norm_eps };
    Ok(Trunk { embed, streams: 1, head: Head::Norm(final_norm), lm_head })
}
