//! Which models are loaded, as Ollama keeps them: a model loads on its first
//! request and stays for its `keep_alive` after the last one ends (zero:
//! unloaded at once; negative: kept). Loading another model unloads idle ones,
//! least recently used first, while more than `max_loaded` would be loaded or
//! the newcomer's memory plan does not fit in what the machine has free. A
//! model in use (generating, or holding a request that waits its turn) is
//! never unloaded: a load that needs its memory marks it draining (no new
//! request takes it) and waits for it. Loads happen one at a time.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;

use super::catalog::CatalogEntry;
use super::elastic::Elastic;
use super::keep_alive::KeepAlive;
use super::{lock, ApiError, MemoryReport, ModelInfo, PrefixCache, PrefixCacheStats, PREFIX_CACHE_ENTRIES};
use crate::experts::CacheStats;
use crate::generate::Engine;
use crate::note;
use crate::plan::governor::Governor;
use crate::plan::{MachineMemory, Plan};

/// A model loaded by a [`ModelLoader`], with the plan it was loaded under.
pub struct LoadedEngine {
    pub engine: Engine,
    pub plan: Option<Plan>,
    /// Re-plan its expert pool as free memory changes (auto-sized pools only).
    pub elastic: Option<Elastic>,
}

/// How the server loads a model directory (the command line plans memory and
/// picks the backend; tests load fixtures on the exact CPU backend).
pub trait ModelLoader: Send + Sync {
    /// Bytes the model in `dir` would take under the plan it gets when
    /// `reclaimable` more bytes were free (what the loaded models hold): the
    /// memory it needs to run at its best beside nothing else.
    fn footprint(&self, dir: &Path, reclaimable: u64) -> Result<u64>;
    fn load(&self, dir: &Path) -> Result<LoadedEngine>;
}

/// A loaded model and everything kept with it.
pub struct Resident {
    pub name: String,
    pub dir: PathBuf,
    pub engine: Engine,
    pub info: ModelInfo,
    pub prefix_cache: Option<Mutex<PrefixCache>>,
    /// Expert cache statistics as of the end of the last generation, so
    /// metadata requests never wait for the model.
    pub expert_stats: Mutex<CacheStats>,
    /// Bytes of state held by the prefix cache, as of the last generation.
    pub cache_state_bytes: AtomicUsize,
    /// The live memory plan (the governor may resize it).
    pub plan: Mutex<Option<Plan>>,
    pub elastic: Option<(Elastic, Mutex<Governor>)>,
    /// The grammar engine over the model's vocabulary, built on the first
    /// request with a constrained output (or why it cannot be).
    pub grammars: OnceLock<Result<Arc<crate::constrain::Grammars>, String>>,
    /// Requests holding the model (a [`Lease`] each).
    users: AtomicUsize,
    /// The keep-alive of the latest request, applied when the last one ends.
    keep_alive: Mutex<KeepAlive>,
    /// When the idle model unloads (`None`: in use, or kept forever).
    expires: Mutex<Option<Instant>>,
    last_used: Mutex<Instant>,
    /// Another model waits for this one's memory: no new request takes it.
    draining: AtomicBool,
    /// Last, so that it drops after the engine (fields drop in order).
    _release: crate::process::ReleaseFreedMemory,
}

impl Resident {
    /// The longest context a request may use: `server_max` (--max-context),
    /// at most the model's own and the context its plan holds KV for.
    pub fn context_limit(&self, server_max: usize) -> usize {
        server_max.min(self.planned_context()).min(self.engine.context_length())
    }

    /// The context the model's memory plan holds KV for (unbounded without a plan).
    pub fn planned_context(&self) -> usize {
        lock(&self.plan).as_ref().map_or(usize::MAX, |p| p.context_tokens)
    }

    /// Why a context of `tokens` is refused: the memory it needs beyond the
    /// plan's KV (empty without a plan).
    pub fn context_need(&self, tokens: usize) -> String {
        lock(&self.plan).as_ref().map_or_else(String::new, |p| format!(": {}", p.context_need(tokens, None)))
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

    /// When the model unloads if no request comes (`/api/ps`): for a model in
    /// use, its keep-alive from now; a model kept forever, a century away.
    pub fn expires_at(&self) -> SystemTime {
        let forever = SystemTime::now() + Duration::from_secs(100 * 365 * 86_400);
        if self.users.load(Ordering::SeqCst) > 0 {
            return match *lock(&self.keep_alive) {
                KeepAlive::For(d) => SystemTime::now() + d,
                KeepAlive::Forever => forever,
            };
        }
        match *lock(&self.expires) {
            Some(at) => SystemTime::now() + at.saturating_duration_since(Instant::now()),
            None => forever,
        }
    }
}

/// A request's hold on a loaded model; the model cannot unload while it lives.
/// Dropping it applies the request's keep-alive.
pub struct Lease {
    model: Arc<Resident>,
    residency: Arc<Residency>,
    keep_alive: KeepAlive,
}

impl std::ops::Deref for Lease {
    type Target = Resident;
    fn deref(&self) -> &Resident {
        &self.model
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.residency.release(&self.model, self.keep_alive);
    }
}

/// The loaded models and the policy above.
pub struct Residency {
    loaded: Mutex<Vec<Arc<Resident>>>,
    /// One load (with the unloading it needs) at a time, in arrival order.
    loading: tokio::sync::Mutex<()>,
    /// Woken when a model's last request ends.
    changed: tokio::sync::Notify,
    loader: Arc<dyn ModelLoader>,
    max_loaded: usize,
    prefix_cache: bool,
    max_context: usize,
    /// Sequences each loaded engine decodes together.
    parallel: usize,
}

impl Residency {
    pub fn new(loader: Arc<dyn ModelLoader>, max_loaded: usize, prefix_cache: bool, max_context: usize, parallel: usize) -> Residency {
        Residency {
            loaded: Mutex::new(Vec::new()),
            loading: tokio::sync::Mutex::new(()),
            changed: tokio::sync::Notify::new(),
            loader,
            max_loaded: max_loaded.max(1),
            prefix_cache,
            max_context,
            parallel,
        }
    }

    /// The loaded models, most recently used first.
    pub fn loaded(&self) -> Vec<Arc<Resident>> {
        let mut models = lock(&self.loaded).clone();
        models.sort_by_key(|m| std::cmp::Reverse(*lock(&m.last_used)));
        models
    }

    pub fn get(&self, name: &str) -> Option<Arc<Resident>> {
        lock(&self.loaded).iter().find(|m| m.name == name).cloned()
    }

    /// A lease on `name` if it is loaded (and not draining, unless `draining_too`).
    fn lease_loaded(self: &Arc<Self>, name: &str, keep_alive: KeepAlive, draining_too: bool) -> Option<Lease> {
        let loaded = lock(&self.loaded);
        let model = loaded.iter().find(|m| m.name == name && (draining_too || !m.draining.load(Ordering::SeqCst)))?;
        model.users.fetch_add(1, Ordering::SeqCst);
        model.draining.store(false, Ordering::SeqCst);
        *lock(&model.expires) = None;
        *lock(&model.keep_alive) = keep_alive;
        *lock(&model.last_used) = Instant::now();
        Some(Lease { model: model.clone(), residency: self.clone(), keep_alive })
    }

    /// A lease on `name` if it is loaded and takes requests.
    pub fn lease_if_loaded(self: &Arc<Self>, name: &str, keep_alive: KeepAlive) -> Option<Lease> {
        self.lease_loaded(name, keep_alive, false)
    }

    /// A lease on the model `entry` names, loading it first if needed.
    pub async fn acquire(self: &Arc<Self>, entry: CatalogEntry, info: ModelInfo, keep_alive: KeepAlive) -> Result<Lease, ApiError> {
        if let Some(lease) = self.lease_loaded(&entry.name, keep_alive, false) {
            return Ok(lease);
        }
        // A task of its own: a client that leaves does not abandon a load
        // halfway (the model is kept for its keep-alive instead).
        let me = self.clone();
        let name = entry.name.clone();
        let task = tokio::spawn(async move {
            let _one_load = me.loading.lock().await;
            if let Some(lease) = me.lease_loaded(&entry.name, keep_alive, true) {
                return Ok(lease);
            }
            me.make_room(&entry).await?;
            let me2 = me.clone();
            let model = tokio::task::spawn_blocking(move || me2.load(&entry, info))
                .await
                .map_err(|e| ApiError::internal(format!("loading the model stopped: {e}")))?
                .map_err(|e| ApiError::internal(format!("loading {e:#}")))?;
            lock(&me.loaded).push(model.clone());
            me.lease_loaded(&model.name, keep_alive, true)
                .ok_or_else(|| ApiError::internal("the model unloaded as soon as it loaded"))
        });
        task.await.map_err(|e| ApiError::internal(format!("loading {name} stopped: {e}")))?
    }

    /// Loads `entry` now (the first `--model`, at start), kept for `keep_alive`.
    pub fn load_at_start(self: &Arc<Self>, entry: &CatalogEntry, info: ModelInfo, keep_alive: KeepAlive) -> Result<()> {
        let model = self.load(entry, info)?;
        lock(&self.loaded).push(model.clone());
        drop(self.lease_loaded(&model.name, keep_alive, true));
        Ok(())
    }

    fn load(&self, entry: &CatalogEntry, info: ModelInfo) -> Result<Arc<Resident>> {
        let started = Instant::now();
        let loaded = self.loader.load(&entry.dir).map_err(|e| e.context(format!("{} from {}", entry.name, entry.dir.display())))?;
        let mut engine = loaded.engine;
        engine.set_parallel(self.parallel)?;
        note!("loaded {} in {:.1}s", entry.name, started.elapsed().as_secs_f64());
        let context = loaded.plan.as_ref().map_or(usize::MAX, |p| p.context_tokens).min(engine.context_length());
        let prefix_cache =
            self.prefix_cache.then(|| Mutex::new(PrefixCache::new(PREFIX_CACHE_ENTRIES, self.max_context.min(context))));
        Ok(Arc::new(Resident {
            name: entry.name.clone(),
            dir: entry.dir.clone(),
            expert_stats: Mutex::new(engine.expert_stats().unwrap_or_default()),
            engine,
            info,
            prefix_cache,
            cache_state_bytes: AtomicUsize::new(0),
            plan: Mutex::new(loaded.plan),
            elastic: loaded.elastic.map(|e| (e, Mutex::new(Governor::new()))),
            grammars: OnceLock::new(),
            users: AtomicUsize::new(0),
            keep_alive: Mutex::new(KeepAlive::default()),
            expires: Mutex::new(None),
            last_used: Mutex::new(Instant::now()),
            draining: AtomicBool::new(false),
            _release: crate::process::ReleaseFreedMemory,
        }))
    }

    /// Unloads models until `entry` may load: fewer than `max_loaded` loaded,
    /// and its footprint within the memory free now. Idle models go first,
    /// least recently used first; a model in use is drained, then unloaded.
    async fn make_room(self: &Arc<Self>, entry: &CatalogEntry) -> Result<(), ApiError> {
        let reclaimable: u64 = self.loaded().iter().map(|m| m.memory().total_bytes).sum();
        if reclaimable == 0 && lock(&self.loaded).is_empty() {
            return Ok(());
        }
        let (loader, dir) = (self.loader.clone(), entry.dir.clone());
        let need = tokio::task::spawn_blocking(move || loader.footprint(&dir, reclaimable))
            .await
            .map_err(|e| ApiError::internal(format!("planning {} stopped: {e}", entry.name)))?
            .map_err(|e| ApiError::internal(format!("planning memory for {}: {e:#}", entry.name)))?;
        loop {
            let loaded = self.loaded();
            let available = MachineMemory::detect().available;
            if loaded.is_empty() || (loaded.len() < self.max_loaded && need <= available) {
                return Ok(());
            }
            let idle = |m: &Arc<Resident>| m.users.load(Ordering::SeqCst) == 0;
            let victim = loaded.iter().rev().find(|m| idle(m)).or(loaded.last()).cloned();
            let Some(victim) = victim else { return Ok(()) };
            let why = if loaded.len() >= self.max_loaded {
                format!("at most {} model(s) stay loaded", self.max_loaded)
            } else {
                format!("it needs {:.2} GB and {:.2} GB are free", need as f64 / 1e9, available as f64 / 1e9)
            };
            victim.draining.store(true, Ordering::SeqCst);
            while !idle(&victim) {
                // Woken when a request ends; the timeout covers a wake-up missed in between.
                let _ = tokio::time::timeout(Duration::from_millis(100), self.changed.notified()).await;
            }
            if self.remove_if_idle(&victim) {
                note!("unloaded {} to load {}: {why}", victim.name, entry.name);
            }
        }
    }

    /// Removes `model` if no request holds it; true when it was removed.
    fn remove_if_idle(&self, model: &Arc<Resident>) -> bool {
        let removed = {
            let mut loaded = lock(&self.loaded);
            let at = loaded.iter().position(|m| Arc::ptr_eq(m, model) && m.users.load(Ordering::SeqCst) == 0);
            at.map(|at| loaded.remove(at))
        };
        // The engine drops outside the lock, when its last handle goes.
        removed.is_some()
    }

    /// Ends a request's hold; the last one applies its keep-alive.
    fn release(&self, model: &Arc<Resident>, keep_alive: KeepAlive) {
        let unload_now = {
            let _loaded = lock(&self.loaded);
            *lock(&model.keep_alive) = keep_alive;
            *lock(&model.last_used) = Instant::now();
            let left = model.users.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
            if left == 0 {
                *lock(&model.expires) = match keep_alive {
                    KeepAlive::For(d) => Some(Instant::now() + d),
                    KeepAlive::Forever => None,
                };
            }
            left == 0 && keep_alive.is_zero()
        };
        if unload_now && self.remove_if_idle(model) {
            note!("unloaded {} (keep_alive 0)", model.name);
        }
        self.changed.notify_waiters();
    }

    /// Unloads `name` now if it is idle, else as soon as its requests end
    /// (`why`: a load-only request with `keep_alive` 0, a delete). True when
    /// it is loaded no more.
    pub fn unload(&self, name: &str, why: &str) -> bool {
        let Some(model) = self.get(name) else { return true };
        *lock(&model.keep_alive) = KeepAlive::For(Duration::ZERO);
        if self.remove_if_idle(&model) {
            note!("unloaded {} ({why})", model.name);
            return true;
        }
        false
    }

    /// Unloads every idle model whose keep-alive has run out.
    pub fn expire(&self) {
        let now = Instant::now();
        let expired: Vec<Arc<Resident>> = {
            let mut loaded = lock(&self.loaded);
            let (gone, kept): (Vec<_>, Vec<_>) = loaded.drain(..).partition(|m| {
                m.users.load(Ordering::SeqCst) == 0 && lock(&m.expires).is_some_and(|at| at <= now)
            });
            *loaded = kept;
            gone
        };
        for model in expired {
            note!("unloaded {}: idle for its keep_alive", model.name);
        }
    }

    /// Runs [`Residency::expire`] a few times a second until the runtime stops.
    pub fn spawn_expiry(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let Some(residency) = me.upgrade() else { return };
                residency.expire();
            }
        });
    }
}
