//! `qwen3_next` (Qwen3-Next-80B-A3B): Gated DeltaNet in three of every four
//! layers, gated full attention with partial RoPE in the rest, routed experts
//! plus a sigmoid-gated shared expert.
//!
//! Layout differences handled here: transformers stores the decoder norms
//! zero-centred (the model multiplies by `1 + w`), mlx-lm stores them already
//! shifted; the Gated DeltaNet's own gated norm is never shifted. The conv
//! weight is `[C, 1, K]` in transformers and `[C, K, 1]` in mlx-lm, the same
//! bytes in both orders.

use anyhow::Result;
use slotstream_backend::{Backend, GateAct};

use super::arch::{LayerKind, ModelArch};
use super::blocks::attention::{Attention, KeySelector};
use super::blocks::delta::GatedDeltaNet;
use super::blocks::projections::{deinterleave_rows, ProjectionPart};
use super::blocks::weights::LoadCx;
use super::decoder::DecoderModel;
use super::layer::{DecoderLayer, Mixer};
use super::load::{assemble, feed_forward, pre_norm, Layout, Trunk};
use super::options::LoadOptions;

/// Gated full attention (qwen3_next, qwen4_exp): `q_proj` interleaves per head
/// [query(hd), gate(hd)] and is regrouped to [queries | gates]; q/k norms get
/// `norm_shift`; partial RoPE; an optional sparse key selector.
pub(crate) fn gated_attention(cx: &LoadCx<'_>, a: &str, norm_shift: f32, selector: Option<Box<dyn KeySelector>>)
    -> Result<Attention> {
    let c = &cx.arch.text;
    let (h, hd, heads, kvh) = (c.hidden_size, c.head_dim(), c.num_attention_heads, c.kv_heads());
    let q = cx.matrix(&format!("{a}.q_proj"), heads * 2 * hd, h)?;
    let q = q.permute_rows(&deinterleave_rows(heads, &[hd, hd]))?;
    Ok(Attention {
        qkv: cx.projections(&[
            ProjectionPart::new("q", q, format!("{a}.q_proj")),
            ProjectionPart::new("k", cx.matrix(&format!("{a}.k_proj"), kvh * hd, h)?, format!("{a}.k_proj")),
            ProjectionPart::new("v", cx.matrix(&format!("{a}.v_proj"), kvh * hd, h)?, format!("{a}.v_proj")),
        ])?,
        o_proj: cx.linear(&format!("{a}.o_proj"), h, heads * hd)?,
        q_norm: cx.rms_norm(&format!("{a}.q_norm.weight"), hd, norm_shift)?,
        k_norm: cx.rms_norm(&format!("{a}.k_norm.weight"), hd, norm_shift)?,
        heads,
        kv_heads: kvh,
        head_dim: hd,
        rotary_dim: (hd as f32 * c.partial_rotary_factor()) as usize,
        rope: c.rope(),
        gated: true,
        selector,
    })
}

/// Gated DeltaNet with qwen3_next's fused projections, grouped per key head:
/// `[q k v z]` and `[b a]`, regrouped so that each part is one block of rows.
fn delta_net(cx: &LoadCx<'_>, l: &str) -> Result<GatedDeltaNet> {
    let arch = cx.arch;
    let d = arch.delta_dims()?;
    let h = arch.text.hidden_size;
    let (nk, nv, dk, dv) = (d.key_heads, d.value_heads, d.key_dim, d.value_dim);
    let r = nv / nk;
    let qkvz = cx.matrix(&format!("{l}.in_proj_qkvz"), 2 * nk * dk + 2 * nv * dv, h)?;
    let qkvz = qkvz.permute_rows(&deinterleave_rows(nk, &[dk, dk, r * dv, r * dv]))?;
    let ba = cx.matrix(&format!("{l}.in_proj_ba"), 2 * nv, h)?;
    let ba = ba.permute_rows(&deinterleave_rows(nk, &[r, r]))?;
    let channels = d.conv_channels();
    Ok(GatedDeltaNet {
        projections: cx.projections(&[
            ProjectionPart::split(&[("qkv", channels), ("z", nv * dv)], qkvz, format!("{l}.in_proj_qkvz"))?,
            ProjectionPart::split(&[("b", nv), ("a", nv)], ba, format!("{l}.in_proj_ba"))?,
        ])?,
        gate_act: GateAct::Silu,
        conv_weight: cx.conv_weight(&format!("{l}.conv1d.weight"), channels, d.conv_kernel)?,
        a_log: cx.vector(&format!("{l}.A_log"), nv, 0.0)?,
        dt_bias: cx.vector(&format!("{l}.dt_bias"), nv, 0.0)?,
        norm: cx.vector(&format!("{l}.norm.weight"), dv, 0.0)?,
        out_proj: cx.linear(&format!("{l}.out_proj"), h, nv * dv)?,
        dims: d,
        eps: arch.text.rms_norm_eps,
    })
}

pub fn load(arch: &ModelArch, b: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    load_hybrid(arch, b, opts, delta_net)
}

/// qwen3_next's trunk, each Gated DeltaNet layer built by `delta_net` from
/// the checkpoint's `{layer}.linear_attn` (the families store its
/// projections differently).
pub(crate) fn load_hybrid(
    arch: &ModelArch,
    b: &dyn Backend,
    opts: &LoadOptions,
    delta_net: fn(&LoadCx<'_>, &str) -> Result<GatedDeltaNet>,
) -> Result<DecoderModel> {
    let ck = arch.open_checkpoint()?;
    let cx = LoadCx { b, ck: &ck, arch, opts };
    let c = &arch.text;
    let layout = Layout::detect(&ck, arch.first_moe_layer())?;
    // transformers' zero-centred norms become plain weights by adding one.
    let shift = if layout.is_transformers() { 1.0 } else { 0.0 };
    let trunk = Trunk::with_final_norm(&cx, shift)?;
    let mut layers = Vec::with_capacity(arch.layers());
    let mut moe_prefixes = Vec::new();
    for i in 0..arch.layers() {
        let p = format!("model.layers.{i}");
        let mixer = match arch.layer_kind(i) {
            LayerKind::FullAttention => Mixer::Attention(gated_attention(&cx, &format!("{p}.self_attn"), shift, None)?),
            LayerKind::LinearAttention => Mixer::Delta(delta_net(&cx, &format!("{p}.linear_attn"))?),
        };
        let ffn = feed_forward(&cx, &p, i, c.shared_expert_intermediate_size, &mut moe_prefixes)?;
        layers.push(DecoderLayer {
            residual: pre_norm(&cx, &p, shift)?,
            mixer,
            ffn,
        });
    }
    assemble(&cx, layout, trunk, layers, &moe_prefixes)
}
