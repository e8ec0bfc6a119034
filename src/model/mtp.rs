//! The multi-token-prediction (MTP) head of qwen4_exp, used to draft one token
//! ahead for speculative decoding.
//!
//! Entry `i` of the head combines the main model's hidden streams at position
//! `i` (before the final collapse) with the embedding of token `i+1`: both are
//! RMS-normalised, projected (one `[H, H]` weight shared by every stream for
//! the hidden part), added, and run through one full-attention decoder layer
//! with its own KV cache (RoPE position `i`) and its own collapse; the shared
//! `lm_head` then gives the draft for token `i+2`.
//!
//! The head only ever sees hidden states of tokens known to be correct, so its
//! cache never needs rolling back; the main model's state does (see
//! [`super::DecoderModel::rollback`]).

use std::collections::BTreeMap;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, Tensor, Weight};

use super::experts_lock;
use super::hyper::HyperMixer;
use super::layers::RmsNorm;
use super::{layer_forward, DecoderLayer, DecoderModel, LayerState, Mixer};
use crate::experts::ExpertCache;

pub struct MtpHead {
    pub fc_embedding: Weight,
    /// `[hidden, hidden]`, applied to each stream.
    pub fc_hidden: Weight,
    pub norm_embedding: RmsNorm,
    /// `[streams*hidden]`: one RMS statistic over all streams together.
    pub norm_hidden: Tensor,
    pub layer: DecoderLayer,
    pub head: HyperMixer,
    /// The head's own routed experts, all resident.
    pub experts: Mutex<ExpertCache>,
    pub streams: usize,
    pub hidden: usize,
    pub eps: f32,
    /// Bytes of the head's weights (`mtp.safetensors`).
    pub bytes: u64,
}

/// The head's per-sequence state: its layer's KV cache, how many entries it
/// has consumed, and main-model hidden rows of positions not yet consumed.
pub struct MtpState {
    pub layer: LayerState,
    pub len: usize,
    /// Hidden states as the forward passes produced them: first position ->
    /// `[n, streams*hidden]`. Overlapping chunks hold equal rows (both come
    /// from the same known tokens); lookups take the newest.
    pub rows: BTreeMap<usize, Tensor>,
}

impl MtpState {
    /// Keeps the main model's hidden rows `h` (`[n, streams*hidden]`) of positions `first..first+n`.
    pub fn record(&mut self, first: usize, h: &Tensor) {
        if first + h.rows() > self.len {
            self.rows.insert(first, h.clone());
        }
    }

    /// The chunk holding position `p` and the row of `p` in it.
    fn row_of(&self, p: usize) -> Option<(&Tensor, usize)> {
        self.rows.range(..=p).rev().find(|(&start, t)| p < start + t.rows()).map(|(&start, t)| (t, p - start))
    }

    /// Rows of positions `first..=last`, `[n, streams*hidden]`.
    fn gather(&self, b: &dyn Backend, first: usize, last: usize) -> Result<Tensor> {
        let mut runs: Vec<(&Tensor, usize, usize)> = Vec::new();
        for p in first..=last {
            let (t, r) = self.row_of(p).with_context(|| format!("internal: the MTP head has no hidden state for position {p}"))?;
            match runs.last_mut() {
                Some((rt, start, len)) if std::ptr::eq(*rt, t) && *start + *len == r => *len += 1,
                _ => runs.push((t, r, 1)),
            }
        }
        if let [(t, 0, n)] = runs[..] {
            if n == t.rows() {
                return Ok(t.clone());
            }
        }
        let parts = runs.iter().map(|&(t, start, len)| b.slice_rows(t, start, len)).collect::<Result<Vec<_>, _>>()?;
        Ok(b.concat_rows(&parts.iter().collect::<Vec<_>>())?)
    }

    pub fn clone_with(&self, b: &dyn Backend, model: &DecoderModel) -> Result<MtpState> {
        let layer = model.clone_layer_state(b, &self.layer)?;
        Ok(MtpState { layer, len: self.len, rows: self.rows.clone() })
    }
}

impl MtpHead {
    pub fn new_state(&self, b: &dyn Backend) -> Result<MtpState> {
        let layer = match &self.layer.mixer {
            Mixer::Attention(a) => {
                LayerState::Attention(a.new_state(b)?, a.indexer.as_ref().map(|_| super::qsa::IndexerState::default()))
            }
            Mixer::Delta(_) => bail!("the MTP head's layer is not full attention"),
        };
        Ok(MtpState { layer, len: 0, rows: BTreeMap::new() })
    }

    /// Consumes entries `st.len..=last`: entry `i` pairs the recorded hidden
    /// row of position `i` with the token at position `i+1`; `tokens` holds
    /// the tokens from position `tokens_start` on. Returns the draft logits
    /// `[1, vocab]` of the last entry (`None` when there was nothing to feed).
    pub fn feed(
        &self,
        b: &dyn Backend,
        model: &DecoderModel,
        st: &mut MtpState,
        tokens: &[u32],
        tokens_start: usize,
        last: usize,
    ) -> Result<Option<Tensor>> {
        if last < st.len {
            return Ok(None);
        }
        let first = st.len;
        let next = (first + 1).checked_sub(tokens_start).and_then(|a| tokens.get(a..=last + 1 - tokens_start));
        let next = next.context("internal: the MTP head was fed tokens it was not given")?;
        let n = next.len();
        let (hc, d) = (self.streams, self.hidden);
        let hidden = st.gather(b, first, last)?;
        let e = self.norm_embedding.forward(b, &b.embed(&model.embed, next)?)?;
        let e = b.matmul(&e, &self.fc_embedding)?;
        let hm = b.rms_norm(&hidden, Some(&self.norm_hidden), hc * d, self.eps)?;
        let f = b.matmul(&hm.reshape(&[n * hc, d])?, &self.fc_hidden)?.reshape(&[n, hc * d])?;
        let fused = b.add(&f, &b.repeat_cols(&e, hc)?)?;
        let mut experts = experts_lock(&self.experts)?;
        let out = layer_forward(b, &self.layer, &fused, &[], first, &mut st.layer, None, &mut experts)?;
        drop(experts);
        st.len = last + 1;
        // The last two rows stay: `trim` may drop the entries they fed.
        st.rows.retain(|&start, t| start + t.rows() >= last);
        let x = self.head.mix(b, &b.slice_rows(&out, n - 1, 1)?)?.0;
        Ok(Some(b.matmul(&x, &model.lm_head)?))
    }

    /// Forgets entries and rows a sequence cut back to `position` tokens can
    /// no longer vouch for: entry `i` needs token `i+1`, so only entries
    /// before `position - 1` stay.
    pub fn trim(&self, b: &dyn Backend, st: &mut MtpState, position: usize) -> Result<()> {
        let keep = position.saturating_sub(1);
        st.rows.retain(|&start, _| start < position);
        if st.len > keep {
            if let (LayerState::Attention(cache, idx), Mixer::Attention(a)) = (&mut st.layer, &self.layer.mixer) {
                b.kv_truncate(cache, keep)?;
                if let (Some(idx), Some(ix)) = (idx.as_mut(), a.indexer.as_ref()) {
                    idx.truncate(keep, ix.head_dim, ix.ratio);
                }
            }
            st.len = keep;
        }
        Ok(())
    }
}
