//! `slotstream serve`: the Ollama, OpenAI (chat, completions, Responses) and
//! Anthropic (Messages) HTTP APIs over every installed model.
//!
//! `state.rs` holds what every handler shares ([`AppState`]), `router.rs` the
//! routes and the layers every request passes; this file starts and stops
//! the server, and holds the request-body helpers the front ends share.
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
mod router;
mod state;
mod tools;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::body::Body;

use crate::note;

pub use catalog::{CatalogEntry, ModelCatalog, Origin};
pub use error::ApiError;
use generation::count_prompt_tokens;
pub use generation::{start_generation, Answer, Event, GenerationRequest, GenerationStream, OutputConstraint, PromptInput, Summary};
pub use keep_alive::{KeepAlive, DEFAULT_KEEP_ALIVE};
pub use model_info::{MemoryReport, ModelInfo};
pub use ollama_env::OllamaEnv;
pub use crate::generate::{PrefixCache, PrefixCacheStats};
pub use residency::{Lease, LoadedEngine, ModelLoader, Resident};

pub use elastic::Elastic;
pub use listen::{serve_on, Timeouts};
use router::error_for_path;
pub use router::{router, MAX_BODY_BYTES};
use state::lock;
pub use state::{check_model_name, AppState, ServerOptions, DEFAULT_MAX_LOADED_MODELS, PREFIX_CACHE_ENTRIES, PROMPT_WORKERS};

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
