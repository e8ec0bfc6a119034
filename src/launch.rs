//! Loading a model for `run`, `serve` and `perplexity`: the memory plan for
//! this machine first (so its banner can be shown before the slow part), then
//! the engine with the expert pool the plan sized.

use std::path::{Path, PathBuf};

use anyhow::Result;
use slotstream_backend::Backend;

use crate::generate::Engine;
use crate::model::{ExpertSlots, LoadOptions};
use crate::plan::{self, MachineMemory, ModelCosts, Plan, PlanRequest};

/// A model directory with the memory plan it will be loaded under.
pub struct PlannedModel {
    pub dir: PathBuf,
    pub costs: ModelCosts,
    pub machine: MachineMemory,
    pub plan: Plan,
}

impl PlannedModel {
    /// Plans `request` for the model in `dir` on this machine as it is now.
    pub fn new(dir: &Path, request: &PlanRequest) -> Result<PlannedModel> {
        let costs = ModelCosts::from_model_dir(dir)?;
        let machine = MachineMemory::detect();
        let plan = plan::plan(&costs, &machine, request)?;
        Ok(PlannedModel { dir: dir.to_path_buf(), costs, machine, plan })
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
        };
        Engine::load(&self.dir, backend, &options)
    }
}
