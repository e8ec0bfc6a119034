//! `slotstream serve`: the Ollama, OpenAI (chat, completions, Responses) and
//! Anthropic (Messages) HTTP APIs over every installed model.
//!
//! `ollama.rs`, `openai.rs`, `responses.rs` and `anthropic.rs` translate
//! their wire formats into one [`GenerationRequest`]; [`start_generation`] is
//! the single entry point they all call. It finds the model in the catalog
//! (`catalog.rs`: `--model` directories and pulled models), takes a lease on
//! it (`residency.rs`: loaded
//! on first use, unloaded after its keep-alive or for another model's memory),
//! renders and tokenizes the prompt, checks it against the context limit,
//! waits its turn in a bounded FIFO queue (one generation at a time), and runs
//! the engine on a blocking thread that streams text back through a channel.
//! A client that goes away drops the receiving end, and the engine stops at
//! its next check. The prefix cache lets a request skip the prompt tokens an
//! earlier request already fed. `/api/pull` and `/api/delete` (`pull.rs`)
//! manage the pulled models. `/health`, `/health/ready` and `/metrics`
//! (`metrics.rs`) serve orchestrators and routers; SIGTERM drains (new
//! requests get 503 while running ones finish) before it stops.

mod anthropic;
mod catalog;
mod delivery;
mod elastic;
mod error;
mod event_stream;
mod generation;
mod guard;
mod keep_alive;
mod listen;
mod metrics;
mod model_info;
mod ollama;
mod ollama_env;
mod ollama_models;
mod openai;
mod pull;
mod request_log;
mod residency;
mod responses;
mod thinking;
mod tools;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post};
use axum::Router;
use tokio::sync::Semaphore;

use crate::note;

pub use catalog::{CatalogEntry, ModelCatalog, Origin};
pub use error::ApiError;
use generation::count_prompt_tokens;
pub use generation::{start_generation, Answer, Event, GenerationRequest, GenerationStream, OutputConstraint, PromptInput, Summary};
use error::{AnthropicError, OllamaError, OpenAiError};
pub use keep_alive::{KeepAlive, DEFAULT_KEEP_ALIVE};
pub use model_info::{MemoryReport, ModelInfo};
pub use ollama_env::OllamaEnv;
pub use crate::generate::{PrefixCache, PrefixCacheStats};
pub use residency::{Lease, LoadedEngine, ModelLoader, Resident};

/// Request bodies larger than this get 413.
pub const MAX_BODY_BYTES: usize = 32 << 20;
/// Entries the prefix cache keeps (each request adds up to two: its prompt and
/// its prompt plus answer).
pub const PREFIX_CACHE_ENTRIES: usize = 6;
/// Prompts rendered and tokenized at once; more wait their turn, so many large
/// prompts arriving together cost the memory of a few.
pub const PROMPT_WORKERS: usize = 2;
/// Models loaded at once at most, unless `--max-loaded-models` says otherwise
/// (Ollama's default on a CPU); memory may allow fewer.
pub const DEFAULT_MAX_LOADED_MODELS: usize = 3;

pub use elastic::Elastic;
pub use listen::{serve_on, Timeouts};

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Prompt plus completion tokens allowed per request.
    pub max_context: usize,
    pub prefix_cache: bool,
    /// Requests that may wait while one generates; more get 503.
    pub queue: usize,
    pub timeouts: Timeouts,
    /// Browser origins allowed besides the loopback ones (`OLLAMA_ORIGINS`:
    /// exact, or with one `*` wildcard).
    pub origins: Vec<String>,
    /// How long a model stays loaded after a request that does not say.
    pub keep_alive: KeepAlive,
    /// Models loaded at once at most.
    pub max_loaded_models: usize,
    /// Generations run at once, their decode steps batched into shared
    /// forward passes (`--parallel`, `OLLAMA_NUM_PARALLEL`); 1 runs one at a time.
    pub parallel: usize,
    /// Where `/api/pull` pulls from and into; `None` refuses pulls.
    pub pulls: Option<crate::pull::PullSource>,
}

impl ServerOptions {
    /// Refuses settings the server could not honour: no context at all, or
    /// no room for one loaded model.
    pub fn check(&self) -> Result<()> {
        if self.max_context == 0 {
            anyhow::bail!("--max-context must be at least 1 token");
        }
        if self.max_loaded_models == 0 {
            anyhow::bail!("--max-loaded-models must be at least 1");
        }
        if self.parallel == 0 || self.parallel > crate::generate::MAX_PARALLEL {
            anyhow::bail!("--parallel must be 1 to {} generations", crate::generate::MAX_PARALLEL);
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
    catalog: ModelCatalog,
    residency: Arc<residency::Residency>,
    options: ServerOptions,
    /// `parallel` permits: the right to generate. Tokio's semaphore is FIFO-fair.
    turn: Arc<Semaphore>,
    waiting: AtomicUsize,
    /// Set on shutdown: running generations stop at their next token.
    stopping: AtomicBool,
    /// Set by SIGTERM: new generations are refused while running ones finish.
    draining: AtomicBool,
    /// Prompts being rendered and tokenized at once (see `PROMPT_WORKERS`).
    prompt_work: Semaphore,
    /// Grammars being compiled at once (see `generation::GRAMMAR_WORKERS`).
    grammar_work: Arc<Semaphore>,
    /// Pulls in progress, by the repository they write into.
    pulls: Arc<pull::PullsInProgress>,
    metrics: Arc<metrics::Metrics>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl AppState {
    /// A server over `catalog`, loading models with `loader`; none is loaded
    /// yet (see [`AppState::load_at_start`]).
    pub fn new(catalog: ModelCatalog, loader: Arc<dyn ModelLoader>, options: ServerOptions) -> Result<Arc<AppState>> {
        options.check()?;
        let residency = Arc::new(residency::Residency::new(
            loader,
            options.max_loaded_models,
            options.prefix_cache,
            options.max_context,
            options.parallel,
        ));
        let metrics = Arc::new(metrics::Metrics::new(residency.clone()));
        Ok(Arc::new(AppState {
            catalog,
            metrics,
            residency,
            turn: Arc::new(Semaphore::new(options.parallel)),
            options,
            waiting: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            prompt_work: Semaphore::new(PROMPT_WORKERS),
            grammar_work: Arc::new(Semaphore::new(generation::GRAMMAR_WORKERS)),
            pulls: Arc::new(pull::PullsInProgress::default()),
        }))
    }

    /// Loads `name` now, kept for the server's default keep-alive as if a
    /// request had loaded it (`serve` loads its first `--model` at start, so a
    /// model that cannot load is found before clients come).
    pub fn load_at_start(&self, name: &str) -> Result<()> {
        let entry = self.catalog.find(name).with_context(|| format!("no model named {name:?} to load"))?;
        let info = self.catalog.describe(&entry).with_context(|| format!("{} cannot be read", entry.dir.display()))?;
        self.residency.load_at_start(&entry, info, self.options.keep_alive)
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

    /// Refuses new generations (503, and `/health/ready` too) while those
    /// running or waiting go on: SIGTERM's drain, so a router sends new
    /// requests elsewhere and none in flight is lost.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Generations holding a turn now.
    fn generations_running(&self) -> usize {
        self.options.parallel.saturating_sub(self.turn.available_permits())
    }

    /// Waits until no generation runs or waits, at most `grace`; false when
    /// some were still going.
    pub async fn drained(&self, grace: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            if self.generations_running() == 0 && self.waiting.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Whether new requests are refused: draining or shutting down.
    fn refusing(&self) -> bool {
        self.draining.load(Ordering::SeqCst) || self.stopping()
    }

    /// The catalog entry and description of the model a request names: 400
    /// without a name, 404 for a model this server does not have.
    fn find_model(&self, requested: &str) -> Result<(CatalogEntry, ModelInfo), ApiError> {
        if requested.trim().is_empty() {
            return Err(ApiError::bad_request("'model' is required"));
        }
        let entry = self.catalog.find(requested).ok_or_else(|| ApiError::model_not_found(requested, &self.catalog.names()))?;
        let info = self.catalog.describe(&entry).ok_or_else(|| {
            ApiError::internal(format!("{} ({}) is not a model slotstream can read", entry.name, entry.dir.display()))
        })?;
        Ok((entry, info))
    }

    /// A lease on the model a request names, loading it if needed. Waiting
    /// for a load counts against `--queue` as waiting for the turn does.
    async fn lease(&self, requested: &str, keep_alive: Option<KeepAlive>) -> Result<Lease, ApiError> {
        if self.refusing() {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is about to stop and takes no new requests; send this one to another server",
            ));
        }
        let (entry, info) = self.find_model(requested)?;
        let keep_alive = keep_alive.unwrap_or(self.options.keep_alive);
        if let Some(lease) = self.residency.lease_if_loaded(&entry.name, keep_alive) {
            return Ok(lease);
        }
        let queued = self.waiting.fetch_add(1, Ordering::SeqCst) + 1;
        let _waiting = generation::Waiting(&self.waiting);
        if queued > self.options.queue {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the server is busy: {} requests are already waiting (--queue); retry later", self.options.queue),
            ));
        }
        self.residency.acquire(entry, info, keep_alive).await
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
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, HEAD, POST, DELETE, OPTIONS"));
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
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        AnthropicError(e).into_response()
    } else if path.starts_with("/v1/") {
        OpenAiError(e).into_response()
    } else {
        OllamaError(e).into_response()
    }
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    error_for_path(&path, ApiError::new(StatusCode::NOT_FOUND, format!("no endpoint {} {path}", req.method())))
}

/// A known path asked with another method: axum answers an empty 405 (and
/// adds the `Allow` header after this layer); the client gets the reason in
/// its API's error form too.
async fn explain_wrong_method(req: Request, next: Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let response = next.run(req).await;
    if response.status() != StatusCode::METHOD_NOT_ALLOWED {
        return response;
    }
    let message = format!("{method} is not allowed on {path} (the Allow header lists what is)");
    error_for_path(&path, ApiError::new(StatusCode::METHOD_NOT_ALLOWED, message))
}

async fn embeddings_refused(req: Request) -> Response {
    error_for_path(req.uri().path(), ApiError::unsupported("embeddings"))
}

async fn root() -> &'static str {
    "Ollama is running"
}

/// `/health`: the server is up and answering.
async fn health() -> Response {
    error::json_response(StatusCode::OK, &serde_json::json!({"status": "ok"}))
}

/// `/health/ready`: whether it takes requests; 503 once it drains or shuts down.
async fn ready(State(app): State<Arc<AppState>>) -> Response {
    if app.refusing() {
        return error::json_response(StatusCode::SERVICE_UNAVAILABLE, &serde_json::json!({"status": "shutting down"}));
    }
    error::json_response(StatusCode::OK, &serde_json::json!({"status": "ready"}))
}

/// The full router over `app`, served on `bound`.
pub fn router(app: Arc<AppState>, bound: SocketAddr) -> Router {
    let body_timeout = app.options.timeouts.body;
    let origins = Arc::new(app.options.origins.clone());
    Router::new()
        .route("/", get(root))
        .route("/health", get(health))
        .route("/health/ready", get(ready))
        .route("/metrics", get(metrics::metrics))
        .route("/api/version", get(ollama_models::version))
        .route("/api/tags", get(ollama_models::tags))
        .route("/api/ps", get(ollama_models::ps))
        .route("/api/show", post(ollama_models::show))
        .route("/api/pull", post(pull::pull))
        .route("/api/delete", delete(pull::delete).post(pull::delete))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/embed", any(embeddings_refused))
        .route("/api/embeddings", any(embeddings_refused))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        .route("/v1/embeddings", any(embeddings_refused))
        .fallback(not_found)
        .layer(axum::middleware::from_fn(explain_wrong_method))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(body_timeout, listen::read_body_within))
        .layer(axum::middleware::from_fn(guard::check_length))
        .layer(axum::middleware::from_fn_with_state(origins, cors))
        .layer(axum::middleware::from_fn_with_state(bound, guard::check_host))
        .layer(axum::middleware::from_fn_with_state(app.metrics.clone(), request_log::log_requests))
        .with_state(app)
}

/// How `slotstream serve` was asked to run.
pub struct ServeConfig {
    /// Bound before any model loads (see [`bind`]), so a port in use is
    /// found at once.
    pub listener: std::net::TcpListener,
    pub catalog: ModelCatalog,
    pub loader: Arc<dyn ModelLoader>,
    /// Loaded before the first request (the first `--model`).
    pub load_first: Option<String>,
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

/// Serves the catalog's models until Ctrl-C or SIGTERM.
pub fn serve(config: ServeConfig) -> Result<()> {
    let app = AppState::new(config.catalog, config.loader, config.options)?;
    if let Some(name) = &config.load_first {
        app.load_at_start(name)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(config.listener).context("listening on the bound socket")?;
        let bound = listener.local_addr().context("reading the address the server is bound to")?;
        let entries = app.catalog.entries();
        let named = |origin: fn(&Origin) -> bool| -> Vec<String> {
            entries.iter().filter(|e| origin(&e.origin)).map(|e| format!("'{}'", e.name)).collect()
        };
        let (given, pulled) = (named(|o| *o == Origin::Directory), named(|o| *o != Origin::Directory));
        let given = if given.is_empty() { "pulled models".to_string() } else { given.join(", ") };
        note!("slotstream serving {given} on http://{bound}");
        if !pulled.is_empty() {
            note!("  and {} pulled model(s): {}", pulled.len(), pulled.join(", "));
        }
        elastic::spawn(app.clone());
        // The first SIGINT cancels the running and waiting generations and
        // shuts down (open connections get --shutdown-grace to take their
        // last chunk); SIGTERM first drains: new requests get 503 while the
        // running and waiting ones get --shutdown-grace to finish. A second
        // signal exits at once.
        let (first_sender, first) = tokio::sync::oneshot::channel::<()>();
        let watched = app.clone();
        let signals = async move {
            if shutdown_signal().await == Signal::Terminate {
                let grace = watched.options.timeouts.shutdown_grace;
                note!("SIGTERM: draining: new requests get 503; running and waiting generations get {grace:?} to finish");
                watched.start_draining();
                tokio::select! {
                    _ = watched.drained(grace) => {}
                    _ = shutdown_signal() => {
                        note!("exiting now");
                        return;
                    }
                }
            }
            let running = watched.generations_running();
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

#[derive(PartialEq)]
enum Signal {
    Interrupt,
    Terminate,
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() -> Signal {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut terminate) = signal(SignalKind::terminate()) {
            return tokio::select! {
                _ = tokio::signal::ctrl_c() => Signal::Interrupt,
                _ = terminate.recv() => Signal::Terminate,
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    Signal::Interrupt
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
    from_json(&bytes)
}

/// Parses `bytes` as one JSON value of type `T` (nothing after it); an error
/// names the field it is about (`messages[0].content`).
fn from_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(ApiError::invalid_json)?;
    de.end().map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    Ok(value)
}

/// Parses a JSON body as two values, each from all of its fields (a part
/// ignores the other's): an error names the field, as one from
/// `#[serde(flatten)]` could not.
fn parse_body_parts<A: serde::de::DeserializeOwned, B: serde::de::DeserializeOwned>(
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(A, B), ApiError> {
    let bytes = body.map_err(|r| ApiError::new(r.status(), r.body_text()))?;
    let first: A = parse_body(Ok(bytes.clone()))?;
    let second = from_json(&bytes)?;
    Ok((first, second))
}

/// A field a request may make large (a schema, a tool list), kept as its
/// JSON text until its size is checked: parsed, a schema takes some 50 times
/// its size in memory (a 22 MB `format` of 700,000 properties took 1.2 GB).
type RawJson = Option<Box<serde_json::value::RawValue>>;

/// The most JSON text of a schema field (`format`, `response_format`) read:
/// twice what its grammar may hold, for the blanks of pretty-printed JSON.
const MAX_SCHEMA_FIELD_BYTES: usize = 2 * crate::constrain::MAX_SCHEMA_BYTES;
/// The most JSON text of `tools` read (their descriptions go to the template).
const MAX_TOOLS_FIELD_BYTES: usize = 4 * crate::constrain::MAX_SCHEMA_BYTES;

/// Parses `raw`, the request's `field`, when it is at most `limit` bytes.
fn bounded_json(raw: RawJson, field: &str, limit: usize) -> Result<Option<serde_json::Value>, ApiError> {
    let Some(raw) = raw else { return Ok(None) };
    let text = raw.get();
    if text.len() > limit {
        return Err(ApiError::bad_request(format!(
            "'{field}' is {} bytes of JSON; the most this server reads is {limit} bytes",
            text.len()
        )));
    }
    serde_json::from_str(text).map_err(|e| ApiError::bad_request(format!("'{field}' is not valid JSON: {e}")))
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
        check_model_name("my-model").expect("a plain name is fine");
        for bad in ["", " ", " padded ", "tab\there"] {
            let error = check_model_name(bad).expect_err(bad);
            assert!(error.to_string().contains("is not a name clients can send"), "{error}");
        }
    }
}
