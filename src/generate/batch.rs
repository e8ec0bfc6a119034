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
//! their steps (every pass takes a [`Batcher::pass_turn`], first come first
//! served), and then joins them.
//!
//! [`DecoderModel::forward_batch`]: crate::model::DecoderModel::forward_batch

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use super::Engine;
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
    shared: Mutex<Shared>,
    changed: Condvar,
    /// Tickets for forward passes: (next to hand out, now serving).
    turns: Mutex<(u64, u64)>,
    turn_done: Condvar,
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
}

/// Passes run so far and the rows (sequence steps) they held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchCounters {
    pub passes: u64,
    pub rows: u64,
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
            shared: Mutex::new(Shared::default()),
            changed: Condvar::new(),
            turns: Mutex::new((0, 0)),
            turn_done: Condvar::new(),
        })
    }

    /// Waits for this thread's turn to run a forward pass, in the order the
    /// turns were asked for: a prompt's next chunk runs after the pass now
    /// running, not after every decode step that follows it (the expert
    /// pool's lock alone lets the thread that just let go take it again).
    pub fn pass_turn(&self) -> PassTurn<'_> {
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = turns.0;
        turns.0 += 1;
        while turns.1 != ticket {
            turns = self.turn_done.wait(turns).unwrap_or_else(|p| p.into_inner());
        }
        PassTurn { batcher: self }
    }

    pub fn parallel(&self) -> usize {
        self.parallel
    }

    pub fn counters(&self) -> BatchCounters {
        let s = self.lock();
        BatchCounters { passes: s.passes, rows: s.rows }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // Every field is whole between statements: a panic elsewhere leaves
        // nothing half-changed.
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a sequence into the decoding set until the member is dropped.
    pub fn join(&self) -> Member<'_> {
        self.lock().decoding += 1;
        Member { batcher: self }
    }
}

/// The right to run a forward pass, until dropped.
pub struct PassTurn<'a> {
    batcher: &'a Batcher,
}

impl Drop for PassTurn<'_> {
    fn drop(&mut self) {
        self.batcher.turns.lock().unwrap_or_else(|p| p.into_inner()).1 += 1;
        self.batcher.turn_done.notify_all();
    }
}

/// A sequence in the decoding set.
pub struct Member<'a> {
    batcher: &'a Batcher,
}

impl Drop for Member<'_> {
    fn drop(&mut self) {
        self.batcher.lock().decoding -= 1;
        self.batcher.changed.notify_all();
    }
}

impl Member<'_> {
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
                *state = done.state;
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
    steps
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let logits = rows.as_ref().map(|r| r[i].clone()).map_err(Clone::clone);
            (s.id, Done { state: s.state, logits })
        })
        .collect()
}
