//! Hyper-connections: the hidden state is `streams` parallel copies of the
//! residual stream, `[tokens, streams*hidden]`. Before a block (mixer or MoE),
//! a [`HyperMixer`] normalises each stream, derives per-element mixing weights
//! through a low-rank bottleneck and averages the weighted streams into the
//! block's input; the block's output is then added to every stream with a
//! learned per-stream injection weight. A final mixer without injection
//! collapses the streams before `lm_head`.

use anyhow::{Context, Result};
use slotstream_backend::{Backend, State, Tensor, Weight};

use super::ple::Ple;
use crate::model::layer::{Block, Head, ReadAhead, Residual, ResidualInputs, RowCacheStats, RunBlock};
use crate::model::blocks::weights::LoadCx;

/// One gated-residual block: `hc_norm`, `input_mix_weight_down/up` and (except
/// for the final collapse) `block_inject_weight`.
pub struct HyperMixer {
    /// Per-stream RMSNorm weight, `[streams*hidden]`.
    pub norm: Tensor,
    /// `[lowrank, streams*hidden]`.
    pub down: Weight,
    /// `[streams*hidden, lowrank]`.
    pub up: Weight,
    /// `[streams, streams*hidden]`; `None` for the final collapse.
    pub inject: Option<Weight>,
    pub streams: usize,
    pub hidden: usize,
    pub eps: f32,
}

impl HyperMixer {
    pub fn load(cx: &LoadCx<'_>, p: &str, inject: bool) -> Result<HyperMixer> {
        let q = cx.arch.qwen4.as_ref().context("internal: hyper-connections without qwen4_exp settings")?;
        let (h, hc) = (cx.arch.text.hidden_size, q.hc_count);
        Ok(HyperMixer {
            norm: cx.vector(&format!("{p}.hc_norm.weight"), hc * h, 0.0)?,
            down: cx.linear(&format!("{p}.input_mix_weight_down"), q.hc_lowrank, hc * h)?,
            up: cx.linear(&format!("{p}.input_mix_weight_up"), hc * h, q.hc_lowrank)?,
            inject: if inject { Some(cx.linear(&format!("{p}.block_inject_weight"), hc, hc * h)?) } else { None },
            streams: hc,
            hidden: h,
            eps: cx.arch.text.rms_norm_eps,
        })
    }

    /// The block input `[tokens, hidden]` mixed from `h`, and the injection
    /// logits `[tokens, streams]` (when this mixer injects).
    pub fn mix(&self, b: &dyn Backend, h: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let normed = b.rms_norm(h, Some(&self.norm), self.hidden, self.eps)?;
        let low = b.silu(&b.scale(&b.matmul(&normed, &self.down)?, 1.0 / self.streams as f32)?)?;
        let mix = b.matmul(&low, &self.up)?;
        let x = b.sigmoid_weighted_stream_mean(&normed, &mix, self.streams)?;
        let inject = match &self.inject {
            Some(w) => Some(b.matmul(&normed, w)?),
            None => None,
        };
        Ok((x, inject))
    }

    /// `h` with `block(mixed input)` injected into every stream.
    pub fn apply(&self, b: &dyn Backend, h: &Tensor, block: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let (x, logits) = self.mix(b, h)?;
        let logits = logits.context("a hyper-connection block without injection weights wraps a layer")?;
        let y = block(&x)?;
        Ok(b.add_gated_to_streams(h, &y, &logits, 1.0 / self.streams as f32)?)
    }
}

impl Head for HyperMixer {
    fn collapse(&self, b: &dyn Backend, h: &Tensor) -> Result<Tensor> {
        Ok(self.mix(b, h)?.0)
    }
}

/// A qwen4_exp layer's wiring: PLE (on its layers) adds the n-gram embedding
/// to the streams, then the mixer and the MoE each run inside a hyper-connection.
pub struct HyperResidual {
    pub attn: HyperMixer,
    pub mlp: HyperMixer,
    pub ple: Option<Ple>,
}

impl Residual for HyperResidual {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn new_state(&self, b: &dyn Backend) -> Result<Vec<State>> {
        Ok(match &self.ple {
            Some(p) => vec![p.new_state(b)?],
            None => Vec::new(),
        })
    }

    fn token_context(&self) -> usize {
        self.ple.as_ref().map_or(0, |p| p.token_context())
    }

    fn uses_token_ids(&self) -> bool {
        self.ple.is_some()
    }

    fn read_ahead<'a>(&'a self, ids: &'a [u32], recent: &[u32]) -> Option<ReadAhead<'a>> {
        let p = self.ple.as_ref()?;
        let context = p.context(recent);
        Some(Box::new(move || p.fetch(ids, &context)))
    }

    fn row_cache_stats(&self) -> Option<RowCacheStats> {
        self.ple.as_ref().map(|p| p.store.stats())
    }

    fn forward(&self, b: &dyn Backend, x: &Tensor, inputs: ResidualInputs<'_>, block: RunBlock<'_>) -> Result<Tensor> {
        let mut h = x.clone();
        if let Some(p) = &self.ple {
            let rows = inputs.read_ahead.context("internal: the PLE layer's n-gram rows were not read")?;
            let conv = inputs.state.first_mut().context("internal: the PLE layer has no convolution state")?;
            h = b.add(&h, &p.forward(b, &h, inputs.ids, rows, conv)?)?;
        }
        h = self.attn.apply(b, &h, &mut |x| block(Block::Mixer, x))?;
        self.mlp.apply(b, &h, &mut |x| block(Block::FeedForward, x))
    }
}
