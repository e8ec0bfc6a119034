//! `qwen3_moe` (Qwen3-30B-A3B and relatives): every layer full attention with
//! q/k RMSNorm and full RoPE; routed experts (optionally dense MLP layers via
//! `mlp_only_layers` / `decoder_sparse_step`); plain `x * w` RMSNorm in both layouts.

use anyhow::Result;
use slotstream_backend::Backend;

use super::arch::ModelArch;
use super::blocks::attention::Attention;
use super::blocks::weights::LoadCx;
use super::decoder::DecoderModel;
use super::layer::{DecoderLayer, Mixer};
use super::load::{assemble, feed_forward, pre_norm, Layout, Trunk};
use super::options::LoadOptions;

pub fn load(arch: &ModelArch, b: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let ck = arch.open_checkpoint()?;
    let cx = LoadCx { b, ck: &ck, arch, opts };
    let c = &arch.text;
    let (h, hd, heads, kvh) = (c.hidden_size, c.head_dim(), c.num_attention_heads, c.kv_heads());
    let layout = Layout::detect(&ck, arch.first_moe_layer())?;
    let trunk = Trunk::with_final_norm(&cx, 0.0)?;
    let mut layers = Vec::with_capacity(arch.layers());
    let mut moe_prefixes = Vec::new();
    for i in 0..arch.layers() {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let attention = Attention {
            qkv: cx.linears(&[
                ("q", format!("{a}.q_proj"), heads * hd, h),
                ("k", format!("{a}.k_proj"), kvh * hd, h),
                ("v", format!("{a}.v_proj"), kvh * hd, h),
            ])?,
            o_proj: cx.linear(&format!("{a}.o_proj"), h, heads * hd)?,
            q_norm: cx.rms_norm(&format!("{a}.q_norm.weight"), hd, 0.0)?,
            k_norm: cx.rms_norm(&format!("{a}.k_norm.weight"), hd, 0.0)?,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            rotary_dim: hd,
            rope: c.rope(),
            gated: false,
            selector: None,
        };
        let ffn = feed_forward(&cx, &p, i, 0, &mut moe_prefixes)?;
        layers.push(DecoderLayer {
            residual: pre_norm(&cx, &p, 0.0)?,
            mixer: Mixer::Attention(attention),
            ffn,
        });
    }
    assemble(&cx, layout, trunk, layers, &moe_prefixes)
}
