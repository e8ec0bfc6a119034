//! Turning logits into the next token: penalties, greedy or temperature
//! sampling with top-k, top-p and min-p, from a seeded generator.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampler settings. `temperature == 0` means greedy (argmax).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probabilities sum to `top_p` (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    pub seed: Option<u64>,
    /// Divides positive (multiplies negative) logits of recently seen tokens (1 = off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every recently seen token (0 = off).
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of recently seen tokens (0 = off).
    pub frequency_penalty: f32,
    /// How many of the latest tokens the penalties look at.
    pub penalty_window: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_window: 64,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!("repetition penalty must be > 0, got {}", self.repetition_penalty));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return Err("presence and frequency penalties must be finite numbers".into());
        }
        Ok(())
    }
}

/// A sampler with its own random stream.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::seed_from_u64(clock_seed()),
        };
        Sampler { params, rng }
    }

    /// Picks the next token given the logits and the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.is_plain_greedy() {
            // Greedy without penalties: no copy of the vocabulary's logits.
            return argmax(logits);
        }
        let mut logits = logits.to_vec();
        self.apply_penalties(&mut logits, history);
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(&logits);
        }
        if p.top_k == 0 || p.top_k >= logits.len() {
            return pick_whole(p, &mut self.rng, &logits);
        }
        let cand = candidates(&logits, p.top_k);
        pick(p, &mut self.rng, &cand)
    }

    /// Whether [`Sampler::sample`] is the plain [`argmax`] of the logits
    /// (greedy, no penalties), which a device can take itself.
    pub fn is_plain_greedy(&self) -> bool {
        self.params.temperature == 0.0 && !self.penalized()
    }

    fn penalized(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        if !self.penalized() {
            return;
        }
        let p = &self.params;
        let window = &history[history.len().saturating_sub(p.penalty_window)..];
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for &t in window {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &n) in &counts {
            let Some(l) = logits.get_mut(t as usize) else { continue };
            if p.repetition_penalty != 1.0 {
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
            *l -= p.presence_penalty + p.frequency_penalty * n as f32;
        }
    }
}

/// A candidate's sort key: ascending keys order logits from the largest
/// down (as `f32::total_cmp` orders them, reversed), ties to the lower id.
/// Whole-integer keys sort several times faster than a comparator over
/// `(id, logit)` pairs (a vocabulary of 152k every sampled token).
fn rank_key(id: u32, logit: f32) -> u64 {
    let bits = logit.to_bits();
    // total_cmp's order as unsigned integers: negatives flipped whole,
    // positives above them.
    let ascending = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
    (u64::from(!ascending) << 32) | u64::from(id)
}

/// The candidates sorted by logit, most likely first (ties to the lower
/// id), the `top_k` best of them when `top_k > 0`: those are picked out
/// first, then sorted.
fn candidates(logits: &[f32], top_k: usize) -> Vec<(u32, f32)> {
    let mut keys: Vec<u64> = logits.iter().enumerate().map(|(i, &l)| rank_key(i as u32, l)).collect();
    if top_k > 0 && top_k < keys.len() {
        keys.select_nth_unstable(top_k - 1);
        keys.truncate(top_k);
    }
    keys.sort_unstable();
    keys.iter().map(|&k| (k as u32, logits[k as u32 as usize])).collect()
}

/// Samples from sorted candidates: softmax at the temperature, then top-p
/// and min-p, then one draw of `rng`.
fn pick(p: &SamplingParams, rng: &mut ChaCha8Rng, cand: &[(u32, f32)]) -> u32 {
    let Some(&(_, max)) = cand.first() else { return 0 };
    let weights: Vec<f32> = cand.iter().map(|&(_, l)| weight(p, l, max)).collect();
    let total: f32 = weights.iter().sum();
    let probs: Vec<f32> = weights.iter().map(|w| w / total).collect();
    let kept_all: f32 = probs.iter().sum();
    let u = rng.random::<f32>();
    // Every candidate is there: the prefix decides.
    pick_prefix(p, u, cand, &probs, kept_all, true).unwrap_or(cand[cand.len() - 1].0)
}

/// A candidate's unnormalised probability: softmax numerator at the
/// temperature, against the largest logit `max`.
fn weight(p: &SamplingParams, logit: f32, max: f32) -> f32 {
    ((logit - max) / p.temperature).exp()
}

/// `pick` over the whole vocabulary (no top-k) without sorting all of it:
/// the best 64 candidates are picked out and sorted, then 8 times as many,
/// until top-p, min-p and the draw are decided within the sorted prefix
/// (a temperature-only draw over 152k logits rarely looks past the first
/// hundreds). The normaliser and the mass kept when nothing is cut are
/// summed in index order: the one difference from `pick` over every
/// candidate sorted, in the last bits of those two sums.
fn pick_whole(p: &SamplingParams, rng: &mut ChaCha8Rng, logits: &[f32]) -> u32 {
    let keys: Vec<u64> = logits.iter().enumerate().map(|(i, &l)| rank_key(i as u32, l)).collect();
    let Some(&best) = keys.iter().min() else { return 0 };
    let max = logits[best as u32 as usize];
    let weights: Vec<f32> = logits.iter().map(|&l| weight(p, l, max)).collect();
    let total: f32 = weights.iter().sum();
    let kept_all: f32 = weights.iter().map(|w| w / total).sum();
    let u = rng.random::<f32>();
    let mut m = 64.min(keys.len());
    loop {
        let mut prefix = keys.clone();
        if m < prefix.len() {
            prefix.select_nth_unstable(m - 1);
            prefix.truncate(m);
        }
        prefix.sort_unstable();
        let cand: Vec<(u32, f32)> = prefix.iter().map(|&k| (k as u32, logits[k as u32 as usize])).collect();
        let probs: Vec<f32> = cand.iter().map(|&(id, _)| weights[id as usize] / total).collect();
        let complete = m == keys.len();
        if let Some(t) = pick_prefix(p, u, &cand, &probs, kept_all, complete) {
            return t;
        }
        if complete {
            return cand[cand.len() - 1].0;
        }
        m = (m * 8).min(keys.len());
    }
}

/// The draw `u` over the sorted candidates `cand` with their normalised
/// probabilities `probs`, all of them (`complete`) or the best of a longer
/// list: top-p and min-p cut in rank order, then the draw walks the kept ones
/// (`kept_all` is their mass when nothing is cut). `None` when the prefix
/// ends before the cut or the draw is decided.
fn pick_prefix(p: &SamplingParams, u: f32, cand: &[(u32, f32)], probs: &[f32], kept_all: f32, complete: bool) -> Option<u32> {
    let first = *probs.first()?;
    let mut top_p = None;
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, pr) in probs.iter().enumerate() {
            acc += pr;
            if acc >= p.top_p {
                top_p = Some(i + 1);
                break;
            }
        }
    }
    let mut min_p = None;
    if p.min_p > 0.0 {
        let floor = first * p.min_p;
        let above = probs.iter().take_while(|&&x| x >= floor).count();
        // All of the prefix above the floor: the cut may lie past it.
        if above < probs.len() || complete {
            min_p = Some(above.max(1));
        }
    }
    let keep = match (top_p, min_p) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let (kept, mass) = match keep {
        Some(k) => (k, probs[..k].iter().sum()),
        // A cut that lies past the prefix: its kept mass is not known yet.
        None if (p.top_p < 1.0 || p.min_p > 0.0) && !complete => return None,
        None => (probs.len(), kept_all),
    };
    let mut r = u * mass;
    for (i, pr) in probs[..kept].iter().enumerate() {
        r -= pr;
        if r <= 0.0 {
            return Some(cand[i].0);
        }
    }
    // Past the last kept candidate without using up the draw (rounding).
    (keep.is_some() || complete).then(|| cand[kept - 1].0)
}

/// Index of the largest logit (the lowest index among equals; NaN never
/// wins, and a NaN first logit is kept as the answer, as a scan comparing
/// each logit with the best so far would).
pub fn argmax(logits: &[f32]) -> u32 {
    let Some(&first) = logits.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    // The largest value first, in eight independent lanes the compiler can
    // keep in vector registers (a whole vocabulary every decoded token: a
    // scan that reloads the best so far took ~0.15 ms for 152k logits),
    // then the first index holding it.
    const LANES: usize = 8;
    let mut lanes = [first; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut best = first;
    for &v in lanes.iter().chain(chunks.remainder()) {
        if v > best {
            best = v;
        }
    }
    logits.iter().position(|&v| v == best).unwrap_or(0) as u32
}

/// A seed from the clock and process id, for unseeded sampling.
fn clock_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ ((std::process::id() as u64) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The candidates as the sampler first ordered them (a comparator sort
    /// of every logit, then top-k): what [`candidates`] must still give.
    fn reference_candidates(logits: &[f32], top_k: usize) -> Vec<(u32, f32)> {
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if top_k > 0 {
            cand.truncate(top_k);
        }
        cand
    }

    /// The first sampler's draw over sorted candidates, with the normaliser
    /// and the uncut mass summed over `index_order` (the whole vocabulary
    /// in index order) where given, as the whole-vocabulary path sums them.
    fn reference_pick(p: &SamplingParams, rng: &mut ChaCha8Rng, cand: &[(u32, f32)], index_order: Option<&[f32]>) -> u32 {
        let max = cand[0].1;
        let w = |l: f32| ((l - max) / p.temperature).exp();
        let mut probs: Vec<f32> = cand.iter().map(|(_, l)| w(*l)).collect();
        let total: f32 = match index_order {
            Some(all) => all.iter().map(|&l| w(l)).sum(),
            None => probs.iter().sum(),
        };
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        // Whether top-p or min-p decided `keep` (else every candidate is kept).
        let mut cut = false;
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p {
                    keep = i + 1;
                    cut = true;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
            cut = true;
        }
        let kept: f32 = match index_order {
            Some(all) if !cut => all.iter().map(|&l| w(l) / total).sum(),
            _ => probs[..keep].iter().sum(),
        };
        let mut r = rng.random::<f32>() * kept;
        for (i, pr) in probs[..keep].iter().enumerate() {
            r -= pr;
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }

    #[test]
    fn candidates_come_in_the_first_samplers_order() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let mut x = 7u64;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as u32
        };
        let mut cases: Vec<Vec<f32>> = vec![
            vec![0.0, -0.0, 0.0, -0.0],
            vec![1.0, inf, 2.0, -inf],
            vec![-inf, 1.0, nan, 2.0, -nan],
            vec![3.0; 9],
        ];
        for n in [2, 17, 300, 5000] {
            // Coarse values: many ties across the top-k boundary.
            cases.push((0..n).map(|_| (next() % 13) as f32 * 0.5 - 3.0).collect());
            cases.push((0..n).map(|_| (next() as f32 / u32::MAX as f32) * 20.0 - 10.0).collect());
        }
        for logits in &cases {
            for (temperature, top_k, top_p, min_p) in [(0.8, 40, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.05), (1.3, 1, 0.5, 0.0), (0.5, 100_000, 0.95, 0.1)] {
                let p = SamplingParams { temperature, top_k, top_p, min_p, seed: Some(next() as u64), ..Default::default() };
                let want = reference_candidates(logits, top_k);
                let got = candidates(logits, top_k);
                let bits = |c: &[(u32, f32)]| c.iter().map(|&(i, l)| (i, l.to_bits())).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "top-k {top_k} of {} logits", logits.len());
                let mut s = Sampler::new(p.clone());
                let mut rng = ChaCha8Rng::seed_from_u64(p.seed.unwrap_or(0));
                let whole = top_k == 0 || top_k >= logits.len();
                for _ in 0..5 {
                    assert_eq!(s.sample(logits, &[]), reference_pick(&p, &mut rng, &want, whole.then_some(logits)), "{p:?} over {} logits", logits.len());
                }
            }
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.9], &[]), 1);
    }

    #[test]
    fn argmax_is_the_first_largest_as_a_plain_scan_finds_it() {
        let scan = slotstream_backend::chosen::scan;
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![nan, 1.0, 2.0],
            vec![1.0, nan, 3.0, nan],
            vec![-0.0, 0.0, -1.0],
            vec![0.0, -0.0],
            vec![-inf, -inf],
            vec![1.0, inf, 2.0, inf],
            (0..37).map(|i| ((i * 7) % 11) as f32).collect(),
            (0..64).map(|i| if i == 63 { 5.0 } else { 1.0 }).collect(),
            (0..19).map(|i| if i % 3 == 0 { nan } else { -(i as f32) }).collect(),
        ];
        for l in &cases {
            assert_eq!(argmax(l), scan(l), "{l:?}");
        }
        // Seeded random vectors with repeated values, every length to 40.
        let mut x = 1u32;
        for len in 1..40 {
            let l: Vec<f32> = (0..len)
                .map(|_| {
                    x = x.wrapping_mul(1664525).wrapping_add(1013904223);
                    ((x >> 28) as f32) - 7.0
                })
                .collect();
            assert_eq!(argmax(&l), scan(&l), "{l:?}");
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let params = SamplingParams { temperature: 1.0, top_k: 2, seed: Some(42), ..Default::default() };
        let logits = [1.0, 1.1, 0.9, 1.05];
        let run = || {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.iter().all(|&t| t == 1 || t == 3), "top_k=2 allowed only tokens 1 and 3: {a:?}");
        assert!(a.contains(&1) && a.contains(&3));
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        let logits = [5.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, min_p: 0.1, seed: Some(1), ..Default::default() });
        assert!((0..100).all(|_| s.sample(&logits, &[]) == 0));
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 0.5, seed: Some(1), ..Default::default() });
        assert!((0..100).all(|_| s.sample(&logits, &[]) == 0));
    }

    #[test]
    fn penalties_push_away_from_repeats() {
        let logits = [2.0, 1.9];
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.2, ..Default::default() });
        assert_eq!(s.sample(&logits, &[0]), 1);
        let mut s = Sampler::new(SamplingParams { presence_penalty: 0.5, ..Default::default() });
        assert_eq!(s.sample(&logits, &[0]), 1);
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 0.06, ..Default::default() });
        assert_eq!(s.sample(&logits, &[0]), 0, "one occurrence costs only 0.06");
        assert_eq!(s.sample(&logits, &[0, 0]), 1);
    }
}
