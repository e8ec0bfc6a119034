//! `qwen3_5_moe` (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B): qwen3_next's
//! trunk (Gated DeltaNet in three of every four layers, gated attention with
//! partial RoPE, routed experts plus a sigmoid-gated shared expert) with the
//! Gated DeltaNet's projections stored apart: `in_proj_qkv` (all query heads,
//! then keys, then values), `in_proj_z`, `in_proj_b` and `in_proj_a`.
//!
//! The checkpoint is a vision-language one: the settings are under
//! `text_config`, the language model's tensors under `model.language_model.`
//! (transformers) or `language_model.model.` (mlx-lm), renamed on opening
//! (`Checkpoint::keep_language_model`). transformers 5 fuses each layer's
//! experts (`experts.gate_up_proj`), which the expert store reads in place.
//! Text positions are the same in all three of its multimodal RoPE sections,
//! so text runs plain RoPE.

use anyhow::Result;
use slotstream_backend::{Backend, GateAct};

use super::arch::ModelArch;
use super::blocks::delta::GatedDeltaNet;
use super::blocks::projections::ProjectionPart;
use super::blocks::weights::LoadCx;
use super::decoder::DecoderModel;
use super::options::LoadOptions;
use super::qwen3_next::load_hybrid;

fn delta_net(cx: &LoadCx<'_>, l: &str) -> Result<GatedDeltaNet> {
    let arch = cx.arch;
    let d = arch.delta_dims()?;
    let h = arch.text.hidden_size;
    let nv = d.value_heads;
    let channels = d.conv_channels();
    let part = |name: &'static str, tensor: &str, rows: usize| -> Result<ProjectionPart> {
        let module = format!("{l}.{tensor}");
        Ok(ProjectionPart::new(name, cx.matrix(&module, rows, h)?, module))
    };
    Ok(GatedDeltaNet {
        projections: cx.projections(&[
            part("qkv", "in_proj_qkv", channels)?,
            part("z", "in_proj_z", nv * d.value_dim)?,
            part("b", "in_proj_b", nv)?,
            part("a", "in_proj_a", nv)?,
        ])?,
        gate_act: GateAct::Silu,
        conv_weight: cx.conv_weight(&format!("{l}.conv1d.weight"), channels, d.conv_kernel)?,
        a_log: cx.vector(&format!("{l}.A_log"), nv, 0.0)?,
        dt_bias: cx.vector(&format!("{l}.dt_bias"), nv, 0.0)?,
        norm: cx.vector(&format!("{l}.norm.weight"), d.value_dim, 0.0)?,
        out_proj: cx.linear(&format!("{l}.out_proj"), h, nv * d.value_dim)?,
        dims: d,
        eps: arch.text.rms_norm_eps,
    })
}

pub fn load(arch: &ModelArch, b: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    load_hybrid(arch, b, opts, delta_net)
}
