//! How fast a model's own streaming runs decoded on this machine, and the
//! decode-speed estimate they give a pool of any size.
//!
//! Each streaming generation (and `doctor --measure`'s decode of the model)
//! keeps, beside its hit rate in `hits.json`, its decode's time per token and
//! the part of it spent waiting on expert reads ([`RunTiming`]), filed under
//! the machine, backend and disk it ran on
//! ([`crate::plan::rates::runs_key`]): a `hits.json` from another host times
//! nothing here. The estimate for a streaming pool then follows the machine
//! as its runs found it, rather than a probe of a few seconds taken minutes
//! earlier (BENCHMARKS.md, "Plan estimates"):
//!
//! - at a share the model ran at: the median time per token of its newest
//!   [`NEWEST_RUNS_PER_SHARE`] runs there;
//! - between two such shares: linear in misses per token between them (a
//!   streaming token costs its compute plus what each miss costs, so its
//!   time is a line in its misses; the two shares' runs give the line);
//! - beyond them: the nearest share's time split as the probe's decode is
//!   split ([`ModelCosts::miss_rates_from_decode`]: the compute at the
//!   compute rates, the rest per miss), priced at this pool's misses;
//! - no timed run here: the rates, as before.
//!
//! The estimate itself is in [`super::estimate`].

use serde::{Deserialize, Serialize};


/// Runs per share the estimate takes the median of (the newest): one run
/// follows the machine fastest but carries a stall whole; three (median)
/// drop one stalled run and still follow the machine within a few runs.
pub const NEWEST_RUNS_PER_SHARE: usize = 3;
/// A run's decode is timed once it has this many steps: the first steps of a
/// decode after a prefill say little about its speed.
pub const MIN_TIMED_STEPS: usize = 8;
/// Shares closer than this are one pool size.
pub(super) const SAME_SHARE: f64 = 1e-9;

/// One streaming run's decode, as timed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RunTiming {
    /// Where it ran: [`crate::plan::rates::runs_key`].
    pub machine: String,
    pub seconds_per_token: f64,
    /// Of which the decode stood waiting on expert reads.
    pub waited_seconds_per_token: f64,
    /// Decode steps timed (tokens after the first).
    pub steps: usize,
}

impl RunTiming {
    /// A decode of `steps` steps in `seconds`, `waited_seconds` of them
    /// waiting on reads, on the machine `machine`; `None` if too short to
    /// say much ([`MIN_TIMED_STEPS`]) or its figures are not times.
    pub fn of(machine: String, steps: usize, seconds: f64, waited_seconds: f64) -> Option<RunTiming> {
        let per_step = |x: f64| x / steps.max(1) as f64;
        let timing = RunTiming { machine, seconds_per_token: per_step(seconds), waited_seconds_per_token: per_step(waited_seconds), steps };
        (steps >= MIN_TIMED_STEPS && timing.is_sane()).then_some(timing)
    }

    /// Positive finite time per token, waiting finite and not negative (a
    /// hand-edited file may hold anything).
    fn is_sane(&self) -> bool {
        let t = self.seconds_per_token;
        t.is_finite() && t > 0.0 && self.waited_seconds_per_token.is_finite() && self.waited_seconds_per_token >= 0.0
    }
}

/// A timed run of a model: its pool's share, when, and its timing.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TimedRun {
    pub share: f64,
    pub unix_seconds: u64,
    pub timing: RunTiming,
}

/// A model's timed runs, on every machine that ran it.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct TimedRuns {
    pub runs: Vec<TimedRun>,
}

/// What the runs at one share give: the median of their newest.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SpeedPoint {
    pub share: f64,
    pub seconds_per_token: f64,
    pub waited_seconds_per_token: f64,
    /// Runs of this machine at this share (the median is of the newest
    /// [`NEWEST_RUNS_PER_SHARE`]).
    pub runs: usize,
}

impl TimedRuns {
    pub const NONE: TimedRuns = TimedRuns { runs: Vec::new() };

    /// One point per share the model ran at on `machine`, by share.
    pub fn points(&self, machine: &str) -> Vec<SpeedPoint> {
        let mut mine: Vec<&TimedRun> =
            self.runs.iter().filter(|r| r.timing.machine == machine && r.share > 0.0 && r.share < 1.0 && r.timing.is_sane()).collect();
        mine.sort_by(|a, b| a.share.total_cmp(&b.share).then(b.unix_seconds.cmp(&a.unix_seconds)));
        let mut points = Vec::new();
        for run in mine.chunk_by(|a, b| (a.share - b.share).abs() < SAME_SHARE) {
            let mut newest: Vec<&RunTiming> = run.iter().take(NEWEST_RUNS_PER_SHARE).map(|r| &r.timing).collect();
            newest.sort_by(|a, b| a.seconds_per_token.total_cmp(&b.seconds_per_token));
            // The middle run, or the mean of the middle two.
            let middle = &newest[(newest.len() - 1) / 2..=newest.len() / 2];
            let mean = |f: fn(&RunTiming) -> f64| middle.iter().map(|t| f(t)).sum::<f64>() / middle.len() as f64;
            points.push(SpeedPoint {
                share: run[0].share,
                seconds_per_token: mean(|t| t.seconds_per_token),
                waited_seconds_per_token: mean(|t| t.waited_seconds_per_token),
                runs: run.len(),
            });
        }
        points
    }
}
