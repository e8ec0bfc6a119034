//! Forward passes of a sequence a draft head (qwen4_exp's MTP) follows: the
//! main model's hidden rows go to the head's state, and the head consumes
//! them either at once ([`HeadFeed::Now`], prefill and speculative decode)
//! or later, in one pass over many rows ([`HeadFeed::Later`]: decode steps
//! that draft nothing, so that drafting can resume).

use anyhow::Result;
use serde::Serialize;
use slotstream_backend::Tensor;

use super::Engine;
use crate::model::SequenceState;

/// Most hidden rows a draft head's state keeps unconsumed while its
/// sequence decodes without drafting; past them the head catches up (one
/// pass over the rows, `lm_head` of one).
pub const DRAFT_BACKLOG: usize = 64;

/// What a sequence with a draft head does while other sequences decode on
/// the same engine (`Engine::mtp_beside_others`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MtpBeside {
    /// Keeps drafting: each step verifies its own draft in its own pass.
    #[default]
    Draft,
    /// Takes one-token passes without a draft while any other sequence is
    /// in its decode loop, and drafts again once it decodes alone (the head
    /// catches up on the rows it missed in one pass). The output is the
    /// same either way; what changes is the work per token.
    Pause,
}

impl MtpBeside {
    /// The policy `opts` asks for (`LoadOptions::mtp_pause_beside_others`).
    pub fn from_options(opts: &crate::model::LoadOptions) -> MtpBeside {
        if opts.mtp_pause_beside_others {
            MtpBeside::Pause
        } else {
            MtpBeside::Draft
        }
    }
}

/// When a draft head consumes the hidden rows a forward pass records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeadFeed {
    /// Every entry whose next token is known.
    Now,
    /// Only once [`DRAFT_BACKLOG`] rows wait.
    Later,
}

impl Engine {
    /// Runs `chunk` (the tokens from `state.position` on; `known` holds the
    /// tokens from position `known_start` on, at least through the chunk) and
    /// returns the hidden state `[chunk.len(), streams*hidden]`. With a draft
    /// head, records the hidden rows and, as `feed` says, feeds the head
    /// every entry whose next token is known.
    pub(crate) fn forward_hidden(
        &self,
        chunk: &[u32],
        state: &mut SequenceState,
        known: &[u32],
        known_start: usize,
        feed: HeadFeed,
    ) -> Result<Tensor> {
        let _turn = self.batch.pass_turn();
        self.forward_hidden_in_turn(chunk, state, known, known_start, feed)
    }

    /// [`Engine::forward_hidden`] by a caller that holds the pass turn (on
    /// a thread of the compute pool, where asking for it again would wait
    /// for the caller's own turn).
    pub(crate) fn forward_hidden_in_turn(
        &self,
        chunk: &[u32],
        state: &mut SequenceState,
        known: &[u32],
        known_start: usize,
        feed: HeadFeed,
    ) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let first = state.position;
        let h = self.model.hidden(b, chunk, state)?;
        if let (Some(head), Some(draft)) = (&self.model.draft, state.draft.as_mut()) {
            draft.record(first, &h);
            let known_end = known_start + known.len();
            let last = (first + chunk.len()).min(known_end.saturating_sub(1));
            let due = match feed {
                HeadFeed::Now => true,
                HeadFeed::Later => last >= draft.len + DRAFT_BACKLOG,
            };
            if last > 0 && due {
                head.feed(b, &self.model, draft, known, known_start, last - 1)?;
            }
        }
        Ok(h)
    }

    /// Feeds a draft head following `state` every entry it has not yet
    /// consumed and can (through `state.position - 2`; `history` holds the
    /// tokens from position 0 on, at least those the state has consumed), as
    /// a turn ends: the next turn's prefill feeds it from there on.
    pub(crate) fn catch_up_draft(&self, state: &mut SequenceState, history: &[u32]) -> Result<()> {
        let (Some(head), Some(draft)) = (&self.model.draft, state.draft.as_mut()) else {
            return Ok(());
        };
        let known = state.position.min(history.len());
        if known >= 2 && draft.len + 1 < known {
            let _turn = self.batch.pass_turn();
            head.feed(self.backend.as_ref(), &self.model, draft, &history[..known], 0, known - 2)?;
        }
        Ok(())
    }
}
