//! Typed calls of `wgsl/moe.wgsl`: the expert FFN `down(silu(gate x) * up x)`
//! of every (token, rank, slot) assignment, straight from the slot pool.

use slotstream_backend::{ExpertAssignment, Result};

use crate::gpu::{whole, Bind, Gpu, MAX_GROUPS};
use crate::kernels::params;
use crate::weights::{GpuPool, PoolMatrix, WeightDesc};

params! {
    /// `Params` of `wgsl/moe.wgsl`.
    pub struct MoeParams {
        w: WeightDesc,
        /// Rows of one expert matrix.
        rows: u32,
        /// This dispatch's first assignment in the list.
        asg_off: u32,
        /// The shard's first slot.
        slot_base: u32,
        x_cols: u32,
        out_cols: u32,
        top_k: u32,
        _pad0: u32,
        _pad1: u32,
    }
}

// Bindings.
const W: u32 = 1;
const W_WORDS: u32 = 6;
const X: u32 = 2;
const OUT: u32 = 3;
const ASSIGNMENTS: u32 = 4;
const AUX: u32 = 5;

/// Unweighted expert outputs into `out: [tokens, top_k, hidden]` (zeroed
/// here: rows without an assignment stay zero).
pub(crate) fn expert_outputs(
    gpu: &Gpu,
    pool: &GpuPool,
    x: Bind<'_>,
    assignments: &[ExpertAssignment],
    top_k: usize,
    out: &wgpu::Buffer,
) -> Result<()> {
    gpu.clear(out)?;
    if assignments.is_empty() {
        return Ok(());
    }
    let (hidden, inter) = (pool.gate.layout_cols(), pool.gate.rows);
    // Assignments grouped by pool shard, each group one run of the list.
    let mut sorted = assignments.to_vec();
    sorted.sort_by_key(|a| a.slot as usize / pool.per_shard);
    let words: Vec<u32> = sorted.iter().flat_map(|a| [a.token, a.rank, a.slot, 0]).collect();
    let asg = gpu.small_input("expert assignments", bytemuck::cast_slice(&words))?;
    let n = sorted.len();
    let gate_out = gpu.alloc(4 * (n * inter) as u64)?;
    let act = gpu.alloc(4 * (n * inter) as u64)?;
    let mut start = 0;
    while start < n {
        let shard = sorted[start].slot as usize / pool.per_shard;
        let mut end = start;
        while end < n && sorted[end].slot as usize / pool.per_shard == shard && end - start < MAX_GROUPS as usize {
            end += 1;
        }
        let run = Run { gpu, shard, shard_rows: pool.shard_slots(shard), slot_base: shard * pool.per_shard, start, count: end - start, top_k };
        run.dispatch("moe_gate", &pool.gate, hidden, inter, &[(X, x), (OUT, gate_out.bind()), (ASSIGNMENTS, whole(&asg))])?;
        let up_binds = [(X, x), (OUT, act.bind()), (ASSIGNMENTS, whole(&asg)), (AUX, gate_out.bind())];
        run.dispatch("moe_up", &pool.up, hidden, inter, &up_binds)?;
        run.dispatch("moe_down", &pool.down, inter, hidden, &[(X, act.bind()), (OUT, whole(out)), (ASSIGNMENTS, whole(&asg))])?;
        start = end;
    }
    Ok(())
}

/// One run of assignments that share a pool shard.
struct Run<'a> {
    gpu: &'a Gpu,
    shard: usize,
    /// Slots in the shard.
    shard_rows: usize,
    slot_base: usize,
    start: usize,
    count: usize,
    top_k: usize,
}

impl Run<'_> {
    /// One of the three projections of every assignment of the run.
    fn dispatch(&self, entry: &str, m: &PoolMatrix, x_cols: usize, out_cols: usize, binds: &[(u32, Bind<'_>)]) -> Result<()> {
        let params = MoeParams {
            w: m.layout.desc(self.shard_rows * m.rows),
            rows: m.rows as u32,
            asg_off: self.start as u32,
            slot_base: self.slot_base as u32,
            x_cols: x_cols as u32,
            out_cols: out_cols as u32,
            top_k: self.top_k as u32,
            ..Default::default()
        };
        let mut all = vec![(W, whole(&m.buffers[self.shard])), (W_WORDS, whole(&m.buffers[self.shard]))];
        all.extend_from_slice(binds);
        let groups = [self.gpu.subgroup_grid(m.rows.div_ceil(4), 128), self.count as u32, 1];
        self.gpu.dispatch(entry, &params, &all, groups)
    }
}
