//! One generation from request to events: the internal request both APIs
//! translate into, the turn queue, prompt rendering, and the engine call on a
//! blocking thread whose text comes back as a stream of events.

mod prompt;

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use axum::http::StatusCode;
use tokio::sync::OwnedSemaphorePermit;

use std::collections::VecDeque;

use super::delivery::{self, Inbox, Outbox};
use super::keep_alive::KeepAlive;
use super::{lock, ApiError, AppState, Lease, Resident};
use crate::constrain::{CompileFailure, ConstraintSpec, GrammarConstraint, Grammars};
use crate::dialect::{AnswerReader, Part, Split, ThinkingSplitter, ToolCall, ToolCallSplitter};
use crate::generate::{lock_cache, FinishReason, GenerateRequest, TokenConstraint, TurnEnd, TurnOutput};
use crate::note;
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatTurn;
pub use prompt::count_prompt_tokens;
use prompt::{render_prompt, think_for};

/// What the prompt is made of.
#[derive(Clone, Debug)]
pub enum PromptInput {
    /// Turns rendered through the model's chat template.
    Chat(Vec<ChatTurn>),
    /// One user message (and an optional system message) through the
    /// template, or the text as-is when `raw`; `context` ids go first.
    Text { text: String, system: Option<String>, raw: bool, context: Vec<u32> },
    /// Token ids as-is.
    Ids(Vec<u32>),
    /// The text between `prefix` and `suffix` (fill-in-the-middle), asked
    /// for with the vocabulary's FIM tokens; `context` ids go first.
    Fill { prefix: String, suffix: String, context: Vec<u32> },
}

impl PromptInput {
    /// The fewest tokens this prompt can be, before the template adds any.
    fn fewest_tokens(&self, codec: &crate::tokenizer::TextCodec) -> usize {
        match self {
            PromptInput::Chat(messages) => codec.fewest_tokens(messages.iter().map(|m| m.content.len()).sum()),
            PromptInput::Text { text, system, context, .. } => {
                context.len() + codec.fewest_tokens(text.len() + system.as_ref().map_or(0, String::len))
            }
            PromptInput::Ids(ids) => ids.len(),
            PromptInput::Fill { prefix, suffix, context } => context.len() + codec.fewest_tokens(prefix.len() + suffix.len()),
        }
    }
}

/// The one internal request both APIs translate into.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub model: String,
    pub prompt: PromptInput,
    /// `None`: up to the context limit.
    pub max_tokens: Option<usize>,
    /// `max_tokens` is a cap the context may lower (Anthropic's required
    /// `max_tokens`, which Claude Code sets to 32000, and Responses'
    /// `max_output_tokens`) rather than a number the context must hold.
    pub max_tokens_is_a_cap: bool,
    /// The request's own context window (Ollama `num_ctx`); at most the server's.
    pub context_limit: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Thinking on/off for templates that support it; `Some(true)` also
    /// splits the reasoning out of the answer (as a prompt that opens the
    /// reasoning itself always does).
    pub think: Option<bool>,
    /// `think: Some(true)` on a model whose template has no thinking switch
    /// is dropped instead of refused (the Responses and Messages APIs, whose
    /// agents send their reasoning settings to every model).
    pub think_if_supported: bool,
    /// Tools for the chat template (`{"type": "function", "function": {...}}`).
    pub tools: Vec<serde_json::Value>,
    /// Cut tool calls out of the answer (as [`Event::ToolCall`]).
    pub parse_tool_calls: bool,
    /// What the output must follow, if anything.
    pub constraint: Option<OutputConstraint>,
    /// How long the model stays loaded after this request (`None`: the server's default).
    pub keep_alive: Option<KeepAlive>,
}

/// A constraint on the output and the request field it came from (named
/// when the grammar engine cannot compile it).
#[derive(Clone, Debug)]
pub struct OutputConstraint {
    pub spec: ConstraintSpec,
    pub field: &'static str,
}

/// How a generation ended, with its counts and timings.
#[derive(Clone, Debug)]
pub struct Summary {
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache instead of being fed.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub finish: FinishReason,
    /// The request's stop string that ended the generation, if one did.
    pub stop_sequence: Option<String>,
    /// Prompt plus generated ids (Ollama's `context`).
    pub context: Vec<u32>,
    pub prompt_eval: Duration,
    pub eval: Duration,
    /// Taking the model: loading it, or waiting for its load (Ollama's `load_duration`).
    pub load: Duration,
    /// From the request's arrival to the end, queueing included.
    pub total: Duration,
}

/// What the engine thread sends.
enum Piece {
    Text(String),
    Done(Summary),
    Failed(ApiError),
}

/// What a handler reads from a running generation.
pub enum Event {
    Delta(Split),
    /// A whole tool call, cut out of the answer.
    ToolCall(ToolCall),
    Done(Summary),
    Failed(ApiError),
}

/// The receiving end of a generation. Dropping it cancels the generation,
/// and so does falling behind (see `delivery.rs`).
pub struct GenerationStream {
    rx: Inbox<Piece>,
    /// Reads the text in the model's chat dialect.
    reader: AnswerReader,
    /// Events split out of one piece, waiting to be read.
    ready: VecDeque<Event>,
    done: Option<Summary>,
    finished: bool,
    prompt_tokens: usize,
}

impl GenerationStream {
    /// The prompt's length in tokens, known before the first event.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Queues the events of read parts: reasoning, then the answer's text
    /// and tool calls in order.
    fn queue(&mut self, parts: Vec<Part>) {
        for part in parts {
            self.ready.push_back(match part {
                Part::Reasoning(t) => Event::Delta(Split { thinking: t, content: String::new() }),
                Part::Text(t) => Event::Delta(Split { thinking: String::new(), content: t }),
                Part::Call(call) => Event::ToolCall(call),
            });
        }
    }

    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Some(ev);
            }
            if self.finished {
                return None;
            }
            if let Some(done) = self.done.take() {
                self.finished = true;
                return Some(Event::Done(done));
            }
            match self.rx.recv().await {
                Some(Piece::Text(t)) => {
                    let parts = self.reader.push(&t);
                    self.queue(parts);
                }
                Some(Piece::Done(summary)) => {
                    // Cut short (the length ran out, or a shutdown), a call
                    // still open is dropped.
                    let parts = self.reader.finish(summary.finish != FinishReason::Stop);
                    self.done = Some(summary);
                    self.queue(parts);
                }
                Some(Piece::Failed(e)) => {
                    self.finished = true;
                    return Some(Event::Failed(e));
                }
                None => {
                    self.finished = true;
                    return Some(Event::Failed(ApiError::internal("the generation stopped unexpectedly")));
                }
            }
        }
    }

    /// Waits for the whole answer.
    pub async fn collect(mut self) -> Result<(Answer, Summary), ApiError> {
        let mut all = Answer::default();
        while let Some(ev) = self.next().await {
            match ev {
                Event::Delta(d) => {
                    all.thinking.push_str(&d.thinking);
                    all.content.push_str(&d.content);
                }
                Event::ToolCall(call) => all.tool_calls.push(call),
                Event::Done(s) => return Ok((all, s)),
                Event::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::internal("the generation ended without a result"))
    }
}

/// A whole answer: reasoning, text and tool calls.
#[derive(Default)]
pub struct Answer {
    pub thinking: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// Decrements the waiting count when a queued request leaves (served or gone).
pub(super) struct Waiting<'a>(pub(super) &'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The single generation entry point.
pub async fn start_generation(app: &Arc<AppState>, req: GenerationRequest) -> Result<GenerationStream, ApiError> {
    let arrived = Instant::now();
    let log = super::request_log::RequestLog::current();
    log.model(&req.model);
    req.sampling.validate().map_err(ApiError::bad_request)?;
    let max_context = app.options.max_context;
    let limit = context_limit(req.context_limit, max_context);
    let leasing = Instant::now();
    let model = app.lease(&req.model, req.keep_alive).await?;
    // Loading it, or waiting for another request's load (near 0 when loaded).
    let load = leasing.elapsed();
    // No longer than its memory plan holds KV for (the model's own context
    // ends a generation softly, below).
    let limit = limit.min(model.planned_context());
    let fewest = req.prompt.fewest_tokens(&model.engine.codec);
    if fewest >= limit {
        return Err(ApiError::bad_request(format!(
            "the prompt is at least {fewest} tokens (judged by its size in bytes), which leaves no room to generate \
             within the context limit of {limit} tokens"
        )));
    }
    let form = model.engine.codec.tool_call_form();
    let think = think_for(&req, &model.engine.codec);
    let (prompt, tools, wanted) = (req.prompt.clone(), req.tools.clone(), req.constraint.clone());
    // Rendering and tokenizing take a CPU and memory in proportion to the
    // prompt: a few at a time, whatever the number of clients. (The
    // vocabulary's trie for a grammar is built here too, once per model.)
    let working = app.prompt_work.acquire().await.map_err(|_| shutting_down())?;
    let prepared = tokio::task::spawn_blocking(move || {
        let prepared = (|| -> Result<_, ApiError> {
            let rendered = render_prompt(&model.engine, prompt, &tools, think, limit)?;
            let grammars = wanted.as_ref().map(|w| model_grammars(&model, w)).transpose()?;
            Ok((rendered, grammars))
        })();
        (model, prepared)
    });
    let (model, prepared) = prepared.await.map_err(|e| ApiError::internal(format!("rendering the prompt failed: {e}")))?;
    let ((prompt_ids, opens_thinking), grammars) = prepared?;
    drop(working);
    let prompt_len = prompt_ids.len();
    if prompt_len >= limit {
        return Err(ApiError::bad_request(format!(
            "the prompt is {prompt_len} tokens, which leaves no room to generate within the context limit of {limit} tokens{}",
            model.context_need(prompt_len + 1)
        )));
    }
    // The model's own context bounds every request, whatever --max-context
    // says: a prompt that fills it is refused here, and the engine ends a
    // longer generation there (finish reason "length").
    let model_context = model.engine.context_length();
    if prompt_len >= model_context {
        return Err(ApiError::bad_request(format!(
            "the prompt is {prompt_len} tokens, which leaves no room to generate within the model's context of {model_context} tokens (max_position_embeddings)"
        )));
    }
    let room = limit - prompt_len;
    let max_tokens = match req.max_tokens {
        Some(n) if req.max_tokens_is_a_cap => n.min(room),
        Some(n) => n,
        None => room,
    };
    if prompt_len.saturating_add(max_tokens) > limit {
        return Err(ApiError::bad_request(format!(
            "the prompt ({prompt_len} tokens) plus the requested {max_tokens} tokens exceeds the context limit of {limit} tokens{}",
            model.context_need(prompt_len.saturating_add(max_tokens))
        )));
    }
    let constraint = match (grammars, req.constraint) {
        (Some(grammars), Some(wanted)) => {
            let spec = wanted.spec.in_form(form);
            Some(compile_grammar(app, grammars, spec, wanted.field, opens_thinking).await?)
        }
        _ => None,
    };

    let permit = wait_turn(app, &model.name).await?;
    let running = app.metrics.running(&model.name);
    let (sender, rx) = delivery::channel(64, app.options.timeouts.write, tokio::runtime::Handle::current());
    let job = GenerateRequest { prompt_ids, max_tokens, sampling: req.sampling, stop: req.stop, ignore_eos: false };
    let app2 = app.clone();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let outcome = run_generation(&app2, &model, &job, constraint, &sender, arrived, &log)
            .map(|summary| summary.map(|summary| Summary { load, ..summary }));
        // Not running by the time its client hears the end.
        drop(running);
        let name = model.name.clone();
        // The model's keep-alive starts before the client hears the end, so
        // what it asks next (`/api/ps`) sees the model as this request left it.
        drop(model);
        let piece = match outcome {
            Ok(Some(summary)) => {
                log.finished(&summary);
                app2.metrics.finished(&name, summary.total, summary.prompt_tokens, summary.completion_tokens, summary.finish);
                Piece::Done(summary)
            }
            Ok(None) => return, // cancelled: nobody is listening
            Err(e) => Piece::Failed(ApiError::internal(format!("generation failed: {e:#}"))),
        };
        sender.send(piece);
    });
    // A prompt that opens the reasoning itself (Qwen3.5's, thinking on by
    // default) gets it split out even unasked: its answer would otherwise
    // carry the reasoning and a stray `</think>`.
    let thinking = (think == Some(true) || opens_thinking).then(|| ThinkingSplitter::new(opens_thinking));
    let tool_calls = req.parse_tool_calls.then(|| ToolCallSplitter::new(form, &req.tools));
    let reader = AnswerReader::new(thinking, tool_calls);
    Ok(GenerationStream { rx, reader, ready: VecDeque::new(), done: None, finished: false, prompt_tokens: prompt_len })
}

/// The context a request gets: its own limit (Ollama's `num_ctx`), capped
/// at the server's `--max-context` with a note, as Ollama caps it (clients
/// such as aider ask for more than a server has as their chats grow).
fn context_limit(requested: Option<usize>, max_context: usize) -> usize {
    match requested {
        Some(n) if n > max_context => {
            note!("num_ctx {n} is larger than --max-context {max_context}; using {max_context}");
            max_context
        }
        Some(n) => n,
        None => max_context,
    }
}

/// Which of `stops` ended a generation that wrote `emitted` (the engine
/// leaves the stop string out) and whose tokens decode to `full`.
fn matched_stop(full: &str, emitted: &str, stops: &[String]) -> Option<String> {
    let after = full.strip_prefix(emitted).unwrap_or(full);
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| after.find(s.as_str()).map(|at| (at, s)))
        .min_by_key(|(at, _)| *at)
        .map(|(_, s)| s.clone())
}

/// The grammar engine over this model's vocabulary (its trie is built on
/// the first request that asks for a grammar).
fn model_grammars(model: &Resident, wanted: &OutputConstraint) -> Result<Arc<Grammars>, ApiError> {
    model
        .grammars
        .get_or_init(|| {
            let engine = &model.engine;
            Grammars::load(&engine.arch().dir, engine.vocab_size(), &engine.codec.eos_ids).map(Arc::new).map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| ApiError::bad_request(format!("'{}' cannot be followed with this model: {e}", wanted.field)))
}

/// Grammars compiled at once: apart from the prompt work plain requests
/// need, so requests with schemas never hold up those without.
pub const GRAMMAR_WORKERS: usize = 2;
/// How long a request waits for its grammar: for a compile slot, then for the
/// compile (a schema within the size limit takes far less, see the README).
pub const GRAMMAR_DEADLINE: Duration = Duration::from_secs(10);

/// Compiles `spec` (the request's `field`), at most [`GRAMMAR_WORKERS`] at
/// once; `reasoning_open`: the prompt ends inside a `<think>` block, which
/// the output closes first. A request that leaves, or whose grammar takes
/// longer than [`GRAMMAR_DEADLINE`], stops its compile (see
/// [`Grammars::constraint_until`]).
async fn compile_grammar(
    app: &AppState,
    grammars: Arc<Grammars>,
    spec: ConstraintSpec,
    field: &'static str,
    reasoning_open: bool,
) -> Result<GrammarConstraint, ApiError> {
    let deadline = tokio::time::Instant::now() + GRAMMAR_DEADLINE;
    let slot = tokio::time::timeout_at(deadline, app.grammar_work.clone().acquire_owned()).await.map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the server is busy compiling other requests' grammars (at most {GRAMMAR_WORKERS} at once); retry later"),
        )
    })?;
    let slot = slot.map_err(|_| shutting_down())?;
    match grammars.constraint_until(spec, reasoning_open, deadline, slot).await {
        Ok(constraint) => Ok(constraint),
        Err(CompileFailure::Refused(e)) => Err(ApiError::bad_request(format!("'{field}' cannot be compiled into a grammar: {e:#}"))),
        Err(CompileFailure::Broken(e)) => Err(ApiError::internal(format!("compiling '{field}' into a grammar failed: {e:#}"))),
        Err(CompileFailure::Late) => Err(ApiError::bad_request(format!(
            "'{field}' did not compile into a grammar within {} s; send a simpler schema (fewer patternProperties, patterns and alternatives)",
            GRAMMAR_DEADLINE.as_secs()
        ))),
    }
}

fn shutting_down() -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down; the request was not answered")
}

/// Waits for the generation slot in FIFO order, or refuses when the queue is full.
async fn wait_turn(app: &Arc<AppState>, model: &str) -> Result<OwnedSemaphorePermit, ApiError> {
    if let Ok(p) = app.turn.clone().try_acquire_owned() {
        return Ok(p);
    }
    let queued = app.waiting.fetch_add(1, Ordering::SeqCst) + 1;
    let _waiting = Waiting(&app.waiting);
    let _counted = app.metrics.waiting(model);
    if queued > app.options.queue {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the server is busy: {} requests are already waiting (--queue); retry later", app.options.queue),
        ));
    }
    app.turn.clone().acquire_owned().await.map_err(|_| shutting_down())
}

/// Runs one generation on the calling (blocking) thread. `Ok(None)`: the
/// client went away.
fn run_generation(
    app: &AppState,
    model: &Lease,
    req: &GenerateRequest,
    mut constraint: Option<GrammarConstraint>,
    tx: &Outbox<Piece>,
    arrived: Instant,
    log: &super::request_log::RequestLog,
) -> Result<Option<Summary>> {
    let engine = &model.engine;
    let constraint = constraint.as_mut().map(|c| c as &mut dyn TokenConstraint);
    let cache = model.prefix_cache.as_ref();
    // Called once per generated token: the first token's time and the gaps.
    let mut last_token: Option<Instant> = None;
    let ended = engine.run_turn(cache, req, constraint, || tx.gone() || app.stopping(), |piece| {
        let now = Instant::now();
        match last_token {
            None => app.metrics.first_token(&model.name, now - arrived),
            Some(last) => app.metrics.inter_token(&model.name, now - last),
        }
        last_token = Some(now);
        if app.stopping() {
            return ControlFlow::Break(());
        }
        if piece.is_empty() {
            // Nothing to send this step; still stop for a client that left.
            return if tx.gone() { ControlFlow::Break(()) } else { ControlFlow::Continue(()) };
        }
        if tx.send(Piece::Text(piece.to_string())) {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    })?;
    let TurnOutput { out, cached_tokens, prompt_feed } = match ended {
        TurnEnd::Done(turn) => turn,
        TurnEnd::CancelledInPrompt { position } => {
            note!("generation: cancelled during prefill at token {position} of {}", req.prompt_ids.len());
            if app.stopping() {
                // Nothing was generated yet: the client learns why.
                tx.send(Piece::Failed(shutting_down()));
            }
            return Ok(None);
        }
    };
    if let Ok(stats) = engine.expert_stats() {
        *lock(&model.expert_stats) = stats;
    }
    if let Some(share) = &out.stats.batched {
        log.batched(share);
    }
    if let Some(c) = cache {
        let bytes: u64 = lock_cache(c).states().map(|s| engine.state_bytes(s)).sum();
        model.cache_state_bytes.store(bytes as usize, Ordering::Relaxed);
    }
    // Cancelled by a shutdown, the stream still ends with its summary.
    if out.finish_reason == FinishReason::Cancelled && !app.stopping() {
        if tx.behind() {
            let tokens = out.generated_ids.len();
            note!("generation: cancelled after {tokens} tokens: the client fell behind the stream (--write-timeout-secs)");
        }
        return Ok(None);
    }
    let stop_sequence = match out.finish_reason {
        FinishReason::Stop if !req.stop.is_empty() => {
            engine.codec.decode(&out.generated_ids).ok().and_then(|full| matched_stop(&full, &out.text, &req.stop))
        }
        _ => None,
    };
    let mut context = out.prompt_ids;
    context.extend(&out.generated_ids);
    Ok(Some(Summary {
        stop_sequence,
        prompt_tokens: out.stats.prompt_tokens,
        cached_tokens,
        completion_tokens: out.stats.generated_tokens,
        finish: out.finish_reason,
        context,
        prompt_eval: prompt_feed + Duration::from_secs_f64(out.stats.prefill_seconds),
        eval: Duration::from_secs_f64(out.stats.decode_seconds),
        load: Duration::ZERO,
        total: arrived.elapsed(),
    }))
}

#[cfg(test)]
mod tests;
