//! `qwen3_moe` (Qwen3-30B-A3B and relatives): every layer full attention with
//! q/k RMSNorm and full RoPE; routed experts (optionally dense MLP layers via
//! `mlp_only_layers` / `decoder_sparse_step`); plain `x * w` RMSNorm in both layouts.

use anyhow::Result;
use slotstream_backend::Backend;

use super::config::MoeConfig;
use super::layers::{linear, vector, Attention, Mlp, MoeBlock, Projections, RmsNorm};
use super::{assemble, load_trunk, LoadOptions, DecoderLayer, DecoderModel, Residual, FeedForward, Layout, Mixer};
use crate::checkpoint::Checkpoint;

pub fn load(config: &serde_json::Value, ck: &Checkpoint, b: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let c = MoeConfig::parse(config)?;
    let (h, hd, heads, kvh) = (c.hidden_size, c.head_dim(), c.num_attention_heads, c.kv_heads());
    let layout = Layout::detect(ck, (0..c.num_hidden_layers).find(|&i| c.is_moe_layer(i)))?;
    let trunk = load_trunk(b, ck, &c, 0.0)?;
    let norm = |name: &str, len: usize| -> Result<RmsNorm> {
        Ok(RmsNorm { weight: vector(b, ck, name, len, 0.0)?, eps: c.rms_norm_eps })
    };
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    let mut moe_prefixes = Vec::new();
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let attention = Attention {
            qkv: Projections::linears(
                b,
                ck,
                &[
                    (format!("{a}.q_proj"), heads * hd, h),
                    (format!("{a}.k_proj"), kvh * hd, h),
                    (format!("{a}.v_proj"), kvh * hd, h),
                ],
            )?,
            o_proj: linear(b, ck, &format!("{a}.o_proj"), h, heads * hd)?,
            q_norm: norm(&format!("{a}.q_norm.weight"), hd)?,
            k_norm: norm(&format!("{a}.k_norm.weight"), hd)?,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            rotary_dim: hd,
            rope_theta: c.rope_theta(),
            gated: false,
            indexer: None,
        };
        let ffn = if c.is_moe_layer(i) {
            let m = format!("{p}.mlp");
            FeedForward::Moe(MoeBlock::load(
                b,
                ck,
                &m,
                h,
                c.num_experts,
                0,
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
            mixer: Mixer::Attention(attention),
            ffn,
        });
    }
    assemble(b, ck, &c, layout, trunk, layers, &moe_prefixes, opts)
}
