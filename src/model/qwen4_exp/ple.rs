//! PLE, the per-layer n-gram embedding of qwen4_exp: embedding rows chosen by
//! hashing the latest tokens, gated against the residual streams and passed
//! through a dilated causal convolution, added to the streams before the
//! layer's mixer.

use std::sync::Arc;

use anyhow::Result;
use slotstream_backend::{Backend, State, Tensor, Weight};

use super::ngram::NgramStore;
use crate::checkpoint::Checkpoint;
use crate::model::blocks::weights::LoadCx;

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

impl Ple {
    /// The PLE block under `p` (`model.layers.1.ple`); `shared` is the
    /// checkpoint the n-gram rows are read from while generating.
    pub fn load(cx: &LoadCx<'_>, shared: &Arc<Checkpoint>, p: &str, eos: u32) -> Result<Ple> {
        let c = &cx.arch.text;
        let q = cx.arch.qwen4.as_ref().ok_or_else(|| anyhow::anyhow!("internal: PLE without qwen4_exp settings"))?;
        let (h, hc, e) = (c.hidden_size, q.hc_count, q.ple_embed_dim);
        let row_floats = e / q.ngram_heads().max(1);
        let cache_rows = cx.opts.ngram_cache_bytes / (4 * row_floats.max(1));
        let store = NgramStore::open(shared.clone(), &format!("{p}.ple_embedding"), q, eos, cache_rows)?;
        let k = q.ple_conv_kernel_size;
        Ok(Ple {
            store,
            key_proj: cx.linear(&format!("{p}.key_proj"), hc * h, e)?,
            value_proj: cx.linear(&format!("{p}.value_proj"), h, e)?,
            norm_key: cx.vector(&format!("{p}.norm_key.weight"), hc * h, 0.0)?,
            norm_query: cx.vector(&format!("{p}.norm_query.weight"), hc * h, 0.0)?,
            norm_conv: cx.vector(&format!("{p}.norm_conv.weight"), hc * h, 0.0)?,
            conv: cx.conv_weight(&format!("{p}.conv1d.weight"), hc * h, k)?,
            kernel: k,
            dilation: q.ngram_size,
            streams: hc,
            hidden: h,
            eps: c.rms_norm_eps,
        })
    }

    /// The convolution window, the one state PLE keeps per sequence.
    pub fn new_state(&self, b: &dyn Backend) -> Result<State> {
        Ok(b.new_conv_state(self.streams * self.hidden, self.kernel, self.dilation)?)
    }

    /// Tokens of history the n-gram hash looks back at.
    pub fn token_context(&self) -> usize {
        self.store.context_len()
    }

    /// The n-gram context before a call, from the sequence's latest tokens.
    pub fn context(&self, recent: &[u32]) -> Vec<u32> {
        self.store.context_from(recent)
    }

    /// The n-gram embedding rows of `ids` (which follow `context`),
    /// `[ids.len(), embed_dim]`: read from disk or the row cache. Depends on
    /// the token ids alone, so it can run ahead of the layers below this one.
    pub fn fetch(&self, ids: &[u32], context: &[u32]) -> Result<Vec<f32>> {
        self.store.embeddings(&self.store.ngram_ids(context, ids))
    }

    /// The PLE output `[tokens, streams*hidden]` to add to `h`, from the
    /// embedding rows [`Ple::fetch`] returned for `ids`.
    pub fn forward(&self, b: &dyn Backend, h: &Tensor, ids: &[u32], emb: Vec<f32>, conv_state: &mut State) -> Result<Tensor> {
        let emb = b.upload(&emb, &[ids.len(), self.store.embed_dim()])?;
        let d = self.hidden;
        let key = b.rms_norm(&b.matmul(&emb, &self.key_proj)?, Some(&self.norm_key), d, self.eps)?;
        let value = b.matmul(&emb, &self.value_proj)?;
        let query = b.rms_norm(h, Some(&self.norm_query), d, self.eps)?;
        let gated = b.stream_dot_gate(&key, &query, &value, self.streams)?;
        let conv_in = b.rms_norm(&gated, Some(&self.norm_conv), d, self.eps)?;
        let conv = b.causal_conv1d_silu(&conv_in, &self.conv, conv_state)?;
        Ok(b.add(&gated, &conv)?)
    }
}
