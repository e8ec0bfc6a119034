//! What speculative decoding needs from a model: a head that drafts the next
//! token from the main model's hidden states (qwen4_exp's MTP head), and the
//! state such a head keeps per sequence.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use slotstream_backend::{Backend, Tensor};

use super::decoder::DecoderModel;
use super::layer::LayerState;

/// A draft head. Entry `i` pairs the main model's hidden row of position `i`
/// with the token at `i+1` and drafts the token at `i+2`. It only ever sees
/// rows of tokens known to be correct, so its own state never needs rolling
/// back; the main model's does ([`DecoderModel::rollback`]).
pub trait DraftHead: Send + Sync {
    /// Bytes of the head's weights.
    fn bytes(&self) -> u64;
    fn new_state(&self, b: &dyn Backend) -> Result<DraftState>;
    /// Consumes entries `st.len..=last`; `tokens` holds the tokens from
    /// position `tokens_start` on. Returns the draft logits `[1, vocab]` of
    /// the last entry (`None` when there was nothing to feed).
    #[allow(clippy::too_many_arguments)]
    fn feed(&self, b: &dyn Backend, model: &DecoderModel, st: &mut DraftState, tokens: &[u32], tokens_start: usize, last: usize)
        -> Result<Option<Tensor>>;
    /// Forgets entries and rows a sequence cut back to `position` tokens can
    /// no longer vouch for: entry `i` needs token `i+1`, so only entries
    /// before `position - 1` stay.
    fn trim(&self, b: &dyn Backend, st: &mut DraftState, position: usize) -> Result<()>;
}

/// A draft head's per-sequence state: its layer's state, how many entries it
/// has consumed, and main-model hidden rows of positions not yet consumed.
pub struct DraftState {
    pub layer: LayerState,
    pub len: usize,
    /// Hidden states as the forward passes produced them: first position ->
    /// `[n, streams*hidden]`. Overlapping chunks hold equal rows (both come
    /// from the same known tokens); lookups take the newest.
    pub rows: BTreeMap<usize, Tensor>,
}

impl DraftState {
    pub fn new(layer: LayerState) -> DraftState {
        DraftState { layer, len: 0, rows: BTreeMap::new() }
    }

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
    pub fn gather(&self, b: &dyn Backend, first: usize, last: usize) -> Result<Tensor> {
        let mut runs: Vec<(&Tensor, usize, usize)> = Vec::new();
        for p in first..=last {
            let (t, r) = self.row_of(p).with_context(|| format!("internal: the draft head has no hidden state for position {p}"))?;
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

    pub fn clone_with(&self, b: &dyn Backend) -> Result<DraftState> {
        Ok(DraftState { layer: self.layer.clone_with(b)?, len: self.len, rows: self.rows.clone() })
    }
}
