//! The single entry point for generation: a loaded model plus its text codec,
//! running chunked prefill and a decode loop (plain or speculative, see
//! [`decode`]) with sampling, end-of-sequence and stop-string handling, and
//! streaming text out as it is produced. The CLI and the server call the
//! [`Engine`]'s methods and never reach into the model.

mod batch;
mod decode;
mod draft;
mod prefix_cache;
mod session;
mod stop;

use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;
use slotstream_backend::Backend;

pub use batch::{BatchCounters, BatchShare, Batcher, PassTurn, TurnKind, MAX_PARALLEL};
pub use decode::MtpStats;
pub use draft::{MtpBeside, DRAFT_BACKLOG};
pub use prefix_cache::{PrefixCache, PrefixCacheStats};
pub use session::{lock_cache, TurnEnd, TurnOutput};
use decode::{DecodeStrategy, Plain, Speculative};
use draft::HeadFeed;
use stop::StopMatcher;

use crate::experts::{CacheCounters, CacheStats, PromptReads, ReadMark};
use crate::model::{self, DecoderModel, Logits, ModelArch, SequenceState};
pub use crate::plan::DEFAULT_PREFILL_CHUNK;

/// Positions of answer tokens a generation's KV caches are given room for
/// before its prompt is fed (past them they grow as they need).
const DECODE_RESERVE: usize = 1024;

/// Most tokens of a prompt chunk with more of the prompt after it, when
/// several generations may run at once and the expert pool holds every
/// expert: a request that arrives while long prompts are fed waits for the
/// chunk running, so a chunk takes about as long as a short prompt's own
/// pass (examples/bench_ttft.rs, BENCHMARKS.md).
pub const SHARED_PREFILL_CHUNK: usize = 32;
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{StreamDecoder, TextCodec};

/// Replaces the MTP head's draft: given the tokens so far, the token to
/// propose next. The head still runs, so its state stays as in real use.
pub type Drafter = Box<dyn Fn(&[u32]) -> u32 + Send + Sync>;

/// A model ready to generate.
pub struct Engine {
    pub backend: Box<dyn Backend>,
    pub model: DecoderModel,
    pub codec: TextCodec,
    /// Prompt tokens per forward pass asked for (the plan's); the backend may
    /// bound it ([`Engine::chunk_tokens`]).
    pub prefill_chunk: usize,
    /// For tests of speculative decoding's verification: drafts chosen by the
    /// test instead of the head (accepted and rejected drafts on demand).
    pub drafter: Option<Drafter>,
    /// Decode greedy tokens one ahead where the backend and model allow
    /// (`decode::Plain`; `LoadOptions::decode_ahead`).
    pub decode_ahead: bool,
    /// Whether a sequence with a draft head keeps drafting while others
    /// decode beside it, or pauses until it decodes alone.
    pub mtp_beside_others: MtpBeside,
    /// The sequences decoding at once, whose steps share forward passes
    /// (up to 1 by default: [`Engine::set_parallel`]).
    pub batch: Batcher,
}

/// Limits which tokens may come next (a JSON schema, a tool call's grammar).
/// The engine asks it before sampling each token and tells it which token was
/// chosen; a request without one pays nothing for the hook.
pub trait TokenConstraint: Send {
    /// Sets the logits of tokens that may not come next to negative infinity;
    /// returns false when no token may come next (the output is complete).
    fn mask(&mut self, logits: &mut [f32]) -> Result<bool>;
    /// Records the chosen token; returns true when nothing more may follow it.
    fn commit(&mut self, token: u32) -> Result<bool>;
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (for tests and benchmarks).
    pub ignore_eos: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The caller asked to stop.
    Cancelled,
}

#[derive(Clone, Debug, Serialize)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Speculative decoding with the MTP head: tokens drafted and accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtp: Option<MtpStats>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    /// The expert pool's counters during decode (prefill left out): what a
    /// decode-speed estimate's hit rate is about. With other sequences
    /// decoding at once, their reads in the same time count too.
    pub decode_experts: CacheCounters,
    /// Decode steps taken in passes with other sequences, and this
    /// sequence's share of what those passes read (`--parallel` above 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batched: Option<BatchShare>,
    /// What the prompt read of the routed experts, as passes over those that missed.
    pub prefill_experts: PromptReads,
}

#[derive(Clone, Debug, Serialize)]
pub struct GenerateOutput {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    /// The end-of-sequence token that ended the output, when the state
    /// consumed it (greedy decoding one token ahead feeds every token it returns).
    #[serde(skip)]
    pub fed_end: Option<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: GenerateStats,
}

impl GenerateOutput {
    /// The tokens a state that generated this output holds, given its
    /// `position`: the prompt, the generated tokens fed back and the fed end.
    pub fn state_ids(&self, position: usize) -> Vec<u32> {
        let mut ids = self.prompt_ids.clone();
        ids.extend(&self.generated_ids);
        ids.extend(self.fed_end);
        ids.truncate(position);
        ids
    }
}

fn per_second(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

impl Engine {
    /// Loads a model directory onto `backend`.
    pub fn load(dir: &Path, backend: Box<dyn Backend>, opts: &model::LoadOptions) -> Result<Engine> {
        Self::load_arch(&ModelArch::read(dir)?, backend, opts)
    }

    /// Loads the model `arch` describes onto `backend`.
    pub fn load_arch(arch: &ModelArch, backend: Box<dyn Backend>, opts: &model::LoadOptions) -> Result<Engine> {
        let model = model::load(arch, backend.as_ref(), opts)?;
        let codec = TextCodec::load(&arch.dir, &arch.eos_ids())?;
        codec.check_fits_model(model.vocab_size(), &arch.dir)?;
        let batch = Batcher::new(1)?;
        Ok(Engine { backend, model, codec, prefill_chunk: DEFAULT_PREFILL_CHUNK, drafter: None, decode_ahead: opts.decode_ahead, mtp_beside_others: MtpBeside::from_options(opts), batch })
    }

    /// Lets up to `parallel` sequences that decode at the same time (each on
    /// its own thread) share forward passes; 1 decodes each alone. Set
    /// between generations.
    pub fn set_parallel(&mut self, parallel: usize) -> Result<()> {
        self.batch = Batcher::new(parallel)?;
        Ok(())
    }

    /// The loaded checkpoint's description.
    pub fn arch(&self) -> &ModelArch {
        &self.model.arch
    }

    /// Most tokens (prompt and generated) one sequence may hold: the model's
    /// trained context, or unbounded when its config does not state one.
    pub fn context_length(&self) -> usize {
        self.arch().context_length().map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX))
    }

    pub fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    /// Bytes of everything resident besides the expert pool.
    pub fn resident_bytes(&self) -> u64 {
        self.model.resident_bytes as u64
    }

    /// Expert cache statistics so far. Read in a pass turn: the pool's lock
    /// alone would let a decoding thread, taking it pass after pass, keep
    /// another generation waiting here.
    pub fn expert_stats(&self) -> Result<CacheStats> {
        let _turn = self.batch.pass_turn();
        self.model.expert_stats()
    }

    /// Keeps a generation's decode hit rate and time for later plans of this
    /// model, when its pool streamed ([`crate::plan::hits::keep_run`]); what
    /// cannot be kept is a note, never an error of the generation. A
    /// speculative decode's time is not a plain decode's, so it keeps only
    /// its hit rate.
    pub fn keep_hit_rate(&self, stats: &GenerateStats) {
        let timing = stats.mtp.is_none().then(|| crate::plan::hits::DecodeTiming {
            backend: self.backend.name(),
            // The first generated token comes from the prefill's logits.
            steps: stats.generated_tokens.saturating_sub(1),
            seconds: stats.decode_seconds,
        });
        let kept = self
            .expert_stats()
            .and_then(|pool| crate::plan::hits::keep_run(self.arch(), pool.slots, &stats.decode_experts, timing.as_ref()));
        if let Err(e) = kept {
            crate::note!("note: this run's expert hit rate was not kept for later estimates: {e:#}");
        }
    }

    /// Starts counting a prompt's expert reads (for [`Engine::expert_reads_since`]).
    /// In a pass turn, as [`Engine::expert_stats`].
    pub fn mark_expert_reads(&self) -> Result<ReadMark> {
        let _turn = self.batch.pass_turn();
        self.model.mark_expert_reads()
    }

    /// What the calls since `mark` read of the routed experts.
    pub fn expert_reads_since(&self, mark: &ReadMark) -> Result<PromptReads> {
        let _turn = self.batch.pass_turn();
        self.model.expert_reads_since(mark)
    }

    /// Whether the expert pool has a slot for every routed expert (it reads
    /// none while decoding or feeding a prompt, once they are in).
    fn pool_holds_every_expert(&self) -> Result<bool> {
        let _turn = self.batch.pass_turn();
        let experts = self.model.experts.lock().map_err(|_| anyhow::anyhow!("the expert cache was poisoned by an earlier failure"))?;
        let store = experts.store();
        Ok(experts.slots() >= store.layers * store.experts_per_layer)
    }

    /// Gives the expert pool `slots` slots (between generations); returns the new statistics.
    pub fn resize_expert_pool(&self, slots: usize) -> Result<CacheStats> {
        self.model.resize_expert_pool(self.backend.as_ref(), slots)
    }

    pub fn new_state(&self) -> Result<SequenceState> {
        self.model.new_state(self.backend.as_ref())
    }

    /// Deep copy of a sequence's state (for a prefix cache).
    pub fn clone_state(&self, state: &SequenceState) -> Result<SequenceState> {
        self.model.clone_state(self.backend.as_ref(), state)
    }

    /// Bytes a sequence's state holds (KV rows in the backend's KV dtype,
    /// recurrent state).
    pub fn state_bytes(&self, state: &SequenceState) -> u64 {
        self.model.state_bytes(self.backend.as_ref(), state)
    }

    /// Prompt tokens per forward pass: [`Engine::prefill_chunk`], within the
    /// backend's own bound ([`Backend::prefill_rows_max`]).
    pub fn chunk_tokens(&self) -> usize {
        self.prefill_chunk.clamp(1, self.backend.prefill_rows_max().unwrap_or(usize::MAX).max(1))
    }

    /// Feeds `ids` in chunks and returns the last position's logits.
    pub fn prefill(&self, ids: &[u32], state: &mut SequenceState) -> Result<Vec<f32>> {
        if ids.is_empty() {
            bail!("the prompt is empty: give at least one token");
        }
        let start = state.position;
        self.model.reserve(self.backend.as_ref(), state, start + ids.len())?;
        let chunks = ids.chunks(self.chunk_tokens());
        let last = chunks.len() - 1;
        let mut logits = Vec::new();
        for (i, chunk) in chunks.enumerate() {
            let h = self.forward_hidden(chunk, state, ids, start, HeadFeed::Now)?;
            // Only the last position's logits are wanted: earlier chunks skip `lm_head`.
            if i == last {
                logits = self.backend.download(&self.model.logits(self.backend.as_ref(), &h, 1)?)?;
            }
        }
        Ok(logits)
    }

    /// Feeds `ids[state.position..end]` (`ids` starts at position 0) one
    /// chunk at a time, asking `cancelled` before each chunk; returns `false`
    /// when it said stop. Logits are not computed.
    pub fn prefill_until(&self, ids: &[u32], end: usize, state: &mut SequenceState, cancelled: impl Fn() -> bool) -> Result<bool> {
        if end > ids.len() {
            bail!("internal: prefill up to {end} of {} tokens", ids.len());
        }
        self.model.reserve(self.backend.as_ref(), state, end)?;
        // Short chunks only where they read nothing more: a streaming pool
        // reads each missed expert once a chunk.
        let short_chunks = self.batch.parallel() > 1 && end - state.position.min(end) > self.chunk_tokens() && self.pool_holds_every_expert()?;
        while state.position < end {
            if cancelled() {
                return Ok(false);
            }
            let from = state.position;
            // A prompt that does not end within one chunk goes in shorter
            // chunks, each a `Bulk` turn, while others may run beside it.
            let (chunk, kind) = match self.chunk_tokens() {
                c if end - from <= c => (c, TurnKind::Next),
                c if short_chunks => (c.min(SHARED_PREFILL_CHUNK), TurnKind::Bulk),
                c => (c, TurnKind::Bulk),
            };
            let stop = end.min(from + chunk);
            let _turn = self.batch.turn(kind);
            self.forward_hidden(&ids[from..stop], state, &ids[from..end], from, HeadFeed::Now)?;
        }
        Ok(true)
    }

    /// Generates from a fresh state, calling `on_text` once per generated
    /// token with the text it made ready (empty while text is held back) and
    /// once at the end with what was still held; `on_text` returning `Break`
    /// cancels.
    pub fn generate(&self, req: &GenerateRequest, on_text: impl FnMut(&str) -> ControlFlow<()>) -> Result<GenerateOutput> {
        let mut state = self.new_state()?;
        self.generate_from(&mut state, req, on_text)
    }

    /// Generates from `state`, which has already consumed the first
    /// `state.position` tokens of `req.prompt_ids` (a reused prefix); feeds the
    /// rest of the prompt, then decodes. Afterwards `state` holds the prompt and
    /// the generated tokens that were fed back (all but a final one that
    /// ended generation by length or stop string, or all of them and the
    /// end-of-sequence token when decoding ahead: [`GenerateOutput::state_ids`]).
    pub fn generate_from(
        &self,
        state: &mut SequenceState,
        req: &GenerateRequest,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<GenerateOutput> {
        self.generate_constrained(state, req, None, on_text)
    }

    /// [`Engine::generate_from`] with every token limited by `constraint`
    /// (decoded one token per pass: a draft head's guesses are not masked).
    pub fn generate_constrained(
        &self,
        state: &mut SequenceState,
        req: &GenerateRequest,
        constraint: Option<&mut dyn TokenConstraint>,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<GenerateOutput> {
        self.generate_held(state, req, constraint, on_text, None)
    }

    /// [`Engine::generate_constrained`], holding `held` (a turn taken
    /// before the prompt's last chunk) through the prompt's last token.
    pub(crate) fn generate_held(
        &self,
        state: &mut SequenceState,
        req: &GenerateRequest,
        mut constraint: Option<&mut dyn TokenConstraint>,
        mut on_text: impl FnMut(&str) -> ControlFlow<()>,
        held: Option<PassTurn<'_>>,
    ) -> Result<GenerateOutput> {
        req.sampling.validate().map_err(anyhow::Error::msg)?;
        if state.position >= req.prompt_ids.len() {
            bail!(
                "the state already holds {} tokens but the prompt has {}: at least one prompt token must be left to feed",
                state.position,
                req.prompt_ids.len()
            );
        }
        let max_tokens = tokens_within_context(
            req.prompt_ids.len(),
            req.max_tokens,
            self.context_length(),
            "the model's context (max_position_embeddings)",
        )?;
        let fed = req.prompt_ids.len() - state.position;
        let mark = self.mark_expert_reads()?;
        let start = Instant::now();
        // The KV caches hold the prompt and the first answer tokens from the
        // start, so that a long prompt's answer does not copy them to grow.
        let answer = max_tokens.min(DECODE_RESERVE);
        self.model.reserve(self.backend.as_ref(), state, req.prompt_ids.len() + answer)?;
        let logits = self.prefill(&req.prompt_ids[state.position..], state)?;
        let prefill_seconds = start.elapsed().as_secs_f64();

        let prefill_experts = self.expert_reads_since(&mark)?;
        let experts_before_decode = self.expert_stats()?.total;
        // The first token needs no other pass: the turn goes on.
        drop(held);
        let decode_start = Instant::now();
        // Counted among the decoding sequences until the strategy is finished.
        let decoding = self.batch.decode_loop();
        let mut strategy: Box<dyn DecodeStrategy + '_> = match &self.model.draft {
            Some(_) if constraint.is_none() => Box::new(Speculative::new(logits)),
            _ if self.batch.parallel() > 1 && self.model.batches(state) => Box::new(Plain::batched(logits, self.batch.join())),
            _ => Box::new(Plain::new(logits)),
        };
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut history = req.prompt_ids.clone();
        let mut generated = Vec::new();
        let mut text = String::new();
        let mut decoder = StreamDecoder::default();
        let mut stops = StopMatcher::new(&req.stop);
        let mut finish = FinishReason::Length;
        let mut hit_stop_string = false;
        let mut ended_by = None;
        // Called for every token, with an empty piece while text is held back
        // (a possible stop string, an incomplete character), so the caller can
        // cancel at every step whatever is shown.
        let mut emit = |piece: &str, text: &mut String| -> ControlFlow<()> {
            text.push_str(piece);
            on_text(piece)
        };
        while generated.len() < max_tokens {
            let more = generated.len() + 1 < max_tokens;
            let Some(next) = strategy.next_token(self, state, &history, &mut sampler, constraint.as_mut().map(|c| &mut **c as _), more)? else {
                // The constraint allows nothing more: the output is complete.
                finish = FinishReason::Stop;
                break;
            };
            if !req.ignore_eos && self.codec.eos_ids.contains(&next) {
                finish = FinishReason::Stop;
                ended_by = Some(next);
                break;
            }
            let complete = match constraint.as_mut() {
                Some(c) => c.commit(next)?,
                None => false,
            };
            generated.push(next);
            history.push(next);
            let piece = decoder.push(&self.codec, next)?;
            let (safe, stopped) = stops.push(&piece);
            if emit(&safe, &mut text).is_break() {
                finish = FinishReason::Cancelled;
                break;
            }
            if stopped {
                finish = FinishReason::Stop;
                hit_stop_string = true;
                break;
            }
            if complete {
                finish = FinishReason::Stop;
                break;
            }
        }
        strategy.finish(self, state)?;
        drop(decoding);
        // Rows a draft head was left to consume later are consumed now.
        self.catch_up_draft(state, &history)?;
        // Decoding ahead fed the end-of-sequence token too.
        let fed_end = ended_by.filter(|_| state.position > history.len());
        if !hit_stop_string && finish != FinishReason::Cancelled {
            // Flush an incomplete character and any text held back for stop matching.
            let tail = decoder.finish(&self.codec)?;
            let (safe, stopped) = stops.push(&tail);
            let rest = if stopped { String::new() } else { stops.finish() };
            if stopped {
                finish = FinishReason::Stop;
            }
            let _ = emit(&(safe + &rest), &mut text);
        }
        let decode_seconds = decode_start.elapsed().as_secs_f64();
        let stats = GenerateStats {
            prompt_tokens: req.prompt_ids.len(),
            generated_tokens: generated.len(),
            mtp: strategy.mtp_stats(),
            prefill_seconds,
            decode_seconds,
            prefill_tokens_per_second: per_second(fed, prefill_seconds),
            // The first generated token comes from the prefill's logits.
            decode_tokens_per_second: per_second(generated.len().saturating_sub(1), decode_seconds),
            decode_experts: self.expert_stats()?.total.since(&experts_before_decode),
            batched: strategy.batch_share(),
            prefill_experts,
        };
        Ok(GenerateOutput { prompt_ids: req.prompt_ids.clone(), generated_ids: generated, fed_end, text, finish_reason: finish, stats })
    }
}

/// How many of the `max_tokens` asked for fit after a prompt of `prompt_len`
/// tokens within `context` tokens (`what` names that limit in the error): all
/// of them, fewer when the context ends first, and an error when the prompt
/// leaves no room at all.
pub fn tokens_within_context(prompt_len: usize, max_tokens: usize, context: usize, what: &str) -> Result<usize> {
    if prompt_len >= context {
        bail!(
            "the prompt is {prompt_len} tokens, which leaves no room to generate within {what} of {context} tokens; \
             shorten the prompt"
        );
    }
    Ok(max_tokens.min(context - prompt_len))
}

/// Perplexity of a text, evaluated in independent windows.
#[derive(Clone, Debug, Serialize)]
pub struct Perplexity {
    pub windows: usize,
    /// Tokens predicted (each window's first token has no prediction).
    pub predicted_tokens: usize,
    pub mean_nll: f64,
    pub perplexity: f64,
}

impl Engine {
    /// Splits `ids` into consecutive windows of `window` tokens and scores each
    /// from an empty state: the mean negative log-likelihood of every token
    /// given the ones before it in its window.
    pub fn perplexity(&self, ids: &[u32], window: usize, max_windows: usize) -> Result<Perplexity> {
        self.score_windows(ids, window, max_windows, false)
    }

    /// [`Engine::perplexity`] with each window fed one token at a time, as
    /// decoding runs: the one-token kernels score the text (a GPU's int8
    /// activations, which prefill never takes).
    pub fn perplexity_one_token(&self, ids: &[u32], window: usize, max_windows: usize) -> Result<Perplexity> {
        self.score_windows(ids, window, max_windows, true)
    }

    fn score_windows(&self, ids: &[u32], window: usize, max_windows: usize, one_token: bool) -> Result<Perplexity> {
        if window < 2 {
            bail!("the perplexity window must be at least 2 tokens");
        }
        if window > self.context_length() {
            bail!("the perplexity window of {window} tokens is over the model's context of {} tokens", self.context_length());
        }
        let vocab = self.model.vocab_size();
        let (mut nll, mut n, mut windows) = (0.0f64, 0usize, 0usize);
        for chunk in ids.chunks_exact(window).take(max_windows) {
            let mut state = self.new_state()?;
            let logits = if one_token {
                let mut rows = Vec::with_capacity((window - 1) * vocab);
                for &id in &chunk[..window - 1] {
                    let t = self.model.forward(self.backend.as_ref(), &[id], &mut state, Logits::Last)?;
                    rows.extend(self.backend.download(&t)?);
                }
                rows
            } else {
                let t = self.model.forward(self.backend.as_ref(), chunk, &mut state, Logits::All)?;
                self.backend.download(&t)?
            };
            for (i, row) in logits.chunks_exact(vocab).take(window - 1).enumerate() {
                let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let log_sum = row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln() + max;
                nll += log_sum - row[chunk[i + 1] as usize] as f64;
                n += 1;
            }
            windows += 1;
        }
        if n == 0 {
            bail!("the text has fewer than {window} tokens: nothing to score");
        }
        let mean = nll / n as f64;
        Ok(Perplexity { windows, predicted_tokens: n, mean_nll: mean, perplexity: mean.exp() })
    }
}

#[cfg(test)]
mod tests {
    use super::tokens_within_context;

    #[test]
    fn generation_is_bounded_by_the_context() {
        assert_eq!(tokens_within_context(10, 5, 100, "the context").expect("fits"), 5);
        assert_eq!(tokens_within_context(10, usize::MAX, 100, "the context").expect("clamped"), 90);
        let error = tokens_within_context(100, 1, 100, "the model's context").expect_err("no room");
        assert!(error.to_string().contains("the prompt is 100 tokens") && error.to_string().contains("the model's context of 100"), "{error}");
    }
}
