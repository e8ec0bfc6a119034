//! Which slots a MoE call's missed experts take.
//!
//! By default the slot whose expert has been needed least, lately: each
//! expert keeps a count of the tokens that chose it, each token weighing
//! half as much after a half-life of tokens. A router keeps coming back to
//! some experts more than others; a recency order (CLOCK, LRU) forgets them
//! as soon as a few tokens pass them by. On the trained demo model with 8 of
//! 32 experts per layer, the same routing traces hit 70.7% against CLOCK's
//! 58.1%, and on a synthetic qwen3_moe with 16 of 64 per layer 39.9% against
//! 27.5% (BENCHMARKS.md, "evicting the least needed expert"). Counting
//! tokens rather than calls lets a prompt's routing say how often each
//! expert is chosen, where a call over the whole prompt would add one to
//! nearly every expert: on the synthetic trunk the GPU benchmark streams
//! (a 30-word prompt, 24 tokens decoded), 42.1% against 34.9%
//! (BENCHMARKS.md, "counting a prompt's tokens").
//!
//! The counts decay together, so they are kept as `ln(count) + now * rate`:
//! ordering those orders the counts at any one time, and only the experts a
//! call needs are updated.

use std::collections::HashSet;
use std::io::{LineWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// How a streaming pool chooses the slots its missed experts take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Eviction {
    /// The slot whose expert's count of tokens that chose it, each halved
    /// after `half_life` tokens, is lowest (empty slots first). The default.
    Frequency { half_life: f64 },
    /// As `Frequency`, but a call adds one to each expert it needed, however
    /// many of its tokens chose it (the earlier count, for measurements).
    Calls { half_life: f64 },
    /// CLOCK: a reference bit per slot, set when its expert is needed,
    /// cleared as the hand passes (the earlier policy, for measurements).
    Clock,
}

/// Tokens after which a call's weight in an expert's count has halved: over
/// traces of the demo model and a synthetic one, 64 to 1024 tokens hit within
/// 0.7 points of each other (64 best on the demo model), 16 up to 1.5 lower.
pub const DEFAULT_HALF_LIFE: f64 = 64.0;

impl Default for Eviction {
    fn default() -> Self {
        Eviction::Frequency { half_life: DEFAULT_HALF_LIFE }
    }
}

impl Eviction {
    /// `frequency`, `calls` (each `:<half-life in tokens>` or not) or `clock`.
    pub fn parse(s: &str) -> Option<Eviction> {
        let s = s.trim();
        if s == "clock" {
            return Some(Eviction::Clock);
        }
        let (name, half_life) = match s.split_once(':') {
            Some((name, h)) => (name, h.parse::<f64>().ok().filter(|h| h.is_finite() && *h > 0.0)?),
            None => (s, DEFAULT_HALF_LIFE),
        };
        match name {
            "frequency" => Some(Eviction::Frequency { half_life }),
            "calls" => Some(Eviction::Calls { half_life }),
            _ => None,
        }
    }
}

/// Up to this many victims are chosen in one pass that keeps the lowest
/// seen; more (a long prefill's batch) by selecting among all.
const FEW: usize = 32;

/// The policy's state over a pool's slots and the model's expert keys.
pub(super) struct Victims {
    policy: Eviction,
    /// Per key, `ln(count) + now * rate` (`-inf`: never needed).
    score: Vec<f64>,
    /// Tokens seen: each call adds its tokens over the MoE layers.
    now: f64,
    /// CLOCK's bit per slot and its hand.
    referenced: Vec<bool>,
    hand: usize,
    /// Scratch: which slots a call pinned.
    mask: Vec<bool>,
}

impl Victims {
    pub(super) fn new(policy: Eviction, keys: usize, slots: usize) -> Victims {
        Victims { policy, score: vec![f64::NEG_INFINITY; keys], now: 0.0, referenced: vec![false; slots], hand: 0, mask: Vec::new() }
    }

    /// A pool of `slots`, starting empty; the counts are kept.
    pub(super) fn resize(&mut self, slots: usize) {
        self.referenced = vec![false; slots];
        self.hand = 0;
    }

    /// Notes one MoE call over `tokens` tokens, out of `layers` MoE layers,
    /// that needed `uses`: each key and how many of the call's tokens chose it.
    pub(super) fn needed(&mut self, tokens: usize, layers: usize, uses: impl Iterator<Item = (u32, u32)>) {
        let (Eviction::Frequency { half_life } | Eviction::Calls { half_life }) = self.policy else { return };
        let per_token = matches!(self.policy, Eviction::Frequency { .. });
        self.now += tokens as f64 / layers.max(1) as f64;
        let rate = std::f64::consts::LN_2 / half_life;
        for (k, n) in uses {
            if let Some(s) = self.score.get_mut(k as usize) {
                let count = (*s - self.now * rate).exp() + if per_token { n as f64 } else { 1.0 };
                *s = count.ln() + self.now * rate;
            }
        }
    }

    /// Notes that `slot`'s expert was needed (a hit) or has just landed there.
    pub(super) fn touched(&mut self, slot: u32) {
        if let Some(r) = self.referenced.get_mut(slot as usize) {
            *r = true;
        }
    }

    /// `n` slots for missed experts, none of them `pinned`; fewer where
    /// fewer are left. `owner` holds each slot's key.
    pub(super) fn choose(&mut self, n: usize, owner: &[Option<u32>], pinned: &HashSet<u32>) -> Vec<u32> {
        let n = n.min(owner.len().saturating_sub(pinned.len()));
        if n == 0 {
            return Vec::new();
        }
        match self.policy {
            Eviction::Clock => {
                let mut pinned = pinned.clone();
                (0..n).map(|_| self.clock(owner, &mut pinned)).collect()
            }
            Eviction::Frequency { .. } | Eviction::Calls { .. } => {
                // A pinned slot's mask, set here and cleared below: one bool
                // per slot is checked far faster than the set.
                self.mask.resize(owner.len(), false);
                pinned.iter().for_each(|&p| self.mask[p as usize] = true);
                let score = |k: u32| self.score.get(k as usize).copied().unwrap_or(f64::NEG_INFINITY);
                let by = |a: &(f64, u32), b: &(f64, u32)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
                let candidates = owner.iter().zip(&self.mask).enumerate().filter(|(_, (_, &pinned))| !pinned);
                let mut free: Vec<(f64, u32)> = Vec::with_capacity(n.min(FEW) + 1);
                if n <= FEW {
                    // A decode's few misses: keep the lowest `n` seen, in order.
                    for (s, (o, _)) in candidates {
                        let c = (o.map_or(f64::NEG_INFINITY, score), s as u32);
                        if free.len() == n && free.last().is_some_and(|w| by(&c, w).is_ge()) {
                            continue;
                        }
                        let at = free.partition_point(|x| by(x, &c).is_lt());
                        free.insert(at, c);
                        free.truncate(n);
                    }
                } else {
                    free.extend(candidates.map(|(s, (o, _))| (o.map_or(f64::NEG_INFINITY, score), s as u32)));
                    if free.len() > n {
                        free.select_nth_unstable_by(n - 1, by);
                        free.truncate(n);
                    }
                    free.sort_unstable_by(by);
                }
                pinned.iter().for_each(|&p| self.mask[p as usize] = false);
                free.into_iter().map(|(_, s)| s).collect()
            }
        }
    }

    /// CLOCK: the next slot that is not pinned and not recently referenced.
    fn clock(&mut self, owner: &[Option<u32>], pinned: &mut HashSet<u32>) -> u32 {
        let n = owner.len();
        loop {
            let s = self.hand;
            self.hand = (self.hand + 1) % n;
            if pinned.contains(&(s as u32)) {
                continue;
            }
            if owner[s].is_some() && self.referenced[s] {
                self.referenced[s] = false;
                continue;
            }
            pinned.insert(s as u32);
            return s as u32;
        }
    }
}

/// Each distinct id of `sorted` and how many times it occurs.
pub(super) fn uses(sorted: &[u32]) -> Vec<(u32, u32)> {
    sorted.chunk_by(|a, b| a == b).map(|run| (run[0], run.len() as u32)).collect()
}

/// Each streaming MoE call's distinct experts, one line per call
/// (`layer tokens id,id:n,...`: `:n` where n > 1 of the call's tokens chose
/// it), to replay against eviction policies (`tools/peer/eviction_sim.py`).
pub(super) struct Trace {
    out: LineWriter<std::fs::File>,
    path: PathBuf,
}

impl Trace {
    pub(super) fn create(path: &Path) -> Result<Trace> {
        let file = std::fs::File::create(path).with_context(|| format!("creating the routing trace {}", path.display()))?;
        Ok(Trace { out: LineWriter::new(file), path: path.to_path_buf() })
    }

    /// `uses`: each distinct expert and how many of the call's tokens chose it.
    pub(super) fn call(&mut self, layer: usize, tokens: usize, uses: &[(u32, u32)]) -> Result<()> {
        let ids: Vec<String> = uses.iter().map(|&(id, n)| if n > 1 { format!("{id}:{n}") } else { id.to_string() }).collect();
        writeln!(self.out, "{layer} {tokens} {}", ids.join(",")).with_context(|| format!("writing the routing trace {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys 0..4 in slots 0..4.
    fn full() -> Vec<Option<u32>> {
        (0..4).map(Some).collect()
    }

    #[test]
    fn an_expert_needed_often_outlives_ones_needed_once() {
        let owner = full();
        let mut v = Victims::new(Eviction::default(), 16, 4);
        for _ in 0..5 {
            v.needed(1, 1, [0].map(|k| (k, 1)).into_iter());
        }
        v.needed(1, 1, [1, 2, 3].map(|k| (k, 1)).into_iter());
        let mut chosen = v.choose(3, &owner, &HashSet::new());
        chosen.sort_unstable();
        assert_eq!(chosen, vec![1, 2, 3], "slot 0's expert was needed five times");
        // CLOCK knows only that each was needed since the hand last passed.
        let mut c = Victims::new(Eviction::Clock, 16, 4);
        (0..4).for_each(|s| c.touched(s));
        assert_eq!(c.choose(1, &owner, &HashSet::new()), vec![0]);
    }

    #[test]
    fn a_prompts_tokens_count_each_one() {
        // One call over a 40-token prompt: expert 0 chosen by 30 tokens, 1-3
        // by fewer; then 8 decoded tokens that need 1-3 and not 0.
        let run = |policy| {
            let mut v = Victims::new(policy, 16, 4);
            v.needed(40, 1, [(0, 30), (1, 4), (2, 3), (3, 3)].into_iter());
            (0..8).for_each(|_| v.needed(1, 1, [(1, 1), (2, 1), (3, 1)].into_iter()));
            v.choose(1, &full(), &HashSet::new())
        };
        assert_ne!(run(Eviction::default()), vec![0], "the prompt chose expert 0 most");
        // Counting calls, the prompt added one to each: 0 goes first.
        assert_eq!(run(Eviction::Calls { half_life: DEFAULT_HALF_LIFE }), vec![0]);
    }

    #[test]
    fn counts_fade_with_the_half_life() {
        // Expert 0 is needed in `early` tokens, then experts 1-3 in each of
        // the next 16; which slot goes first?
        let first_choice = |half_life: f64, early: usize| {
            let mut v = Victims::new(Eviction::Frequency { half_life }, 16, 4);
            (0..early).for_each(|_| v.needed(1, 1, [0].map(|k| (k, 1)).into_iter()));
            (0..16).for_each(|_| v.needed(1, 1, [1, 2, 3].map(|k| (k, 1)).into_iter()));
            v.choose(1, &full(), &HashSet::new())
        };
        // Expert 0 was needed more often (20 times against 16), but four
        // half-lives ago: its count has faded below the others'.
        assert_eq!(first_choice(4.0, 20), vec![0]);
        // Without the fading (a half-life far longer than the run), 0 stays.
        assert_ne!(first_choice(1e9, 20), vec![0]);
    }

    #[test]
    fn empty_slots_go_first_and_pinned_ones_never() {
        let mut owner = full();
        owner[2] = None;
        let pinned: HashSet<u32> = [0, 1].into_iter().collect();
        for policy in [Eviction::default(), Eviction::Clock] {
            let mut v = Victims::new(policy, 16, 4);
            v.needed(1, 1, [3].map(|k| (k, 1)).into_iter());
            (0..4).for_each(|s| v.touched(s));
            assert_eq!(v.choose(2, &owner, &pinned), vec![2, 3], "{policy:?}");
            assert_eq!(v.choose(0, &owner, &pinned), Vec::<u32>::new());
            assert_eq!(v.choose(3, &owner, &pinned).len(), 2, "{policy:?}: only two slots are free");
        }
    }

    #[test]
    fn a_trace_holds_a_line_per_call() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace");
        let mut t = Trace::create(&path).unwrap();
        t.call(0, 33, &[(1, 1), (4, 12), (9, 1)]).unwrap();
        t.call(1, 1, &[]).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "0 33 1,4:12,9\n1 1 \n", "each line is out as written");
        assert!(Trace::create(&dir.path().join("no/such/dir")).is_err());
    }

    #[test]
    fn a_few_victims_or_many_are_the_lowest_counts_in_order() {
        // 100 slots holding keys 0..100, key k needed (k * 37) % 101 + 1 times;
        // slots 3 and 50 pinned, 7 empty.
        let mut owner: Vec<Option<u32>> = (0..100).map(Some).collect();
        owner[7] = None;
        let pinned: HashSet<u32> = [3, 50].into_iter().collect();
        let mut v = Victims::new(Eviction::Frequency { half_life: 1e9 }, 100, 100);
        for k in 0..100u32 {
            (0..=(k * 37) % 101).for_each(|_| v.needed(0, 1, [(k, 1)].into_iter()));
        }
        let mut want: Vec<u32> = (0..100).filter(|s| !pinned.contains(s) && *s != 7).collect();
        want.sort_by_key(|&k| ((k * 37) % 101, k));
        want.insert(0, 7);
        for n in [1, 5, FEW, FEW + 1, 60, 98] {
            assert_eq!(v.choose(n, &owner, &pinned), want[..n], "{n} victims");
        }
    }

    #[test]
    fn policies_parse() {
        assert_eq!(Eviction::parse("clock"), Some(Eviction::Clock));
        assert_eq!(Eviction::parse(" frequency "), Some(Eviction::default()));
        assert_eq!(Eviction::parse("frequency:16"), Some(Eviction::Frequency { half_life: 16.0 }));
        assert_eq!(Eviction::parse("calls"), Some(Eviction::Calls { half_life: DEFAULT_HALF_LIFE }));
        assert_eq!(Eviction::parse("calls:256"), Some(Eviction::Calls { half_life: 256.0 }));
        for bad in ["", "lru", "frequency:", "frequency:0", "frequency:-3", "frequency:inf", "frequency:x", "clock:4", "calls:"] {
            assert_eq!(Eviction::parse(bad), None, "{bad:?}");
        }
    }
}
