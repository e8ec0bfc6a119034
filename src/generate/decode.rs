//! Decoding strategies over one step API: each call yields the next token.
//! [`Plain`] runs one forward pass per token; [`Speculative`] lets the
//! model's draft head propose a token and verifies it in the same pass that
//! computes the next one (two tokens for one pass when the draft is right).
//! Greedy output is identical either way.

use std::collections::VecDeque;

use anyhow::{Context, Result};
use serde::Serialize;

use slotstream_backend::chosen::PendingRead;
use slotstream_backend::Tensor;

use super::batch::{BatchShare, Member};
use super::draft::HeadFeed;
use super::{Engine, MtpBeside, TokenConstraint};
use crate::model::{Logits, SequenceState};
use crate::sampling::Sampler;

/// Drafts judged before drafting may pause, and the acceptance it needs.
const MTP_PROBE_DRAFTS: usize = 16;
const MTP_MIN_ACCEPTANCE: f64 = 0.3;

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct MtpStats {
    pub drafted: usize,
    pub accepted: usize,
    /// Forward passes of the main model during decode.
    pub forward_passes: usize,
    /// Drafting stopped for the rest of a request because too few drafts
    /// were accepted to pay for themselves.
    pub paused: bool,
    /// Passes taken without a draft because other sequences were decoding
    /// ([`MtpBeside::Pause`]).
    pub passes_beside_others: usize,
}

impl MtpStats {
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// One way of producing tokens after the prompt.
pub(super) trait DecodeStrategy {
    /// The next token. `history` holds the prompt and every token returned so
    /// far; `state` has consumed all of them but at most the last few.
    /// `more`: whether another token will be asked for if this one does not
    /// end the output. `None`: the constraint allows no token (only
    /// [`Plain`] takes one).
    fn next_token(
        &mut self,
        engine: &Engine,
        state: &mut SequenceState,
        history: &[u32],
        sampler: &mut Sampler,
        constraint: Option<&mut dyn TokenConstraint>,
        more: bool,
    ) -> Result<Option<u32>>;
    /// Tidies the state once generation ends.
    fn finish(&mut self, _engine: &Engine, _state: &mut SequenceState) -> Result<()> {
        Ok(())
    }
    fn mtp_stats(&self) -> Option<MtpStats> {
        None
    }
    /// Steps taken in passes with other sequences (after `finish` too).
    fn batch_share(&self) -> Option<BatchShare> {
        None
    }
}

/// One forward pass per token. Greedy tokens without a constraint, on a
/// backend that keeps chosen tokens on the device, are decoded one token
/// ahead: the pass that consumes token k is recorded (and the device starts
/// on it) before token k is read back, so the device never waits for the
/// host between tokens. The state then holds every token returned, the one
/// that ended the output (an end-of-sequence) included.
pub(super) struct Plain<'a> {
    /// Logits to sample the next token from (the prefill's, at first).
    logits: Option<Vec<f32>>,
    /// The next token, chosen on the device and being read back.
    ahead: Option<Ahead>,
    /// Steps taken in passes with the other decoding sequences (never ahead).
    batch: Option<Member<'a>>,
    /// The member's share, kept when it leaves the decoding set.
    share: Option<BatchShare>,
}

struct Ahead {
    chosen: Tensor,
    read: PendingRead,
}

impl<'a> Plain<'a> {
    pub fn new(prefill_logits: Vec<f32>) -> Self {
        Plain { logits: Some(prefill_logits), ahead: None, batch: None, share: None }
    }

    /// Each step in a pass with the other sequences of `batch`.
    pub fn batched(prefill_logits: Vec<f32>, batch: Member<'a>) -> Self {
        Plain { logits: Some(prefill_logits), ahead: None, batch: Some(batch), share: None }
    }

    /// Whether tokens after this one may be chosen on the device.
    fn ahead_allowed(engine: &Engine, state: &SequenceState, sampler: &Sampler, constrained: bool) -> bool {
        engine.decode_ahead
            && !constrained
            && sampler.is_plain_greedy()
            && engine.backend.keeps_chosen_tokens()
            && engine.model.feeds_chosen_tokens(state)
    }

    /// Records the forward pass of `token` (host id or chosen on the device)
    /// and the choice of the token after it.
    fn feed(engine: &Engine, state: &mut SequenceState, token: Fed<'_>) -> Result<Ahead> {
        let b = engine.backend.as_ref();
        let logits = match token {
            Fed::Id(id) => engine.model.forward(b, &[id], state, Logits::Last)?,
            Fed::Chosen(c) => engine.model.forward_chosen(b, c, state)?,
        };
        let chosen = b.choose_greedy(&logits)?;
        let read = b.start_reading_chosen(&chosen)?;
        Ok(Ahead { chosen, read })
    }
}

enum Fed<'a> {
    Id(u32),
    Chosen(&'a Tensor),
}

impl DecodeStrategy for Plain<'_> {
    fn next_token(
        &mut self,
        engine: &Engine,
        state: &mut SequenceState,
        history: &[u32],
        sampler: &mut Sampler,
        constraint: Option<&mut dyn TokenConstraint>,
        more: bool,
    ) -> Result<Option<u32>> {
        let b = engine.backend.as_ref();
        let ahead = more && self.batch.is_none() && Self::ahead_allowed(engine, state, sampler, constraint.is_some());
        if let Some(a) = self.ahead.take() {
            if ahead {
                self.ahead = Some(Self::feed(engine, state, Fed::Chosen(&a.chosen))?);
            }
            return Ok(Some(b.finish_reading_chosen(a.read)?));
        }
        let mut logits = match self.logits.take() {
            Some(l) => l,
            None => {
                let last = *history.last().context("internal: decoding with an empty history")?;
                match &self.batch {
                    Some(batch) => batch.step(engine, last, state)?,
                    // A draft head following the sequence keeps its rows, so
                    // that a later speculative decode finds them.
                    None if state.draft.is_some() => {
                        let h = engine.forward_hidden(&[last], state, history, 0, HeadFeed::Later)?;
                        b.download(&engine.model.logits(b, &h, 1)?)?
                    }
                    None => {
                        let _turn = engine.batch.pass_turn();
                        b.download(&engine.model.forward(b, &[last], state, Logits::Last)?)?
                    }
                }
            }
        };
        if let Some(c) = constraint {
            if !c.mask(&mut logits)? {
                return Ok(None);
            }
        }
        let token = sampler.sample(&logits, history);
        if ahead {
            self.ahead = Some(Self::feed(engine, state, Fed::Id(token))?);
        }
        Ok(Some(token))
    }

    fn finish(&mut self, _engine: &Engine, _state: &mut SequenceState) -> Result<()> {
        self.ahead = None;
        // Out of the decoding set: the others stop waiting for this sequence.
        if let Some(member) = self.batch.take() {
            self.share = Some(member.share());
        }
        Ok(())
    }

    fn batch_share(&self) -> Option<BatchShare> {
        self.batch.as_ref().map(Member::share).or_else(|| self.share.clone())
    }
}

/// Speculative decoding with the model's draft head.
pub(super) struct Speculative {
    logits: Option<Vec<f32>>,
    /// Tokens already decided, to be returned before any new pass.
    ready: VecDeque<u32>,
    stats: MtpStats,
}

impl Speculative {
    pub fn new(prefill_logits: Vec<f32>) -> Self {
        Speculative { logits: Some(prefill_logits), ready: VecDeque::new(), stats: MtpStats::default() }
    }

    /// One step after `history`'s last token was sampled (the state holds
    /// every earlier token but at most one). Drafts the token after it, runs
    /// the unfed tokens plus the draft through the model in one pass and
    /// samples the real next token from the same logits plain decoding would
    /// use. A matching draft yields two tokens (queued in `ready`); otherwise
    /// the state is rolled back to before the pass and the sampled token is
    /// queued. Returns logits to sample from when nothing was queued (a
    /// catch-up pass without a draft).
    fn step(&mut self, engine: &Engine, state: &mut SequenceState, history: &[u32], sampler: &mut Sampler) -> Result<Option<Vec<f32>>> {
        // The whole step (the head's pass, the main pass, a rollback) is one
        // turn, run on a thread of the compute pool: its operations outside
        // the main pass would each hand their work to the pool and sleep.
        // Nothing in it may ask for the turn again (it runs on another thread).
        let _turn = engine.batch.pass_turn();
        crate::model::on_compute_threads(|| self.step_in_turn(engine, state, history, sampler))
    }

    fn step_in_turn(&mut self, engine: &Engine, state: &mut SequenceState, history: &[u32], sampler: &mut Sampler) -> Result<Option<Vec<f32>>> {
        let b = engine.backend.as_ref();
        let model = &engine.model;
        let head = model.draft.as_ref().context("internal: speculative decoding without a draft head")?;
        let stats = &mut self.stats;
        let q = history.len() - 1;
        let p = state.position;
        stats.forward_passes += 1;
        if stats.drafted >= MTP_PROBE_DRAFTS && stats.acceptance() < MTP_MIN_ACCEPTANCE {
            // The head stops following this sequence: its state is dropped,
            // and decoding goes on as without a head.
            stats.paused = true;
            state.draft = None;
        }
        if state.draft.is_some() && engine.mtp_beside_others == MtpBeside::Pause && engine.batch.others_decoding() {
            // Other sequences decode beside this one: no draft, the head's
            // rows kept for when it decodes alone again.
            stats.passes_beside_others += 1;
            let h = engine.forward_hidden_in_turn(&history[p..], state, history, 0, HeadFeed::Later)?;
            return Ok(Some(b.download(&model.logits(b, &h, 1)?)?));
        }
        if q >= p + 2 || state.draft.is_none() {
            // Two drafts in a row were rejected (catch up without a draft, so a
            // pass never grows past three tokens), or drafting is paused.
            let h = engine.forward_hidden_in_turn(&history[p..], state, &history[p..], p, HeadFeed::Now)?;
            return Ok(Some(b.download(&model.logits(b, &h, 1)?)?));
        }
        let draft_state = state.draft.as_mut().context("internal: the sequence has no draft state")?;
        let draft_logits = head.feed(b, model, draft_state, history, 0, q - 1)?;
        let draft_logits = b.download(&draft_logits.context("internal: the draft head had nothing to draft from")?)?;
        let draft = match &engine.drafter {
            Some(f) => f(history),
            None => crate::sampling::argmax(&draft_logits),
        };
        stats.drafted += 1;
        let snapshot = model.snapshot(b, state)?;
        let mut fed: Vec<u32> = history[p..].to_vec();
        fed.push(draft);
        let h = model.hidden(b, &fed, state)?;
        let logits = b.download(&model.logits(b, &h, 2)?)?;
        let vocab = logits.len() / 2;
        let sampled = sampler.sample(&logits[..vocab], history);
        // The known tokens' rows are right whatever the draft was; the draft's
        // row only when the draft is accepted.
        let right = if sampled == draft { h.clone() } else { b.slice_rows(&h, 0, fed.len() - 1)? };
        if let Some(d) = state.draft.as_mut() {
            d.record(p, &right);
        }
        if sampled == draft {
            stats.accepted += 1;
            let mut extended = history.to_vec();
            extended.push(draft);
            let after = sampler.sample(&logits[vocab..], &extended);
            self.ready.extend([draft, after]);
        } else {
            model.rollback(b, state, snapshot)?;
            self.ready.push_back(sampled);
        }
        Ok(None)
    }
}

impl DecodeStrategy for Speculative {
    fn next_token(
        &mut self,
        engine: &Engine,
        state: &mut SequenceState,
        history: &[u32],
        sampler: &mut Sampler,
        constraint: Option<&mut dyn TokenConstraint>,
        _more: bool,
    ) -> Result<Option<u32>> {
        if constraint.is_some() {
            anyhow::bail!("internal: speculative decoding cannot follow a constraint");
        }
        loop {
            if let Some(t) = self.ready.pop_front() {
                return Ok(Some(t));
            }
            if let Some(logits) = self.logits.take() {
                return Ok(Some(sampler.sample(&logits, history)));
            }
            self.logits = self.step(engine, state, history, sampler)?;
        }
    }

    fn finish(&mut self, engine: &Engine, state: &mut SequenceState) -> Result<()> {
        if let (Some(head), Some(d)) = (&engine.model.draft, state.draft.as_mut()) {
            head.trim(engine.backend.as_ref(), d, state.position)?;
        }
        Ok(())
    }

    fn mtp_stats(&self) -> Option<MtpStats> {
        Some(self.stats)
    }
}
