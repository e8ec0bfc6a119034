//! Model architectures. Each family lives in its own file and turns a
//! checkpoint into a [`DecoderModel`]; [`load`] picks the family from
//! `config.json`'s `model_type`.

pub mod config;
pub mod layers;
mod qwen3_moe;
mod qwen3_next;

use std::path::Path;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, State, Tensor, Weight};

use crate::checkpoint::{Checkpoint, QuantConfig};
use crate::experts::{ExpertCache, ExpertStore};
use layers::{Attention, DeltaState, GatedDeltaNet, Mlp, MoeBlock, RmsNorm};

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

pub struct DecoderLayer {
    pub input_norm: RmsNorm,
    pub mixer: Mixer,
    pub post_norm: RmsNorm,
    pub ffn: FeedForward,
}

/// Per-layer state of one sequence.
pub enum LayerState {
    Attention(State),
    Delta(DeltaState),
}

/// Everything a sequence carries between forward calls.
pub struct SequenceState {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub position: usize,
}

/// A pre-norm decoder-only MoE transformer: embeddings, layers, final norm, head.
pub struct DecoderModel {
    pub model_type: String,
    pub embed: Weight,
    pub layers: Vec<DecoderLayer>,
    pub final_norm: RmsNorm,
    pub lm_head: Weight,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The routed experts of every MoE layer, streamed into a slot pool.
    pub experts: Mutex<ExpertCache>,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Bytes of everything resident besides the expert pool.
    pub resident_bytes: usize,
}

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

impl DecoderModel {
    pub fn new_state(&self, b: &dyn Backend) -> Result<SequenceState> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => a.new_state(b).map(LayerState::Attention),
                Mixer::Delta(d) => d.new_state(b).map(LayerState::Delta),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SequenceState { layers, position: 0 })
    }

    /// Runs `ids` through the model, extending `state`; returns logits
    /// `[1 or ids.len(), vocab]`.
    pub fn forward(&self, b: &dyn Backend, ids: &[u32], state: &mut SequenceState, which: Logits) -> Result<Tensor> {
        if ids.is_empty() {
            bail!("forward called with no tokens");
        }
        let mut x = b.embed(&self.embed, ids)?;
        let mut experts = self.experts.lock().map_err(|_| anyhow::anyhow!("the expert cache was poisoned by an earlier failure"))?;
        for (i, (layer, st)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            x = self.layer_forward(b, layer, &x, st, &mut experts).with_context(|| format!("layer {i}"))?;
        }
        drop(experts);
        if which == Logits::Last && ids.len() > 1 {
            x = b.slice_rows(&x, ids.len() - 1, 1)?;
        }
        let x = self.final_norm.forward(b, &x)?;
        state.position += ids.len();
        Ok(b.matmul(&x, &self.lm_head)?)
    }

    fn layer_forward(&self, b: &dyn Backend, layer: &DecoderLayer, x: &Tensor, st: &mut LayerState, experts: &mut ExpertCache) -> Result<Tensor> {
        let normed = layer.input_norm.forward(b, x)?;
        let mixed = match (&layer.mixer, st) {
            (Mixer::Attention(a), LayerState::Attention(cache)) => a.forward(b, &normed, cache)?,
            (Mixer::Delta(d), LayerState::Delta(ds)) => d.forward(b, &normed, ds)?,
            _ => bail!("sequence state does not match the layer kind"),
        };
        let h = b.add(x, &mixed)?;
        let normed = layer.post_norm.forward(b, &h)?;
        let ff = match &layer.ffn {
            FeedForward::Dense(m) => m.forward(b, &normed)?,
            FeedForward::Moe(m) => m.forward(b, &normed, experts)?,
        };
        Ok(b.add(&h, &ff)?)
    }

    /// Deep copy of a sequence's state.
    pub fn clone_state(&self, b: &dyn Backend, s: &SequenceState) -> Result<SequenceState> {
        let layers = s
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Attention(c) => LayerState::Attention(b.clone_state(c)?),
                    LayerState::Delta(d) => LayerState::Delta(DeltaState {
                        conv: b.clone_state(&d.conv)?,
                        recurrent: b.clone_state(&d.recurrent)?,
                    }),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SequenceState { layers, position: s.position })
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
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { expert_slots: ExpertSlots::All }
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
    Ok(DecoderModel {
        model_type: c.model_type.clone(),
        embed: trunk.embed,
        layers,
        final_norm: trunk.final_norm,
        lm_head: trunk.lm_head,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        experts: Mutex::new(expert_cache(b, ck, layout, moe_prefixes, c, opts)?),
        top_k: c.num_experts_per_tok,
        resident_bytes: ck.bytes_where(|n| !crate::experts::is_routed_expert_tensor(n)) as usize,
    })
}

/// Locates the routed experts of `moe_prefixes` and creates the slot pool.
fn expert_cache(
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
    ExpertCache::new(b, store, slots.max(1))
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
        _ => qwen3_next::load(&config, &ck, backend, opts),
    };
    result.with_context(|| format!("loading the {model_type} model in {}", dir.display()))
}

/// Fails with a clear message unless `config.json` names a family we run.
pub fn check_model_type(config: &serde_json::Value, config_path: &Path) -> Result<()> {
    match config.get("model_type").and_then(|m| m.as_str()).unwrap_or("") {
        "qwen3_moe" | "qwen3_next" => Ok(()),
        "" => bail!("{} has no 'model_type'", config_path.display()),
        "qwen4_exp" => bail!(
            "{} is Qwen3.8-Flash-Next (model_type qwen4_exp), whose architecture (hyper-connections, \
             n-gram PLE, QSA attention) slotstream does not run yet; supported: qwen3_moe, qwen3_next",
            config_path.display()
        ),
        other => bail!(
            "model_type '{other}' in {} is not supported (supported: qwen3_moe, qwen3_next)",
            config_path.display()
        ),
    }
}

/// The parts every family shares: embeddings, final norm, head.
pub(crate) struct Trunk {
    pub embed: Weight,
    pub final_norm: RmsNorm,
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
    Ok(Trunk { embed, final_norm, lm_head })
}
