//! Full (softmax) attention with q/k RMSNorm, (partial) RoPE, GQA, an
//! optional sigmoid output gate and an optional sparse key selection.

use std::any::Any;

use anyhow::{bail, Result};
use slotstream_backend::{Backend, KeySelection, QkNorm, State, Tensor, Weight};

use super::norm::RmsNorm;
use super::projections::Projections;

/// Chooses, per query, which earlier keys it attends to (sparse attention,
/// e.g. qwen4_exp's QSA). Without one, attention is dense and causal.
pub trait KeySelector: Send + Sync {
    fn new_state(&self) -> Box<dyn KeySelectorState>;
    /// Records what it needs of `x` (the layer input, `[tokens, hidden]`, the
    /// first token at `start`) and returns the selection of its queries, or
    /// `None` when every one of them attends densely.
    fn select(&self, b: &dyn Backend, x: &Tensor, st: &mut dyn KeySelectorState, start: usize)
        -> Result<Option<KeySelection>>;
}

/// A [`KeySelector`]'s memory of one sequence.
pub trait KeySelectorState: Send + Sync {
    /// Forgets every position from `len` on.
    fn truncate(&mut self, len: usize);
    fn clone_box(&self) -> Box<dyn KeySelectorState>;
    fn bytes(&self) -> usize;
    /// For the selector that made it to reach its own type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

pub struct Attention {
    /// `q` (followed by the gate when `gated`), `k` and `v` projections.
    pub qkv: Projections,
    pub o_proj: Weight,
    pub q_norm: RmsNorm,
    pub k_norm: RmsNorm,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope: slotstream_backend::Rope,
    pub gated: bool,
    pub selector: Option<Box<dyn KeySelector>>,
}

/// The KV cache of one attention layer, and its key selector's memory.
pub struct AttentionState {
    pub kv: State,
    pub selector: Option<Box<dyn KeySelectorState>>,
}

impl AttentionState {
    pub fn clone_with(&self, b: &dyn Backend) -> Result<AttentionState> {
        Ok(AttentionState { kv: b.clone_state(&self.kv)?, selector: self.selector.as_ref().map(|s| s.clone_box()) })
    }

    /// Forgets every position from `len` on (speculative decoding's rollback).
    pub fn truncate(&mut self, b: &dyn Backend, len: usize) -> Result<()> {
        b.kv_truncate(&mut self.kv, len)?;
        if let Some(s) = self.selector.as_mut() {
            s.truncate(len);
        }
        Ok(())
    }
}

impl Attention {
    pub fn new_state(&self, b: &dyn Backend) -> Result<AttentionState> {
        Ok(AttentionState {
            kv: b.new_kv_cache(self.kv_heads, self.head_dim)?,
            selector: self.selector.as_ref().map(|s| s.new_state()),
        })
    }

    /// `x: [tokens, hidden]`, the first token at position `start`.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, st: &mut AttentionState, start: usize) -> Result<Tensor> {
        let selection = match (&self.selector, st.selector.as_mut()) {
            (Some(sel), Some(s)) => sel.select(b, x, s.as_mut(), start)?,
            (None, None) => None,
            _ => bail!("attention layer and its state disagree about the key selector"),
        };
        let (q, k, v, gate) = self.project(b, x)?;
        let out = self.attend(b, &q, &k, &v, st, start, selection.as_ref())?;
        // Their buffers serve the output projection.
        drop((q, k, v));
        self.output(b, out, gate)
    }

    /// One token of each of several sequences (row `i` of `x` is sequence
    /// `i`'s, at position `starts[i]`, over its own KV cache `states[i]`):
    /// the projections take every row in one product, attention runs per
    /// sequence. Dense attention only (no key selector).
    pub fn forward_batch(&self, b: &dyn Backend, x: &Tensor, states: &mut [&mut AttentionState], starts: &[usize]) -> Result<Tensor> {
        if self.selector.is_some() {
            bail!("internal: a batched decode step through attention with a key selector");
        }
        let (q, k, v, gate) = self.project(b, x)?;
        let mut outs = Vec::with_capacity(states.len());
        for (i, (st, &start)) in states.iter_mut().zip(starts).enumerate() {
            let row = |t: &Tensor| b.slice_rows(t, i, 1);
            outs.push(self.attend(b, &row(&q)?, &row(&k)?, &row(&v)?, st, start, None)?);
        }
        let out = b.concat_rows(&outs.iter().collect::<Vec<_>>())?;
        self.output(b, out, gate)
    }

    /// `q`, `k`, `v` and the output gate (when `gated`) of `x`.
    fn project(&self, b: &dyn Backend, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let (h, hd) = (self.heads, self.head_dim);
        let p = self.qkv.forward(b, x)?;
        let (projected, k, v) = (p.get("q")?, p.get("k")?, p.get("v")?);
        let (q, gate) = if self.gated {
            (b.slice_cols(projected, 0, h * hd)?, Some(b.slice_cols(projected, h * hd, h * hd)?))
        } else {
            (projected.clone(), None)
        };
        Ok((q, k.clone(), v.clone(), gate))
    }

    /// Attention of one sequence's queries over its cache (extended by `k`, `v`).
    #[allow(clippy::too_many_arguments)]
    fn attend(&self, b: &dyn Backend, q: &Tensor, k: &Tensor, v: &Tensor, st: &mut AttentionState, start: usize, selection: Option<&KeySelection>) -> Result<Tensor> {
        let hd = self.head_dim;
        if b.kv_len(&st.kv)? != start {
            bail!("KV cache holds {} positions but the call starts at {start}", b.kv_len(&st.kv)?);
        }
        let norm = QkNorm {
            weights: [&self.q_norm.weight, &self.k_norm.weight],
            eps: [self.q_norm.eps, self.k_norm.eps],
            head_dim: hd,
            rotary_dim: self.rotary_dim,
            rope: self.rope,
            start_pos: start,
        };
        let scale = (hd as f32).powf(-0.5);
        Ok(b.attention_qk_norm(q, k, v, &mut st.kv, self.heads, scale, selection, &norm)?)
    }

    /// The gate (when `gated`) and the output projection.
    fn output(&self, b: &dyn Backend, out: Tensor, gate: Option<Tensor>) -> Result<Tensor> {
        let out = match gate {
            Some(gate) => b.sigmoid_mul(&out, &gate)?,
            None => out,
        };
        Ok(b.matmul(&out, &self.o_proj)?)
    }
}
