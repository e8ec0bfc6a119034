//! `qwen4_exp` (Qwen3.8-Flash-Next): qwen3_next's hybrid of Gated DeltaNet and
//! gated full attention, with
//! - hyper-connections ([`hyper`]): 4 residual streams mixed before every
//!   block and collapsed before `lm_head` (no final norm: the collapse carries it);
//! - Gated DeltaNet with split projections and a sigmoid output gate;
//! - QSA ([`qsa`]): an indexer that limits each query to the best key blocks
//!   once the context outgrows its budget;
//! - PLE ([`ple`], [`ngram`]): an n-gram embedding added to the streams at one
//!   layer, its 32 GB table streamed from disk by row;
//! - MTP ([`mtp`]): a draft head for speculative decoding.
//!
//! The checkpoint is multimodal: text tensors live under `language_model.`,
//! the vision tower is skipped. Norm weights are stored as the multiplier the
//! model applies (the MLX conversion already added one), so none is shifted.

pub mod hyper;
pub mod mtp;
pub mod ngram;
pub mod ple;
pub mod qsa;

use std::sync::Arc;

use anyhow::{Context, Result};
use slotstream_backend::Backend;

use super::config::Qwen4Config;
use hyper::{HyperMixer, HyperResidual};
use mtp::MtpHead;
use ple::Ple;

use super::arch::{LayerKind, ModelArch};
use super::blocks::delta::GatedDeltaNet;
use super::blocks::moe::MoeBlock;
use super::decoder::DecoderModel;
use super::layer::{DecoderLayer, FeedForward, Mixer};
use super::blocks::weights::LoadCx;
use super::load::{assemble, Layout, Trunk};
use super::options::LoadOptions;

/// Gated DeltaNet with one projection per part and the configured output gate.
fn delta_net(cx: &LoadCx<'_>, l: &str, q: &Qwen4Config) -> Result<GatedDeltaNet> {
    let d = cx.arch.delta_dims()?;
    let h = cx.arch.text.hidden_size;
    let channels = d.conv_channels();
    let value_total = d.value_heads * d.value_dim;
    Ok(GatedDeltaNet {
        projections: cx.linears(&[
            ("qkv", format!("{l}.in_proj_qkv"), channels, h),
            ("z", format!("{l}.in_proj_z"), value_total, h),
            ("b", format!("{l}.in_proj_b"), d.value_heads, h),
            ("a", format!("{l}.in_proj_a"), d.value_heads, h),
        ])?,
        gate_act: q.gate_act()?,
        conv_weight: cx.conv_weight(&format!("{l}.conv1d.weight"), channels, d.conv_kernel)?,
        a_log: cx.vector(&format!("{l}.A_log"), d.value_heads, 0.0)?,
        dt_bias: cx.vector(&format!("{l}.dt_bias"), d.value_heads, 0.0)?,
        norm: cx.vector(&format!("{l}.norm.weight"), d.value_dim, 0.0)?,
        out_proj: cx.linear(&format!("{l}.out_proj"), h, value_total)?,
        dims: d,
        eps: cx.arch.text.rms_norm_eps,
    })
}

pub fn load(arch: &ModelArch, b: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let q = arch.qwen4.as_ref().context("internal: a qwen4_exp model without its settings")?;
    let ck = Arc::new(arch.open_checkpoint()?);
    let cx = LoadCx { b, ck: &ck, arch, opts };
    let c = &arch.text;
    let eos = *arch.eos_ids().first().context("config.json text_config has no eos_token_id (the n-gram hash needs it)")?;
    let (embed, lm_head) = Trunk::embeddings(&cx)?;
    let trunk = Trunk {
        embed,
        streams: q.hc_count,
        head: Box::new(HyperMixer::load(&cx, "model.hyper_connection_mixer", false)?),
        lm_head,
    };
    let mut layers = Vec::with_capacity(arch.layers());
    let mut moe_prefixes = Vec::new();
    for i in 0..arch.layers() {
        let p = format!("model.layers.{i}");
        let mixer = match arch.layer_kind(i) {
            LayerKind::FullAttention => Mixer::Attention(qsa::gated_attention(&cx, &format!("{p}.self_attn"))?),
            LayerKind::LinearAttention => Mixer::Delta(delta_net(&cx, &format!("{p}.linear_attn"), q)?),
        };
        let ple = if q.ple_layer_ids.contains(&(i + 1)) { Some(Ple::load(&cx, &ck, &format!("{p}.ple"), eos)?) } else { None };
        let m = format!("{p}.mlp");
        // A softmax over the selected logits equals the full softmax renormalised.
        let ffn = FeedForward::Moe(MoeBlock::load(&cx, &m, c.shared_expert_intermediate_size, moe_prefixes.len(), true)?);
        moe_prefixes.push(m);
        layers.push(DecoderLayer {
            residual: Box::new(HyperResidual {
                attn: HyperMixer::load(&cx, &format!("{p}.attn_hyper_connection"), true)?,
                mlp: HyperMixer::load(&cx, &format!("{p}.mlp_hyper_connection"), true)?,
                ple,
            }),
            mixer,
            ffn,
        });
    }
    let mut model = assemble(&cx, Layout::Mlx, trunk, layers, &moe_prefixes)?;
    let mtp_path = arch.dir.join("mtp.safetensors");
    if opts.mtp && mtp_path.exists() {
        let head = MtpHead::load(&cx, &mtp_path).with_context(|| format!("loading the MTP head {}", mtp_path.display()))?;
        model.draft = Some(Box::new(head));
    }
    Ok(model)
}
