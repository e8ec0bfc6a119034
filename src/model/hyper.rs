//! Hyper-connections and the per-layer n-gram embedding (PLE) of qwen4_exp.
//!
//! The hidden state is `streams` parallel copies of the residual stream,
//! `[tokens, streams*hidden]`. Before a block (mixer or MoE), a [`HyperMixer`]
//! normalises each stream, derives per-element mixing weights through a
//! low-rank bottleneck and averages the weighted streams into the block's
//! input; the block's output is then added to every stream with a learned
//! per-stream injection weight. A final mixer without injection collapses the
//! streams before `lm_head`.

use anyhow::{Context, Result};
use slotstream_backend::{Backend, State, Tensor, Weight};

use super::ngram::NgramStore;

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

/// The PLE block of one layer: n-gram embedding rows of the token ids, gated
/// against the streams and passed through a dilated causal convolution.
pub struct Ple {
    pub store: NgramStore,
    /// `[streams*hidden, embed_dim]`.
    pub key_proj: Weight,
    /// `[hidden, embed_dim]`.
    pub value_proj: Weight,
    pub norm_key: Tensor,
    pub norm_query: Tensor,
    pub norm_conv: Tensor,
    /// `[streams*hidden, kernel]`.
    pub conv: Tensor,
    pub kernel: usize,
    pub dilation: usize,
    pub streams: usize,
    pub hidden: usize,
    pub eps: f32,
}

/// What a PLE layer carries between calls: the convolution window and the
/// last tokens (the n-gram context).
pub struct PleState {
    pub conv: State,
    pub context: Vec<u32>,
}

impl PleState {
    pub fn clone_with(&self, b: &dyn Backend) -> Result<PleState> {
        Ok(PleState { conv: b.clone_state(&self.conv)?, context: self.context.clone() })
    }
}

impl Ple {
    pub fn new_state(&self, b: &dyn Backend) -> Result<PleState> {
        Ok(PleState {
            conv: b.new_conv_state(self.streams * self.hidden, self.kernel, self.dilation)?,
            context: self.store.initial_context(),
        })
    }

    /// The n-gram embedding rows of `ids` (which follow `context`, the state's),
    /// `[ids.len(), embed_dim]`: read from disk or the row cache. Depends on
    /// the token ids alone, so it can run ahead of the layers below this one.
    pub fn fetch(&self, ids: &[u32], context: &[u32]) -> Result<Vec<f32>> {
        self.store.embeddings(&self.store.ngram_ids(context, ids))
    }

    /// The PLE output `[tokens, streams*hidden]` to add to `h`, from the
    /// embedding rows [`Ple::fetch`] returned for `ids`.
    pub fn forward(&self, b: &dyn Backend, h: &Tensor, ids: &[u32], emb: Vec<f32>, st: &mut PleState) -> Result<Tensor> {
        st.context = self.store.next_context(&st.context, ids);
        let emb = b.upload(&emb, &[ids.len(), self.store.embed_dim()])?;
        let d = self.hidden;
        let key = b.rms_norm(&b.matmul(&emb, &self.key_proj)?, Some(&self.norm_key), d, self.eps)?;
        let value = b.matmul(&emb, &self.value_proj)?;
        let query = b.rms_norm(h, Some(&self.norm_query), d, self.eps)?;
        let gated = b.stream_dot_gate(&key, &query, &value, self.streams)?;
        let conv_in = b.rms_norm(&gated, Some(&self.norm_conv), d, self.eps)?;
        let conv = b.causal_conv1d_silu(&conv_in, &self.conv, &mut st.conv)?;
        Ok(b.add(&gated, &conv)?)
    }
}
