//! A decoder-only MoE transformer (embeddings, layers, head, `lm_head`) and
//! the state one sequence carries through it.

use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, Tensor, Weight};

use super::arch::ModelArch;
use super::blocks::attention::AttentionState;
use super::blocks::delta::DeltaState;
use super::layer::{DecoderLayer, Head, Hidden, LayerState, MixerState, RowCacheStats};
use super::speculative::DraftState;
use crate::experts::{CacheStats, ExpertCache, PromptReads, ReadMark};

pub struct DecoderModel {
    pub arch: ModelArch,
    pub embed: Weight,
    /// Parallel residual streams (1 except with hyper-connections).
    pub streams: usize,
    pub layers: Vec<DecoderLayer>,
    pub head: Box<dyn Head>,
    pub lm_head: Weight,
    /// The routed experts of every MoE layer, streamed into a slot pool.
    pub experts: Mutex<ExpertCache>,
    /// Bytes of everything resident besides the expert pool.
    pub resident_bytes: usize,
    /// Checkpoint tensors the loader did not use (a mismatch to look into).
    pub unused_tensors: Vec<String>,
    /// How many of a sequence's latest tokens the layers look back at.
    pub token_context: usize,
    /// A head that drafts tokens for speculative decoding (qwen4_exp's MTP).
    pub draft: Option<Box<dyn DraftHead>>,
}

/// Everything a sequence carries between forward calls.
pub struct SequenceState {
    pub layers: Vec<LayerState>,
    /// The latest `token_context` tokens consumed.
    pub recent: Vec<u32>,
    /// The draft head's state, when the model has one and it follows this sequence.
    pub draft: Option<DraftState>,
    /// Tokens consumed so far.
    pub position: usize,
}

/// The parts of a sequence's state that cannot be cut back to an earlier
/// position (recurrent, convolution and residual state), saved before a
/// speculative forward pass; KV caches are truncated instead.
pub struct Snapshot {
    position: usize,
    recent: Vec<u32>,
    delta: Vec<Option<DeltaState>>,
    residual: Vec<Vec<slotstream_backend::State>>,
}

/// A head that drafts tokens for speculative decoding from the main model's
/// hidden states (qwen4_exp's MTP head). Entry `i` pairs the main model's hidden row of position `i`
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

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

/// Runs `f` on a thread of the compute pool (rayon's global pool, which the
/// CPU backend splits its work over). A forward pass issues dozens of parallel
/// operations; started from a thread outside the pool, each one would hand its
/// work over and sleep until it is done (two context switches, and one thread
/// more than cores while the pool spins). From a pool thread the work is
/// shared by work-stealing instead. Called from a pool thread, `f` just runs.
pub fn on_compute_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

pub(crate) fn experts_lock(m: &Mutex<ExpertCache>) -> Result<std::sync::MutexGuard<'_, ExpertCache>> {
    m.lock().map_err(|_| anyhow::anyhow!("the expert cache was poisoned by an earlier failure"))
}

impl DecoderModel {
    pub fn vocab_size(&self) -> usize {
        self.arch.text.vocab_size
    }

    pub fn hidden_size(&self) -> usize {
        self.arch.text.hidden_size
    }

    pub fn new_state(&self, b: &dyn Backend) -> Result<SequenceState> {
        let layers = self.layers.iter().map(|l| l.new_state(b)).collect::<Result<Vec<_>>>()?;
        let draft = self.draft.as_ref().map(|d| d.new_state(b)).transpose()?;
        Ok(SequenceState { layers, recent: Vec::new(), draft, position: 0 })
    }

    /// Runs `ids` through the model, extending `state`; returns logits
    /// `[1 or ids.len(), vocab]`.
    pub fn forward(&self, b: &dyn Backend, ids: &[u32], state: &mut SequenceState, which: Logits) -> Result<Tensor> {
        // The expert cache is locked before the pool is entered: a pool
        // thread waiting inside one pass may pick up another caller's pass,
        // which must not then block on a lock held further down its own stack.
        let mut guard = experts_lock(&self.experts)?;
        let experts = &mut *guard;
        on_compute_threads(|| {
            let h = self.hidden_locked(b, ids, state, experts)?;
            let last = match which {
                Logits::Last => 1,
                Logits::All => ids.len(),
            };
            self.logits(b, &h, last)
        })
    }

    /// Logits `[n, vocab]` of the last `n` rows of a hidden state: the one
    /// place hidden states become logits.
    pub fn logits(&self, b: &dyn Backend, h: &Tensor, n: usize) -> Result<Tensor> {
        let rows = h.rows();
        let h = if rows > n { b.slice_rows(h, rows - n, n)? } else { h.clone() };
        self.vocab_logits(b, &self.head.collapse(b, &h)?)
    }

    /// `lm_head` over already collapsed rows (a draft head's own collapse).
    pub fn vocab_logits(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(b.matmul(x, &self.lm_head)?)
    }

    /// Runs the layers over `ids`, extending `state`; returns the last hidden
    /// state `[ids.len(), streams*hidden]` before the head.
    pub fn hidden(&self, b: &dyn Backend, ids: &[u32], state: &mut SequenceState) -> Result<Tensor> {
        let mut guard = experts_lock(&self.experts)?;
        let experts = &mut *guard;
        on_compute_threads(|| self.hidden_locked(b, ids, state, experts))
    }

    fn hidden_locked(&self, b: &dyn Backend, ids: &[u32], state: &mut SequenceState, experts: &mut ExpertCache) -> Result<Tensor> {
        if ids.is_empty() {
            bail!("forward called with no tokens");
        }
        let x = b.embed(&self.embed, ids)?;
        self.layers_locked(b, x, ids, ids.len(), state, experts)
    }

    /// Whether `state` can take tokens chosen on the device
    /// ([`DecoderModel::forward_chosen`]): no layer's wiring reads token
    /// ids, and no draft head follows the sequence.
    pub fn feeds_chosen_tokens(&self, state: &SequenceState) -> bool {
        self.token_context == 0 && self.draft.is_none() && state.draft.is_none() && self.layers.iter().all(|l| !l.residual.uses_token_ids())
    }

    /// [`DecoderModel::forward`] of one token chosen on the device by
    /// `Backend::choose_greedy` (the caller checked
    /// [`DecoderModel::feeds_chosen_tokens`]): its logits `[1, vocab]`.
    pub fn forward_chosen(&self, b: &dyn Backend, chosen: &Tensor, state: &mut SequenceState) -> Result<Tensor> {
        let mut guard = experts_lock(&self.experts)?;
        let experts = &mut *guard;
        on_compute_threads(|| {
            let x = b.embed_chosen(&self.embed, chosen)?;
            let h = self.layers_locked(b, x, &[], 1, state, experts)?;
            self.logits(b, &h, 1)
        })
    }

    /// The layers over embedded rows `x` of `n` tokens (`ids`, when the
    /// wiring reads them).
    fn layers_locked(&self, b: &dyn Backend, x: Tensor, ids: &[u32], n: usize, state: &mut SequenceState, experts: &mut ExpertCache) -> Result<Tensor> {
        if state.layers.len() != self.layers.len() {
            bail!("the sequence state has {} layers for a model of {}", state.layers.len(), self.layers.len());
        }
        let mut x = x;
        if self.streams > 1 {
            x = b.repeat_cols(&x, self.streams)?;
        }
        // Each layer may leave its last add to the next one's norm.
        let mut x = Some(Hidden::from(x));
        let start = state.position;
        let SequenceState { layers: layer_states, recent, .. } = state;
        std::thread::scope(|scope| -> Result<()> {
            // Work that needs only the token ids (reading n-gram rows from
            // disk) runs while the layers before it run.
            let mut ahead: Vec<_> = self
                .layers
                .iter()
                .map(|l| l.residual.read_ahead(ids, recent).map(|work| scope.spawn(work)))
                .collect();
            for (i, ((layer, st), ahead)) in self.layers.iter().zip(layer_states.iter_mut()).zip(ahead.iter_mut()).enumerate() {
                let read = match ahead.take() {
                    Some(handle) => {
                        Some(handle.join().map_err(|_| anyhow::anyhow!("layer {i}'s read-ahead thread panicked"))??)
                    }
                    None => None,
                };
                let input = x.take().context("no hidden state between layers")?;
                let next_moe = self.layers[i + 1..].iter().find_map(|l| l.moe());
                x = Some(layer.forward_hidden(b, input, ids, start, st, read, experts, next_moe).with_context(|| format!("layer {i}"))?);
            }
            Ok(())
        })?;
        if self.token_context > 0 {
            recent.extend_from_slice(ids);
            let excess = recent.len().saturating_sub(self.token_context);
            recent.drain(..excess);
        }
        state.position += n;
        x.context("no hidden state after the layers")?.form(b)
    }

    /// Saves what [`DecoderModel::rollback`] needs to return `s` to its current position.
    pub fn snapshot(&self, b: &dyn Backend, s: &SequenceState) -> Result<Snapshot> {
        let delta = s
            .layers
            .iter()
            .map(|l| match &l.mixer {
                MixerState::Delta(d) => d.clone_with(b).map(Some),
                MixerState::Attention(_) => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let residual = s
            .layers
            .iter()
            .map(|l| l.residual.iter().map(|st| b.clone_state(st)).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Snapshot { position: s.position, recent: s.recent.clone(), delta, residual })
    }

    /// Returns `s` to where it was when `snap` was taken.
    pub fn rollback(&self, b: &dyn Backend, s: &mut SequenceState, snap: Snapshot) -> Result<()> {
        for ((st, saved), residual) in s.layers.iter_mut().zip(snap.delta).zip(snap.residual) {
            match (&mut st.mixer, saved) {
                (MixerState::Delta(d), Some(saved)) => *d = saved,
                (MixerState::Attention(a), None) => a.truncate(b, snap.position)?,
                _ => bail!("a snapshot does not match the sequence state"),
            }
            st.residual = residual;
        }
        s.recent = snap.recent;
        s.position = snap.position;
        Ok(())
    }

    /// Room for `positions` positions in every KV cache of `s`
    /// ([`Backend::kv_reserve`]): a prefill's caches allocated once.
    pub fn reserve(&self, b: &dyn Backend, s: &mut SequenceState, positions: usize) -> Result<()> {
        for st in &mut s.layers {
            if let MixerState::Attention(a) = &mut st.mixer {
                b.kv_reserve(&mut a.kv, positions)?;
            }
        }
        Ok(())
    }

    /// Deep copy of a sequence's state.
    pub fn clone_state(&self, b: &dyn Backend, s: &SequenceState) -> Result<SequenceState> {
        let layers = s.layers.iter().map(|l| l.clone_with(b)).collect::<Result<Vec<_>>>()?;
        let draft = s.draft.as_ref().map(|d| d.clone_with(b)).transpose()?;
        Ok(SequenceState { layers, recent: s.recent.clone(), draft, position: s.position })
    }

    /// Bytes of one sequence's state: the KV rows (in the backend's KV dtype)
    /// and key-selector memory of attention layers, plus the fixed-size
    /// state of Gated DeltaNet layers.
    pub fn state_bytes(&self, b: &dyn Backend, s: &SequenceState) -> u64 {
        let per_position = self.arch.kv_bytes_per_position(b.kv_cache_type());
        s.layers
            .iter()
            .map(|l| match &l.mixer {
                MixerState::Attention(AttentionState { kv, selector }) => {
                    b.kv_len(kv).unwrap_or(0) as u64 * per_position + selector.as_ref().map_or(0, |x| x.bytes() as u64)
                }
                MixerState::Delta(_) => self.arch.delta_dims().map_or(0, |d| d.state_bytes()),
            })
            .sum()
    }

    /// Row-cache counters of layers that stream rows by token (qwen4_exp's
    /// n-gram table), summed; `None` when no layer does.
    pub fn ngram_stats(&self) -> Option<RowCacheStats> {
        self.layers.iter().filter_map(|l| l.residual.row_cache_stats()).reduce(|a, b| a.plus(&b))
    }

    /// Counters of the expert pool.
    pub fn expert_stats(&self) -> Result<CacheStats> {
        Ok(experts_lock(&self.experts)?.stats())
    }

    /// Starts counting a prompt's expert reads ([`ExpertCache::mark_reads`]).
    pub fn mark_expert_reads(&self) -> Result<ReadMark> {
        Ok(experts_lock(&self.experts)?.mark_reads())
    }

    /// The expert reads since `mark`.
    pub fn expert_reads_since(&self, mark: &ReadMark) -> Result<PromptReads> {
        Ok(experts_lock(&self.experts)?.reads_since(mark))
    }

    /// Gives the expert pool `slots` slots (between requests).
    pub fn resize_expert_pool(&self, b: &dyn Backend, slots: usize) -> Result<CacheStats> {
        let mut experts = experts_lock(&self.experts)?;
        experts.resize(b, slots)?;
        Ok(experts.stats())
    }
}
