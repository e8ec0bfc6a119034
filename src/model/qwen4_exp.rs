//! `qwen4_exp` (Qwen3.8-Flash-Next): qwen3_next's hybrid of Gated DeltaNet and
//! gated full attention, with
//! - hyper-connections: 4 residual streams mixed before every block and
//!   collapsed before `lm_head` (no final norm: the collapse carries it);
//! - Gated DeltaNet with split projections and a sigmoid output gate;
//! - QSA: an indexer that limits each query to the best key blocks once the
//!   context outgrows its budget;
//! - PLE: an n-gram embedding added to the streams at one layer, its 32 GB
//!   table streamed from disk by row.
//!
//! The checkpoint is multimodal: text tensors live under `language_model.`,
//! the vision tower is skipped. Norm weights are stored as the multiplier the
//! model applies (the MLX conversion already added one), so none is shifted.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use slotstream_backend::{Backend, GateAct};

use super::config::MoeConfig;
use super::hyper::{HyperMixer, Ple};
use super::layers::{linear, vector, Attention, DeltaProjections, GatedDeltaNet, MoeBlock, Projections, RmsNorm};
use super::mtp::MtpHead;
use super::ngram::NgramStore;
use super::qsa::Indexer;
use super::{assemble, DecoderLayer, DecoderModel, FeedForward, Head, Layout, LoadOptions, Mixer, Residual, Trunk};
use crate::checkpoint::Checkpoint;

/// The qwen4_exp settings beyond what [`MoeConfig`] reads.
#[derive(Clone, Debug, Deserialize)]
pub struct Qwen4Config {
    pub hc_count: usize,
    pub hc_lowrank: usize,
    pub indexer_n_heads: usize,
    pub indexer_kv_heads: usize,
    pub indexer_head_dim: usize,
    pub indexer_budget: usize,
    pub indexer_compress_ratio: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub split_ngram_parts: usize,
    pub ple_embed_dim: usize,
    #[serde(default)]
    pub ple_layer_ids: Vec<usize>,
    pub ple_conv_kernel_size: usize,
    #[serde(default = "sigmoid")]
    pub output_gate_type: String,
}

fn sigmoid() -> String {
    "sigmoid".into()
}

/// The text config of a qwen4_exp `config.json` (under `text_config`).
pub fn text_config(config: &serde_json::Value) -> Result<&serde_json::Value> {
    config.get("text_config").context("config.json of a qwen4_exp model has no 'text_config'")
}

impl Qwen4Config {
    pub fn parse(text: &serde_json::Value) -> Result<Qwen4Config> {
        let q: Qwen4Config = serde_json::from_value(text.clone())
            .context("config.json text_config is missing a qwen4_exp field (hyper-connection, indexer or n-gram settings)")?;
        if q.hc_count == 0 || q.indexer_compress_ratio == 0 || q.ngram_size < 2 || q.heads_per_ngram == 0 {
            bail!("config.json text_config: hc_count, indexer_compress_ratio and heads_per_ngram must be positive and ngram_size at least 2");
        }
        if q.indexer_kv_heads != 1 {
            bail!("config.json text_config: indexer_kv_heads {} is not supported (the indexer has one key head)", q.indexer_kv_heads);
        }
        if q.indexer_budget % q.indexer_compress_ratio != 0 || q.indexer_budget == 0 {
            bail!(
                "config.json text_config: indexer_budget {} is not a positive multiple of indexer_compress_ratio {}",
                q.indexer_budget, q.indexer_compress_ratio
            );
        }
        Ok(q)
    }

    pub fn gate_act(&self) -> Result<GateAct> {
        match self.output_gate_type.as_str() {
            "sigmoid" => Ok(GateAct::Sigmoid),
            "silu" | "swish" => Ok(GateAct::Silu),
            other => bail!("config.json text_config: output_gate_type '{other}' is not supported (sigmoid or silu)"),
        }
    }
}

fn is_full_attention(c: &MoeConfig, i: usize) -> Result<bool> {
    match c.layer_types.as_ref().and_then(|t| t.get(i)).map(|s| s.as_str()) {
        Some("full_attention") => Ok(true),
        Some("linear_attention") => Ok(false),
        Some(other) => bail!("config.json layer_types[{i}] is '{other}' (expected full_attention or linear_attention)"),
        None => Ok((i + 1) % c.full_attention_interval.max(1) == 0),
    }
}

fn hyper_mixer(b: &dyn Backend, ck: &Checkpoint, p: &str, c: &MoeConfig, q: &Qwen4Config, inject: bool) -> Result<HyperMixer> {
    let (h, hc) = (c.hidden_size, q.hc_count);
    Ok(HyperMixer {
        norm: vector(b, ck, &format!("{p}.hc_norm.weight"), hc * h, 0.0)?,
        down: linear(b, ck, &format!("{p}.input_mix_weight_down"), q.hc_lowrank, hc * h)?,
        up: linear(b, ck, &format!("{p}.input_mix_weight_up"), hc * h, q.hc_lowrank)?,
        inject: if inject { Some(linear(b, ck, &format!("{p}.block_inject_weight"), hc, hc * h)?) } else { None },
        streams: hc,
        hidden: h,
        eps: c.rms_norm_eps,
    })
}

/// A `[channels, kernel, 1]` (mlx) or `[channels, 1, kernel]` conv weight as `[channels, kernel]`.
fn conv_weight(b: &dyn Backend, ck: &Checkpoint, name: &str, channels: usize, k: usize) -> Result<slotstream_backend::Tensor> {
    let shape = ck.entry(name)?.shape.clone();
    if shape != [channels, 1, k] && shape != [channels, k, 1] {
        bail!("tensor '{name}' has shape {shape:?}, expected [{channels}, {k}, 1]");
    }
    Ok(b.upload(&ck.f32_tensor(name, &shape)?, &[channels, k])?)
}

/// Gated full attention with its QSA indexer.
fn attention(b: &dyn Backend, ck: &Checkpoint, a: &str, c: &MoeConfig, q: &Qwen4Config) -> Result<Attention> {
    let rotary_dim = (c.head_dim() as f32 * c.partial_rotary_factor()) as usize;
    let ihd = q.indexer_head_dim;
    let ix = format!("{a}.indexer");
    let indexer = Indexer {
        qk_proj: linear(b, ck, &format!("{ix}.index_qk_proj"), (q.indexer_n_heads + q.indexer_kv_heads) * ihd, c.hidden_size)?,
        q_norm: ck.f32_tensor(&format!("{ix}.q_layernorm.weight"), &[ihd])?,
        k_norm: ck.f32_tensor(&format!("{ix}.k_layernorm.weight"), &[ihd])?,
        heads: q.indexer_n_heads,
        head_dim: ihd,
        budget: q.indexer_budget,
        ratio: q.indexer_compress_ratio,
        rotary_dim: rotary_dim.min(ihd),
        rope_theta: c.rope_theta(),
        eps: c.rms_norm_eps,
    };
    super::qwen3_next::gated_attention(b, ck, a, c, 0.0, Some(indexer))
}

fn delta_net(b: &dyn Backend, ck: &Checkpoint, l: &str, c: &MoeConfig, q: &Qwen4Config) -> Result<GatedDeltaNet> {
    let h = c.hidden_size;
    let need = |v: Option<usize>, name: &str| v.with_context(|| format!("config.json text_config is missing '{name}'"));
    let nk = need(c.linear_num_key_heads, "linear_num_key_heads")?;
    let nv = need(c.linear_num_value_heads, "linear_num_value_heads")?;
    let dk = need(c.linear_key_head_dim, "linear_key_head_dim")?;
    let dv = need(c.linear_value_head_dim, "linear_value_head_dim")?;
    if nk == 0 || nv % nk != 0 {
        bail!("config.json: {nv} linear value heads are not a multiple of {nk} key heads");
    }
    let channels = 2 * nk * dk + nv * dv;
    let k = c.linear_conv_kernel_dim;
    Ok(GatedDeltaNet {
        projections: DeltaProjections::Split(Projections::linears(
            b,
            ck,
            &[
                (format!("{l}.in_proj_qkv"), channels, h),
                (format!("{l}.in_proj_z"), nv * dv, h),
                (format!("{l}.in_proj_b"), nv, h),
                (format!("{l}.in_proj_a"), nv, h),
            ],
        )?),
        gate_act: q.gate_act()?,
        conv_weight: conv_weight(b, ck, &format!("{l}.conv1d.weight"), channels, k)?,
        a_log: vector(b, ck, &format!("{l}.A_log"), nv, 0.0)?,
        dt_bias: vector(b, ck, &format!("{l}.dt_bias"), nv, 0.0)?,
        norm: vector(b, ck, &format!("{l}.norm.weight"), dv, 0.0)?,
        out_proj: linear(b, ck, &format!("{l}.out_proj"), h, nv * dv)?,
        key_heads: nk,
        value_heads: nv,
        key_dim: dk,
        value_dim: dv,
        conv_kernel: k,
        eps: c.rms_norm_eps,
    })
}

/// The routed experts (softmax over the selected router logits) and the
/// sigmoid-gated shared expert.
fn moe(b: &dyn Backend, ck: &Checkpoint, m: &str, c: &MoeConfig, moe_index: usize) -> Result<MoeBlock> {
    let h = c.hidden_size;
    // A softmax over the selected logits equals the full softmax renormalised.
    MoeBlock::load(b, ck, m, h, c.num_experts, c.shared_expert_intermediate_size, moe_index, c.num_experts_per_tok, true)
}

#[allow(clippy::too_many_arguments)]
fn ple(b: &dyn Backend, ck: &Arc<Checkpoint>, p: &str, c: &MoeConfig, q: &Qwen4Config, eos: u32, opts: &LoadOptions) -> Result<Ple> {
    let (h, hc, e) = (c.hidden_size, q.hc_count, q.ple_embed_dim);
    let heads = (q.ngram_size - 1) * q.heads_per_ngram;
    let row_floats = e / heads.max(1);
    let cache_rows = opts.ngram_cache_bytes / (4 * row_floats.max(1));
    let store = NgramStore::open(
        ck.clone(),
        &format!("{p}.ple_embedding"),
        q.split_ngram_parts,
        e,
        q.ngram_size,
        q.heads_per_ngram,
        eos,
        cache_rows,
    )?;
    let k = q.ple_conv_kernel_size;
    Ok(Ple {
        store,
        key_proj: linear(b, ck, &format!("{p}.key_proj"), hc * h, e)?,
        value_proj: linear(b, ck, &format!("{p}.value_proj"), h, e)?,
        norm_key: vector(b, ck, &format!("{p}.norm_key.weight"), hc * h, 0.0)?,
        norm_query: vector(b, ck, &format!("{p}.norm_query.weight"), hc * h, 0.0)?,
        norm_conv: vector(b, ck, &format!("{p}.norm_conv.weight"), hc * h, 0.0)?,
        conv: conv_weight(b, ck, &format!("{p}.conv1d.weight"), hc * h, k)?,
        kernel: k,
        dilation: q.ngram_size,
        streams: hc,
        hidden: h,
        eps: c.rms_norm_eps,
    })
}

pub fn load(config: &serde_json::Value, mut ck: Checkpoint, b: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let text = text_config(config)?;
    let c = MoeConfig::parse(text)?;
    let q = Qwen4Config::parse(text)?;
    ck.keep_language_model();
    let ck = Arc::new(ck);
    let (h, v) = (c.hidden_size, c.vocab_size);
    let eos = *c.eos_ids().first().context("config.json text_config has no eos_token_id (the n-gram hash needs it)")?;
    let embed = linear(b, &ck, "model.embed_tokens", v, h)?;
    let lm_head = if c.tie_word_embeddings { embed.clone() } else { linear(b, &ck, "lm_head", v, h)? };
    let trunk = Trunk {
        embed,
        streams: q.hc_count,
        head: Head::Hyper(hyper_mixer(b, &ck, "model.hyper_connection_mixer", &c, &q, false)?),
        lm_head,
    };
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    let mut moe_prefixes = Vec::new();
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mixer = if is_full_attention(&c, i)? {
            Mixer::Attention(attention(b, &ck, &format!("{p}.self_attn"), &c, &q)?)
        } else {
            Mixer::Delta(delta_net(b, &ck, &format!("{p}.linear_attn"), &c, &q)?)
        };
        let ple = if q.ple_layer_ids.contains(&(i + 1)) { Some(ple(b, &ck, &format!("{p}.ple"), &c, &q, eos, opts)?) } else { None };
        let ffn = FeedForward::Moe(moe(b, &ck, &format!("{p}.mlp"), &c, moe_prefixes.len())?);
        moe_prefixes.push(format!("{p}.mlp"));
        layers.push(DecoderLayer {
            residual: Residual::Hyper {
                attn: hyper_mixer(b, &ck, &format!("{p}.attn_hyper_connection"), &c, &q, true)?,
                mlp: hyper_mixer(b, &ck, &format!("{p}.mlp_hyper_connection"), &c, &q, true)?,
            },
            ple,
            mixer,
            ffn,
        });
    }
    let mut model = assemble(b, &ck, &c, Layout::Mlx, trunk, layers, &moe_prefixes, opts)?;
    let mtp_path = ck.dir.join("mtp.safetensors");
    if opts.mtp && mtp_path.exists() {
        model.mtp = Some(load_mtp(b, &mtp_path, &c, &q, opts).with_context(|| format!("loading the MTP head {}", mtp_path.display()))?);
    }
    Ok(model)
}

/// The MTP head from `mtp.safetensors` (tensors under `mtp.`, quantized like the main model).
fn load_mtp(b: &dyn Backend, path: &std::path::Path, c: &MoeConfig, q: &Qwen4Config, opts: &LoadOptions) -> Result<MtpHead> {
    let mut ck = Checkpoint::open_file(path, ck_quant_of(path)?)?;
    ck.strip_prefix("mtp.");
    let (h, hc) = (c.hidden_size, q.hc_count);
    let layer = DecoderLayer {
        residual: Residual::Hyper {
            attn: hyper_mixer(b, &ck, "layers.0.attn_hyper_connection", c, q, true)?,
            mlp: hyper_mixer(b, &ck, "layers.0.mlp_hyper_connection", c, q, true)?,
        },
        ple: None,
        mixer: Mixer::Attention(attention(b, &ck, "layers.0.self_attn", c, q)?),
        ffn: FeedForward::Moe(moe(b, &ck, "layers.0.mlp", c, 0)?),
    };
    let experts = super::expert_cache(b, &ck, Layout::Mlx, &["layers.0.mlp".to_string()], c, &LoadOptions { expert_slots: super::ExpertSlots::All, ..opts.clone() })?;
    let head = MtpHead {
        fc_embedding: linear(b, &ck, "fc_embedding", h, h)?,
        fc_hidden: linear(b, &ck, "fc_hidden", h, h)?,
        norm_embedding: RmsNorm { weight: vector(b, &ck, "pre_fc_norm_embedding.weight", h, 0.0)?, eps: c.rms_norm_eps },
        norm_hidden: vector(b, &ck, "pre_fc_norm_hidden.weight", hc * h, 0.0)?,
        layer,
        head: hyper_mixer(b, &ck, "hyper_connection_mixer", c, q, false)?,
        experts: std::sync::Mutex::new(experts),
        streams: hc,
        hidden: h,
        eps: c.rms_norm_eps,
        bytes: ck.bytes_where(|_| true),
    };
    let unused = ck.unused();
    if !unused.is_empty() {
        bail!("mtp.safetensors has tensors the MTP head does not use: {}", unused.join(", "));
    }
    Ok(head)
}

/// The quantization settings of the model whose `mtp.safetensors` is at `path`.
fn ck_quant_of(path: &std::path::Path) -> Result<crate::checkpoint::QuantConfig> {
    let config_path = path.with_file_name("config.json");
    let text = std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)?;
    crate::checkpoint::QuantConfig::from_config(&value)
}
