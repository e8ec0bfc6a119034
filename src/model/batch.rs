//! One decode step of several sequences in one forward pass: one row per
//! sequence through every matmul (the projections, the experts, `lm_head`),
//! attention and the Gated DeltaNet recurrence per sequence over its own
//! state. Each row is computed as that sequence's step alone would compute
//! it on a backend whose kernels reduce each row in the same order whatever
//! the number of rows (the CPU backend up to its `ROW_EXACT_TOKENS`).

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, Tensor};

use super::decoder::{experts_lock, on_compute_threads, DecoderModel, SequenceState};
use super::layer::{Hidden, Mixer, MixerState};

impl DecoderModel {
    /// Whether `state` can take a step of [`DecoderModel::forward_batch`]:
    /// no draft head follows it, and no layer keeps per-sequence state
    /// besides its mixer's, reads token ids or selects keys (qwen4_exp's
    /// PLE and QSA decode one sequence at a time).
    pub fn batches(&self, state: &SequenceState) -> bool {
        self.draft.is_none()
            && state.draft.is_none()
            && self.token_context == 0
            && state.layers.len() == self.layers.len()
            && state.layers.iter().all(|l| l.residual.is_empty())
            && self.layers.iter().all(|l| {
                !l.residual.uses_token_ids() && !matches!(&l.mixer, Mixer::Attention(a) if a.selector.is_some())
            })
    }

    /// Feeds `tokens[i]` to `states[i]` for every `i` in one pass; returns
    /// the logits `[tokens.len(), vocab]`, row `i` sequence `i`'s.
    pub fn forward_batch(&self, b: &dyn Backend, tokens: &[u32], states: &mut [&mut SequenceState]) -> Result<Tensor> {
        if tokens.is_empty() || tokens.len() != states.len() {
            bail!("internal: a batched step of {} tokens for {} sequences", tokens.len(), states.len());
        }
        if let Some(i) = states.iter().position(|s| !self.batches(s)) {
            bail!("internal: sequence {i} of a batched step cannot be batched");
        }
        let mut guard = experts_lock(&self.experts)?;
        let experts = &mut *guard;
        on_compute_threads(|| {
            let mut x = b.embed(&self.embed, tokens)?;
            if self.streams > 1 {
                x = b.repeat_cols(&x, self.streams)?;
            }
            let starts: Vec<usize> = states.iter().map(|s| s.position).collect();
            let mut x = Some(Hidden::from(x));
            for (i, layer) in self.layers.iter().enumerate() {
                let mut mixers: Vec<&mut MixerState> = states.iter_mut().map(|s| &mut s.layers[i].mixer).collect();
                let next_moe = self.layers[i + 1..].iter().find_map(|l| l.moe());
                let input = x.take().context("no hidden state between layers")?;
                let out = layer.forward_batch(b, input, &starts, &mut mixers, experts, next_moe);
                x = Some(out.with_context(|| format!("layer {i}"))?);
            }
            for s in states.iter_mut() {
                s.position += 1;
            }
            let h = x.context("no hidden state after the layers")?.form(b)?;
            self.logits(b, &h, tokens.len())
        })
    }
}
