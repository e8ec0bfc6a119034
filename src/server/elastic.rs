//! The governor loop of an auto-sized server: re-plans the expert pool as the
//! machine's free memory changes and resizes it between requests (see
//! [`crate::plan::governor`] for the rules). Explicitly sized pools and
//! `--no-elastic` servers never run it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::plan::governor::Decision;
use crate::plan::{self, MachineMemory, ModelCosts, PlanRequest};
use crate::note;

use super::{lock, AppState, Resident};

/// What the governor re-plans with.
#[derive(Clone, Debug)]
pub struct Elastic {
    pub costs: ModelCosts,
    pub request: PlanRequest,
}

/// Runs until the server stops: every few seconds, each loaded model with
/// an auto-sized pool is re-planned and, between requests, resized.
pub fn spawn(app: Arc<AppState>) {
    tokio::spawn(async move {
        let start = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            for model in app.residency.loaded() {
                if model.elastic.is_some() {
                    govern(&app, model, start.elapsed().as_secs_f64()).await;
                }
            }
        }
    });
}

/// One governor tick for one model.
async fn govern(app: &Arc<AppState>, model: Arc<Resident>, now: f64) {
    let Some((elastic, governor)) = &model.elastic else { return };
    // Holding every generation turn makes the resize happen between requests.
    let turns = u32::try_from(app.options.parallel).unwrap_or(u32::MAX);
    let permit = app.turn.clone().try_acquire_many_owned(turns).ok();
    let (pool, shared) = {
        let stats = lock(&model.expert_stats);
        (stats.pool_bytes as u64, stats.shared_bytes as u64)
    };
    let mut machine = MachineMemory::detect();
    // Our own pool is memory we could give back.
    machine.available += pool;
    // The plan sizes routed slots; shared experts held beside them come and go with a full pool.
    let current = pool - shared.min(pool);
    let desired = match plan::plan(&elastic.costs, &machine, &elastic.request) {
        Ok(p) => p,
        Err(e) => {
            note!("governor: re-planning {} failed: {e}", model.name);
            return;
        }
    };
    let decision = lock(governor).tick(now, desired.pool_bytes, current, permit.is_some());
    if let Decision::Resize { from_bytes, to_bytes } = decision {
        let model2 = model.clone();
        let slots = desired.slots;
        let result = tokio::task::spawn_blocking(move || -> anyhow::Result<crate::experts::CacheStats> {
            let _permit = permit;
            model2.engine.resize_expert_pool(slots)
        })
        .await;
        match result {
            Ok(Ok(stats)) => {
                note!(
                    "governor: {} expert pool {:.2} GB -> {:.2} GB ({} slots, {:.1} GB reclaimable)",
                    model.name,
                    from_bytes as f64 / 1e9,
                    to_bytes as f64 / 1e9,
                    stats.slots,
                    machine.available as f64 / 1e9
                );
                *lock(&model.expert_stats) = stats;
                *lock(&model.plan) = Some(desired);
            }
            Ok(Err(e)) => note!("governor: resizing {} failed: {e:#}", model.name),
            Err(e) => note!("governor: resize task failed: {e}"),
        }
    }
}
