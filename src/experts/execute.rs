//! A placed streaming MoE call, run: the misses given pool slots are read
//! (with what was read ahead for them) and written as they land, the pool's
//! experts compute, then the staged misses run group by group from the
//! staging pool, expert-major: every token of the call that routes to an
//! expert goes through it at once, while the next group's reads are in flight.
//!
//! Each (token, expert) output is computed the same way wherever the expert
//! sits (one run over all of its tokens), the groups write disjoint rows and
//! the weighted sum runs in routing-rank order at the end, so the output does
//! not depend on where the experts ran from.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use slotstream_backend::{Backend, ExpertPool, Routes, Tensor};

use super::placement::Placement;
use super::read_ahead::GroupReads;
use super::{CacheCounters, ExpertCache, ExpertRecord, ExpertStore, Handover, Progress};

/// Staged experts written and computed at a time. The staging pool holds two
/// groups, so that a GPU can write one while the other computes.
pub const STAGING_GROUP: usize = 16;

/// When a call's own reads were issued and when its last one landed.
#[derive(Default)]
struct ReadMarks {
    issued: Option<Instant>,
    landed: Option<Instant>,
}

impl ExpertCache {
    /// Runs the call `placed` describes; `ended` is when the MoE call before
    /// handed its compute over (a decode's lead is counted from it).
    pub(super) fn execute(
        &mut self,
        b: &dyn Backend,
        layer: usize,
        x: &Tensor,
        routes: &Routes,
        placed: Placement,
        ended: Option<(usize, Instant)>,
    ) -> Result<Tensor> {
        let key_base = layer * self.store.experts_per_layer;
        let mut counters = CacheCounters {
            hits: placed.hits.len() as u64,
            misses: (placed.to_pool.len() + placed.staged.len()) as u64,
            staged: placed.staged.len() as u64,
            ..Default::default()
        };
        let marks = self.fill_pool(b, layer, &placed, &mut counters)?;
        if placed.staged.is_empty() {
            let out = b.moe(x, &self.pool, routes, key_base);
            let now = Instant::now();
            if let (Some((before, ended)), Some(issued)) = (ended, marks.issued) {
                if before + 1 == layer {
                    counters.lead_seconds = issued.saturating_duration_since(ended).as_secs_f64();
                }
            }
            counters.tail_seconds = marks.landed.map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
            self.ended = out.is_ok().then_some((layer, now));
            self.count_call(layer, counters);
            return Ok(out?);
        }
        if self.staging.is_none() {
            self.staging = Some(Staging::new(b, &self.store)?);
        }
        let staging = self.staging.as_mut().ok_or_else(|| anyhow::anyhow!("internal: no staging pool"))?;
        let mut reads = GroupReads::start(&self.store, layer, placed.staged.chunks(staging.group).map(<[u32]>::to_vec).collect());
        // The pool's experts compute while the first staged group is read.
        let pooled = !placed.hits.is_empty() || !placed.to_pool.is_empty();
        let outputs = if pooled { Some(b.moe_expert_outputs(x, &self.pool, routes, key_base)?) } else { None };
        let ran = staging.run(b, &mut reads, x, routes, outputs, &mut counters);
        // The staging table says "no slot" again, whatever happened.
        let cleared = staging.clear(b);
        let outputs = ran?;
        cleared?;
        self.count_call(layer, counters);
        Ok(b.moe_combine(&outputs, routes)?)
    }

    /// Reads the misses placed in pool slots (taking what was read ahead
    /// for them; issuing the guess for the next call once its own reads are
    /// out) and writes each matrix into its slot as it lands; then maps them.
    fn fill_pool(&mut self, b: &dyn Backend, layer: usize, placed: &Placement, counters: &mut CacheCounters) -> Result<ReadMarks> {
        let mut record_misses = placed.to_pool.clone();
        // A call with staged experts (a long one) takes no guess and leaves
        // what was read ahead unused: it reads its misses as they come.
        let (mut ahead, mut guess) = (None, None);
        if placed.staged.is_empty() {
            ahead = self.take_ahead(layer, &record_misses, counters);
            if let Some((_, covered)) = &ahead {
                record_misses.sort_by_key(|e| covered.contains(e));
            }
            guess = self.guessed.take();
        } else {
            self.take_ahead(layer, &[], counters);
            self.guessed = None;
        }
        let mut marks = ReadMarks::default();
        let mut started = None;
        let (store, pool) = (&self.store, &mut self.pool);
        let victims = &placed.slots;
        let write_seconds = std::cell::Cell::new(0.0);
        let timed = |write: &mut dyn FnMut() -> Result<()>| -> Result<()> {
            let t = Instant::now();
            write()?;
            write_seconds.set(write_seconds.get() + t.elapsed().as_secs_f64());
            Ok(())
        };
        let wait = Instant::now();
        let covered = ahead.as_ref().map_or(0, |(_, c)| c.len());
        let to_read = &record_misses[..record_misses.len() - covered];
        let ahead_start = self.ahead_start;
        let issued_at = &mut marks.issued;
        let progress = |at: Progress| {
            if at == Progress::Issued {
                *issued_at = Some(Instant::now());
            }
            if at == ahead_start {
                started = guess.take().map(|(l, experts): (usize, Vec<u32>)| super::read_ahead::Ahead {
                    layer: l,
                    records: store.read_later(l, experts.clone()),
                    experts,
                });
            }
        };
        // What was read ahead, once this call's own reads are issued.
        let mut ahead_secs = 0.0;
        let ready = |block: bool| -> Option<Result<Vec<ExpertRecord>>> {
            let Some((a, _)) = &ahead else { return Some(Ok(Vec::new())) };
            let got = if block {
                a.records.recv().ok()
            } else {
                match a.records.try_recv() {
                    Err(std::sync::mpsc::TryRecvError::Empty) => return None,
                    got => got.ok(),
                }
            };
            let (a, covered) = ahead.take()?;
            // A guess that failed to read (or whose job is gone) is read
            // again here: it is needed now.
            let (records, secs) = match got {
                Some(Ok(read)) => read,
                _ => return Some(store.read_many(layer, &covered).map(|(records, _)| records)),
            };
            ahead_secs = secs;
            let mut by_id: HashMap<u32, ExpertRecord> = a.experts.into_iter().zip(records).collect();
            let ready: Vec<ExpertRecord> = covered.iter().filter_map(|e| by_id.remove(e)).collect();
            if ready.len() != covered.len() {
                return Some(Err(anyhow::anyhow!("the experts read ahead for MoE layer {layer} came back incomplete")));
            }
            Some(Ok(ready))
        };
        let read = store.read_each(layer, to_read, self.write_as_landed, ready, progress, |at, handed| {
            let slot = victims[at] as usize;
            timed(&mut || match handed {
                Handover::Matrix(which, m) => Ok(b.write_expert_matrix(pool, slot, which, m)?),
                Handover::Whole(e) => Ok(b.write_expert(pool, slot, e)?),
            })
        });
        counters.wait_seconds += wait.elapsed().as_secs_f64();
        counters.read_seconds += ahead_secs;
        counters.write_seconds += write_seconds.get();
        if let Some(a) = started.take() {
            self.ahead = Some(a);
        }
        let mut table = placed.evicted.clone();
        match read {
            Ok(secs) => {
                counters.read_seconds += secs;
                // With no reads of its own, the call's tail is not counted.
                marks.landed = (!to_read.is_empty()).then(|| wait + Duration::from_secs_f64(secs));
            }
            Err(e) => {
                // The evicted experts leave the device table with their slots,
                // whatever those hold now.
                let _ = b.map_experts(&mut self.pool, &table);
                return Err(e);
            }
        }
        counters.bytes_read += record_misses.len() as u64 * self.store.record_bytes;
        for (&e, &s) in record_misses.iter().zip(&placed.slots) {
            table.push(self.settle(layer, e, s));
        }
        b.map_experts(&mut self.pool, &table)?;
        Ok(marks)
    }
}

/// The pool a long call's misses that find no free slot run from: two
/// groups of [`STAGING_GROUP`] slots, a table over one layer's experts.
pub(super) struct Staging {
    pool: ExpertPool,
    group: usize,
    /// The experts its table maps now.
    mapped: Vec<u32>,
}

impl Staging {
    fn new(b: &dyn Backend, store: &ExpertStore) -> Result<Staging> {
        let group = STAGING_GROUP.min(store.experts_per_layer).max(1);
        Ok(Staging { pool: b.new_expert_pool(&store.layout, 2 * group, store.experts_per_layer)?, group, mapped: Vec::new() })
    }

    pub fn bytes(&self) -> usize {
        self.pool.bytes
    }

    /// Runs each group `reads` brings, written into the half the group
    /// before did not use, over every token routed to it; the outputs are
    /// gathered into `outputs` (made by the first group where `None`).
    fn run(&mut self, b: &dyn Backend, reads: &mut GroupReads, x: &Tensor, routes: &Routes, mut outputs: Option<Tensor>, counters: &mut CacheCounters) -> Result<Tensor> {
        let mut half = 0;
        while let Some(read) = reads.next_group() {
            let read = read?;
            counters.read_seconds += read.read_seconds;
            counters.wait_seconds += read.wait_seconds;
            counters.bytes_read += read.records.len() as u64 * reads.store().record_bytes;
            let base = half * self.group;
            let written = Instant::now();
            for (i, record) in read.records.iter().enumerate() {
                b.write_expert(&mut self.pool, base + i, &reads.store().host_expert(record))?;
            }
            counters.write_seconds += written.elapsed().as_secs_f64();
            let mut table: Vec<(u32, Option<u32>)> = self.mapped.drain(..).map(|e| (e, None)).collect();
            table.extend(read.experts.iter().enumerate().map(|(i, &e)| (e, Some((base + i) as u32))));
            b.map_experts(&mut self.pool, &table)?;
            self.mapped.extend(&read.experts);
            outputs = Some(match outputs {
                None => b.moe_expert_outputs(x, &self.pool, routes, 0)?,
                Some(o) => b.moe_expert_outputs_into(o, x, &self.pool, routes, 0)?,
            });
            half ^= 1;
        }
        outputs.ok_or_else(|| anyhow::anyhow!("a MoE call with no experts"))
    }

    /// Unmaps the experts the table maps.
    fn clear(&mut self, b: &dyn Backend) -> Result<()> {
        let table: Vec<(u32, Option<u32>)> = self.mapped.drain(..).map(|e| (e, None)).collect();
        Ok(b.map_experts(&mut self.pool, &table)?)
    }
}
