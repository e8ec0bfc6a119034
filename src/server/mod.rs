//! `slotstream serve`: the Ollama and OpenAI HTTP APIs over one loaded model.
//!
//! `ollama.rs` and `openai.rs` translate their wire formats into one
//! [`GenerationRequest`]; [`start_generation`] is the single entry point both
//! call. It renders and tokenizes the prompt, checks it against the context
//! limit, waits its turn in a bounded FIFO queue (one generation at a time),
//! and runs the engine on a blocking thread that streams text back through a
//! channel. A client that goes away drops the receiving end, and the engine
//! stops at its next check. The prefix cache lets a request skip the prompt
//! tokens an earlier request already fed.

mod elastic;
mod error;
mod model_info;
mod ollama;
mod openai;
mod prefix_cache;
mod thinking;

use std::net::{IpAddr, SocketAddr};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::experts::CacheStats;
use crate::generate::{Engine, FinishReason, GenerateRequest};
use crate::model::SequenceState;
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatMessage;

pub use error::ApiError;
use error::{OllamaError, OpenAiError};
pub use model_info::{MemoryReport, ModelInfo};
pub use prefix_cache::{PrefixCache, PrefixCacheStats};
use thinking::{Split, ThinkingSplitter};

/// Request bodies larger than this get 413.
pub const MAX_BODY_BYTES: usize = 32 << 20;
/// Entries the prefix cache keeps (each request adds up to two: its prompt and
/// its prompt plus answer).
pub const PREFIX_CACHE_ENTRIES: usize = 6;

pub use elastic::Elastic;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The name clients use for the model.
    pub model_name: String,
    /// Prompt plus completion tokens allowed per request.
    pub max_context: usize,
    pub prefix_cache: bool,
    /// Requests that may wait while one generates; more get 503.
    pub queue: usize,
    /// The memory plan the model was loaded with.
    pub plan: Option<crate::plan::Plan>,
    /// Re-plan and resize the expert pool as free memory changes (auto-sized only).
    pub elastic: Option<elastic::Elastic>,
}

/// Everything handlers share.
pub struct AppState {
    engine: Arc<Engine>,
    model: ModelInfo,
    options: ServerOptions,
    /// One permit: the right to generate. Tokio's semaphore is FIFO-fair.
    turn: Arc<Semaphore>,
    waiting: AtomicUsize,
    prefix_cache: Option<Mutex<PrefixCache>>,
    /// Expert cache statistics as of the end of the last generation, so
    /// metadata requests never wait for the model.
    expert_stats: Mutex<CacheStats>,
    /// Bytes of state held by the prefix cache, as of the last generation.
    cache_state_bytes: AtomicUsize,
    /// The live memory plan (updated by the governor).
    plan: Mutex<Option<crate::plan::Plan>>,
    loaded_at: SystemTime,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl AppState {
    pub fn new(engine: Engine, model: ModelInfo, options: ServerOptions) -> Arc<AppState> {
        let expert_stats = engine.expert_stats().unwrap_or_default();
        let plan = options.plan.clone();
        let prefix_cache =
            options.prefix_cache.then(|| Mutex::new(PrefixCache::new(PREFIX_CACHE_ENTRIES, options.max_context)));
        Arc::new(AppState {
            engine: Arc::new(engine),
            model,
            options,
            turn: Arc::new(Semaphore::new(1)),
            waiting: AtomicUsize::new(0),
            prefix_cache,
            expert_stats: Mutex::new(expert_stats),
            cache_state_bytes: AtomicUsize::new(0),
            plan: Mutex::new(plan),
            loaded_at: SystemTime::now(),
        })
    }

    pub fn memory(&self) -> MemoryReport {
        let expert_cache = lock(&self.expert_stats).clone();
        let prefix_cache = match &self.prefix_cache {
            Some(c) => lock(c).stats(),
            None => PrefixCacheStats::default(),
        };
        let resident = self.engine.resident_bytes();
        let pool = expert_cache.pool_bytes as u64;
        let states = self.cache_state_bytes.load(Ordering::Relaxed) as u64;
        MemoryReport {
            resident_weight_bytes: resident,
            expert_pool_bytes: pool,
            expert_slots: expert_cache.slots,
            prefix_cache_state_bytes: states,
            total_bytes: resident + pool + states,
            prefix_cache,
            expert_cache,
            plan: lock(&self.plan).clone(),
        }
    }

    fn check_model(&self, requested: &str) -> Result<(), ApiError> {
        if requested.trim().is_empty() {
            return Err(ApiError::bad_request("'model' is required"));
        }
        if !self.model.answers_to(requested) {
            return Err(ApiError::model_not_found(requested, &self.model.name));
        }
        Ok(())
    }
}

/// What the prompt is made of.
#[derive(Clone, Debug)]
pub enum PromptInput {
    /// Turns rendered through the model's chat template.
    Chat(Vec<ChatMessage>),
    /// One user message (and an optional system message) through the
    /// template, or the text as-is when `raw`; `context` ids go first.
    Text { text: String, system: Option<String>, raw: bool, context: Vec<u32> },
    /// Token ids as-is.
    Ids(Vec<u32>),
}

/// The one internal request both APIs translate into.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub model: String,
    pub prompt: PromptInput,
    /// `None`: up to the context limit.
    pub max_tokens: Option<usize>,
    /// The request's own context window (Ollama `num_ctx`); at most the server's.
    pub context_limit: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Thinking on/off for templates that support it; `Some(true)` also
    /// splits the reasoning out of the answer.
    pub think: Option<bool>,
}

/// How a generation ended, with its counts and timings.
#[derive(Clone, Debug)]
pub struct Summary {
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache instead of being fed.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub finish: FinishReason,
    /// Prompt plus generated ids (Ollama's `context`).
    pub context: Vec<u32>,
    pub prompt_eval: Duration,
    pub eval: Duration,
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
    Done(Summary),
    Failed(ApiError),
}

/// The receiving end of a generation. Dropping it cancels the generation.
pub struct GenerationStream {
    rx: mpsc::Receiver<Piece>,
    splitter: Option<ThinkingSplitter>,
    done: Option<Summary>,
    finished: bool,
}

impl GenerationStream {
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if self.finished {
                return None;
            }
            if let Some(done) = self.done.take() {
                self.finished = true;
                return Some(Event::Done(done));
            }
            match self.rx.recv().await {
                Some(Piece::Text(t)) => {
                    let split = match &mut self.splitter {
                        Some(s) => s.push(&t),
                        None => Split { thinking: String::new(), content: t },
                    };
                    if !split.thinking.is_empty() || !split.content.is_empty() {
                        return Some(Event::Delta(split));
                    }
                }
                Some(Piece::Done(summary)) => {
                    self.done = Some(summary);
                    let rest = self.splitter.as_mut().map(|s| s.finish()).unwrap_or_default();
                    if !rest.thinking.is_empty() || !rest.content.is_empty() {
                        return Some(Event::Delta(rest));
                    }
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
    pub async fn collect(mut self) -> Result<(Split, Summary), ApiError> {
        let mut all = Split::default();
        while let Some(ev) = self.next().await {
            match ev {
                Event::Delta(d) => {
                    all.thinking.push_str(&d.thinking);
                    all.content.push_str(&d.content);
                }
                Event::Done(s) => return Ok((all, s)),
                Event::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::internal("the generation ended without a result"))
    }
}

/// Decrements the waiting count when a queued request leaves (served or gone).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The single generation entry point.
pub async fn start_generation(app: &Arc<AppState>, req: GenerationRequest) -> Result<GenerationStream, ApiError> {
    let arrived = Instant::now();
    app.check_model(&req.model)?;
    req.sampling.validate().map_err(ApiError::bad_request)?;
    let max_context = app.options.max_context;
    let limit = req.context_limit.unwrap_or(max_context);
    if limit > max_context {
        return Err(ApiError::bad_request(format!(
            "num_ctx {limit} is larger than this server's --max-context {max_context}"
        )));
    }
    let engine = app.engine.clone();
    let (prompt, think) = (req.prompt.clone(), req.think);
    let (prompt_ids, opens_thinking) = tokio::task::spawn_blocking(move || render_prompt(&engine, prompt, think))
        .await
        .map_err(|e| ApiError::internal(format!("rendering the prompt failed: {e}")))??;
    let prompt_len = prompt_ids.len();
    if prompt_len >= limit {
        return Err(ApiError::bad_request(format!(
            "the prompt is {prompt_len} tokens, which leaves no room to generate within the context limit of {limit} tokens"
        )));
    }
    let max_tokens = req.max_tokens.unwrap_or(limit - prompt_len);
    if prompt_len.saturating_add(max_tokens) > limit {
        return Err(ApiError::bad_request(format!(
            "the prompt ({prompt_len} tokens) plus the requested {max_tokens} tokens exceeds the context limit of {limit} tokens"
        )));
    }

    let permit = wait_turn(app).await?;
    let (tx, rx) = mpsc::channel(64);
    let job = GenerateRequest { prompt_ids, max_tokens, sampling: req.sampling, stop: req.stop, ignore_eos: false };
    let app2 = app.clone();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let piece = match run_generation(&app2, &job, &tx, arrived) {
            Ok(Some(summary)) => Piece::Done(summary),
            Ok(None) => return, // cancelled: nobody is listening
            Err(e) => Piece::Failed(ApiError::internal(format!("generation failed: {e:#}"))),
        };
        let _ = tx.blocking_send(piece);
    });
    let splitter = (think == Some(true)).then(|| ThinkingSplitter::new(opens_thinking));
    Ok(GenerationStream { rx, splitter, done: None, finished: false })
}

/// Waits for the generation slot in FIFO order, or refuses when the queue is full.
async fn wait_turn(app: &Arc<AppState>) -> Result<OwnedSemaphorePermit, ApiError> {
    if let Ok(p) = app.turn.clone().try_acquire_owned() {
        return Ok(p);
    }
    let queued = app.waiting.fetch_add(1, Ordering::SeqCst) + 1;
    let _waiting = Waiting(&app.waiting);
    if queued > app.options.queue {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the server is busy: {} requests are already waiting (--queue); retry later", app.options.queue),
        ));
    }
    app.turn.clone().acquire_owned().await.map_err(|_| ApiError::internal("the server is shutting down"))
}

/// Turns the prompt into token ids; also says whether the rendered prompt
/// already opens a `<think>` block.
fn render_prompt(engine: &Engine, prompt: PromptInput, think: Option<bool>) -> Result<(Vec<u32>, bool), ApiError> {
    let codec = &engine.codec;
    let template = |messages: &[ChatMessage]| -> Result<String, ApiError> {
        if think == Some(true) && !codec.chat_template().is_some_and(|t| t.contains("enable_thinking")) {
            return Err(ApiError::bad_request(
                "this model does not support thinking: its chat template has no enable_thinking switch",
            ));
        }
        codec
            .apply_chat_template(messages, true, think)
            .map_err(|e| ApiError::bad_request(format!("{e:#}")))
    };
    let encode = |text: &str| codec.encode(text, false).map_err(|e| ApiError::bad_request(format!("{e:#}")));
    let (ids, text) = match prompt {
        PromptInput::Chat(messages) => {
            if !codec.has_chat_template() {
                return Err(ApiError::bad_request(
                    "this model has no chat template; use /api/generate with \"raw\": true or /v1/completions",
                ));
            }
            let text = template(&messages)?;
            (encode(&text)?, text)
        }
        PromptInput::Text { text, system, raw, context } => {
            let text = if raw || !codec.has_chat_template() {
                text
            } else {
                let mut messages = Vec::new();
                if let Some(s) = system.filter(|s| !s.is_empty()) {
                    messages.push(ChatMessage { role: "system".into(), content: s });
                }
                messages.push(ChatMessage { role: "user".into(), content: text });
                template(&messages)?
            };
            let mut ids = context;
            ids.extend(encode(&text)?);
            (ids, text)
        }
        PromptInput::Ids(ids) => (ids, String::new()),
    };
    let vocab = engine.vocab_size();
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::bad_request(format!("token id {bad} is outside the model's vocabulary of {vocab}")));
    }
    if ids.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    Ok((ids, text.trim_end().ends_with("<think>")))
}

/// Runs one generation on the calling (blocking) thread. `Ok(None)`: the
/// client went away.
fn run_generation(app: &AppState, req: &GenerateRequest, tx: &mpsc::Sender<Piece>, arrived: Instant) -> Result<Option<Summary>> {
    let engine = &app.engine;
    let copy = |s: &SequenceState| engine.clone_state(s);
    let ids = &req.prompt_ids;
    let started = Instant::now();
    let cached = match &app.prefix_cache {
        Some(c) => lock(c).lookup(ids, copy)?,
        None => None,
    };
    let mut state = match cached {
        Some(s) => s,
        None => engine.new_state()?,
    };
    let cached_tokens = state.position;
    // Feed all but the last prompt token here, in chunks, so a client that
    // leaves during a long prefill is noticed, and so the prompt's state can be
    // kept for the next request.
    if !engine.prefill_until(ids, ids.len() - 1, &mut state, || tx.is_closed())? {
        eprintln!("generation: cancelled during prefill at token {} of {}", state.position, ids.len());
        return Ok(None);
    }
    let prefill_body = started.elapsed();
    if let Some(c) = &app.prefix_cache {
        if state.position > cached_tokens {
            let snapshot = copy(&state)?;
            lock(c).insert(ids[..state.position].to_vec(), snapshot);
        }
    }
    let out = engine.generate_from(&mut state, req, |piece| {
        if tx.blocking_send(Piece::Text(piece.to_string())).is_ok() {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    });
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            if let Some(c) = &app.prefix_cache {
                lock(c).clear();
            }
            return Err(e);
        }
    };
    if let Ok(stats) = engine.expert_stats() {
        *lock(&app.expert_stats) = stats;
    }
    if let Some(c) = &app.prefix_cache {
        let mut fed = out.prompt_ids.clone();
        fed.extend(&out.generated_ids);
        fed.truncate(state.position);
        let mut cache = lock(c);
        cache.insert(fed, state);
        let bytes: u64 = cache.states().map(|s| engine.state_bytes(s)).sum();
        app.cache_state_bytes.store(bytes as usize, Ordering::Relaxed);
    }
    eprintln!(
        "generation: {} prompt tokens ({} reused), {} generated, {:?}, prefill {:.3}s, decode {:.3}s",
        out.stats.prompt_tokens,
        cached_tokens,
        out.stats.generated_tokens,
        out.finish_reason,
        prefill_body.as_secs_f64() + out.stats.prefill_seconds,
        out.stats.decode_seconds
    );
    if out.finish_reason == FinishReason::Cancelled {
        return Ok(None);
    }
    let mut context = out.prompt_ids;
    context.extend(&out.generated_ids);
    Ok(Some(Summary {
        prompt_tokens: out.stats.prompt_tokens,
        cached_tokens,
        completion_tokens: out.stats.generated_tokens,
        finish: out.finish_reason,
        context,
        prompt_eval: prefill_body + Duration::from_secs_f64(out.stats.prefill_seconds),
        eval: Duration::from_secs_f64(out.stats.decode_seconds),
        total: arrived.elapsed(),
    }))
}

/// Whether an `Origin` header names this machine.
fn is_loopback_origin(origin: &str) -> bool {
    let Some((scheme, rest)) = origin.split_once("://") else { return false };
    if !matches!(scheme, "http" | "https") {
        return false;
    }
    let authority = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        authority.split(':').next().unwrap_or("")
    };
    let host = host.to_ascii_lowercase();
    if host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// CORS: loopback origins are allowed (and preflights answered); any other
/// origin is refused with 403 before the request reaches a handler.
async fn cors(req: Request, next: Next) -> Response {
    let origin = req.headers().get(header::ORIGIN).cloned();
    let Some(origin) = origin else { return next.run(req).await };
    let allowed = origin.to_str().is_ok_and(is_loopback_origin);
    if !allowed {
        let e = ApiError::new(
            StatusCode::FORBIDDEN,
            format!("origin {:?} is not allowed: this server accepts browser requests from loopback origins only", origin),
        );
        return error_for_path(req.uri().path(), e);
    }
    let preflight = req.method() == Method::OPTIONS;
    let request_headers = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    let mut resp = if preflight { StatusCode::NO_CONTENT.into_response() } else { next.run(req).await };
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    if preflight {
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, HEAD, POST, OPTIONS"));
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            request_headers.unwrap_or_else(|| HeaderValue::from_static("Authorization, Content-Type")),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    }
    resp
}

/// An error in the flavour of the API the path belongs to.
fn error_for_path(path: &str, e: ApiError) -> Response {
    if path.starts_with("/v1/") {
        OpenAiError(e).into_response()
    } else {
        OllamaError(e).into_response()
    }
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    error_for_path(&path, ApiError::new(StatusCode::NOT_FOUND, format!("no endpoint {} {path}", req.method())))
}

async fn embeddings_refused(req: Request) -> Response {
    error_for_path(req.uri().path(), ApiError::unsupported("embeddings"))
}

async fn root() -> &'static str {
    "Ollama is running"
}

/// The full router over `app`.
pub fn router(app: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/api/version", get(ollama::version))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/embed", any(embeddings_refused))
        .route("/api/embeddings", any(embeddings_refused))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{model}", get(openai::model))
        .route("/v1/embeddings", any(embeddings_refused))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(cors))
        .with_state(app)
}

/// Serves `app` on `listener` until the process ends or `shutdown` resolves.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    app: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    axum::serve(listener, router(app)).with_graceful_shutdown(shutdown).await.context("serving HTTP")
}

/// How `slotstream serve` was asked to run.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub model_dir: PathBuf,
    pub host: String,
    pub port: u16,
    pub options: ServerOptions,
}

/// Loads the model and serves until Ctrl-C.
pub fn serve(config: ServeConfig, engine: Engine) -> Result<()> {
    let model = ModelInfo::describe(engine.arch(), config.options.model_name.clone());
    let app = AppState::new(engine, model, config.options);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let ip: IpAddr = config.host.parse().with_context(|| format!("--host {} is not an IP address", config.host))?;
        let addr = SocketAddr::new(ip, config.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr} (is another server, e.g. Ollama, already using the port? try --port)"))?;
        let bound = listener.local_addr().unwrap_or(addr);
        eprintln!("slotstream serving '{}' on http://{bound}", app.model.name);
        if let Some(e) = app.options.elastic.clone() {
            elastic::spawn(app.clone(), e);
        }
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        serve_on(listener, app, shutdown).await
    })
}

/// Whether a request asked for streaming, with each API's default.
fn streaming(requested: Option<bool>, default: bool) -> bool {
    requested.unwrap_or(default)
}

/// Parses a JSON body, mapping a body that could not be read (too large,
/// broken connection) or parsed into the matching error.
fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| ApiError::new(r.status(), r.body_text()))?;
    if is_blank(&bytes) {
        return Err(ApiError::bad_request("the request body is empty; send a JSON object"));
    }
    serde_json::from_slice(&bytes).map_err(ApiError::invalid_json)
}

fn is_blank(b: &[u8]) -> bool {
    b.iter().all(|c| c.is_ascii_whitespace())
}

/// A streaming response body from a stream of already-encoded chunks.
fn stream_body<S>(s: S) -> Body
where
    S: futures_util::Stream<Item = axum::body::Bytes> + Send + 'static,
{
    use futures_util::StreamExt;
    Body::from_stream(s.map(Ok::<_, std::convert::Infallible>))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_origins() {
        for ok in ["http://localhost", "http://localhost:3000", "https://127.0.0.1:8080", "http://[::1]:5173", "http://app.localhost"] {
            assert!(is_loopback_origin(ok), "{ok} should be allowed");
        }
        for bad in ["http://example.com", "null", "file://", "http://localhost.evil.com", "http://10.0.0.1", "ftp://localhost", ""] {
            assert!(!is_loopback_origin(bad), "{bad} should be refused");
        }
    }
}
