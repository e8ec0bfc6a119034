//! Loading a model for `run`, `serve` and `perplexity`: the memory plan for
//! this machine first (so its banner can be shown before the slow part), then
//! the engine with the expert pool the plan sized. [`ServeLoader`] does the
//! same for each model `serve` loads on demand.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Result;
use slotstream_backend::{Backend, KvCacheType};

use crate::backend_spec::BackendSpec;
use crate::generate::Engine;
use crate::model::{ExpertSlots, LoadOptions, ModelArch};
use crate::model_ref::ResolvedModel;
use crate::note;
use crate::plan::{self, hits, MachineMemory, ModelCosts, Plan, PlanMode, PlanRequest, RateCache, RateKeys};
use crate::server::{Elastic, LoadedEngine, ModelLoader};

/// A model directory with the memory plan it will be loaded under.
pub struct PlannedModel {
    pub arch: ModelArch,
    pub costs: ModelCosts,
    pub machine: MachineMemory,
    pub plan: Plan,
}

impl PlannedModel {
    /// Plans `request` for the model `arch` on this machine as it is now,
    /// for `backend` (whose KV cache dtype sizes the context).
    pub fn new(arch: ModelArch, request: &PlanRequest, backend: &dyn Backend) -> Result<PlannedModel> {
        let mut costs = costs_on(&arch, BackendCosts::of(backend))?;
        let mut machine = MachineMemory::detect();
        // What `doctor --measure` measured for this backend and disk, else the defaults (the banner says which).
        let model_key = hits::model_key(&arch).ok();
        let keys = RateKeys::new(&backend.name(), &costs.expert_format, &arch.dir, costs.expert_record_bytes, model_key.as_deref());
        match RateCache::path().and_then(|path| RateCache::load(&path)) {
            Ok(cache) => machine.rates = cache.apply(&keys, machine.rates),
            Err(e) => note!("note: the plan's estimate uses default rates: {e:#}"),
        }
        // The hit rate this model's own runs measured, else the assumed one (the banner says which).
        match hits::curve_for(&arch) {
            Ok(curve) => costs.hit_curve = curve,
            Err(e) => note!("note: {e:#}"),
        }
        let plan = plan::plan(&costs, &machine, request)?;
        Ok(PlannedModel { arch, costs, machine, plan })
    }

    pub fn dir(&self) -> &Path {
        &self.arch.dir
    }

    /// What a context of `tokens` costs beyond the tokens the plan holds KV
    /// for: said where such a context is refused.
    pub fn context_need(&self, tokens: usize) -> String {
        self.plan.context_need(tokens, Some(self.machine.available))
    }

    /// The plan's banner, shown before loading.
    pub fn banner(&self) -> String {
        self.plan.banner(&self.costs, &self.machine)
    }

    /// Loads the model on `backend` with the planned pool; a pool with a slot
    /// for every expert is read in full now, so the first tokens wait on no reads.
    pub fn load(&self, backend: Box<dyn Backend>) -> Result<Engine> {
        let options = LoadOptions {
            expert_slots: ExpertSlots::Count(self.plan.slots),
            mtp: self.plan.mtp,
            preload_experts: true,
            ..Default::default()
        }
        .with_env_overrides()?;
        let bytes = self.costs.resident_bytes + self.plan.pool_bytes;
        let _shown = LoadIndicator::start(format!("loading {:.2} GB of weights", bytes as f64 / 1e9));
        let mut engine = Engine::load_arch(&self.arch, backend, &options)?;
        // Long chunks are for a streaming pool, which reads each missed
        // expert once a chunk. A pool that holds every expert reads nothing:
        // its chunk is what the backend runs best (its bound, else the
        // default), so that a cancelled prompt stops soon.
        engine.prefill_chunk = if is_resident(&self.plan) {
            engine.backend.prefill_rows_max().unwrap_or(crate::plan::DEFAULT_PREFILL_CHUNK).min(self.plan.prefill_chunk)
        } else {
            self.plan.prefill_chunk
        };
        Ok(engine)
    }
}

/// Resolves `--model`, telling the user when the bundled demo runs instead.
pub fn resolve_model(spec: Option<&str>) -> Result<ResolvedModel> {
    let model = ResolvedModel::resolve(spec)?;
    if model.is_demo {
        note!("{}", crate::demo::NOTE);
    }
    Ok(model)
}

/// Plans memory for a model, tells what will run (see [`announce`]), and
/// loads it.
pub fn load_planned(dir: &Path, request: &PlanRequest, backend: &BackendSpec, verbose: bool) -> Result<(Engine, PlannedModel)> {
    // A folder that holds no model is named before any GPU is looked for.
    let arch = ModelArch::read(dir)?;
    let (backend, no_gpu) = backend.create_quietly()?;
    let planned = PlannedModel::new(arch, request, backend.as_ref())?;
    announce(&planned, &backend.name(), no_gpu.as_deref(), verbose);
    let engine = planned.load(backend)?;
    Ok((engine, planned))
}

/// Generations `serve` decodes at once unless `--parallel` or
/// `OLLAMA_NUM_PARALLEL` says: the backend's default, no more than the memory
/// plan of the model loaded at start (`first`) allows ([`plan::parallel_within`]:
/// 1 where a streaming pool takes the memory); the backend's default where
/// that model cannot be planned (loading it will say why).
pub fn default_parallel(backend: &BackendSpec, first: Option<&Path>, request: &PlanRequest) -> usize {
    let most = backend.default_parallel();
    let Some(dir) = first.filter(|_| most > 1) else { return most };
    let planned = || -> Result<usize> {
        let arch = ModelArch::read(dir)?;
        let (b, _) = backend.create_quietly()?;
        let costs = costs_on(&arch, BackendCosts::of(b.as_ref()))?;
        Ok(plan::plan(&costs, &MachineMemory::detect(), request)?.parallel)
    };
    planned().map_or(most, |n| n.min(most))
}

/// Whether the plan holds every expert in memory, so that nothing is read
/// from disk after loading.
pub fn is_resident(plan: &Plan) -> bool {
    plan.slots >= plan.total_experts
}

/// The plan's banner and the backend (and why no GPU runs it, where `auto`
/// found none) with `verbose` or when experts stream from disk, whose
/// estimates are worth reading; else one line.
fn announce(planned: &PlannedModel, backend: &str, no_gpu: Option<&str>, verbose: bool) {
    if verbose || !is_resident(&planned.plan) {
        if let Some(why) = no_gpu {
            note!("note: no usable GPU, so the CPU runs the model (--backend cpu chooses it without looking for one): {why}");
        }
        note!("{}", planned.banner());
        note!("  backend: {backend}");
    } else {
        note!("{}", one_line(planned.plan.peak_bytes, backend, no_gpu.is_some()));
    }
}

/// What [`announce`] says of a resident model.
fn one_line(peak_bytes: u64, backend: &str, no_gpu: bool) -> String {
    let gpu = if no_gpu { "; no usable GPU (-v says why)" } else { "" };
    format!("every expert in memory (peak ~{:.1} GB), on {backend}{gpu}", peak_bytes as f64 / 1e9)
}

/// The `--model` directories `serve` answers for besides the pulled models.
pub struct ServedModels;

impl ServedModels {
    /// Each `--model`, named by the `--name` of the same rank (the first
    /// names the first) or its own name, and the model to load at start (the
    /// first one). With no
    /// `--model`: the installed default model (a pulled one, so no directory),
    /// else the bundled demo.
    pub fn resolve(models: &[String], names: &[String]) -> Result<(Vec<(String, PathBuf)>, Option<String>)> {
        if names.len() > models.len().max(1) {
            anyhow::bail!(
                "{} --name flags for {} --model flags: the first --name names the first --model, the second the \
                 second, and so on",
                names.len(),
                models.len()
            );
        }
        let specs: Vec<Option<&str>> =
            if models.is_empty() { vec![None] } else { models.iter().map(|m| Some(m.as_str())).collect() };
        let mut directories: Vec<(String, PathBuf)> = Vec::new();
        let mut load_first = None;
        for (i, spec) in specs.into_iter().enumerate() {
            let model = ResolvedModel::resolve(spec)?;
            if model.is_demo {
                note!("{}", crate::demo::NOTE);
            }
            if spec.is_none() && !model.is_demo && names.is_empty() {
                load_first = Some(model.name);
                continue;
            }
            let name = names.get(i).cloned().unwrap_or(model.name);
            if let Some((_, other)) = directories.iter().find(|(n, _)| *n == name) {
                anyhow::bail!(
                    "two models are both named {name:?} ({} and {}); name one with --name",
                    other.display(),
                    model.dir.display()
                );
            }
            directories.push((name, model.dir));
        }
        let load_first = load_first.or_else(|| directories.first().map(|(name, _)| name.clone()));
        Ok((directories, load_first))
    }
}

/// How `serve` loads a model: planned for this machine as it is when the
/// model is asked for, on a fresh backend of the kind the flags chose.
pub struct ServeLoader {
    pub backend: BackendSpec,
    pub request: PlanRequest,
    /// Let an auto-sized pool follow free memory (`--no-elastic` turns it off).
    pub elastic: bool,
    /// The whole plan on every load, resident or not (`-v`).
    pub verbose: bool,
    /// What the backend's kind changes in a plan, learnt from the first backend made.
    kind: Mutex<Option<BackendCosts>>,
}

/// What a backend changes in a model's costs: its KV cache dtype, and
/// whether a pool of every expert also holds the shared experts.
#[derive(Clone, Copy)]
struct BackendCosts {
    kv: KvCacheType,
    pools_shared: bool,
}

impl BackendCosts {
    fn of(b: &dyn Backend) -> BackendCosts {
        BackendCosts { kv: b.kv_cache_type(), pools_shared: b.pools_shared_experts() }
    }
}

/// The costs of `arch` on a backend of kind `kind`.
fn costs_on(arch: &ModelArch, kind: BackendCosts) -> Result<ModelCosts> {
    let mut costs = ModelCosts::of(arch, kind.kv)?;
    if kind.pools_shared {
        costs.full_pool_extra_bytes = ModelCosts::shared_expert_bytes(arch)?;
    }
    Ok(costs)
}

impl ServeLoader {
    pub fn new(backend: BackendSpec, request: PlanRequest, elastic: bool, verbose: bool) -> ServeLoader {
        ServeLoader { backend, request, elastic, verbose, kind: Mutex::new(None) }
    }

    fn remember_kind(&self, backend: &dyn Backend) -> BackendCosts {
        let kind = BackendCosts::of(backend);
        *self.kind.lock().unwrap_or_else(|e| e.into_inner()) = Some(kind);
        kind
    }
}

impl ModelLoader for ServeLoader {
    fn footprint(&self, dir: &Path, reclaimable: u64) -> Result<u64> {
        let known = *self.kind.lock().unwrap_or_else(|e| e.into_inner());
        let kind = match known {
            Some(kind) => kind,
            None => self.remember_kind(self.backend.create()?.as_ref()),
        };
        let costs = costs_on(&ModelArch::read(dir)?, kind)?;
        let mut machine = MachineMemory::detect();
        machine.available += reclaimable;
        Ok(plan::plan(&costs, &machine, &self.request)?.peak_bytes)
    }

    fn load(&self, dir: &Path) -> Result<LoadedEngine> {
        let arch = ModelArch::read(dir)?;
        let (backend, no_gpu) = self.backend.create_quietly()?;
        self.remember_kind(backend.as_ref());
        let planned = PlannedModel::new(arch, &self.request, backend.as_ref())?;
        announce(&planned, &backend.name(), no_gpu.as_deref(), self.verbose);
        let engine = planned.load(backend)?;
        // Only an auto-sized pool follows free memory: an explicit size is a promise.
        // Re-plans keep the context this plan holds KV for (requests are bounded by it).
        let request = PlanRequest { context_tokens: planned.plan.context_tokens, grow_to: None, ..self.request.clone() };
        let elastic = (self.elastic && planned.plan.mode == PlanMode::Auto)
            .then(|| Elastic { costs: planned.costs.clone(), request });
        Ok(LoadedEngine { engine, plan: Some(planned.plan), elastic })
    }
}

/// A spinner with the elapsed time on a terminal's stderr, shown once
/// loading has taken a second (a quick load stays silent); it clears when
/// dropped.
struct LoadIndicator {
    done: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoadIndicator {
    fn start(message: String) -> LoadIndicator {
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            use std::sync::mpsc::RecvTimeoutError;
            if finished.recv_timeout(Duration::from_secs(1)) != Err(RecvTimeoutError::Timeout) {
                return;
            }
            // Hidden by indicatif when stderr is not a terminal.
            let spinner = indicatif::ProgressBar::new_spinner().with_message(message);
            if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
                spinner.set_style(style);
            }
            spinner.enable_steady_tick(Duration::from_millis(120));
            let _ = finished.recv();
            spinner.finish_and_clear();
        });
        LoadIndicator { done: Some(done), thread: Some(thread) }
    }
}

impl Drop for LoadIndicator {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resident_model_is_one_short_line_naming_the_backend() {
        let line = one_line(412_000_000, "cpu (2 threads)", true);
        assert_eq!(line, "every expert in memory (peak ~0.4 GB), on cpu (2 threads); no usable GPU (-v says why)");
        assert!(!line.contains('\n') && line.len() < 100);
        assert_eq!(one_line(5_000_000_000, "wgpu (NVIDIA H100)", false), "every expert in memory (peak ~5.0 GB), on wgpu (NVIDIA H100)");
    }
}
