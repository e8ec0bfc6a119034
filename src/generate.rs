//! The single entry point for generation: a loaded model plus its text codec,
//! running chunked prefill and a decode loop with sampling, end-of-sequence and
//! stop-string handling, and streaming text out as it is produced.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use slotstream_backend::{Backend, Tensor};

use crate::model::{self, DecoderModel, Logits, SequenceState};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{StreamDecoder, TextCodec};

/// Prompt tokens processed per forward pass during prefill.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// Replaces the MTP head's draft: given the tokens so far, the token to
/// propose next. The head still runs, so its state stays as in real use.
pub type Drafter = Box<dyn Fn(&[u32]) -> u32 + Send + Sync>;

/// A model ready to generate.
pub struct Engine {
    pub backend: Box<dyn Backend>,
    pub model: DecoderModel,
    pub codec: TextCodec,
    pub prefill_chunk: usize,
    /// For tests of speculative decoding's verification: drafts chosen by the
    /// test instead of the head (accepted and rejected drafts on demand).
    pub drafter: Option<Drafter>,
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
}

#[derive(Clone, Debug, Serialize)]
pub struct GenerateOutput {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: GenerateStats,
}

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct MtpStats {
    pub drafted: usize,
    pub accepted: usize,
    /// Forward passes of the main model during decode.
    pub forward_passes: usize,
    /// Drafting stopped for the rest of the request because too few drafts
    /// were accepted to pay for themselves.
    pub paused: bool,
}

/// Drafts judged before drafting may pause, and the acceptance it needs.
const MTP_PROBE_DRAFTS: usize = 16;
const MTP_MIN_ACCEPTANCE: f64 = 0.3;

impl MtpStats {
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

fn per_second(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Holds back text that could be the start of a stop string, and finds stops.
struct StopMatcher<'a> {
    stops: &'a [String],
    pending: String,
}

impl<'a> StopMatcher<'a> {
    /// Adds text; returns what is safe to emit and whether a stop string matched.
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter(|s| !s.is_empty()).filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // The longest suffix of `pending` that is a prefix of some stop string.
        let mut hold = 0;
        for s in self.stops {
            for (i, _) in self.pending.char_indices() {
                let tail = &self.pending[i..];
                if s.starts_with(tail) {
                    hold = hold.max(tail.len());
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

impl Engine {
    /// Loads a model directory onto `backend`.
    pub fn load(dir: &Path, backend: Box<dyn Backend>, opts: &model::LoadOptions) -> Result<Engine> {
        let model = model::load(dir, backend.as_ref(), opts)?;
        let config_eos = read_config_eos(dir)?;
        let codec = TextCodec::load(dir, &config_eos)?;
        Ok(Engine { backend, model, codec, prefill_chunk: DEFAULT_PREFILL_CHUNK, drafter: None })
    }

    /// Expert cache statistics so far.
    pub fn expert_stats(&self) -> Result<crate::experts::CacheStats> {
        let cache = self.model.experts.lock().map_err(|_| anyhow::anyhow!("the expert cache was poisoned by an earlier failure"))?;
        Ok(cache.stats())
    }

    pub fn new_state(&self) -> Result<SequenceState> {
        self.model.new_state(self.backend.as_ref())
    }

    /// Feeds `ids` in chunks and returns the last position's logits.
    pub fn prefill(&self, ids: &[u32], state: &mut SequenceState) -> Result<Vec<f32>> {
        if ids.is_empty() {
            bail!("the prompt is empty: give at least one token");
        }
        let mut logits = Vec::new();
        let start = state.position;
        for chunk in ids.chunks(self.prefill_chunk.max(1)) {
            let t = self.forward_tracked(chunk, state, ids, start)?;
            logits = self.backend.download(&self.logits_of_last(&t, 1)?)?;
        }
        Ok(logits)
    }

    /// Runs `chunk` (the tokens from `state.position` on; `known` holds the
    /// tokens from position `known_start` on, at least through the chunk) and
    /// returns the hidden state `[chunk.len(), streams*hidden]`. With an MTP
    /// head, records the hidden rows and feeds the head every entry whose
    /// next token is known.
    fn forward_tracked(&self, chunk: &[u32], state: &mut SequenceState, known: &[u32], known_start: usize) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let first = state.position;
        let h = self.model.hidden(b, chunk, state)?;
        if let (Some(head), Some(mtp)) = (&self.model.mtp, state.mtp.as_mut()) {
            mtp.record(first, &h);
            let known_end = known_start + known.len();
            let last = (first + chunk.len()).min(known_end.saturating_sub(1));
            if last > 0 {
                head.feed(b, &self.model, mtp, known, known_start, last - 1)?;
            }
        }
        Ok(h)
    }

    /// Logits `[n, vocab]` of the last `n` rows of a hidden state.
    fn logits_of_last(&self, h: &Tensor, n: usize) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let rows = h.rows();
        let h = if rows > n { b.slice_rows(h, rows - n, n)? } else { h.clone() };
        Ok(b.matmul(&self.model.collapse(b, &h)?, &self.model.lm_head)?)
    }

    /// Generates from a fresh state, calling `on_text` with each piece of text;
    /// `on_text` returning `Break` cancels.
    pub fn generate(&self, req: &GenerateRequest, on_text: impl FnMut(&str) -> ControlFlow<()>) -> Result<GenerateOutput> {
        let mut state = self.new_state()?;
        self.generate_from(&mut state, req, on_text)
    }

    /// Generates from `state`, which has already consumed the first
    /// `state.position` tokens of `req.prompt_ids` (a reused prefix); feeds the
    /// rest of the prompt, then decodes. Afterwards `state` holds the prompt and
    /// the generated tokens that were fed back (all but a final one that ended
    /// generation by length or stop string).
    pub fn generate_from(
        &self,
        state: &mut SequenceState,
        req: &GenerateRequest,
        mut on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<GenerateOutput> {
        req.sampling.validate().map_err(anyhow::Error::msg)?;
        if state.position >= req.prompt_ids.len() {
            bail!(
                "the state already holds {} tokens but the prompt has {}: at least one prompt token must be left to feed",
                state.position,
                req.prompt_ids.len()
            );
        }
        let fed = req.prompt_ids.len() - state.position;
        let start = Instant::now();
        let mut logits = self.prefill(&req.prompt_ids[state.position..], state)?;
        let prefill_seconds = start.elapsed().as_secs_f64();

        let decode_start = Instant::now();
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut history = req.prompt_ids.clone();
        let mut generated = Vec::new();
        let mut text = String::new();
        let mut decoder = StreamDecoder::default();
        let mut stops = StopMatcher { stops: &req.stop, pending: String::new() };
        let mut finish = FinishReason::Length;
        let mut hit_stop_string = false;
        let mut emit = |piece: &str, text: &mut String| -> ControlFlow<()> {
            if piece.is_empty() {
                return ControlFlow::Continue(());
            }
            text.push_str(piece);
            on_text(piece)
        };
        let mut ready: std::collections::VecDeque<u32> = std::collections::VecDeque::new();
        let mut mtp_stats = self.model.mtp.as_ref().map(|_| MtpStats::default());
        while generated.len() < req.max_tokens {
            let next = match ready.pop_front() {
                Some(t) => t,
                None => sampler.sample(&logits, &history),
            };
            if !req.ignore_eos && self.codec.eos_ids.contains(&next) {
                finish = FinishReason::Stop;
                break;
            }
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
            if generated.len() == req.max_tokens || !ready.is_empty() {
                continue;
            }
            match mtp_stats.as_mut() {
                None => {
                    let t = self.model.forward(self.backend.as_ref(), &[next], state, Logits::Last)?;
                    logits = self.backend.download(&t)?;
                }
                Some(stats) => {
                    logits = self.speculate(state, &history, &mut sampler, &mut ready, stats)?;
                }
            }
        }
        if let (Some(head), Some(mtp)) = (&self.model.mtp, state.mtp.as_mut()) {
            head.trim(self.backend.as_ref(), mtp, state.position)?;
        }
        if !hit_stop_string {
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
            mtp: mtp_stats,
            prefill_seconds,
            decode_seconds,
            prefill_tokens_per_second: per_second(fed, prefill_seconds),
            // The first generated token comes from the prefill's logits.
            decode_tokens_per_second: per_second(generated.len().saturating_sub(1), decode_seconds),
        };
        Ok(GenerateOutput { prompt_ids: req.prompt_ids.clone(), generated_ids: generated, text, finish_reason: finish, stats })
    }
}

impl Engine {
    /// One step of speculative decoding with the MTP head, after `history`'s
    /// last token was sampled (the state holds every earlier token but at most
    /// one). Drafts the token after it, runs the unfed tokens plus the draft
    /// through the model in one pass and samples the real next token from the
    /// same logits plain decoding would use. A matching draft yields two tokens
    /// (queued in `ready`); otherwise the state is rolled back to before the
    /// pass and the sampled token is queued. Returns logits to sample from when
    /// nothing was queued (a catch-up pass without a draft).
    fn speculate(
        &self,
        state: &mut SequenceState,
        history: &[u32],
        sampler: &mut Sampler,
        ready: &mut std::collections::VecDeque<u32>,
        stats: &mut MtpStats,
    ) -> Result<Vec<f32>> {
        let b = self.backend.as_ref();
        let head = self.model.mtp.as_ref().context("internal: speculative decoding without an MTP head")?;
        let q = history.len() - 1;
        let p = state.position;
        stats.forward_passes += 1;
        if stats.drafted >= MTP_PROBE_DRAFTS && stats.acceptance() < MTP_MIN_ACCEPTANCE {
            // The head stops following this sequence: its state is dropped,
            // and decoding goes on as without a head.
            stats.paused = true;
            state.mtp = None;
        }
        if q >= p + 2 || state.mtp.is_none() {
            // Two drafts in a row were rejected (catch up without a draft, so a
            // pass never grows past three tokens), or drafting is paused.
            let h = self.forward_tracked(&history[p..], state, &history[p..], p)?;
            return Ok(self.backend.download(&self.logits_of_last(&h, 1)?)?);
        }
        let mtp = state.mtp.as_mut().context("internal: the sequence has no MTP state")?;
        let draft_logits = head.feed(b, &self.model, mtp, history, 0, q - 1)?;
        let draft_logits = self.backend.download(&draft_logits.context("internal: the MTP head had nothing to draft from")?)?;
        let draft = match &self.drafter {
            Some(f) => f(history),
            None => crate::sampling::argmax(&draft_logits),
        };
        stats.drafted += 1;
        let snapshot = self.model.snapshot(b, state)?;
        let mut fed: Vec<u32> = history[p..].to_vec();
        fed.push(draft);
        let h = self.model.hidden(b, &fed, state)?;
        let logits = self.backend.download(&self.logits_of_last(&h, 2)?)?;
        let vocab = logits.len() / 2;
        let sampled = sampler.sample(&logits[..vocab], history);
        // The known tokens' rows are right whatever the draft was; the draft's
        // row only when the draft is accepted.
        let right = if sampled == draft { h.clone() } else { b.slice_rows(&h, 0, fed.len() - 1)? };
        if let Some(mtp) = state.mtp.as_mut() {
            mtp.record(p, &right);
        }
        if sampled == draft {
            stats.accepted += 1;
            let mut extended = history.to_vec();
            extended.push(draft);
            let after = sampler.sample(&logits[vocab..], &extended);
            ready.extend([draft, after]);
        } else {
            self.model.rollback(b, state, snapshot)?;
            ready.push_back(sampled);
        }
        Ok(Vec::new())
    }
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
        if window < 2 {
            bail!("the perplexity window must be at least 2 tokens");
        }
        let vocab = self.model.vocab_size;
        let (mut nll, mut n, mut windows) = (0.0f64, 0usize, 0usize);
        for chunk in ids.chunks_exact(window).take(max_windows) {
            let mut state = self.new_state()?;
            let t = self.model.forward(self.backend.as_ref(), chunk, &mut state, Logits::All)?;
            let logits = self.backend.download(&t)?;
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

fn read_config_eos(dir: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let v = v.get("text_config").filter(|_| v.get("eos_token_id").is_none()).unwrap_or(&v);
    Ok(match v.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|n| n.as_u64()).map(|n| n as u32).collect(),
        _ => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let stops = vec!["</end>".to_string()];
        let mut m = StopMatcher { stops: &stops, pending: String::new() };
        assert_eq!(m.push("hello <"), ("hello ".to_string(), false));
        assert_eq!(m.push("/en"), (String::new(), false));
        assert_eq!(m.push("d> more"), (String::new(), true));
        let mut m = StopMatcher { stops: &stops, pending: String::new() };
        assert_eq!(m.push("a </e"), ("a ".to_string(), false));
        assert_eq!(m.push("x"), ("</ex".to_string(), false));
        assert_eq!(m.finish(), "");
    }
}
