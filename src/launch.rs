//! Loading a model for `run`, `serve` and `perplexity`: the memory plan for
//! this machine first (so its banner can be shown before the slow part), then
//! the engine with the expert pool the plan sized.

use std::path::Path;

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
        Engine::load_arch(&self.arch, backend, &options)
    }
}
