//! Turning a checkpoint into a [`DecoderModel`]: the family registry, load
//! options, and what every family's loader shares (weights by name, the
//! trunk, the expert pool).

use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, HostMatrix, Tensor, Weight};

use super::arch::{Family, ModelArch};
use super::blocks::norm::RmsNorm;
use super::blocks::projections::{upload, ProjectionPart, Projections};
use super::decoder::DecoderModel;
use super::layer::{DecoderLayer, Head};
use crate::checkpoint::Checkpoint;
use crate::experts::{ExpertCache, ExpertStore};

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
    /// Concatenate linear layers over one input into one weight (one matmul).
    /// Off only for before/after measurements.
    pub fuse_projections: bool,
}

/// Default bound of the n-gram row cache.
pub const DEFAULT_NGRAM_CACHE_BYTES: usize = 64 << 20;

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            expert_slots: ExpertSlots::All,
            mtp: false,
            ngram_cache_bytes: DEFAULT_NGRAM_CACHE_BYTES,
            preload_experts: false,
            fuse_projections: true,
        }
    }
}

impl LoadOptions {
    /// Applies the measurement knob `SLOTSTREAM_FUSED_PROJECTIONS=0` (keep
    /// projections apart). The only place it is read.
    pub fn with_env_overrides(mut self) -> Self {
        if std::env::var("SLOTSTREAM_FUSED_PROJECTIONS").is_ok_and(|v| v == "0") {
            self.fuse_projections = false;
        }
        self
    }
}

/// Builds the model `arch` describes on `backend`.
pub fn load(arch: &ModelArch, backend: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let result = match arch.family {
        Family::Qwen3Moe => super::qwen3_moe::load(arch, backend, opts),
        Family::Qwen3Next => super::qwen3_next::load(arch, backend, opts),
        Family::Qwen4Exp => super::qwen4_exp::load(arch, backend, opts),
    };
    result.with_context(|| format!("loading the {} model in {}", arch.family.model_type(), arch.dir.display()))
}

/// What a family's loader works with: the backend, the checkpoint, its
/// description and the options; weights are fetched by name.
#[derive(Clone, Copy)]
pub struct LoadCx<'a> {
    pub b: &'a dyn Backend,
    pub ck: &'a Checkpoint,
    pub arch: &'a ModelArch,
    pub opts: &'a LoadOptions,
}

impl<'a> LoadCx<'a> {
    /// The same, reading another checkpoint (the MTP head's file).
    pub fn with_checkpoint<'b>(&self, ck: &'b Checkpoint) -> LoadCx<'b>
    where
        'a: 'b,
    {
        LoadCx { b: self.b, ck, arch: self.arch, opts: self.opts }
    }

    pub fn matrix(&self, prefix: &str, rows: usize, cols: usize) -> Result<HostMatrix<'a>> {
        self.ck.matrix(prefix, &[], rows, cols)
    }

    /// `{prefix}` as a `[rows, cols]` linear layer.
    pub fn linear(&self, prefix: &str, rows: usize, cols: usize) -> Result<Weight> {
        upload(self.b, &self.matrix(prefix, rows, cols)?, prefix)
    }

    /// A 1-D float parameter, plus `shift` (for zero-centred norms).
    pub fn vector(&self, name: &str, len: usize, shift: f32) -> Result<Tensor> {
        let mut v = self.ck.f32_tensor(name, &[len])?;
        if shift != 0.0 {
            v.iter_mut().for_each(|x| *x += shift);
        }
        Ok(self.b.upload(&v, &[len])?)
    }

    pub fn rms_norm(&self, name: &str, len: usize, shift: f32) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: self.vector(name, len, shift)?, eps: self.arch.text.rms_norm_eps })
    }

    /// Matrices over one input, fused as the options allow.
    pub fn projections(&self, parts: &[ProjectionPart<'_>]) -> Result<Projections> {
        Projections::load(self.b, parts, self.opts.fuse_projections)
    }

    /// `(output, prefix, rows, cols)` linear layers over one input.
    pub fn linears(&self, specs: &[(&'static str, String, usize, usize)]) -> Result<Projections> {
        let parts = specs
            .iter()
            .map(|(out, p, r, c)| Ok(ProjectionPart::new(out, self.matrix(p, *r, *c)?, p.clone())))
            .collect::<Result<Vec<_>>>()?;
        self.projections(&parts)
    }

    /// A depthwise convolution weight stored `[channels, 1, kernel]`
    /// (transformers) or `[channels, kernel, 1]` (mlx-lm), the same bytes in
    /// both orders, as `[channels, kernel]`.
    pub fn conv_weight(&self, name: &str, channels: usize, k: usize) -> Result<Tensor> {
        let shape = self.ck.entry(name)?.shape.clone();
        if shape != [channels, 1, k] && shape != [channels, k, 1] {
            bail!(
                "tensor '{name}' has shape {shape:?}, expected [{channels}, 1, {k}] (transformers) or [{channels}, {k}, 1] (mlx-lm)"
            );
        }
        Ok(self.b.upload(&self.ck.f32_tensor(name, &shape)?, &[channels, k])?)
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
    let experts = Mutex::new(expert_cache(cx, layout, moe_prefixes, cx.opts.expert_slots)?);
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

/// Locates the routed experts of `moe_prefixes` and creates the slot pool.
pub fn expert_cache(cx: &LoadCx<'_>, layout: Layout, moe_prefixes: &[String], slots: ExpertSlots) -> Result<ExpertCache> {
    let c = &cx.arch.text;
    let store =
        ExpertStore::new(cx.ck, moe_prefixes, layout == Layout::Mlx, c.num_experts, c.hidden_size, c.moe_intermediate_size)?;
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
    if cx.opts.preload_experts && slots >= total {
        cache.load_all(cx.b)?;
    }
    Ok(cache)
}
