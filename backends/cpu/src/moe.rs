//! Routed experts' outputs from a pool's slots (`Backend::moe_expert_outputs`).

use rayon::prelude::*;
use slotstream_backend::{checks, ExpertPool, Result, Routes, Tensor};

use crate::{data, matmul, not_ours, silu, CpuBackend, CpuExpertPool, NO_SLOT};

/// Writes the unweighted output of each (token, rank) whose expert `pool`'s
/// table has into its row of `out` (`[tokens, top_k, hidden]`); the other
/// rows are left as they are. Each expert runs once over all its tokens, so
/// a row's value does not depend on which pool its expert sat in.
pub(crate) fn expert_outputs(cpu: &CpuBackend, x: &Tensor, pool: &ExpertPool, routes: &Routes, key_base: usize, out: &mut [f32]) -> Result<()> {
    let p = pool.get::<CpuExpertPool>().ok_or_else(|| not_ours("the expert pool"))?;
    let (tokens, top_k) = checks::moe_routes(x, p.gate.cols, routes, key_base, pool.keys)?;
    let hidden = x.cols();
    if out.len() != tokens * top_k * hidden {
        return Err(slotstream_backend::shape_error("moe_expert_outputs", format!("{} outputs for {tokens} x {top_k} x {hidden}", out.len())));
    }
    let xd = data(x)?;
    let rd = data(&routes.tensor)?;
    // (token, rank) of each slot's users, so each expert's weights are read once per call.
    let mut by_slot: std::collections::BTreeMap<u32, Vec<(usize, usize)>> = Default::default();
    for t in 0..tokens {
        for r in 0..top_k {
            let id = rd[t * 2 * top_k + r].to_bits() as usize;
            let slot = if id < routes.gating.experts { p.table[key_base + id] } else { NO_SLOT };
            if slot != NO_SLOT {
                by_slot.entry(slot).or_default().push((t, r));
            }
        }
    }
    let groups: Vec<(u32, Vec<(usize, usize)>)> = by_slot.into_iter().collect();
    let run = |(slot, users): &(u32, Vec<(usize, usize)>), parallel: bool| {
        let s = *slot as usize;
        let xs: Vec<f32> = users.iter().flat_map(|&(t, _)| xd[t * hidden..(t + 1) * hidden].iter().copied()).collect();
        let n = users.len();
        let g = matmul::matmul(&xs, n, &p.gate, s, &cpu.plan, parallel);
        let u = matmul::matmul(&xs, n, &p.up, s, &cpu.plan, parallel);
        let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        matmul::matmul(&act, n, &p.down, s, &cpu.plan, parallel)
    };
    // At decode each expert's matrices are small (a few hundred KB): one
    // parallel region over the experts, each computed by one thread, costs
    // far less than three thread-pool round trips per expert.
    let results: Vec<Vec<f32>> = if groups.len() > 1 && rayon::current_num_threads() > 1 {
        groups.par_iter().map(|g| run(g, false)).collect()
    } else {
        groups.iter().map(|g| run(g, true)).collect()
    };
    for ((_, users), y) in groups.iter().zip(&results) {
        for (i, &(t, r)) in users.iter().enumerate() {
            let row = t * top_k + r;
            out[row * hidden..(row + 1) * hidden].copy_from_slice(&y[i * hidden..(i + 1) * hidden]);
        }
    }
    Ok(())
}
