//! The knee: the pool past which more cache stops making decode faster, and
//! auto's pool stops growing (the rest of the machine's memory is left to
//! its other work).
//!
//! A streamed token costs its compute plus its misses' reads
//! ([`ModelCosts::decode_time`]): the model misses layers x top-k x (1 - hit)
//! experts a token (480 x (1 - hit) for the flagship's 48 layers of top-10),
//! each a record read at the disk's rate (or what a miss was measured to
//! cost here), plus a read latency per layer that missed. The hit rate comes
//! from the model's hit-rate curve ([`super::hits`]: measured by its runs
//! here, assumed before any). Growing the pool shrinks only the reads; once
//! they are a small share of the compute, more memory buys almost nothing.
//! The knee is the smallest pool per layer whose reads cost at most
//! [`KNEE_READ_SHARE`] of the token's compute. So it moves with the machine:
//! a fast disk or slow compute (the CPU) reaches it with a small pool, a slow
//! disk or fast compute only with a large one; and with the routing: a model
//! whose routing is skewed (a few experts take most uses) reaches it sooner.
//!
//! A model that has not streamed here has no measured routing, only the
//! assumed curve ([`super::hits::ASSUMED_EXPONENT`]), which has little skew
//! and puts the knee near every expert: auto's pool would take all the
//! memory it may use, leaving the smallest prefill chunk (a streamed prompt
//! reads its missed experts once per chunk, so that would read several times
//! more). Until the model's first streaming run measures its routing, the
//! knee is the reference's share of the experts ([`super::KNEE_FRACTION`]).

use super::costs::ModelCosts;
use super::Rates;

/// Reads per token at the knee, as a share of the token's compute: what
/// this estimate gives at the reference's knee. The flagship's decode on an
/// M5 Pro (~12 tok/s: 83 ms a token; whole 2.76 MB records at 17.3 GB/s,
/// 0.16 ms each) stopped getting faster at 205 of 512 experts per layer
/// (33 GB). There its routing (FreeToken: 93.3% of expert uses in a pool of
/// 36.6%, share^0.069) finds 94%: 29 misses a token, 4.7 ms, and 47% of the
/// 48 layers miss one (0.1 ms each, 2.3 ms): 7 ms, 8% of the 83 ms. This
/// share brings back 215 per layer there (a test checks it).
pub const KNEE_READ_SHARE: f64 = 0.08;

/// Where the knee is for a model on a machine, and what the plan estimates there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Knee {
    /// From the model's measured routing (else the reference's share).
    pub measured: bool,
    /// Experts per layer at the knee (the model's all when no smaller pool
    /// gets its reads within [`KNEE_READ_SHARE`]).
    pub experts_per_layer: usize,
    /// The hit rate and the reads' share of the compute there.
    pub hit_rate: f64,
    pub read_share: f64,
}

impl Knee {
    /// The smallest pool of at least `floor` experts per layer whose
    /// estimated reads are within [`KNEE_READ_SHARE`] of its compute, for
    /// `model` at `rates`.
    pub fn of(model: &ModelCosts, rates: &Rates, floor: usize) -> Knee {
        let all = model.experts_per_layer.max(1);
        (floor.clamp(1, all)..all)
            .map(|per_layer| Knee::at(model, rates, per_layer))
            .find(|k| k.read_share <= KNEE_READ_SHARE)
            .unwrap_or_else(|| Knee::at(model, rates, all))
    }

    /// The knee auto plans with: [`Knee::of`] once the model's routing is
    /// measured here (its hit-rate curve comes from runs), else the
    /// reference's share (see the module's doc); never below `floor`.
    pub fn for_plan(model: &ModelCosts, rates: &Rates, floor: usize) -> Knee {
        if model.hit_curve.runs > 0 {
            return Knee::of(model, rates, floor);
        }
        let all = model.experts_per_layer.max(1);
        let per_layer = ((all as f64 * super::KNEE_FRACTION).ceil() as usize).max(floor).min(all);
        Knee { measured: false, ..Knee::at(model, rates, per_layer) }
    }

    /// A pool of `per_layer` experts per layer: its hit rate and reads' share.
    fn at(model: &ModelCosts, rates: &Rates, per_layer: usize) -> Knee {
        let hit_rate = model.hit_curve.hit_rate(per_layer as f64 / model.experts_per_layer.max(1) as f64);
        let t = model.decode_time(hit_rate, rates);
        // A token with no compute (rates that say nothing) has no knee short of all.
        let read_share = if t.compute > 0.0 { (t.latency + t.misses) / t.compute } else { f64::INFINITY };
        Knee { measured: true, experts_per_layer: per_layer, hit_rate, read_share }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::hits::{HitRateCurve, HitRun};
    use crate::plan::machine::APPLE_COMPUTE;
    use crate::plan::rates::{DiskRates, Measured, MissRates, RateSource};

    /// The flagship with FreeToken's routing: 93.3% of expert uses found in a
    /// pool of 36.6% of the experts (share^0.069 at every share).
    fn skewed_flagship() -> ModelCosts {
        let run = HitRun { share: 0.366, hit_rate: 0.933, expert_uses: 10_000, unix_seconds: 0, timing: None };
        ModelCosts { hit_curve: HitRateCurve::fit(&[run]).expect("fits"), ..ModelCosts::flagship() }
    }

    /// A machine whose token computes in `token_ms` and whose disk reads
    /// whole 2.76 MB records at `disk_gbps` (as measured: [`MissRates`]).
    fn machine(token_ms: f64, disk_gbps: f64, latency_ms: f64) -> Rates {
        let disk = DiskRates { read_gbps: disk_gbps, read_latency_ms: latency_ms };
        let miss_ms = 2_764_800.0 / (disk_gbps * 1e9) * 1e3;
        let miss = Some(Measured { rates: MissRates { miss_ms, token_ms }, unix_seconds: 0, how: String::new() });
        Rates { miss, ..Rates::unmeasured(APPLE_COMPUTE, disk, RateSource::Simulated) }
    }

    /// The knee is the smallest pool whose reads are within the share: the
    /// one below it is over.
    fn check_smallest(model: &ModelCosts, rates: &Rates, k: &Knee) {
        assert!(k.read_share <= KNEE_READ_SHARE, "{k:?}");
        let below = k.experts_per_layer - 1;
        let t = model.decode_time(model.hit_curve.hit_rate(below as f64 / 512.0), rates);
        assert!((t.latency + t.misses) / t.compute > KNEE_READ_SHARE, "{below} per layer is within the share too: {t:?}");
    }

    #[test]
    fn the_reference_knee_comes_back_and_moves_with_the_disk_compute_and_routing() {
        let model = skewed_flagship();
        // The reference: an M5 Pro, ~12 tok/s, 17.3 GB/s, stopped improving at 205 per layer.
        let reference = machine(83.0, 17.3, 0.1);
        let k = Knee::of(&model, &reference, 14);
        assert!((195..=225).contains(&k.experts_per_layer), "{k:?}");
        check_smallest(&model, &reference, &k);
        // The same GPU on a 1.56 GB/s disk (the dev VM's): reads cost 11x more, more cache keeps paying.
        let slow_disk = machine(83.0, 1.56, 0.4);
        let slow = Knee::of(&model, &slow_disk, 14);
        assert!(slow.experts_per_layer > 440, "{slow:?}");
        check_smallest(&model, &slow_disk, &slow);
        // That disk under the CPU's ~0.8 s token (48 layers on 2 cores): the reads matter less.
        let cpu = machine(800.0, 1.56, 0.4);
        let on_cpu = Knee::of(&model, &cpu, 14);
        assert!((150..=240).contains(&on_cpu.experts_per_layer), "{on_cpu:?}");
        check_smallest(&model, &cpu, &on_cpu);
        // Routing assumed, not measured (share^0.6, little skew): no pool short of nearly all,
        // so until a run measures it auto plans with the reference's share.
        let assumed = Knee::of(&ModelCosts::flagship(), &reference, 14);
        assert!(assumed.experts_per_layer > 450, "{assumed:?}");
        let planned = Knee::for_plan(&ModelCosts::flagship(), &reference, 14);
        assert_eq!((planned.experts_per_layer, planned.measured), (205, false), "{planned:?}");
        assert_eq!(Knee::for_plan(&model, &slow_disk, 14), slow);
    }

    #[test]
    fn without_compute_the_knee_is_every_expert_and_never_below_the_floor() {
        let model = skewed_flagship();
        let k = Knee::of(&model, &machine(0.0, 17.3, 0.1), 14);
        assert_eq!((k.experts_per_layer, k.read_share), (512, 0.0), "{k:?}");
        // Reads that cost nothing: the floor.
        let free = Knee::of(&model, &machine(83.0, 1e9, 0.0), 14);
        assert_eq!(free.experts_per_layer, 14, "{free:?}");
    }
}
