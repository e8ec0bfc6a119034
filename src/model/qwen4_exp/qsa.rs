//! The QSA indexer of qwen4_exp's full-attention layers.
//!
//! While a query sees at most `budget` keys it attends to all of them. Past
//! that, the keys are grouped in blocks of `ratio` positions; each complete
//! block gets one compressed key (the mean of the indexer's raw keys over the
//! block, RMS-normalised, RoPE'd at the block's first position) and the query
//! scores every block wholly in its past by `sum over indexer heads of
//! relu(q_h . key_block) / sqrt(head_dim)`. It then attends to the tokens of
//! the `budget/ratio` best blocks plus its own trailing partial block.
//!
//! A query sees every key exactly when its visible blocks fit the budget, so
//! the choice depends only on the query's position, never on how a prompt is
//! split into calls. Scoring runs on the host: the compressed keys of a
//! sequence are computed once per block and kept in [`IndexerState`].

use std::any::Any;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use slotstream_backend::{Backend, KeySelection, Tensor, Weight};

use crate::model::blocks::attention::{Attention, KeySelector, KeySelectorState};
use crate::model::blocks::weights::LoadCx;

/// Weights and settings of one layer's indexer.
pub struct Indexer {
    /// `[(heads + 1) * head_dim, hidden]`: query heads, then the one key head.
    pub qk_proj: Weight,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub heads: usize,
    pub head_dim: usize,
    /// Keys a query attends to before the sparse path starts.
    pub budget: usize,
    /// Positions per compressed block.
    pub ratio: usize,
    pub rotary_dim: usize,
    pub rope: slotstream_backend::Rope,
    pub eps: f32,
}

/// The indexer's per-sequence memory: raw keys of every position and the
/// compressed key of every complete block. While every query is still dense
/// the projections stay where the backend computed them (`pending`, no
/// GPU-to-CPU read); they come to the host the first time a query needs scores.
#[derive(Clone)]
pub struct IndexerState {
    head_dim: usize,
    ratio: usize,
    raw: Vec<f32>,
    /// Projections `[rows, (heads+1)*head_dim]` not yet on the host, with how
    /// many of their rows are still part of the sequence.
    pending: Vec<(Tensor, usize)>,
    blocks: Vec<f32>,
}

impl IndexerState {
    /// Positions recorded.
    fn len(&self) -> usize {
        self.raw.len() / self.head_dim + self.pending.iter().map(|(_, n)| n).sum::<usize>()
    }
}

impl KeySelectorState for IndexerState {
    fn bytes(&self) -> usize {
        4 * (self.raw.len() + self.blocks.len() + self.pending.iter().map(|(t, _)| t.numel()).sum::<usize>())
    }

    fn truncate(&mut self, len: usize) {
        let on_host = self.raw.len() / self.head_dim;
        if len <= on_host {
            self.raw.truncate(len * self.head_dim);
            self.pending.clear();
        } else {
            let mut left = len - on_host;
            for (_, rows) in self.pending.iter_mut() {
                *rows = (*rows).min(left);
                left -= *rows;
            }
            self.pending.retain(|(_, rows)| *rows > 0);
        }
        self.blocks.truncate(len / self.ratio * self.head_dim);
    }

    fn clone_box(&self) -> Box<dyn KeySelectorState> {
        Box::new(self.clone())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Indexer {
    /// The indexer of the attention module `a` (`{a}.indexer.*`).
    pub fn load(cx: &LoadCx<'_>, a: &str) -> Result<Indexer> {
        let c = &cx.arch.text;
        let q = cx.arch.qwen4.as_ref().context("internal: a QSA indexer without qwen4_exp settings")?;
        let rotary_dim = (c.head_dim() as f32 * c.partial_rotary_factor()) as usize;
        let ihd = q.indexer_head_dim;
        let ix = format!("{a}.indexer");
        Ok(Indexer {
            qk_proj: cx.linear(&format!("{ix}.index_qk_proj"), (q.indexer_n_heads + q.indexer_kv_heads) * ihd, c.hidden_size)?,
            q_norm: cx.ck.f32_tensor(&format!("{ix}.q_layernorm.weight"), &[ihd])?,
            k_norm: cx.ck.f32_tensor(&format!("{ix}.k_layernorm.weight"), &[ihd])?,
            heads: q.indexer_n_heads,
            head_dim: ihd,
            budget: q.indexer_budget,
            ratio: q.indexer_compress_ratio,
            rotary_dim: rotary_dim.min(ihd),
            rope: c.rope(),
            eps: c.rms_norm_eps,
        })
    }

    /// Blocks a query keeps once sparse.
    pub fn top_blocks(&self) -> usize {
        self.budget / self.ratio
    }

    /// Whether the query at `pos` attends sparsely.
    fn sparse_at(&self, pos: usize) -> bool {
        (pos + 1) / self.ratio > self.top_blocks()
    }

}

impl KeySelector for Indexer {
    fn new_state(&self) -> Box<dyn KeySelectorState> {
        Box::new(IndexerState {
            head_dim: self.head_dim,
            ratio: self.ratio,
            raw: Vec::new(),
            pending: Vec::new(),
            blocks: Vec::new(),
        })
    }

    /// Records the raw keys of `x` and scores the blocks each sparse query sees.
    fn select(&self, b: &dyn Backend, x: &Tensor, st: &mut dyn KeySelectorState, start: usize) -> Result<Option<KeySelection>> {
        let st = st.as_any_mut().downcast_mut::<IndexerState>().context("internal: a QSA indexer was given another selector's state")?;
        let hd = self.head_dim;
        let tokens = x.rows();
        if st.len() != start {
            bail!("the QSA indexer holds {} keys but the call starts at position {start}", st.len());
        }
        let projected = b.matmul(x, &self.qk_proj)?;
        let qk_row = (self.heads + 1) * hd;
        if !(0..tokens).any(|t| self.sparse_at(start + t)) {
            st.pending.push((projected, tokens));
            return Ok(None);
        }
        // The first sparse call brings the earlier projections over, in one read.
        let pending = std::mem::take(&mut st.pending);
        if !pending.is_empty() {
            let parts = pending.iter().map(|(t, rows)| b.slice_rows(t, 0, *rows)).collect::<Result<Vec<_>, _>>()?;
            let earlier = b.download(&b.concat_rows(&parts.iter().collect::<Vec<_>>())?)?;
            for row in earlier.chunks_exact(qk_row) {
                st.raw.extend_from_slice(&row[self.heads * hd..]);
            }
        }
        let qk = b.download(&projected)?;
        for t in 0..tokens {
            st.raw.extend_from_slice(&qk[t * qk_row + self.heads * hd..(t + 1) * qk_row]);
        }
        // Compressed keys of blocks completed since the last call.
        let complete = (start + tokens) / self.ratio;
        for n in st.blocks.len() / hd..complete {
            let mut key = vec![0.0f32; hd];
            for p in n * self.ratio..(n + 1) * self.ratio {
                key.iter_mut().zip(&st.raw[p * hd..(p + 1) * hd]).for_each(|(k, r)| *k += r);
            }
            key.iter_mut().for_each(|k| *k /= self.ratio as f32);
            rms_norm(&mut key, &self.k_norm, self.eps);
            self.rope.apply(&mut key, self.head_dim, 1, self.rotary_dim, n * self.ratio);
            st.blocks.extend_from_slice(&key);
        }
        let per_query = self.top_blocks();
        let scale = 1.0 / (hd as f32).sqrt();
        let blocks_of = &st.blocks;
        // Queries are scored independently (a long prefill scores every visible block per query).
        let rows: Vec<Vec<u32>> = (0..tokens)
            .into_par_iter()
            .map(|t| {
                let pos = start + t;
                let mut row = Vec::with_capacity(per_query);
                if !self.sparse_at(pos) {
                    row.push(KeySelection::DENSE);
                    row.resize(per_query, KeySelection::UNUSED);
                    return row;
                }
                let mut q: Vec<f32> = qk[t * qk_row..t * qk_row + self.heads * hd].to_vec();
                for head in q.chunks_exact_mut(hd) {
                    rms_norm(head, &self.q_norm, self.eps);
                    self.rope.apply(head, self.head_dim, 1, self.rotary_dim, pos);
                }
                // Blocks wholly at or before the query.
                let visible = (pos + 1) / self.ratio;
                let mut scored: Vec<(f32, u32)> = (0..visible)
                    .map(|n| {
                        let key = &blocks_of[n * hd..(n + 1) * hd];
                        let s: f32 = q
                            .chunks_exact(hd)
                            .map(|qh| qh.iter().zip(key).map(|(a, b)| a * b).sum::<f32>().max(0.0))
                            .sum();
                        (s * scale, n as u32)
                    })
                    .collect();
                // Best first; equal scores keep the earlier block.
                let keep = per_query.min(scored.len());
                scored.select_nth_unstable_by(keep - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                row.extend(scored[..keep].iter().map(|s| s.1));
                row.sort_unstable();
                row.resize(per_query, KeySelection::UNUSED);
                row
            })
            .collect();
        let blocks = rows.concat();
        Ok(Some(KeySelection { block: self.ratio, per_query, blocks }))
    }
}

/// Gated full attention with its QSA indexer.
pub fn gated_attention(cx: &LoadCx<'_>, a: &str) -> Result<Attention> {
    crate::model::qwen3_next::gated_attention(cx, a, 0.0, Some(Box::new(Indexer::load(cx, a)?)))
}

fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * r * w);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_starts_when_visible_blocks_exceed_the_budget() {
        let ix = Indexer {
            qk_proj: slotstream_backend::Weight::from_buffer(std::sync::Arc::new(()), 1, 1, 1, 0),
            q_norm: vec![],
            k_norm: vec![],
            heads: 1,
            head_dim: 1,
            budget: 32,
            ratio: 4,
            rotary_dim: 0,
            rope: slotstream_backend::Rope::plain(1.0),
            eps: 1e-6,
        };
        // Position 35 sees 36 keys = 9 blocks > 8.
        assert!(!ix.sparse_at(31));
        assert!(!ix.sparse_at(34));
        assert!(ix.sparse_at(35));
    }
}
