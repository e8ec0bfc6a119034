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

use serde::{Deserialize, Serialize};

use super::costs::{DecodeSample, ModelCosts};
use super::rates::Measured;
use super::Rates;

/// Runs per share the estimate takes the median of (the newest): one run
/// follows the machine fastest but carries a stall whole; three (median)
/// drop one stalled run and still follow the machine within a few runs.
pub const NEWEST_RUNS_PER_SHARE: usize = 3;
/// A run's decode is timed once it has this many steps: the first steps of a
/// decode after a prefill say little about its speed.
pub const MIN_TIMED_STEPS: usize = 8;
/// Shares closer than this are one pool size.
const SAME_SHARE: f64 = 1e-9;

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

/// Where a streaming pool's estimate came from, when from the model's runs.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "kebab-case", tag = "how")]
pub enum FromRuns {
    /// Runs at this pool's share: their time per token.
    AtShare { point: SpeedPoint },
    /// Between two shares the model ran at, linear in misses per token.
    Between { low: SpeedPoint, high: SpeedPoint },
    /// Beyond the shares it ran at: the nearest one's time split into its
    /// compute and `miss_ms` a miss, at this pool's misses.
    Nearest { point: SpeedPoint, miss_ms: f64 },
}

/// A decode-speed estimate and where it came from.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DecodeEstimate {
    pub seconds_per_token: f64,
    /// The model's timed runs on this machine it came from; none: the rates.
    pub from_runs: Option<FromRuns>,
}

impl DecodeEstimate {
    pub fn tokens_per_second(&self) -> f64 {
        1.0 / self.seconds_per_token
    }
}

impl FromRuns {
    /// The banner's `speed:` line after its label, for a pool smaller than
    /// `model` estimated `from_runs` (none: from the rates).
    pub fn describe(from_runs: Option<&FromRuns>, model: &ModelCosts) -> String {
        let per_layer = |p: &SpeedPoint| format!("{:.0}", p.share * model.experts_per_layer as f64);
        let runs = |n: usize| format!("{n} run{}", if n == 1 { "" } else { "s" });
        let newest = |p: &SpeedPoint| {
            let n = p.runs.min(NEWEST_RUNS_PER_SHARE);
            if n == 1 {
                format!("{:.1} ms a token", p.seconds_per_token * 1e3)
            } else {
                format!("the newest {n}'s median {:.1} ms a token", p.seconds_per_token * 1e3)
            }
        };
        match from_runs {
            None => "from the rates and hit rate above (this model's streaming runs were not timed on this machine and backend)".into(),
            Some(FromRuns::AtShare { point }) => {
                format!("measured from {} of this model here at this pool's size ({})", runs(point.runs), newest(point))
            }
            Some(FromRuns::Between { low, high }) => format!(
                "measured from {} of this model here, between {} at {} and {} at {} of {} experts per layer (by misses per token)",
                runs(low.runs + high.runs),
                runs(low.runs),
                per_layer(low),
                runs(high.runs),
                per_layer(high),
                model.experts_per_layer
            ),
            Some(FromRuns::Nearest { point, miss_ms }) => format!(
                "measured from {} of this model here at {} of {} experts per layer ({}), at this pool's misses \
                 ({miss_ms:.3} ms a miss)",
                runs(point.runs),
                per_layer(point),
                model.experts_per_layer,
                newest(point)
            ),
        }
    }
}

impl ModelCosts {
    /// The decode estimate for a pool of `slots`: from the model's timed
    /// runs on this machine where it streams and has them (see the module's
    /// doc), else from the rates ([`ModelCosts::decode_time`]).
    pub fn estimate_decode(&self, slots: usize, rates: &Rates) -> DecodeEstimate {
        let share = self.pool_share(slots);
        if slots < self.total_experts() {
            if let Some(machine) = &rates.runs_key {
                let points = self.hit_curve.timed.points(machine);
                if let Some(estimate) = self.estimate_from_runs(share, &points, rates) {
                    return estimate;
                }
            }
        }
        DecodeEstimate { seconds_per_token: self.decode_time(self.hit_rate(slots), rates).total(), from_runs: None }
    }

    /// The estimate at `share` from `points` (by share); `None` without any,
    /// or when the nearest one's time cannot be split (it missed nothing).
    fn estimate_from_runs(&self, share: f64, points: &[SpeedPoint], rates: &Rates) -> Option<DecodeEstimate> {
        let hit_rate = |s: f64| self.hit_curve.hit_rate(s);
        let misses = |s: f64| self.misses_per_token(hit_rate(s));
        if let Some(point) = points.iter().find(|p| (p.share - share).abs() < SAME_SHARE) {
            let seconds_per_token = point.seconds_per_token;
            return Some(DecodeEstimate { seconds_per_token, from_runs: Some(FromRuns::AtShare { point: point.clone() }) });
        }
        if let Some([low, high]) = points.windows(2).find(|w| w[0].share < share && share < w[1].share) {
            let (at_low, at_high, here) = (misses(low.share), misses(high.share), misses(share));
            // A hit curve flat between them: by share instead.
            let along = if (at_low - at_high).abs() > 1e-9 {
                (here - at_low) / (at_high - at_low)
            } else {
                (share - low.share) / (high.share - low.share)
            };
            let seconds_per_token = low.seconds_per_token + (high.seconds_per_token - low.seconds_per_token) * along.clamp(0.0, 1.0);
            let from_runs = Some(FromRuns::Between { low: low.clone(), high: high.clone() });
            return Some(DecodeEstimate { seconds_per_token, from_runs });
        }
        let nearest = if share < points.first()?.share { points.first()? } else { points.last()? };
        let sample = DecodeSample {
            seconds_per_token: nearest.seconds_per_token,
            hit_rate: hit_rate(nearest.share),
            waited_seconds_per_token: nearest.waited_seconds_per_token,
        };
        let split = self.miss_rates_from_decode(&sample, rates)?;
        let priced = Rates { miss: Some(Measured { rates: split, unix_seconds: 0, how: String::new() }), ..rates.clone() };
        let seconds_per_token = self.decode_time(hit_rate(share), &priced).total();
        Some(DecodeEstimate { seconds_per_token, from_runs: Some(FromRuns::Nearest { point: nearest.clone(), miss_ms: split.miss_ms }) })
    }
}
