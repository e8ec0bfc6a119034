//! Loading a model for `run`, `serve` and `perplexity`: the memory plan for
//! this machine first (so its banner can be shown before the slow part), then
//! the engine with the expert pool the plan sized.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use slotstream_backend::Backend;

use crate::generate::Engine;
use crate::model::{ExpertSlots, LoadOptions, ModelArch};
use crate::plan::{self, MachineMemory, ModelCosts, Plan, PlanRequest};

/// A model directory with the memory plan it will be loaded under.
pub struct PlannedModel {
    pub arch: ModelArch,
    pub costs: ModelCosts,
    pub machine: MachineMemory,
    pub plan: Plan,
}

impl PlannedModel {
    /// Plans `request` for the model in `dir` on this machine as it is now,
    /// for `backend` (whose KV cache dtype sizes the context).
    pub fn new(dir: &Path, request: &PlanRequest, backend: &dyn Backend) -> Result<PlannedModel> {
        let arch = ModelArch::read(dir)?;
        let costs = ModelCosts::of(&arch, backend.kv_cache_dtype())?;
        let machine = MachineMemory::detect();
        let plan = plan::plan(&costs, &machine, request)?;
        Ok(PlannedModel { arch, costs, machine, plan })
    }

    pub fn dir(&self) -> &Path {
        &self.arch.dir
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
        .with_env_overrides();
        let bytes = self.costs.resident_bytes + self.plan.pool_bytes;
        let _shown = LoadIndicator::start(format!("loading {:.2} GB of weights", bytes as f64 / 1e9));
        Engine::load_arch(&self.arch, backend, &options)
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
