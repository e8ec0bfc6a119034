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
mod generation;
mod guard;
mod listen;
mod model_info;
mod ollama;
mod ollama_env;
mod openai;
mod prefix_cache;
mod request_log;
mod thinking;
mod tools;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use tokio::sync::Semaphore;

use crate::experts::CacheStats;
use crate::generate::Engine;
use crate::note;

pub use error::ApiError;
pub use generation::{start_generation, Answer, Event, GenerationRequest, GenerationStream, OutputConstraint, PromptInput, Summary};
use error::{OllamaError, OpenAiError};
pub use model_info::{MemoryReport, ModelInfo};
pub use ollama_env::OllamaEnv;
pub use prefix_cache::{PrefixCache, PrefixCacheStats};

/// Request bodies larger than this get 413.
pub const MAX_BODY_BYTES: usize = 32 << 20;
/// Entries the prefix cache keeps (each request adds up to two: its prompt and
/// its prompt plus answer).
pub const PREFIX_CACHE_ENTRIES: usize = 6;
/// Prompts rendered and tokenized at once; more wait their turn, so many large
/// prompts arriving together cost the memory of a few.
pub const PROMPT_WORKERS: usize = 2;

pub use elastic::Elastic;
pub use listen::{serve_on, Timeouts};

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
    pub timeouts: Timeouts,
    /// Browser origins allowed besides the loopback ones (`OLLAMA_ORIGINS`:
    /// exact, or with one `*` wildcard).
    pub origins: Vec<String>,
}

impl ServerOptions {
    /// Refuses settings the server could not honour: a model name clients
    /// cannot send (empty, or with spaces around it, which requests lose when
    /// they are trimmed), or no context at all.
    pub fn check(&self) -> Result<()> {
        check_model_name(&self.model_name)?;
        if self.max_context == 0 {
            anyhow::bail!("--max-context must be at least 1 token");
        }
        Ok(())
    }
}

/// Refuses a model name clients cannot send: empty, with spaces around it
/// (requests lose them when they are trimmed) or control characters.
pub fn check_model_name(name: &str) -> Result<()> {
    if name.trim().is_empty() || name.trim() != name || name.chars().any(char::is_control) {
        anyhow::bail!("--name {name:?} is not a name clients can send: give a non-empty name without surrounding spaces");
    }
    Ok(())
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
    /// Set on shutdown: running generations stop at their next token.
    stopping: AtomicBool,
    /// Prompts being rendered and tokenized at once (see `PROMPT_WORKERS`).
    prompt_work: Semaphore,
    /// The grammar engine over the model's vocabulary, built on the first
    /// request with a constrained output (or why it cannot be).
    grammars: std::sync::OnceLock<Result<Arc<crate::constrain::Grammars>, String>>,
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
            stopping: AtomicBool::new(false),
            prompt_work: Semaphore::new(PROMPT_WORKERS),
            grammars: std::sync::OnceLock::new(),
        })
    }

    /// Cancels running generations (their streams still end with a summary)
    /// and refuses new ones: the server is shutting down.
    pub fn stop_generations(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.turn.close();
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
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

/// CORS: loopback origins and those `OLLAMA_ORIGINS` names are allowed (and
/// preflights answered); any other origin is refused with 403 before the
/// request reaches a handler.
async fn cors(State(extra): State<Arc<Vec<String>>>, req: Request, next: Next) -> Response {
    let origins: Vec<HeaderValue> = req.headers().get_all(header::ORIGIN).iter().cloned().collect();
    let Some(origin) = origins.first().cloned() else { return next.run(req).await };
    // Two origins are no origin: which one the browser meant cannot be known.
    let allowed = origins.len() == 1
        && origin.to_str().is_ok_and(|o| guard::is_loopback_origin(o) || ollama_env::origin_allowed(o, &extra));
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

/// The full router over `app`, served on `bound`.
pub fn router(app: Arc<AppState>, bound: SocketAddr) -> Router {
    let body_timeout = app.options.timeouts.body;
    let origins = Arc::new(app.options.origins.clone());
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
        .layer(axum::middleware::from_fn_with_state(body_timeout, listen::read_body_within))
        .layer(axum::middleware::from_fn(guard::check_length))
        .layer(axum::middleware::from_fn_with_state(origins, cors))
        .layer(axum::middleware::from_fn_with_state(bound, guard::check_host))
        .layer(axum::middleware::from_fn(request_log::log_requests))
        .with_state(app)
}

/// How `slotstream serve` was asked to run.
#[derive(Debug)]
pub struct ServeConfig {
    pub model_dir: PathBuf,
    /// Bound before the model loads (see [`bind`]), so a port in use is
    /// found at once.
    pub listener: std::net::TcpListener,
    pub options: ServerOptions,
}

/// Binds `host:port` for [`serve`].
pub fn bind(host: &str, port: u16) -> Result<std::net::TcpListener> {
    let ip: IpAddr = host.parse().with_context(|| format!("--host {host} is not an IP address"))?;
    let addr = SocketAddr::new(ip, port);
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("binding {addr} (is another server, e.g. Ollama, already using the port? try --port)"))?;
    listener.set_nonblocking(true).context("making the listening socket non-blocking")?;
    Ok(listener)
}

/// Serves the loaded model until Ctrl-C or SIGTERM.
pub fn serve(config: ServeConfig, engine: Engine) -> Result<()> {
    config.options.check()?;
    let model = ModelInfo::describe(engine.arch(), config.options.model_name.clone());
    let app = AppState::new(engine, model, config.options);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(config.listener).context("listening on the bound socket")?;
        let bound = listener.local_addr().context("reading the address the server is bound to")?;
        note!("slotstream serving '{}' on http://{bound}", app.model.name);
        if let Some(e) = app.options.elastic.clone() {
            elastic::spawn(app.clone(), e);
        }
        // The first SIGINT or SIGTERM cancels the running and waiting
        // generations and shuts down (open connections get --shutdown-grace
        // to take their last chunk); a second one exits at once.
        let (first_sender, first) = tokio::sync::oneshot::channel::<()>();
        let watched = app.clone();
        let signals = async move {
            shutdown_signal().await;
            let running = usize::from(watched.turn.available_permits() == 0);
            let waiting = watched.waiting.load(Ordering::SeqCst);
            note!(
                "shutting down: cancelling {running} running and {waiting} waiting generation(s) (a second Ctrl-C exits at once)"
            );
            let _ = first_sender.send(());
            shutdown_signal().await;
            note!("exiting now");
        };
        tokio::select! {
            served = serve_on(listener, app, async move { let _ = first.await; }) => served,
            () = signals => Ok(()),
        }
    })?;
    // Generation threads were told to stop; do not wait for one stuck in a forward pass.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    Ok(())
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut terminate) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
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
    fn a_model_name_clients_cannot_send_is_refused() {
        let options = |name: &str| ServerOptions {
            model_name: name.to_string(),
            max_context: 4096,
            prefix_cache: true,
            queue: 16,
            plan: None,
            elastic: None,
            timeouts: Timeouts::default(),
            origins: Vec::new(),
        };
        options("my-model").check().expect("a plain name is fine");
        for bad in ["", " ", " padded ", "tab\there"] {
            let error = options(bad).check().expect_err(bad);
            assert!(error.to_string().contains("is not a name clients can send"), "{error}");
        }
    }
}
