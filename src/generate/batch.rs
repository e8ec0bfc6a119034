//! Continuous batching: the sequences decoding at the same time take their
//! steps together, one forward pass for all of them
//! ([`DecoderModel::forward_batch`]: one row per sequence through every
//! matmul, a MoE layer's experts the union of the rows' routes, each missed
//! one read once).
//!
//! Each generation keeps its own thread, sampler, constraint and stop
//! strings; only the forward pass is shared. A sequence that wants its next
//! logits hands its state and token to the [`Batcher`] and waits; the first
//! waiter that finds no pass running and every decoding sequence waiting (or
//! the oldest waiting longer than [`PATIENCE`]) runs one pass over the
//! waiting steps, oldest first, and hands each its logits and state back.
//! Sequences join and leave between any two steps, so a request that
//! arrives while others decode feeds its prompt a chunk at a time, between
//! their steps, and then joins them.
//!
//! Every forward pass takes a [`Batcher::pass_turn`]. Turns go first come
//! first served within two kinds: [`TurnKind::Next`] (a decode step, or the
//! last chunk of a prompt: a token waits on it) and [`TurnKind::Bulk`] (a
//! long prompt's chunk with more to follow). A waiting `Next` turn goes
//! before waiting `Bulk` ones, but never twice in a row while a `Bulk` one
//! waits, so a short request's first token waits for the chunk running, not
//! for every long prompt's next chunk, and a long prompt still advances
//! between decode steps. A thread that holds the turn and asks again gets it
//! at once (a short prompt's two passes run back to back).
//!
//! Each batched pass counts the expert pool's hits, misses and bytes read
//! ([`BatchCounters`]); a sequence adds up its passes' shares
//! ([`BatchShare`]: bytes per generated token).
//!
//! [`DecoderModel::forward_batch`]: crate::model::DecoderModel::forward_batch

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use serde::Serialize;

use super::Engine;
use crate::experts::CacheCounters;
use crate::model::{Logits, SequenceState};

/// How long the oldest waiting step waits for the other decoding sequences
/// before a pass runs without them (one whose client reads slowly, or whose
/// grammar takes long to mask, holds up the others no longer than this).
pub const PATIENCE: Duration = Duration::from_millis(30);

/// Most sequences one pass takes (kernels compute a row alike whatever the
/// batch up to this many rows on the CPU backend: `ROW_EXACT_TOKENS`).
pub const MAX_PARALLEL: usize = 16;

/// The sequences decoding on one engine and their waiting steps.
pub struct Batcher {
    parallel: usize,
    /// Sequences in their decode loop, whatever their strategy (batched,
    /// alone or speculative): [`Batcher::decode_loop`].
    in_decode: AtomicUsize,
    shared: Mutex<Shared>,
    changed: Condvar,
    turns: Mutex<Turns>,
    turn_done: Condvar,
}

/// What a forward pass is for, which decides its place among the waiting
/// turns (see the module's description).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnKind {
    /// A decode step, or the last chunk of a prompt (its first token waits).
    Next,
    /// A prompt's chunk with more of the prompt after it.
    Bulk,
}

/// Tickets for forward passes.
#[derive(Default)]
struct Turns {
    next_ticket: u64,
    /// The ticket holding the turn, its thread (once it has woken) and how
    /// many of that thread's turns are nested in it.
    serving: Option<(u64, Option<ThreadId>, usize)>,
    next: VecDeque<u64>,
    bulk: VecDeque<u64>,
    /// The last turn handed over was a `Next` one while a `Bulk` one waited.
    bulk_passed: bool,
}

impl Turns {
    /// Hands the turn to the ticket whose go it is (or to nobody).
    fn hand_over(&mut self) -> Option<u64> {
        let bulk = if self.bulk_passed || self.next.is_empty() { self.bulk.pop_front() } else { None };
        if bulk.is_some() {
            self.bulk_passed = false;
            return bulk;
        }
        let next = self.next.pop_front();
        self.bulk_passed = next.is_some() && !self.bulk.is_empty();
        next
    }
}

#[derive(Default)]
struct Shared {
    /// Sequences in their decode loop (each has at most one step waiting).
    decoding: usize,
    next_id: u64,
    waiting: Vec<Step>,
    done: HashMap<u64, Done>,
    running: bool,
    /// Passes run and the sequences they took, for reports and tests.
    passes: u64,
    rows: u64,
    /// The expert pool's hits, misses and bytes read over the passes.
    reads: (u64, u64, u64),
}

struct Step {
    id: u64,
    token: u32,
    state: SequenceState,
    since: Instant,
}

struct Done {
    state: SequenceState,
    logits: Result<Vec<f32>, String>,
    /// The pass's rows and what it read of the experts.
    rows: usize,
    reads: CacheCounters,
}

/// Passes run so far and the rows (sequence steps) they held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchCounters {
    pub passes: u64,
    pub rows: u64,
    /// Over those passes: routed (row, expert) pairs found in the pool,
    /// experts missed, and the bytes the misses read (each missed expert
    /// read once for every row routed to it). Divided by `rows`, each is
    /// per generated token.
    pub expert_hits: u64,
    pub expert_misses: u64,
    pub expert_bytes_read: u64,
}

/// One sequence's decode steps taken in passes with others, and its share
/// of what those passes read of the experts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BatchShare {
    /// Steps taken in a pass, and those whose pass held other sequences too.
    pub steps: u64,
    pub shared_steps: u64,
    /// Mean sequences per pass over the steps.
    pub mean_rows: f64,
    /// The passes' expert hits, misses and bytes read, each pass's divided
    /// by its rows: per generated token of this sequence, summed.
    pub expert_hits: f64,
    pub expert_misses: f64,
    pub expert_bytes_read: f64,
}

impl BatchShare {
    fn add(&mut self, rows: usize, reads: &CacheCounters) {
        let n = rows.max(1) as f64;
        self.mean_rows = (self.mean_rows * self.steps as f64 + n) / (self.steps + 1) as f64;
        self.steps += 1;
        self.shared_steps += u64::from(rows > 1);
        self.expert_hits += reads.hits as f64 / n;
        self.expert_misses += reads.misses as f64 / n;
        self.expert_bytes_read += reads.bytes_read as f64 / n;
    }

    /// Expert bytes read per step (generated token).
    pub fn bytes_per_token(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.expert_bytes_read / self.steps as f64
        }
    }
}

impl Batcher {
    /// A batcher of up to `parallel` sequences per pass (1: every sequence
    /// decodes alone).
    pub fn new(parallel: usize) -> Result<Batcher> {
        if parallel == 0 || parallel > MAX_PARALLEL {
            bail!("--parallel {parallel} is out of range: give 1 to {MAX_PARALLEL} sequences");
        }
        Ok(Batcher {
            parallel,
            in_decode: AtomicUsize::new(0),
            shared: Mutex::new(Shared::default()),
            changed: Condvar::new(),
            turns: Mutex::new(Turns::default()),
            turn_done: Condvar::new(),
        })
    }

    /// Waits for this thread's turn to run a forward pass (a `Next` turn).
    pub fn pass_turn(&self) -> PassTurn<'_> {
        self.turn(TurnKind::Next)
    }

    /// Waits for this thread's turn to run a forward pass of `kind`, in the
    /// order the module's description gives: a prompt's next chunk runs
    /// soon after the pass now running, not after every decode step that
    /// follows it (the expert pool's lock alone lets the thread that just
    /// let go take it again). A thread holding the turn gets it at once.
    pub fn turn(&self, kind: TurnKind) -> PassTurn<'_> {
        let me = std::thread::current().id();
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, thread, depth)) = turns.serving.as_mut() {
            if *thread == Some(me) {
                *depth += 1;
                return PassTurn { batcher: self };
            }
        }
        let ticket = turns.next_ticket;
        turns.next_ticket += 1;
        match kind {
            TurnKind::Next => turns.next.push_back(ticket),
            TurnKind::Bulk => turns.bulk.push_back(ticket),
        }
        if turns.serving.is_none() {
            let first = turns.hand_over();
            turns.serving = first.map(|t| (t, None, 0));
        }
        while turns.serving.map(|(t, ..)| t) != Some(ticket) {
            turns = self.turn_done.wait(turns).unwrap_or_else(|p| p.into_inner());
        }
        turns.serving = Some((ticket, Some(me), 0));
        PassTurn { batcher: self }
    }

    pub fn parallel(&self) -> usize {
        self.parallel
    }

    pub fn counters(&self) -> BatchCounters {
        let s = self.lock();
        BatchCounters {
            passes: s.passes,
            rows: s.rows,
            expert_hits: s.reads.0,
            expert_misses: s.reads.1,
            expert_bytes_read: s.reads.2,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // Every field is whole between statements: a panic elsewhere leaves
        // nothing half-changed.
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a sequence into the sequences in their decode loop until the
    /// guard is dropped (every generation, batched or not).
    pub fn decode_loop(&self) -> DecodeLoop<'_> {
        self.in_decode.fetch_add(1, Ordering::SeqCst);
        DecodeLoop { batcher: self }
    }

    /// Whether sequences besides the caller's (which holds a
    /// [`Batcher::decode_loop`]) are in their decode loop.
    pub fn others_decoding(&self) -> bool {
        self.in_decode.load(Ordering::SeqCst) > 1
    }

    /// Counts a sequence into the decoding set until the member is dropped.
    pub fn join(&self) -> Member<'_> {
        self.lock().decoding += 1;
        Member { batcher: self, share: Mutex::new(BatchShare::default()) }
    }
}

/// A sequence in its decode loop ([`Batcher::decode_loop`]).
pub struct DecodeLoop<'a> {
    batcher: &'a Batcher,
}

impl Drop for DecodeLoop<'_> {
    fn drop(&mut self) {
        self.batcher.in_decode.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The right to run a forward pass, until dropped.
pub struct PassTurn<'a> {
    batcher: &'a Batcher,
}

impl Drop for PassTurn<'_> {
    fn drop(&mut self) {
        let mut turns = self.batcher.turns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, _, depth)) = turns.serving.as_mut() {
            if *depth > 0 {
                *depth -= 1;
                return;
            }
        }
        // The next holder fills in its own thread when it wakes.
        turns.serving = turns.hand_over().map(|t| (t, None, 0));
        drop(turns);
        self.batcher.turn_done.notify_all();
    }
}

/// A sequence in the decoding set.
pub struct Member<'a> {
    batcher: &'a Batcher,
    share: Mutex<BatchShare>,
}

impl Drop for Member<'_> {
    fn drop(&mut self) {
        self.batcher.lock().decoding -= 1;
        self.batcher.changed.notify_all();
    }
}

impl Member<'_> {
    /// This sequence's steps so far and its share of their passes' reads.
    pub fn share(&self) -> BatchShare {
        self.share.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Feeds `token` to `state` in a pass with the other decoding sequences'
    /// steps; returns the logits after it.
    pub fn step(&self, engine: &Engine, token: u32, state: &mut SequenceState) -> Result<Vec<f32>> {
        let b = self.batcher;
        let placeholder = SequenceState { layers: Vec::new(), recent: Vec::new(), draft: None, position: 0 };
        let mut shared = b.lock();
        let id = shared.next_id;
        shared.next_id += 1;
        shared.waiting.push(Step { id, token, state: std::mem::replace(state, placeholder), since: Instant::now() });
        b.changed.notify_all();
        loop {
            if let Some(done) = shared.done.remove(&id) {
                drop(shared);
                *state = done.state;
                self.share.lock().unwrap_or_else(|p| p.into_inner()).add(done.rows, &done.reads);
                return done.logits.map_err(|e| anyhow!(e));
            }
            let oldest = shared.waiting.first().map(|s| s.since.elapsed());
            let all_in = shared.waiting.len() >= shared.decoding.min(b.parallel);
            if !shared.running && oldest.is_some_and(|waited| all_in || waited >= PATIENCE) {
                let take = shared.waiting.len().min(b.parallel);
                let steps: Vec<Step> = shared.waiting.drain(..take).collect();
                shared.running = true;
                drop(shared);
                let finished = run_pass(engine, steps);
                shared = b.lock();
                shared.running = false;
                shared.passes += 1;
                shared.rows += finished.len() as u64;
                if let Some((_, done)) = finished.first() {
                    let r = &done.reads;
                    shared.reads = (shared.reads.0 + r.hits, shared.reads.1 + r.misses, shared.reads.2 + r.bytes_read);
                }
                shared.done.extend(finished);
                b.changed.notify_all();
                continue;
            }
            shared = match oldest {
                Some(waited) if !shared.running => {
                    b.changed.wait_timeout(shared, PATIENCE.saturating_sub(waited)).unwrap_or_else(|p| p.into_inner()).0
                }
                _ => b.changed.wait(shared).unwrap_or_else(|p| p.into_inner()),
            };
        }
    }
}

/// One forward pass over `steps`; every step gets its state back, with its
/// logits or the pass's error.
fn run_pass(engine: &Engine, mut steps: Vec<Step>) -> Vec<(u64, Done)> {
    let b = engine.backend.as_ref();
    let tokens: Vec<u32> = steps.iter().map(|s| s.token).collect();
    let _turn = engine.batch.pass_turn();
    // No other pass runs in this turn: the pool's counters move by this one's.
    let before = engine.model.expert_stats().map(|s| s.total).unwrap_or_default();
    let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<Vec<f32>>> {
        if let [one] = steps.as_mut_slice() {
            // Alone: the plain one-token pass.
            return Ok(vec![b.download(&engine.model.forward(b, &tokens, &mut one.state, Logits::Last)?)?]);
        }
        let mut states: Vec<&mut SequenceState> = steps.iter_mut().map(|s| &mut s.state).collect();
        let logits = b.download(&engine.model.forward_batch(b, &tokens, &mut states)?)?;
        let vocab = logits.len() / tokens.len();
        Ok(logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }));
    let rows: Result<Vec<Vec<f32>>, String> = match outcome {
        Ok(Ok(rows)) => Ok(rows),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(_) => Err("a batched decode step panicked".to_string()),
    };
    let reads = engine.model.expert_stats().map(|s| s.total.since(&before)).unwrap_or_default();
    let n = steps.len();
    let mut rows: Vec<Result<Vec<f32>, String>> = match rows {
        Ok(rows) => rows.into_iter().map(Ok).collect(),
        Err(e) => vec![Err(e); n],
    };
    rows.resize(n, Err("internal: a batched pass gave fewer rows than it took".to_string()));
    steps
        .into_iter()
        .zip(rows)
        .map(|(s, logits)| (s.id, Done { state: s.state, logits, rows: n, reads: reads.clone() }))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiting `Next` turn goes before waiting `Bulk` ones, but not twice
    /// in a row while one waits; alone, each kind goes in its order.
    #[test]
    fn next_turns_go_first_but_never_starve_bulk_ones() {
        let mut t = Turns::default();
        t.bulk.extend([1, 2, 3]);
        t.next.extend([4, 5]);
        assert_eq!(t.hand_over(), Some(4));
        assert_eq!(t.hand_over(), Some(1), "a bulk turn after a next one that passed it");
        assert_eq!(t.hand_over(), Some(5));
        t.next.push_back(6);
        assert_eq!(t.hand_over(), Some(2));
        assert_eq!(t.hand_over(), Some(6));
        assert_eq!(t.hand_over(), Some(3));
        assert_eq!(t.hand_over(), None);
        t.next.extend([7, 8]);
        assert_eq!((t.hand_over(), t.hand_over(), t.hand_over()), (Some(7), Some(8), None), "no bulk turn waits");
    }

    /// A thread holding the turn gets it again at once; another thread's
    /// turn waits until the outer one is let go.
    #[test]
    fn a_held_turn_nests_and_others_wait_for_it() {
        let b = Batcher::new(2).expect("a batcher");
        let outer = b.turn(TurnKind::Next);
        let inner = b.turn(TurnKind::Bulk);
        let order = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let _t = b.turn(TurnKind::Next);
                order.lock().expect("order").push("other");
            });
            drop(inner);
            std::thread::sleep(Duration::from_millis(50));
            order.lock().expect("order").push("outer");
            drop(outer);
            waiter.join().expect("the waiting thread");
        });
        assert_eq!(*order.lock().expect("order"), ["outer", "other"]);
        let _again = b.turn(TurnKind::Bulk);
    }
}
