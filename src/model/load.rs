//! What every family's loader shares besides reading weights: the expert
//! layout, the trunk (embeddings, head, `lm_head`), the expert pool, and
//! putting a [`DecoderModel`] together.

use std::sync::Mutex;

use anyhow::{bail, Result};
use slotstream_backend::Weight;

use super::arch::ModelArch;
use super::blocks::weights::LoadCx;
use super::decoder::DecoderModel;
use super::blocks::mlp::Mlp;
use super::blocks::moe::MoeBlock;
use super::layer::{DecoderLayer, FeedForward, Head, PreNorm};
use super::options::ExpertSlots;
use crate::checkpoint::Checkpoint;
use crate::experts::{ExpertCache, ExpertStore, ExpertTensors};

/// How a checkpoint stores its experts and norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// transformers: one tensor per expert (`mlp.experts.{e}.gate_proj`), or
    /// since transformers 5 gate and up fused (`mlp.experts.gate_up_proj`).
    HuggingFace { fused: bool },
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
            Ok(Layout::HuggingFace { fused: false })
        } else if ck.has(&format!("{p}.experts.gate_up_proj")) {
            Ok(Layout::HuggingFace { fused: true })
        } else {
            bail!(
                "cannot find layer {l}'s experts in {}: expected '{p}.switch_mlp.gate_proj.weight' (mlx-lm), \
                 '{p}.experts.0.gate_proj.weight' or '{p}.experts.gate_up_proj' (transformers)",
                ck.dir.display()
            )
        }
    }

    /// Whether the checkpoint is in transformers' layout (zero-centred norms
    /// where the family has them).
    pub fn is_transformers(self) -> bool {
        matches!(self, Layout::HuggingFace { .. })
    }

    pub fn expert_tensors(self) -> ExpertTensors {
        match self {
            Layout::Mlx => ExpertTensors::Stacked,
            Layout::HuggingFace { fused: false } => ExpertTensors::PerExpert,
            Layout::HuggingFace { fused: true } => ExpertTensors::Fused,
        }
    }
}

/// Layer `layer`'s feed-forward under `{prefix}.mlp`: routed experts (the
/// block's prefix is added to `moe_prefixes`, in order) or a dense MLP.
pub fn feed_forward(cx: &LoadCx<'_>, prefix: &str, layer: usize, shared_inter: usize, moe_prefixes: &mut Vec<String>)
    -> Result<FeedForward> {
    let c = &cx.arch.text;
    let m = format!("{prefix}.mlp");
    if !cx.arch.is_moe_layer(layer) {
        return Ok(FeedForward::Dense(Mlp::load(cx, &m, c.hidden_size, c.dense_intermediate(layer)?)?));
    }
    let block = MoeBlock::load(cx, &m, shared_inter, moe_prefixes.len(), c.norm_topk_prob)?;
    moe_prefixes.push(m);
    Ok(FeedForward::Moe(block))
}

/// The pre-norm wiring of the layer under `prefix` (`shift` added to both norms).
pub fn pre_norm(cx: &LoadCx<'_>, prefix: &str, shift: f32) -> Result<Box<PreNorm>> {
    let h = cx.arch.text.hidden_size;
    Ok(Box::new(PreNorm {
        input: cx.rms_norm(&format!("{prefix}.input_layernorm.weight"), h, shift)?,
        post: cx.rms_norm(&format!("{prefix}.post_attention_layernorm.weight"), h, shift)?,
    }))
}

/// Embeddings, the head (final norm or stream collapse) and `lm_head`.
pub struct Trunk {
    pub embed: Weight,
    pub streams: usize,
    pub head: Box<dyn Head>,
    pub lm_head: Weight,
}

impl Trunk {
    /// The embedding table, and `lm_head` (or the table again when tied).
    pub fn embeddings(cx: &LoadCx<'_>) -> Result<(Weight, Weight)> {
        let c = &cx.arch.text;
        let (v, h) = (c.vocab_size, c.hidden_size);
        let embed = cx.linear("model.embed_tokens", v, h)?;
        let lm_head = if c.tie_word_embeddings {
            embed.clone()
        } else if cx.ck.has("lm_head.weight") {
            cx.linear("lm_head", v, h)?
        } else {
            bail!("the checkpoint has no 'lm_head.weight' and config.json does not set tie_word_embeddings");
        };
        Ok((embed, lm_head))
    }

    /// One residual stream and a final RMSNorm (`norm_shift` added to its weight).
    pub fn with_final_norm(cx: &LoadCx<'_>, norm_shift: f32) -> Result<Trunk> {
        let (embed, lm_head) = Self::embeddings(cx)?;
        let norm = cx.rms_norm("model.norm.weight", cx.arch.text.hidden_size, norm_shift)?;
        Ok(Trunk { embed, streams: 1, head: Box::new(norm), lm_head })
    }
}

/// Puts a family's loaded parts together, with the expert pool of the MoE
/// blocks under `moe_prefixes`.
pub fn assemble(cx: &LoadCx<'_>, layout: Layout, trunk: Trunk, layers: Vec<DecoderLayer>, moe_prefixes: &[String])
    -> Result<DecoderModel> {
    // The MoE blocks whose shared expert a pool slot may hold: those that
    // run it from one fused gate-and-up weight (`Backend::moe_shared`).
    let shared: Vec<bool> = layers
        .iter()
        .filter_map(|l| match &l.ffn {
            FeedForward::Moe(m) => Some(m.shared.as_ref().is_some_and(|s| s.inputs.single().is_some())),
            FeedForward::Dense(_) => None,
        })
        .collect();
    let experts = Mutex::new(expert_cache(cx, layout, moe_prefixes, cx.opts.expert_slots, &shared)?);
    let token_context = layers.iter().map(|l| l.residual.token_context()).max().unwrap_or(0);
    Ok(DecoderModel {
        arch: cx.arch.clone(),
        embed: trunk.embed,
        layers,
        streams: trunk.streams,
        head: trunk.head,
        lm_head: trunk.lm_head,
        experts,
        resident_bytes: cx.ck.bytes_where(|n| !ModelArch::is_streamed_tensor(n)) as usize,
        unused_tensors: cx.ck.unused(),
        token_context,
        draft: None,
    })
}

/// Locates the routed experts of `moe_prefixes` (and the shared experts of
/// those `shared` flags) and creates the slot pool.
pub fn expert_cache(cx: &LoadCx<'_>, layout: Layout, moe_prefixes: &[String], slots: ExpertSlots, shared: &[bool]) -> Result<ExpertCache> {
    let c = &cx.arch.text;
    let (experts, hidden, inter) = (c.num_experts, c.hidden_size, c.moe_intermediate_size);
    let mut store = ExpertStore::new(cx.ck, moe_prefixes, layout.expert_tensors(), experts, hidden, inter, cx.opts.read_threads, shared)?;
    if !cx.opts.reuse_read_buffers {
        store.keep_read_buffers(0);
    }
    let total = moe_prefixes.len() * c.num_experts;
    let slots = match slots {
        ExpertSlots::All => total,
        ExpertSlots::Count(n) => {
            let min = ExpertCache::min_slots(c.num_experts_per_tok);
            if n < min {
                bail!("an expert pool of {n} slots is too small: one token uses {min} experts");
            }
            n.min(total)
        }
    };
    let mut cache = ExpertCache::new(cx.b, store, slots.max(1))?;
    if let Some(n) = cx.opts.read_ahead {
        cache.read_ahead = n;
    }
    cache.write_as_landed = cx.opts.write_as_landed;
    cache.ahead_start = cx.opts.ahead_start;
    cache.set_eviction(cx.opts.eviction);
    if let Some(path) = &cx.opts.routing_trace {
        cache.trace_routing(path)?;
    }
    if cx.opts.preload_experts && slots >= total {
        cache.load_all(cx.b)?;
    }
    Ok(cache)
}
