//! `qwen3_next` (Qwen3-Next-80B-A3B): Gated DeltaNet in three of every four
//! layers, gated full attention with partial RoPE in the rest, routed experts
//! plus a sigmoid-gated shared expert.
//!
//! Layout differences handled here: transformers stores the decoder norms
//! zero-centred (the model multiplies by `1 + w`), mlx-lm stores them already
//! shifted; the Gated DeltaNet's own gated norm is never shifted. The conv
//! weight is `[C, 1, K]` in transformers and `[C, K, 1]` in mlx-lm, the same
//! bytes in both orders.

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, GateAct};

use super::config::MoeConfig;
use super::qsa::Indexer;
use super::layers::{deinterleave_rows, linear, vector, Attention, DeltaProjections, GatedDeltaNet, Mlp, MoeBlock, Projections, RmsNorm};
use super::{assemble, load_trunk, LoadOptions, DecoderLayer, DecoderModel, Residual, FeedForward, Layout, Mixer};
use crate::checkpoint::Checkpoint;

/// Whether layer `i` is full attention (otherwise Gated DeltaNet).
fn is_full_attention(c: &MoeConfig, i: usize) -> Result<bool> {
    match &c.layer_types {
        Some(types) => match types.get(i).map(|s| s.as_str()) {
            Some("full_attention") => Ok(true),
            Some("linear_attention") => Ok(false),
            Some(other) => bail!("config.json layer_types[{i}] is '{other}' (expected full_attention or linear_attention)"),
            None => bail!("config.json layer_types has {} entries for {} layers", types.len(), c.num_hidden_layers),
        },
        None => Ok((i + 1) % c.full_attention_interval.max(1) == 0),
    }
}

/// Gated full attention (qwen3_next, qwen4_exp): `q_proj` interleaves per head
/// [query(hd), gate(hd)] and is regrouped to [queries | gates]; q/k norms get
/// `norm_shift`; partial RoPE. `indexer` adds qwen4_exp's QSA.
pub(crate) fn gated_attention(
    b: &dyn Backend,
    ck: &Checkpoint,
    a: &str,
    c: &MoeConfig,
    norm_shift: f32,
    indexer: Option<Indexer>,
) -> Result<Attention> {
    let (h, hd, heads, kvh) = (c.hidden_size, c.head_dim(), c.num_attention_heads, c.kv_heads());
    let norm = |name: &str| -> Result<RmsNorm> { Ok(RmsNorm { weight: vector(b, ck, name, hd, norm_shift)?, eps: c.rms_norm_eps }) };
    let q = ck.matrix(&format!("{a}.q_proj"), &[], heads * 2 * hd, h)?;
    let q = q.permute_rows(&deinterleave_rows(heads, &[hd, hd]))?;
    Ok(Attention {
        qkv: Projections::load(
            b,
            &[
                (q, format!("{a}.q_proj")),
                (ck.matrix(&format!("{a}.k_proj"), &[], kvh * hd, h)?, format!("{a}.k_proj")),
                (ck.matrix(&format!("{a}.v_proj"), &[], kvh * hd, h)?, format!("{a}.v_proj")),
            ],
        )?,
        o_proj: linear(b, ck, &format!("{a}.o_proj"), h, heads * hd)?,
        q_norm: norm(&format!("{a}.q_norm.weight"))?,
        k_norm: norm(&format!("{a}.k_norm.weight"))?,
        heads,
        kv_heads: kvh,
        head_dim: hd,
        rotary_dim: (hd as f32 * c.partial_rotary_factor()) as usize,
        rope_theta: c.rope_theta(),
        gated: true,
        indexer,
    })
}

pub fn load(config: &serde_json::Value, ck: &Checkpoint, b: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let c = MoeConfig::parse(config)?;
    let h = c.hidden_size;
    let need = |v: Option<usize>, name: &str| v.with_context(|| format!("config.json is missing '{name}'"));
    let nk = need(c.linear_num_key_heads, "linear_num_key_heads")?;
    let nv = need(c.linear_num_value_heads, "linear_num_value_heads")?;
    let dk = need(c.linear_key_head_dim, "linear_key_head_dim")?;
    let dv = need(c.linear_value_head_dim, "linear_value_head_dim")?;
    if nk == 0 || nv % nk != 0 {
        bail!("config.json: {nv} linear value heads are not a multiple of {nk} key heads");
    }
    let layout = Layout::detect(ck, (0..c.num_hidden_layers).find(|&i| c.is_moe_layer(i)))?;
    // transformers' zero-centred norms become plain weights by adding one.
    let shift = if layout == Layout::HuggingFace { 1.0 } else { 0.0 };
    let trunk = load_trunk(b, ck, &c, shift)?;
    let norm = |name: &str, len: usize| -> Result<RmsNorm> {
        Ok(RmsNorm { weight: vector(b, ck, name, len, shift)?, eps: c.rms_norm_eps })
    };
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    let mut moe_prefixes = Vec::new();
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mixer = if is_full_attention(&c, i)? {
            Mixer::Attention(gated_attention(b, ck, &format!("{p}.self_attn"), &c, shift, None)?)
        } else {
            let l = format!("{p}.linear_attn");
            let r = nv / nk;
            // Fused projections are grouped per key head: [q k v z] and [b a].
            let qkvz = ck.matrix(&format!("{l}.in_proj_qkvz"), &[], 2 * nk * dk + 2 * nv * dv, h)?;
            let qkvz = qkvz.permute_rows(&deinterleave_rows(nk, &[dk, dk, r * dv, r * dv]))?;
            let ba = ck.matrix(&format!("{l}.in_proj_ba"), &[], 2 * nv, h)?;
            let ba = ba.permute_rows(&deinterleave_rows(nk, &[r, r]))?;
            let channels = 2 * nk * dk + nv * dv;
            let conv_name = format!("{l}.conv1d.weight");
            let conv_shape = ck.entry(&conv_name)?.shape.clone();
            let k = c.linear_conv_kernel_dim;
            if conv_shape != [channels, 1, k] && conv_shape != [channels, k, 1] {
                bail!(
                    "tensor '{conv_name}' has shape {conv_shape:?}, expected [{channels}, 1, {k}] (transformers) or [{channels}, {k}, 1] (mlx-lm)"
                );
            }
            let conv = ck.f32_tensor(&conv_name, &conv_shape)?;
            Mixer::Delta(GatedDeltaNet {
                projections: DeltaProjections::Fused(Projections::load(
                    b,
                    &[(qkvz, format!("{l}.in_proj_qkvz")), (ba, format!("{l}.in_proj_ba"))],
                )?),
                gate_act: GateAct::Silu,
                conv_weight: b.upload(&conv, &[channels, k])?,
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
        };
        let ffn = if c.is_moe_layer(i) {
            let m = format!("{p}.mlp");
            FeedForward::Moe(MoeBlock::load(
                b,
                ck,
                &m,
                h,
                c.num_experts,
                c.shared_expert_intermediate_size,
                moe_prefixes.len(),
                c.num_experts_per_tok,
                c.norm_topk_prob,
            )?)
        } else {
            FeedForward::Dense(Mlp::load(b, ck, &format!("{p}.mlp"), h, c.dense_intermediate(i)?)?)
        };
        if let FeedForward::Moe(_) = ffn {
            moe_prefixes.push(format!("{p}.mlp"));
        }
        layers.push(DecoderLayer {
            residual: Residual::PreNorm {
                input: norm(&format!("{p}.input_layernorm.weight"), h)?,
                post: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            },
            ple: None,
            mixer,
            ffn,
        });
    }
    assemble(b, ck, &c, layout, trunk, layers, &moe_prefixes, opts)
}
