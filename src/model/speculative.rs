//! The state a draft head for speculative decoding keeps per sequence (the
//! head itself is [`super::decoder::DraftHead`]).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use slotstream_backend::{Backend, Tensor};

use super::layer::LayerState;

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
