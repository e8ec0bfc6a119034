//! How often a model's routed experts are found in a pool smaller than the
//! model: a power law of the pool's share of the experts, hit = share^e
//! (expert popularity is skewed, so a small pool holds more than its share),
//! whose exponent may change with the share.
//!
//! Every streaming generation keeps its decode hit rate and the pool's share
//! for its model in `hits.json` in slotstream's cache folder (the newest
//! [`MAX_RUNS_PER_MODEL`] runs of each model), and so does `doctor
//! --measure`'s decode of the model. The plan takes the exponent each share
//! the model ran at measured, interpolated between them (one exponent for
//! all shares missed the synthetic model's 88% at 48 of 64 per layer by 8
//! points: BENCHMARKS.md, "Plan estimates"), and assumes
//! [`ASSUMED_EXPONENT`] for a model that has not streamed here yet. A model
//! is known by its files (config, weight file names, sizes and modification
//! times), not by where it is. A run keeps its decode's timing too, for the
//! speed estimate of the machine it ran on ([`super::speeds`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::speeds::{RunTiming, TimedRun, TimedRuns};
use crate::experts::CacheCounters;
use crate::model::ModelArch;

/// The exponent assumed for a model that has not streamed here: fitted
/// loosely to the reference measurements and a synthetic model's
/// (BENCHMARKS.md, "Plan estimates").
pub const ASSUMED_EXPONENT: f64 = 0.6;
/// Runs kept per model (the newest).
pub const MAX_RUNS_PER_MODEL: usize = 16;
/// Models kept (those that streamed most recently).
const MAX_MODELS: usize = 64;
/// A run is kept once its decode looked up this many experts: a shorter one
/// says more about a cold pool than about the model's routing.
pub const MIN_EXPERT_USES: u64 = 64;
/// Fitted exponents stay within these bounds (share^0.05 is nearly all
/// hits, share^10 nearly none).
const EXPONENT_RANGE: (f64, f64) = (0.05, 10.0);

/// The share of expert uses found in a pool holding `share` of the experts:
/// share^e, with e measured at the shares the model ran at.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HitRateCurve {
    /// (share, exponent) at each share the model's runs had, by share;
    /// none: [`ASSUMED_EXPONENT`] everywhere.
    points: Vec<(f64, f64)>,
    /// Runs of this model the exponents come from; 0: assumed.
    pub runs: usize,
    /// The model's runs whose decode was timed, on whichever machine: the
    /// speed estimate takes the ones of the machine it plans for
    /// ([`super::speeds`]).
    pub timed: TimedRuns,
}

impl HitRateCurve {
    pub const ASSUMED: HitRateCurve = HitRateCurve { points: Vec::new(), runs: 0, timed: TimedRuns::NONE };

    /// The exponent at `share`: measured there, interpolated linearly in the
    /// share between the nearest measured shares, assumed without any. Below
    /// the smallest share it is the smallest share's; above the largest it
    /// goes on falling as it fell between the two largest (skewed popularity
    /// makes it fall: the experts a larger pool adds are the rarely used
    /// ones), never below [`EXPONENT_RANGE`] and never rising.
    pub fn exponent(&self, share: f64) -> f64 {
        let Some(&(first_share, first)) = self.points.first() else { return ASSUMED_EXPONENT };
        if share <= first_share {
            return first;
        }
        let line = |(s0, e0): (f64, f64), (s1, e1): (f64, f64)| e0 + (e1 - e0) * (share - s0) / (s1 - s0);
        for pair in self.points.windows(2) {
            if share <= pair[1].0 {
                return line(pair[0], pair[1]);
            }
        }
        match self.points[..] {
            [.., before, last] => line(before, last).clamp(EXPONENT_RANGE.0, last.1),
            _ => first,
        }
    }

    pub fn hit_rate(&self, share: f64) -> f64 {
        let share = share.clamp(0.0, 1.0);
        share.powf(self.exponent(share))
    }

    /// The exponent of each share the runs had, ln hit / ln share of their
    /// mean log hit rate, over the runs whose figures make sense (a pool
    /// smaller than the model, a hit rate within 0..=1); `None` if no run does.
    pub fn fit(runs: &[HitRun]) -> Option<HitRateCurve> {
        let mut points: Vec<(f64, f64)> = runs
            .iter()
            .filter(|r| r.share > 0.0 && r.share < 1.0 && (0.0..=1.0).contains(&r.hit_rate))
            // A run that found nothing still says "few": ln 0 would say "none ever".
            .map(|r| (r.share, r.hit_rate.max(1e-3).ln()))
            .collect();
        if points.is_empty() {
            return None;
        }
        let used = points.len();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        // Runs at one share (the same pool size) are one point: their mean log hit rate.
        let mut merged: Vec<(f64, f64, usize)> = Vec::new();
        for (share, log_hit) in points {
            match merged.last_mut() {
                Some((s, sum, n)) if (share - *s).abs() < 1e-9 => {
                    *sum += log_hit;
                    *n += 1;
                }
                _ => merged.push((share, log_hit, 1)),
            }
        }
        let points = merged
            .into_iter()
            .map(|(share, sum, n)| (share, (sum / n as f64 / share.ln()).clamp(EXPONENT_RANGE.0, EXPONENT_RANGE.1)))
            .collect();
        Some(HitRateCurve { points, runs: used, timed: TimedRuns::NONE })
    }

    /// The banner's `hits:` line after its label, for a pool holding `share`.
    pub fn describe(&self, share: f64) -> String {
        let percent = 100.0 * self.hit_rate(share);
        let exponent = self.exponent(share);
        match self.runs {
            0 => format!(
                "~{percent:.0}% of expert uses assumed found in the pool (the cached share to the power {exponent}; \
                 this model has not streamed here yet: its first streaming run or `doctor --measure` measures its own)"
            ),
            n => format!(
                "~{percent:.0}% of expert uses found in the pool, measured from {n} run{} of this model \
                 (the cached share to the power {exponent:.2})",
                if n == 1 { "" } else { "s" },
            ),
        }
    }
}

/// One streaming generation's decode.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HitRun {
    /// The pool's slots over the model's routed experts.
    pub share: f64,
    pub hit_rate: f64,
    /// Experts looked up (hits and misses).
    pub expert_uses: u64,
    pub unix_seconds: u64,
    /// Its decode's time per token and where it ran; none in files of
    /// earlier versions, and for a run too short to time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<RunTiming>,
}

/// The runs of one model.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ModelHits {
    /// Where the model was last run from, for a reader of the file.
    pub model: String,
    pub runs: Vec<HitRun>,
}

/// `hits.json`: runs by model key ([`model_key`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct HitCache {
    #[serde(default)]
    pub models: BTreeMap<String, ModelHits>,
}

const REMEDY: &str = "delete it (the next streaming run writes a new one)";

impl HitCache {
    pub fn path() -> Result<PathBuf> {
        Ok(crate::user_cache::dir()?.join("hits.json"))
    }

    /// The runs in `path`; none if the file does not exist.
    pub fn load(path: &Path) -> Result<HitCache> {
        crate::user_cache::read_json(path, "expert hit rates", REMEDY)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        crate::user_cache::write_json(path, self)
    }

    /// The curve fitted to the model's runs, or the assumed one; with the
    /// runs that were timed.
    pub fn curve(&self, key: &str) -> HitRateCurve {
        let Some(model) = self.models.get(key) else { return HitRateCurve::ASSUMED };
        let mut curve = HitRateCurve::fit(&model.runs).unwrap_or(HitRateCurve::ASSUMED);
        let timed = model
            .runs
            .iter()
            .filter_map(|r| r.timing.clone().map(|timing| TimedRun { share: r.share, unix_seconds: r.unix_seconds, timing }));
        curve.timed = TimedRuns { runs: timed.collect() };
        curve
    }

    /// Adds a run of the model `key` (found at `model`), keeping the newest
    /// runs of each model and the models that ran most recently.
    pub fn record(&mut self, key: &str, model: &str, run: HitRun) {
        let entry = self.models.entry(key.to_string()).or_default();
        entry.model = model.to_string();
        entry.runs.push(run);
        let excess = entry.runs.len().saturating_sub(MAX_RUNS_PER_MODEL);
        entry.runs.drain(..excess);
        while self.models.len() > MAX_MODELS {
            let newest = |m: &ModelHits| m.runs.iter().map(|r| r.unix_seconds).max().unwrap_or(0);
            let Some(stalest) = self.models.iter().min_by_key(|(_, m)| newest(m)).map(|(k, _)| k.clone()) else { return };
            self.models.remove(&stalest);
        }
    }
}

/// The model `arch` describes as a key: a digest of its config and of its
/// weight files' names, sizes and modification times (a model rewritten in
/// place is a new model; the same files elsewhere are not).
pub fn model_key(arch: &ModelArch) -> Result<String> {
    files_key(&arch.raw, &arch.dir)
}

fn files_key(config: &serde_json::Value, dir: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(config.to_string());
    let entries = std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    let mut weights: Vec<PathBuf> =
        entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "safetensors")).collect();
    weights.sort();
    for path in weights {
        let meta = std::fs::metadata(&path).with_context(|| format!("reading {}", path.display()))?;
        let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        hasher.update(path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        hasher.update(meta.len().to_le_bytes());
        hasher.update(modified.to_le_bytes());
    }
    Ok(crate::hex::lower(&hasher.finalize()[..8]))
}

/// The curve for the model `arch` describes, from what its runs kept.
pub fn curve_for(arch: &ModelArch) -> Result<HitRateCurve> {
    let key = model_key(arch)?;
    let path = HitCache::path()?;
    let cache = HitCache::load(&path).context("the hit rate is assumed")?;
    Ok(cache.curve(&key))
}

/// One read-modify-write of the file at a time within this process (`serve`
/// generates for several models at once).
static HITS_FILE: Mutex<()> = Mutex::new(());

/// Whether a decode from a pool of `slots` of `total_experts` says something
/// of the model's routing: the pool streamed, and the decode looked up at
/// least [`MIN_EXPERT_USES`] experts.
fn worth_keeping(slots: usize, total_experts: usize, decode: &CacheCounters) -> bool {
    slots < total_experts && decode.hits + decode.misses >= MIN_EXPERT_USES
}

/// How a generation's decode was timed: on the backend named `backend`,
/// `steps` steps (tokens after the first) in `seconds`.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeTiming {
    pub backend: String,
    pub steps: usize,
    pub seconds: f64,
}

/// Keeps the decode hit rate of a generation of the model `arch` describes
/// from a pool of `slots`, if [`worth_keeping`], and its decode's timing
/// where it has one long enough ([`RunTiming::of`]), filed under this
/// machine, the backend and the model's disk. A file that cannot be read is
/// replaced. Returns whether the run was kept.
pub fn keep_run(arch: &ModelArch, slots: usize, decode: &CacheCounters, timing: Option<&DecodeTiming>) -> Result<bool> {
    let total_experts = arch.moe_layers() * arch.text.num_experts;
    if !worth_keeping(slots, total_experts, decode) {
        return Ok(false);
    }
    let key = model_key(arch)?;
    let path = HitCache::path()?;
    let _only_writer = HITS_FILE.lock().unwrap_or_else(|e| e.into_inner());
    // The plan said so when it could not read the file; the runs in it are lost either way.
    let mut cache = HitCache::load(&path).unwrap_or_default();
    let run = HitRun {
        share: slots as f64 / total_experts as f64,
        hit_rate: decode.hit_rate(),
        expert_uses: decode.hits + decode.misses,
        unix_seconds: super::rates::now_unix(),
        timing: timing.and_then(|t| {
            let machine = super::rates::runs_key(&t.backend, &arch.dir)?;
            RunTiming::of(machine, t.steps, t.seconds, decode.wait_seconds)
        }),
    };
    let shown = std::fs::canonicalize(&arch.dir).unwrap_or_else(|_| arch.dir.clone());
    cache.record(&key, &shown.display().to_string(), run);
    cache.save(&path)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(share: f64, hit_rate: f64, unix_seconds: u64) -> HitRun {
        HitRun { share, hit_rate, expert_uses: 1000, unix_seconds, timing: None }
    }

    #[test]
    fn the_fit_recovers_a_power_law_and_passes_over_nonsense() {
        let exact: Vec<HitRun> = [0.25, 0.4, 0.75].iter().map(|&s: &f64| run(s, s.powf(0.9), 0)).collect();
        let curve = HitRateCurve::fit(&exact).expect("three runs fit");
        for share in [0.1, 0.25, 0.3, 0.6, 0.75, 0.9] {
            assert!((curve.exponent(share) - 0.9).abs() < 1e-9 && curve.runs == 3, "{curve:?} at {share}");
        }

        let nonsense = [run(1.0, 1.0, 0), run(0.0, 0.0, 0), run(f64::NAN, 0.5, 0), run(0.5, 1.5, 0), run(0.5, f64::INFINITY, 0)];
        assert_eq!(HitRateCurve::fit(&nonsense), None, "no run of a pool smaller than the model with a real hit rate");
        let none_found = HitRateCurve::fit(&[run(0.5, 0.0, 0)]).expect("a run that found nothing is a run");
        assert!(none_found.exponent(0.5) > 5.0 && none_found.exponent(0.5) <= EXPONENT_RANGE.1, "{none_found:?}");
        let all_found = HitRateCurve::fit(&[run(0.5, 1.0, 0)]).expect("fits");
        assert_eq!(all_found.exponent(0.5), EXPONENT_RANGE.0);
    }

    /// The synthetic model's decode hit rates (bench_plan.sh: pools of 16, 26
    /// and 48 of 64 per layer) need an exponent that falls with the share
    /// (0.84, 0.71, 0.45): each share gets its own back, and shares between
    /// them one in between.
    #[test]
    fn each_share_the_model_ran_at_keeps_its_own_hit_rate() {
        let bench = [run(0.25, 0.311, 0), run(0.406, 0.527, 1), run(0.75, 0.878, 2), run(0.406, 0.527, 3)];
        let curve = HitRateCurve::fit(&bench).expect("fits");
        assert_eq!(curve.runs, 4);
        for r in &bench {
            assert!((curve.hit_rate(r.share) - r.hit_rate).abs() < 1e-9, "{curve:?} at {}: {}", r.share, curve.hit_rate(r.share));
        }
        let (low, high) = (curve.exponent(0.406), curve.exponent(0.75));
        let between = curve.exponent(0.578);
        assert!((between - (low + high) / 2.0).abs() < 1e-3, "{low} {between} {high}");
        assert_eq!(curve.exponent(0.1), curve.exponent(0.25), "below the runs: the smallest share's");
        let slope = (high - low) / (0.75 - 0.406);
        assert!((curve.exponent(0.9) - (high + 0.15 * slope)).abs() < 1e-9, "above them it falls on: {curve:?}");
        // Without the run at 48 of 64, the two smaller pools foretell it within a point.
        let foretold = HitRateCurve::fit(&bench[..2]).expect("fits").hit_rate(0.75);
        assert!((foretold - 0.878).abs() < 0.01, "{foretold}");
        let rising = HitRateCurve::fit(&[run(0.25, 0.5, 0), run(0.5, 0.45, 1)]).expect("fits");
        assert_eq!(rising.exponent(0.9), rising.exponent(0.5), "an exponent that rose between the runs stays put above them");
        let steep = HitRateCurve::fit(&[run(0.1, 0.5, 0), run(0.2, 0.9, 1)]).expect("fits");
        assert_eq!(steep.exponent(0.9), EXPONENT_RANGE.0, "{steep:?}");
        // Two runs at one share are one point: their mean log hit rate.
        let twice = HitRateCurve::fit(&[run(0.5, 0.4, 0), run(0.5, 0.9, 1)]).expect("fits");
        assert!((twice.hit_rate(0.5) - (0.4f64 * 0.9).sqrt()).abs() < 1e-9, "{twice:?}");
    }

    #[test]
    fn the_banner_says_whether_the_hit_rate_is_assumed_or_measured() {
        let assumed = HitRateCurve::ASSUMED.describe(0.25);
        assert!(assumed.starts_with("~44% of expert uses assumed") && assumed.contains("power 0.6;"), "{assumed}");
        let runs: Vec<HitRun> = (0..3).map(|t| run(0.25, 0.25f64.powf(0.9), t)).collect();
        let measured = HitRateCurve::fit(&runs).expect("fits").describe(0.25);
        assert!(measured.starts_with("~29% of expert uses found") && measured.contains("measured from 3 runs of this model"), "{measured}");
        assert!(HitRateCurve::fit(&runs[..1]).expect("fits").describe(0.5).contains("from 1 run of"));
    }

    #[test]
    fn the_file_keeps_the_newest_runs_of_the_latest_models_and_round_trips() {
        let mut cache = HitCache::default();
        assert_eq!(cache.curve("m"), HitRateCurve::ASSUMED, "nothing recorded: assumed");
        for t in 0..(MAX_RUNS_PER_MODEL as u64 + 5) {
            cache.record("m", "/models/m", run(0.5, 0.5f64.powf(0.8), t));
        }
        let runs = &cache.models["m"].runs;
        assert_eq!((runs.len(), runs[0].unix_seconds), (MAX_RUNS_PER_MODEL, 5), "the oldest runs go first");
        let curve = cache.curve("m");
        assert!((curve.exponent(0.5) - 0.8).abs() < 1e-9 && curve.runs == MAX_RUNS_PER_MODEL, "{curve:?}");
        for m in 0..MAX_MODELS as u64 {
            cache.record(&format!("other {m}"), "elsewhere", run(0.5, 0.5, 1000 + m));
        }
        assert_eq!(cache.models.len(), MAX_MODELS);
        assert!(!cache.models.contains_key("m") && cache.models.contains_key("other 0"), "the model that ran longest ago goes");

        let dir = tempfile::tempdir().expect("a scratch folder");
        let path = dir.path().join("cache/hits.json");
        assert_eq!(HitCache::load(&path).expect("no file is no runs"), HitCache::default());
        cache.save(&path).expect("saving");
        assert_eq!(HitCache::load(&path).expect("loading"), cache);
        std::fs::write(&path, r#"{"models": {"m": {"model": 3}}}"#).expect("writing");
        let error = format!("{:#}", HitCache::load(&path).expect_err("not hit rates"));
        assert!(error.contains("not a file of expert hit rates") && error.contains("delete it"), "{error}");
    }

    /// A run keeps its decode's timing beside its hit rate, within the same
    /// bounds; a file of an earlier version (runs without timings) reads as
    /// runs with none, and a run too short to time keeps its hit rate alone.
    #[test]
    fn runs_keep_their_timing_and_files_without_one_still_read() {
        let dir = tempfile::tempdir().expect("a scratch folder");
        let path = dir.path().join("hits.json");
        let old = r#"{"models": {"m": {"model": "/models/m", "runs": [{"share": 0.25, "hit_rate": 0.3, "expert_uses": 900, "unix_seconds": 7}]}}}"#;
        std::fs::write(&path, old).expect("writing");
        let mut cache = HitCache::load(&path).expect("an earlier version's file reads");
        assert_eq!(cache.models["m"].runs[0].timing, None);
        assert!(cache.curve("m").timed.runs.is_empty() && cache.curve("m").runs == 1, "{:?}", cache.curve("m"));

        let timing =
            |seconds: f64, steps: usize| RunTiming::of("here | cpu (2 threads) | /dev/vda (254:0)".into(), steps, seconds, seconds / 4.0);
        assert_eq!(timing(1.0, super::super::speeds::MIN_TIMED_STEPS - 1), None, "too few steps to time");
        assert_eq!(timing(f64::NAN, 40), None, "not a time");
        let timed = timing(4.0, 40).expect("40 steps in 4 s");
        assert_eq!((timed.seconds_per_token, timed.waited_seconds_per_token, timed.steps), (0.1, 0.025, 40));
        for t in 0..(MAX_RUNS_PER_MODEL as u64 + 3) {
            cache.record("m", "/models/m", HitRun { timing: Some(timed.clone()), ..run(0.5, 0.6, 100 + t) });
        }
        assert_eq!(cache.models["m"].runs.len(), MAX_RUNS_PER_MODEL, "timed runs count against the same bound");
        cache.save(&path).expect("saving");
        let back = HitCache::load(&path).expect("loading");
        assert_eq!(back, cache);
        let curve = back.curve("m");
        assert_eq!(curve.timed.runs.len(), MAX_RUNS_PER_MODEL);
        assert!(curve.timed.runs.iter().all(|r| r.share == 0.5 && r.timing == timed), "{curve:?}");
        assert_eq!(curve.timed.points("here | cpu (2 threads) | /dev/vda (254:0)").len(), 1);
        assert!(curve.timed.points("elsewhere").is_empty(), "another machine's runs time nothing here");
        let untimed = serde_json::to_string(&run(0.5, 0.6, 1)).expect("JSON");
        assert!(!untimed.contains("timing"), "no timing, no field (the file stays as earlier versions wrote it): {untimed}");
    }

    #[test]
    fn a_model_is_known_by_its_files() {
        let dir = tempfile::tempdir().expect("a scratch folder");
        let write = |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).expect("writing");
        let config = serde_json::json!({"num_experts": 8});
        assert!(files_key(&config, &dir.path().join("absent")).is_err(), "no folder: no model");
        write("model.safetensors", b"1234");
        let key = files_key(&config, dir.path()).expect("a key");
        assert_eq!(files_key(&config, dir.path()).expect("a key"), key, "the same files, the same key");
        write("tokenizer.json", b"[]");
        assert_eq!(files_key(&config, dir.path()).expect("a key"), key, "only the config and the weights count");
        assert_ne!(files_key(&serde_json::json!({"num_experts": 16}), dir.path()).expect("a key"), key, "another config");
        write("model.safetensors", b"12345");
        assert_ne!(files_key(&config, dir.path()).expect("a key"), key, "other weights, another model");
    }

    #[test]
    fn only_runs_that_streamed_long_enough_are_kept() {
        let counters = |hits, misses| CacheCounters { hits, misses, ..Default::default() };
        assert!(!worth_keeping(64, 64, &counters(900, 100)), "a resident pool finds every expert by construction");
        assert!(!worth_keeping(16, 64, &counters(10, MIN_EXPERT_USES - 11)), "too short a run");
        assert!(worth_keeping(16, 64, &counters(10, MIN_EXPERT_USES - 10)));
    }
}
