//! Routed experts streamed from disk into a fixed pool of slots shared by all
//! layers.
//!
//! The router's logits are routed where they were computed (a kernel on a
//! GPU), and the pool's slot table (expert -> slot) lives there too. When the
//! pool holds every expert, a MoE call never leaves the device. Otherwise a
//! MoE call reads back the routed expert ids and runs in three steps, each in
//! its own file: `placement.rs` says where each expert runs from (the slot
//! that holds it; for a miss, a slot of the experts needed least lately,
//! `evict.rs`, at decode, or at prefill a free slot or else the transient
//! staging pool, so that a prompt leaves decode's experts in the pool);
//! `read_ahead.rs` keeps the disk busy ahead of the compute (a decode's guess
//! of the next layer's experts, a prefill's next group of staged experts);
//! `execute.rs` reads the misses, fills the slot tables and computes,
//! expert-major: each expert once over all of the call's tokens routed to it.
//!
//! Output never depends on the pool size: each (token, expert) output is
//! computed the same way wherever the expert sits, the pool's and the staging
//! groups' calls write disjoint rows, and the weighted sum runs in
//! routing-rank order at the end. That holds bit for bit on the CPU backend.
//! On the wgpu backend a pool that holds every expert keeps 4-bit slots
//! interleaved and runs the shared expert as one more rank, which rounds
//! differently from a streaming pool; tests check that the tokens are the same.

mod evict;
mod execute;
mod placement;
mod read_ahead;
mod stats;
mod coalesce;
mod store;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use slotstream_backend::{add_shared_expert, Backend, ExpertPool, Routes, SharedExpert, Tensor};

pub use evict::{Eviction, DEFAULT_HALF_LIFE};
pub use execute::STAGING_GROUP;
pub use stats::{CacheCounters, CacheStats, PromptReads, ReadMark};
pub use store::{ExpertRecord, ExpertStore, ExpertTensors, Handover, Progress, ReadTimes};

/// Most tokens of a MoE call that reads ahead the next call's guessed experts
/// and gives its misses the slots of experts needed least lately: a decode
/// step (a few drafted tokens). A longer call (a prefill chunk, which touches
/// most experts) runs misses that find no free slot from staging.
const READ_AHEAD_MAX_TOKENS: usize = 4;

/// Guessed experts per token read ahead by default ([`ExpertCache::read_ahead`]).
/// Measured with a pool of 25%: on the dev VM's CPU backend decode +9.9% over
/// 12 alternating runs (3.6% more bytes read); on an H200 (A's trunk with 64
/// experts, Vulkan) +13% over two alternating pairs, the guess's read-back
/// per MoE layer included (BENCHMARKS.md, "reading the next layer's experts
/// ahead" and "the shared expert in the pool").
pub const DEFAULT_READ_AHEAD: usize = 2;

/// The slot pool, the eviction policy's bookkeeping and the store it is filled from.
pub struct ExpertCache {
    pool: ExpertPool,
    store: Arc<ExpertStore>,
    /// How many of each token's guessed experts for the next MoE layer a
    /// streaming decode reads while this layer's are read and computed
    /// ([`ExpertCache::guess_next`]; the best first; 0: none).
    pub read_ahead: usize,
    /// Write a streamed expert's matrices as they land, and what was read
    /// ahead for the call as soon as it has; off: the earlier handover,
    /// what was read ahead first, then each expert whole (for before/after
    /// measurements; [`ExpertStore::read_each`]).
    pub write_as_landed: bool,
    /// When the guess for the next MoE call goes out: at
    /// [`Progress::Landed`] (the default), once this call's own reads have
    /// landed, so that the disk works through the time between two layers'
    /// reads (this layer's compute, the next one's routing); at `Draining`,
    /// once a read thread would stand idle; at `Issued`, queued behind them
    /// (the earlier order). Other than the default only for measurements.
    pub ahead_start: Progress,
    /// The experts guessed for the next MoE call.
    guessed: Option<(usize, Vec<u32>)>,
    ahead: Option<read_ahead::Ahead>,
    /// Where a long call's misses that have no free slot run from, made on
    /// first use ([`STAGING_GROUP`]).
    staging: Option<execute::Staging>,
    /// Per key, 1 + the [`ExpertCache::mark_reads`] epoch in which it last missed (0: never).
    missed_in: Vec<u32>,
    epoch: u32,
    /// Key (`layer * experts + expert`) held by each routed slot.
    owner: Vec<Option<u32>>,
    /// Whether each MoE layer's shared expert sits in a slot after the
    /// routed ones (its key is `layers * experts + layer`, past the routed
    /// keys): never evicted.
    shared: Vec<bool>,
    slot_of: HashMap<u32, u32>,
    victims: evict::Victims,
    trace: Option<evict::Trace>,
    per_layer: Vec<CacheCounters>,
    /// The store's busy seconds and read times when a streaming call last counted them.
    busy_mark: (f64, ReadTimes),
    /// The MoE layer of the last streaming call and when it handed its
    /// compute over (the next layer's call counts `lead_seconds` from it).
    ended: Option<(usize, Instant)>,
}

impl ExpertCache {
    /// The smallest pool that can run the model: one token's experts at once.
    pub fn min_slots(top_k: usize) -> usize {
        top_k.max(1)
    }

    /// A pool of `slots` routed experts; where that is every expert and the
    /// backend asks for it, one more slot for each shared expert the store
    /// reads, which is read and written here.
    pub fn new(backend: &dyn Backend, store: ExpertStore, slots: usize) -> Result<ExpertCache> {
        if slots == 0 {
            bail!("the expert pool needs at least one slot");
        }
        let pool = Self::new_pool(backend, &store, slots)?;
        let (layers, store_experts) = (store.layers, store.experts_per_layer);
        let mut cache = ExpertCache {
            shared: vec![false; layers],
            pool,
            store: Arc::new(store),
            read_ahead: DEFAULT_READ_AHEAD,
            write_as_landed: true,
            ahead_start: Progress::Landed,
            guessed: None,
            ahead: None,
            staging: None,
            missed_in: vec![0; layers * store_experts],
            epoch: 0,
            owner: vec![None; slots],
            slot_of: HashMap::new(),
            victims: evict::Victims::new(Eviction::default(), layers * store_experts, slots),
            trace: None,
            per_layer: vec![CacheCounters::default(); layers],
            busy_mark: (0.0, ReadTimes::default()),
            ended: None,
        };
        cache.hold_shared(backend)?;
        Ok(cache)
    }

    /// A pool of `slots` routed experts and, when they are every expert and
    /// `b` runs shared experts from the pool, one slot per shared expert the
    /// store reads (their keys after the routed ones, one per MoE layer).
    fn new_pool(b: &dyn Backend, store: &ExpertStore, slots: usize) -> Result<ExpertPool> {
        let routed = store.layers * store.experts_per_layer;
        let shared = if slots >= routed && b.pools_shared_experts() { store.shared_layers().len() } else { 0 };
        let keys = if shared > 0 { routed + store.layers } else { routed };
        Ok(b.new_expert_pool(&store.layout, slots + shared, keys)?)
    }

    /// Slots for routed experts.
    pub fn slots(&self) -> usize {
        self.owner.len()
    }

    /// The keys (`layer * experts + expert`) of the routed experts in the pool, in order.
    pub fn held(&self) -> Vec<u32> {
        let mut keys: Vec<u32> = self.owner.iter().flatten().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Reads each shared expert the store has into the slots the pool has
    /// after the routed ones and maps it under key `layers * experts + layer`.
    fn hold_shared(&mut self, b: &dyn Backend) -> Result<()> {
        self.shared.iter_mut().for_each(|s| *s = false);
        let routed_keys = self.store.layers * self.store.experts_per_layer;
        let spare = self.pool.slots - self.owner.len();
        for (i, layer) in self.store.shared_layers().into_iter().enumerate().take(spare) {
            let (records, _) = self.store.read_many(layer, &[self.store.shared_id()])?;
            let Some(record) = records.first() else { bail!("MoE layer {layer}'s shared expert came back empty") };
            let slot = self.owner.len() + i;
            b.write_expert(&mut self.pool, slot, &self.store.host_expert(record))?;
            b.map_experts(&mut self.pool, &[((routed_keys + layer) as u32, Some(slot as u32))])?;
            self.shared[layer] = true;
        }
        self.busy_mark = self.mark();
        Ok(())
    }

    pub fn store(&self) -> &ExpertStore {
        &self.store
    }

    /// Replaces the pool with one of `slots` slots, starting cold. Output is
    /// unaffected; only speed changes.
    pub fn resize(&mut self, backend: &dyn Backend, slots: usize) -> Result<()> {
        if slots == 0 {
            bail!("the expert pool needs at least one slot");
        }
        // Free the old pool before allocating the new one.
        self.pool = backend.new_expert_pool(&self.store.layout, 1, 1)?;
        self.pool = Self::new_pool(backend, &self.store, slots)?;
        self.owner = vec![None; slots];
        self.slot_of.clear();
        self.victims.resize(slots);
        self.guessed = None;
        self.ahead = None;
        self.staging = None;
        self.ended = None;
        self.hold_shared(backend)
    }

    pub fn stats(&self) -> CacheStats {
        let mut total = CacheCounters::default();
        for l in &self.per_layer {
            total.add(l);
        }
        CacheStats {
            slots: self.owner.len(),
            pool_bytes: self.pool.bytes,
            shared_bytes: self.pool.bytes / self.pool.slots.max(1) * (self.pool.slots - self.owner.len()),
            staging_bytes: self.staging.as_ref().map_or(0, |s| s.bytes()),
            direct_io: self.store.direct_io(),
            total,
            per_layer: self.per_layer.clone(),
        }
    }

    pub fn reset_stats(&mut self) {
        self.per_layer.iter_mut().for_each(|c| *c = CacheCounters::default());
        self.busy_mark = self.mark();
    }

    /// Reads every expert into its own slot (the pool must have one for
    /// each). Counted as load, not in the hit/miss counters. Each batch of
    /// reads runs while the batch before it is written to its slots. After
    /// an error the cache is not fit for use (the load that called it fails).
    pub fn load_all(&mut self, b: &dyn Backend) -> Result<()> {
        let experts = self.store.experts_per_layer;
        if self.owner.len() < self.store.layers * experts {
            bail!("{} slots cannot hold all {} experts", self.owner.len(), self.store.layers * experts);
        }
        let all: Vec<u32> = (0..experts as u32).collect();
        let batches: Vec<(usize, &[u32])> = (0..self.store.layers).flat_map(|l| all.chunks(16).map(move |c| (l, c))).collect();
        let (store, pool, owner, slot_of) = (&self.store, &mut self.pool, &mut self.owner, &mut self.slot_of);
        let mut records = match batches.first() {
            Some(&(layer, some)) => store.read_many(layer, some)?.0,
            None => Vec::new(),
        };
        for (i, &(layer, some)) in batches.iter().enumerate() {
            let next = batches.get(i + 1).copied();
            let (written, read) = std::thread::scope(|scope| {
                let reader = next.map(|(l, n)| scope.spawn(move || store.read_many(l, n)));
                let written = some.iter().zip(&records).try_for_each(|(e, record)| -> Result<()> {
                    let key = key_of(experts, layer, *e);
                    b.write_expert(pool, key as usize, &store.host_expert(record))?;
                    owner[key as usize] = Some(key);
                    slot_of.insert(key, key);
                    Ok(())
                });
                (written, reader.map(|h| h.join()))
            });
            written?;
            records = match read {
                Some(Ok(read)) => read?.0,
                Some(Err(_)) => bail!("an expert read thread panicked"),
                None => Vec::new(),
            };
        }
        let table: Vec<(u32, Option<u32>)> = (0..(self.store.layers * experts) as u32).map(|k| (k, Some(k))).collect();
        b.map_experts(&mut self.pool, &table)?;
        self.busy_mark = self.mark();
        Ok(())
    }

    /// Whether a guess of the next MoE call's experts would be read ahead
    /// (a streaming pool, read-ahead on, a decode-sized call of `tokens`).
    pub fn wants_guess(&self, tokens: usize) -> bool {
        self.read_ahead > 0 && tokens <= READ_AHEAD_MAX_TOKENS && !self.holds_all()
    }

    /// [`ExpertCache::run_layer`] plus the layer's sigmoid-gated shared
    /// expert: in the routed experts' kernels where the pool holds every
    /// expert and this one too ([`Backend::moe_shared`]), else after them.
    pub fn run_layer_shared(&mut self, b: &dyn Backend, layer: usize, x: &Tensor, routes: &Routes, ids: Option<Vec<u32>>, shared: SharedExpert<'_>) -> Result<Tensor> {
        if let Some(key_base) = self.resident(layer, routes) {
            let key = self.shared.get(layer).is_some_and(|&s| s).then(|| self.store.layers * self.store.experts_per_layer + layer);
            return Ok(b.moe_shared(x, &self.pool, routes, key_base, &SharedExpert { key, ..shared })?);
        }
        let y = self.run_layer(b, layer, x, routes, ids)?;
        Ok(add_shared_expert(b, &y, x, &shared)?)
    }

    /// When every expert sits in a slot (and the table is in step): counts
    /// the call's (token, expert) pairs as hits and gives the layer's first
    /// key; the call then never leaves the device.
    fn resident(&mut self, layer: usize, routes: &Routes) -> Option<usize> {
        if !self.holds_all() || routes.gating.experts != self.store.experts_per_layer {
            return None;
        }
        self.per_layer[layer].hits += (routes.tokens() * routes.gating.top_k) as u64;
        Some(layer * self.store.experts_per_layer)
    }

    /// Adds a streaming call's counters, with the store's busy seconds since the call before's.
    fn count_call(&mut self, layer: usize, mut counters: CacheCounters) {
        let (busy, times) = self.mark();
        let (busy_before, times_before) = std::mem::replace(&mut self.busy_mark, (busy, times));
        counters.disk_busy_seconds = (busy - busy_before).max(0.0);
        counters.disk_reads = times.reads.saturating_sub(times_before.reads);
        counters.disk_read_seconds = (times.seconds - times_before.seconds).max(0.0);
        self.per_layer[layer].add(&counters);
    }

    fn mark(&self) -> (f64, ReadTimes) {
        (self.store.busy_seconds(), self.store.read_times())
    }

    /// Whether every expert of the model sits in a slot.
    fn holds_all(&self) -> bool {
        self.slot_of.len() == self.store.layers * self.store.experts_per_layer
    }

    fn key(&self, layer: usize, expert: u32) -> u32 {
        key_of(self.store.experts_per_layer, layer, expert)
    }

    /// Sets how missed experts choose their slots (the default:
    /// [`Eviction::Frequency`]); what the pool has learnt of the routing is
    /// dropped.
    pub fn set_eviction(&mut self, policy: Eviction) {
        self.victims = evict::Victims::new(policy, self.store.layers * self.store.experts_per_layer, self.owner.len());
    }

    /// Writes each streaming call's distinct experts to `path`, a line each.
    pub fn trace_routing(&mut self, path: &std::path::Path) -> Result<()> {
        self.trace = Some(evict::Trace::create(path)?);
        Ok(())
    }

    /// Routed-expert output of one MoE layer for `x` (`[tokens, hidden]`)
    /// routed by `routes`, whose ids are `ids` where already read back.
    pub fn run_layer(&mut self, b: &dyn Backend, layer: usize, x: &Tensor, routes: &Routes, ids: Option<Vec<u32>>) -> Result<Tensor> {
        let experts = self.store.experts_per_layer;
        if routes.gating.experts != experts {
            bail!("a router over {} experts for a store of {experts} per layer", routes.gating.experts);
        }
        // Only a decode-sized streaming call that follows the layer before's
        // counts a lead; any other call ends the chain.
        let ended = self.ended.take();
        if let Some(key_base) = self.resident(layer, routes) {
            return Ok(b.moe(x, &self.pool, routes, key_base)?);
        }
        let routed = match ids {
            Some(ids) => ids,
            None => b.routed_experts(routes)?,
        };
        let placed = self.place(layer, routes.tokens(), routed)?;
        self.execute(b, layer, x, routes, placed, ended)
    }

    /// Starts counting a prompt's reads: what [`ExpertCache::reads_since`] counts from.
    pub fn mark_reads(&mut self) -> ReadMark {
        self.epoch += 1;
        ReadMark { epoch: self.epoch, counters: self.stats().total }
    }

    /// The reads since `mark`, as passes over the distinct experts that missed.
    pub fn reads_since(&self, mark: &ReadMark) -> PromptReads {
        let missed = self.missed_in.iter().filter(|&&e| e > mark.epoch).count() as u64;
        PromptReads::new(&self.stats().total.since(&mark.counters), missed, self.store.record_bytes)
    }
}

/// The slot table key of `expert` of MoE layer `layer`.
fn key_of(experts_per_layer: usize, layer: usize, expert: u32) -> u32 {
    (layer * experts_per_layer) as u32 + expert
}
