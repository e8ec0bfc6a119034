//! What every handler shares: the server's options, and [`AppState`] (the
//! model catalog, the loaded models, the turn queue, the drain and shutdown
//! flags, the work limits and the metrics).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Context, Result};
use axum::http::StatusCode;
use tokio::sync::Semaphore;

use super::{generation, metrics, pull, residency};
use super::{ApiError, CatalogEntry, KeepAlive, Lease, ModelCatalog, ModelInfo, ModelLoader, Timeouts};

/// Entries the prefix cache keeps (each request adds up to two: its prompt and
/// its prompt plus answer).
pub const PREFIX_CACHE_ENTRIES: usize = 6;
/// Prompts rendered and tokenized at once; more wait their turn, so many large
/// prompts arriving together cost the memory of a few.
pub const PROMPT_WORKERS: usize = 2;
/// Models loaded at once at most, unless `--max-loaded-models` says otherwise
/// (Ollama's default on a CPU); memory may allow fewer.
pub const DEFAULT_MAX_LOADED_MODELS: usize = 3;

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
    pub(super) catalog: ModelCatalog,
    pub(super) residency: Arc<residency::Residency>,
    pub(super) options: ServerOptions,
    /// `parallel` permits: the right to generate. Tokio's semaphore is FIFO-fair.
    pub(super) turn: Arc<Semaphore>,
    pub(super) waiting: AtomicUsize,
    /// Set on shutdown: running generations stop at their next token.
    pub(super) stopping: AtomicBool,
    /// Set by SIGTERM: new generations are refused while running ones finish.
    pub(super) draining: AtomicBool,
    /// Prompts being rendered and tokenized at once (see `PROMPT_WORKERS`).
    pub(super) prompt_work: Semaphore,
    /// Grammars being compiled at once (see `generation::GRAMMAR_WORKERS`).
    pub(super) grammar_work: Arc<Semaphore>,
    /// Pulls in progress, by the repository they write into.
    pub(super) pulls: Arc<pull::PullsInProgress>,
    pub(super) metrics: Arc<metrics::Metrics>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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

    pub(super) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Refuses new generations (503, and `/health/ready` too) while those
    /// running or waiting go on: SIGTERM's drain, so a router sends new
    /// requests elsewhere and none in flight is lost.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Generations holding a turn now.
    pub(super) fn generations_running(&self) -> usize {
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
    pub(super) fn refusing(&self) -> bool {
        self.draining.load(Ordering::SeqCst) || self.stopping()
    }

    /// The catalog entry and description of the model a request names: 400
    /// without a name, 404 for a model this server does not have.
    pub(super) fn find_model(&self, requested: &str) -> Result<(CatalogEntry, ModelInfo), ApiError> {
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
    pub(super) async fn lease(&self, requested: &str, keep_alive: Option<KeepAlive>) -> Result<Lease, ApiError> {
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
