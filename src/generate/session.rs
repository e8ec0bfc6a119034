//! One turn of a conversation, as both the server and the interactive chat
//! run it: the prefix cache's longest cached prefix of the prompt, the rest
//! of the prompt fed in chunks (asking before each whether to stop), the
//! prompt's state kept for the next turn, the answer decoded, and the state
//! after the answer kept too.

use std::ops::ControlFlow;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::prefix_cache::PrefixCache;
use super::{Engine, GenerateOutput, GenerateRequest, TokenConstraint, TurnKind};

/// How a turn ended.
pub enum TurnEnd {
    /// `cancelled` said stop while the prompt was being fed, after `position`
    /// of its tokens; nothing was generated.
    CancelledInPrompt { position: usize },
    Done(TurnOutput),
}

/// A finished (or, during decode, cancelled) turn.
pub struct TurnOutput {
    pub out: GenerateOutput,
    /// Prompt tokens taken from the prefix cache instead of being fed.
    pub cached_tokens: usize,
    /// Time spent feeding the prompt before the decode's own prefill (its
    /// last token): add `out.stats.prefill_seconds` for the whole prompt's.
    pub prompt_feed: Duration,
}

/// The cache's lock; a panic elsewhere leaves entries that are still whole
/// states, so a poisoned lock is taken as it is.
pub fn lock_cache(cache: &Mutex<PrefixCache>) -> MutexGuard<'_, PrefixCache> {
    cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Engine {
    /// Runs one turn: `req.prompt_ids` from the longest prefix `cache` holds
    /// (a fresh state without one), feeding all but the prompt's last token
    /// in chunks while `cancelled` says go on, then decoding with
    /// [`Engine::generate_constrained`] (`on_text` as there). The states
    /// after the prompt and after the answer go into `cache`; a failure
    /// clears it (its states may be in doubt).
    pub fn run_turn(
        &self,
        cache: Option<&Mutex<PrefixCache>>,
        req: &GenerateRequest,
        constraint: Option<&mut dyn TokenConstraint>,
        cancelled: impl Fn() -> bool,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<TurnEnd> {
        let result = self.turn(cache, req, constraint, cancelled, on_text);
        if let (Err(_), Some(c)) = (&result, cache) {
            lock_cache(c).clear();
        }
        result
    }

    fn turn(
        &self,
        cache: Option<&Mutex<PrefixCache>>,
        req: &GenerateRequest,
        constraint: Option<&mut dyn TokenConstraint>,
        cancelled: impl Fn() -> bool,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<TurnEnd> {
        let ids = &req.prompt_ids;
        if ids.is_empty() {
            anyhow::bail!("the prompt is empty: give at least one token");
        }
        let started = Instant::now();
        let cached = match cache {
            Some(c) => lock_cache(c).lookup(ids, |s| self.clone_state(s))?,
            None => None,
        };
        let mut state = match cached {
            Some(s) => s,
            None => self.new_state()?,
        };
        let cached_tokens = state.position;
        // A prompt that ends within one chunk holds one turn through its
        // last token: its first token waits for no other pass in between.
        let held = (ids.len().saturating_sub(state.position) <= self.chunk_tokens()).then(|| self.batch.turn(TurnKind::Next));
        let mark = self.mark_expert_reads()?;
        // All but the last prompt token are fed here, in chunks, so that a
        // caller who stops during a long prompt is heard, and so that the
        // prompt's state can be kept for the next turn.
        if !self.prefill_until(ids, ids.len() - 1, &mut state, cancelled)? {
            return Ok(TurnEnd::CancelledInPrompt { position: state.position });
        }
        let prompt_feed = started.elapsed();
        // What the prompt read from disk (with other sequences decoding at
        // once, their reads in the same time are counted too).
        let reads = self.expert_reads_since(&mark)?;
        if reads.bytes_read > 0 {
            let fed = state.position - cached_tokens;
            crate::note!("prompt: {fed} tokens in {:.2} s: {}", prompt_feed.as_secs_f64(), reads.describe());
        }
        if let Some(c) = cache {
            if state.position > cached_tokens {
                let copy = self.clone_state(&state)?;
                lock_cache(c).insert(ids[..state.position].to_vec(), copy);
            }
        }
        let out = self.generate_held(&mut state, req, constraint, on_text, held)?;
        self.keep_hit_rate(&out.stats);
        if let Some(c) = cache {
            lock_cache(c).insert(out.state_ids(state.position), state);
        }
        Ok(TurnEnd::Done(TurnOutput { out, cached_tokens, prompt_feed }))
    }
}
