//! The decode-speed estimate of a pool: from the model's timed runs on
//! this machine where it streams and has them ([`super::speeds`]), else
//! from the rates.

use serde::Serialize;

use super::costs::{DecodeSample, ModelCosts};
use super::rates::Measured;
use super::speeds::{SpeedPoint, NEWEST_RUNS_PER_SHARE, SAME_SHARE};
use super::Rates;

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
