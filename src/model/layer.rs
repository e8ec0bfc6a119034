//! One decoder layer: a token mixer and a feed-forward block, wired around
//! the residual stream by a [`Residual`], and the per-sequence state it keeps.
//!
//! The wiring is a trait so that a family with its own (qwen4_exp's
//! hyper-connections and n-gram embedding) keeps it in its own folder; the
//! plain pre-norm wiring is [`PreNorm`].

use anyhow::{bail, Result};
use serde::Serialize;
use slotstream_backend::{Backend, State, Tensor};

use super::blocks::attention::{Attention, AttentionState};
use super::blocks::delta::{DeltaState, GatedDeltaNet};
use super::blocks::mlp::Mlp;
use super::blocks::moe::MoeBlock;
use super::blocks::norm::RmsNorm;
use crate::experts::ExpertCache;

/// Token mixer of one decoder layer.
pub enum Mixer {
    Attention(Attention),
    Delta(GatedDeltaNet),
}

/// Feed-forward of one decoder layer.
pub enum FeedForward {
    Dense(Mlp),
    Moe(MoeBlock),
}

/// Which of a layer's two blocks a [`Residual`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    Mixer,
    FeedForward,
}

/// What a [`Residual`] may use besides the hidden state.
pub struct ResidualInputs<'a> {
    /// The tokens of this call.
    pub ids: &'a [u32],
    /// The backend states this wiring keeps for the sequence ([`Residual::new_state`]).
    pub state: &'a mut [State],
    /// What [`Residual::read_ahead`] returned for this call.
    pub read_ahead: Option<Vec<f32>>,
}

/// Work that depends on the token ids alone, run on its own thread while the
/// layers below run.
pub type ReadAhead<'a> = Box<dyn FnOnce() -> Result<Vec<f32>> + Send + 'a>;

/// Counters of a cache of rows streamed from disk by token id.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RowCacheStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    pub cached_rows: usize,
    pub capacity_rows: usize,
}

impl RowCacheStats {
    pub fn plus(&self, o: &RowCacheStats) -> RowCacheStats {
        RowCacheStats {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            bytes_read: self.bytes_read + o.bytes_read,
            cached_rows: self.cached_rows + o.cached_rows,
            capacity_rows: self.capacity_rows + o.capacity_rows,
        }
    }
}

/// Runs one of a layer's blocks on its input.
pub type RunBlock<'a> = &'a mut dyn FnMut(Block, &Tensor) -> Result<Tensor>;

/// How a layer's blocks are wrapped around the residual stream.
pub trait Residual: Send + Sync {
    /// Backend states kept per sequence (a convolution window, ...).
    fn new_state(&self, _b: &dyn Backend) -> Result<Vec<State>> {
        Ok(Vec::new())
    }

    /// How many of the sequence's latest tokens [`Residual::read_ahead`] needs.
    fn token_context(&self) -> usize {
        0
    }

    /// Whether [`ResidualInputs::ids`] are read (a forward pass of a token
    /// chosen on the device passes none).
    fn uses_token_ids(&self) -> bool {
        false
    }

    /// Starts work on `ids` (which follow the tokens `recent`) that needs no
    /// hidden state; its result comes back as [`ResidualInputs::read_ahead`].
    fn read_ahead<'a>(&'a self, _ids: &'a [u32], _recent: &[u32]) -> Option<ReadAhead<'a>> {
        None
    }

    /// Counters of a row cache this wiring streams through (n-gram rows).
    fn row_cache_stats(&self) -> Option<RowCacheStats> {
        None
    }

    /// For tests and tools that look inside a family's wiring.
    fn as_any(&self) -> &dyn std::any::Any;

    /// The layer's output for `x`; `block` runs the mixer or feed-forward.
    fn forward(&self, b: &dyn Backend, x: &Tensor, inputs: ResidualInputs<'_>, block: RunBlock<'_>) -> Result<Tensor>;

    /// [`Residual::forward`] on a hidden state whose last add may still be
    /// pending, leaving this layer's own last add pending where the wiring
    /// can take it into the next layer's norm. The default forms the sum
    /// first and leaves nothing pending.
    fn forward_hidden(&self, b: &dyn Backend, x: Hidden, inputs: ResidualInputs<'_>, block: RunBlock<'_>) -> Result<Hidden> {
        let x = x.form(b)?;
        Ok(Hidden::from(self.forward(b, &x, inputs, block)?))
    }
}

/// A hidden state `base + pending` whose add has not been recorded yet: the
/// next layer's input norm forms the sum in its own kernel
/// (`Backend::add_rms_norm`), one dispatch fewer per layer on a GPU.
pub struct Hidden {
    pub base: Tensor,
    pub pending: Option<Tensor>,
}

impl From<Tensor> for Hidden {
    fn from(base: Tensor) -> Hidden {
        Hidden { base, pending: None }
    }
}

impl Hidden {
    /// The hidden state as one tensor.
    pub fn form(self, b: &dyn Backend) -> Result<Tensor> {
        Ok(match self.pending {
            Some(p) => b.add(&self.base, &p)?,
            None => self.base,
        })
    }
}

/// What turns the last hidden state into the input of `lm_head`: a final
/// norm, or a collapse of several residual streams.
pub trait Head: Send + Sync {
    fn collapse(&self, b: &dyn Backend, h: &Tensor) -> Result<Tensor>;
}

pub struct DecoderLayer {
    pub residual: Box<dyn Residual>,
    pub mixer: Mixer,
    pub ffn: FeedForward,
}

/// A mixer's per-sequence state.
pub enum MixerState {
    Attention(AttentionState),
    Delta(DeltaState),
}

/// Per-layer state of one sequence.
pub struct LayerState {
    pub mixer: MixerState,
    /// The residual wiring's own states.
    pub residual: Vec<State>,
}

impl LayerState {
    pub fn clone_with(&self, b: &dyn Backend) -> Result<LayerState> {
        let mixer = match &self.mixer {
            MixerState::Attention(a) => MixerState::Attention(a.clone_with(b)?),
            MixerState::Delta(d) => MixerState::Delta(d.clone_with(b)?),
        };
        let residual = self.residual.iter().map(|s| b.clone_state(s)).collect::<Result<Vec<_>, _>>()?;
        Ok(LayerState { mixer, residual })
    }
}

impl DecoderLayer {
    /// The layer's MoE block, if its feed-forward is one.
    pub fn moe(&self) -> Option<&MoeBlock> {
        match &self.ffn {
            FeedForward::Moe(m) => Some(m),
            FeedForward::Dense(_) => None,
        }
    }

    pub fn new_state(&self, b: &dyn Backend) -> Result<LayerState> {
        let mixer = match &self.mixer {
            Mixer::Attention(a) => MixerState::Attention(a.new_state(b)?),
            Mixer::Delta(d) => MixerState::Delta(d.new_state(b)?),
        };
        Ok(LayerState { mixer, residual: self.residual.new_state(b)? })
    }

    /// The layer over `x` (`[tokens, streams*hidden]`); `ids` are the tokens
    /// of this call, the first at position `start`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        ids: &[u32],
        start: usize,
        st: &mut LayerState,
        read_ahead: Option<Vec<f32>>,
        experts: &mut ExpertCache,
    ) -> Result<Tensor> {
        self.forward_hidden(b, Hidden::from(x.clone()), ids, start, st, read_ahead, experts, None)?.form(b)
    }

    /// [`DecoderLayer::forward`] on a hidden state whose last add may be
    /// pending, leaving its own pending where the wiring allows. `next_moe`
    /// is the model's next MoE block after this layer's (its experts may be
    /// read ahead).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_hidden(
        &self,
        b: &dyn Backend,
        x: Hidden,
        ids: &[u32],
        start: usize,
        st: &mut LayerState,
        read_ahead: Option<Vec<f32>>,
        experts: &mut ExpertCache,
        next_moe: Option<&MoeBlock>,
    ) -> Result<Hidden> {
        let LayerState { mixer: mixer_state, residual } = st;
        let mut block = |which: Block, input: &Tensor| -> Result<Tensor> {
            match which {
                Block::Mixer => match (&self.mixer, &mut *mixer_state) {
                    (Mixer::Attention(a), MixerState::Attention(s)) => a.forward(b, input, s, start),
                    (Mixer::Delta(d), MixerState::Delta(s)) => d.forward(b, input, s),
                    _ => bail!("sequence state does not match the layer kind"),
                },
                Block::FeedForward => self.feed_forward(b, input, experts, next_moe),
            }
        };
        let inputs = ResidualInputs { ids, state: residual, read_ahead };
        self.residual.forward_hidden(b, x, inputs, &mut block)
    }

    /// One decode step of several sequences: row `i` of `x` is sequence
    /// `i`'s token at position `starts[i]`, mixed over its own state
    /// `mixers[i]`; the feed-forward takes every row at once (a MoE block's
    /// experts are the union of the rows' routes, each read once). Only for
    /// wirings that keep no per-sequence state of their own and read no ids.
    pub fn forward_batch(
        &self,
        b: &dyn Backend,
        x: Hidden,
        starts: &[usize],
        mixers: &mut [&mut MixerState],
        experts: &mut ExpertCache,
        next_moe: Option<&MoeBlock>,
    ) -> Result<Hidden> {
        let mut block = |which: Block, input: &Tensor| -> Result<Tensor> {
            match which {
                Block::Mixer => match &self.mixer {
                    Mixer::Attention(a) => {
                        let mut states = mixers
                            .iter_mut()
                            .map(|m| match &mut **m {
                                MixerState::Attention(s) => Ok(s),
                                MixerState::Delta(_) => bail!("sequence state does not match the layer kind"),
                            })
                            .collect::<Result<Vec<_>>>()?;
                        a.forward_batch(b, input, &mut states, starts)
                    }
                    Mixer::Delta(d) => {
                        let mut states = mixers
                            .iter_mut()
                            .map(|m| match &mut **m {
                                MixerState::Delta(s) => Ok(s),
                                MixerState::Attention(_) => bail!("sequence state does not match the layer kind"),
                            })
                            .collect::<Result<Vec<_>>>()?;
                        d.forward_batch(b, input, &mut states)
                    }
                },
                Block::FeedForward => self.feed_forward(b, input, experts, next_moe),
            }
        };
        let inputs = ResidualInputs { ids: &[], state: &mut [], read_ahead: None };
        self.residual.forward_hidden(b, x, inputs, &mut block)
    }

    fn feed_forward(&self, b: &dyn Backend, input: &Tensor, experts: &mut ExpertCache, next_moe: Option<&MoeBlock>) -> Result<Tensor> {
        match &self.ffn {
            FeedForward::Dense(m) => m.forward(b, input),
            FeedForward::Moe(m) => m.forward(b, input, experts, next_moe),
        }
    }
}

/// `h = x + mixer(input_norm(x)); h + ffn(post_norm(h))` (qwen3_moe, qwen3_next).
pub struct PreNorm {
    pub input: RmsNorm,
    pub post: RmsNorm,
}

impl Residual for PreNorm {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn forward(&self, b: &dyn Backend, x: &Tensor, inputs: ResidualInputs<'_>, block: RunBlock<'_>) -> Result<Tensor> {
        self.forward_hidden(b, Hidden::from(x.clone()), inputs, block)?.form(b)
    }

    /// The last add (`h + ffn`) is left pending for the next layer's input norm.
    /// Each tensor is dropped once nothing reads it any more: on a GPU its
    /// buffer then serves the feed-forward, whose prefill-sized scratch is
    /// the largest of a layer (kept to the end of the scope, the input's two
    /// parts, the input, its norm and the mixer's output were five hidden
    /// states of a chunk held through the MoE).
    fn forward_hidden(&self, b: &dyn Backend, x: Hidden, _inputs: ResidualInputs<'_>, block: RunBlock<'_>) -> Result<Hidden> {
        let Hidden { base, pending } = x;
        let (x, normed) = match pending {
            Some(p) => self.input.add_forward(b, &base, &p)?,
            None => {
                let normed = self.input.forward(b, &base)?;
                (base.clone(), normed)
            }
        };
        drop(base);
        let mixed = block(Block::Mixer, &normed)?;
        drop(normed);
        let (h, normed) = self.post.add_forward(b, &x, &mixed)?;
        drop((x, mixed));
        let ff = block(Block::FeedForward, &normed)?;
        Ok(Hidden { base: h, pending: Some(ff) })
    }
}

impl Head for RmsNorm {
    fn collapse(&self, b: &dyn Backend, h: &Tensor) -> Result<Tensor> {
        self.forward(b, h)
    }
}
