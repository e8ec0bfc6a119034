//! Routed experts streamed from disk into a fixed pool of slots shared by all
//! layers.
//!
//! The router's logits are routed where they were computed (a kernel on a
//! GPU), and the pool's slot table (expert -> slot) lives there too. When the
//! pool holds every expert, a MoE call never leaves the device. Otherwise,
//! per MoE call: read back the routed expert ids, pin the layer's experts
//! already in a slot (hits), give the rest the slots of the experts needed
//! least lately (`evict.rs`; pinned slots skipped), read the misses with many
//! reads in flight, update the slot table, and compute. When a call needs more
//! experts than there are slots (a long prefill touches nearly every expert),
//! the experts are taken in batches that fit, hits first, and the next
//! batch's reads overlap the current batch's compute.
//!
//! Output never depends on the pool size: each (token, expert) output is
//! computed the same way wherever the expert sits, batches write disjoint rows,
//! and the weighted sum runs in routing-rank order at the end. That holds bit
//! for bit on the CPU backend. On the wgpu backend a pool that holds every
//! expert keeps 4-bit slots interleaved and runs the shared expert as one more
//! rank, which rounds differently from a streaming pool; tests check that
//! the tokens are the same.

mod evict;
mod stats;
mod store;

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use slotstream_backend::{add_shared_expert, Backend, ExpertPool, Routes, SharedExpert, Tensor};

pub use evict::{Eviction, DEFAULT_HALF_LIFE};
pub use stats::{CacheCounters, CacheStats};
pub use store::{ExpertRecord, ExpertStore, ExpertTensors, Handover, Progress, ReadTimes};

/// Experts of one MoE layer being read ahead of its call.
struct Ahead {
    layer: usize,
    experts: Vec<u32>,
    records: Receiver<Result<(Vec<ExpertRecord>, f64)>>,
}

/// Most tokens of a MoE call that reads ahead the next call's guessed experts
/// (decode, a few drafted tokens; a prefill touches most experts anyway).
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
    ahead: Option<Ahead>,
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

    /// Notes `guess` (the next MoE layer's router applied to this layer's
    /// input: in trained models the hidden state moves little between
    /// layers) as a guess of MoE layer `layer`'s experts. Those not in a
    /// slot are read once the current call has issued its own reads, and
    /// that call uses whichever it then needs. Output never depends on it.
    /// The current call's `current` routes are read back with the guess (one
    /// round trip on a GPU); their ids are returned for [`ExpertCache::run_layer`].
    pub fn guess_next(&mut self, b: &dyn Backend, layer: usize, guess: &Routes, current: &Routes) -> Result<Vec<u32>> {
        if layer >= self.store.layers || guess.gating.experts != self.store.experts_per_layer {
            bail!("a guess for MoE layer {layer} over {} experts does not fit the store", guess.gating.experts);
        }
        let mut both = b.routed_experts_many(&[current, guess])?.into_iter();
        let (Some(current_ids), Some(guessed)) = (both.next(), both.next()) else {
            bail!("the backend read back fewer routings than asked for");
        };
        // Each token's best `read_ahead` guesses (ids come best first).
        let k = guess.gating.top_k.max(1);
        let mut ids: Vec<u32> = guessed.chunks(k).flat_map(|t| t[..self.read_ahead.min(t.len())].to_vec()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.retain(|&e| (e as usize) < self.store.experts_per_layer && !self.slot_of.contains_key(&self.key(layer, e)));
        self.guessed = (!ids.is_empty()).then_some((layer, ids));
        Ok(current_ids)
    }

    /// Takes what is being read ahead for `layer`, counted in `counters`
    /// (without waiting for it), with the experts of `misses` it holds;
    /// `None` when it holds none of them. Anything read ahead is counted
    /// as read, whether used or dropped (for another layer).
    fn take_ahead(&mut self, layer: usize, misses: &[u32], counters: &mut CacheCounters) -> Option<(Ahead, Vec<u32>)> {
        let ahead = self.ahead.take()?;
        let covered: Vec<u32> =
            if ahead.layer == layer { misses.iter().copied().filter(|e| ahead.experts.contains(e)).collect() } else { Vec::new() };
        counters.read_ahead += ahead.experts.len() as u64;
        counters.read_ahead_used += covered.len() as u64;
        // The guesses not used were read all the same.
        counters.bytes_read += (ahead.experts.len() - covered.len()) as u64 * self.store.record_bytes;
        (!covered.is_empty()).then_some((ahead, covered))
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
        let gating = routes.gating;
        let experts = self.store.experts_per_layer;
        if gating.experts != experts {
            bail!("a router over {} experts for a store of {experts} per layer", gating.experts);
        }
        let key_base = layer * experts;
        // Only a decode-sized streaming call that follows the layer before's
        // counts a lead; any other call ends the chain.
        let ended = self.ended.take();
        if let Some(key_base) = self.resident(layer, routes) {
            return Ok(b.moe(x, &self.pool, routes, key_base)?);
        }
        let mut needed = match ids {
            Some(ids) => ids,
            None => b.routed_experts(routes)?,
        };
        needed.sort_unstable();
        let uses = evict::uses(&needed);
        needed.dedup();
        if let Some(&e) = needed.iter().find(|&&e| e as usize >= experts) {
            bail!("router chose expert {e} of {experts}");
        }
        self.victims.needed(routes.tokens(), self.store.layers, uses.iter().map(|&(e, n)| (key_of(experts, layer, e), n)));
        if let Some(trace) = &mut self.trace {
            trace.call(layer, routes.tokens(), &uses)?;
        }
        // Hits first: they need no reads and their compute hides the first reads.
        let (mut order, misses): (Vec<u32>, Vec<u32>) =
            needed.iter().partition(|&&e| self.slot_of.contains_key(&self.key(layer, e)));
        let hit_count = order.len();
        order.extend(misses);
        let batches: Vec<&[u32]> = order.chunks(self.owner.len()).collect();
        let mut counters = CacheCounters { hits: hit_count as u64, misses: (order.len() - hit_count) as u64, ..Default::default() };

        let misses_of = |cache: &ExpertCache, batch: &[u32]| -> Vec<u32> {
            batch.iter().copied().filter(|&e| !cache.slot_of.contains_key(&cache.key(layer, e))).collect()
        };
        // The first batch's misses are read here, each written to its slot as
        // it lands; later batches' are read while the batch before computes.
        let mut record_misses = batches.first().map(|bt| misses_of(self, bt)).unwrap_or_default();
        let mut records: Vec<ExpertRecord> = Vec::new();
        // A decode-sized call takes what was read ahead for it (those misses
        // go last, already in memory) and reads the next call's guess once
        // its own reads are issued; a call in batches does neither.
        let (mut ahead, mut guess) = (None, None);
        if batches.len() == 1 {
            ahead = self.take_ahead(layer, &record_misses, &mut counters);
            if let Some((_, covered)) = &ahead {
                record_misses.sort_by_key(|e| covered.contains(e));
            }
            guess = self.guessed.take();
        } else {
            self.take_ahead(layer, &[], &mut counters);
            self.guessed = None;
        }
        let mut started = None;
        let (mut issued_at, mut landed_at) = (None, None);

        let mut total: Option<Tensor> = None;
        for (i, batch) in batches.iter().enumerate() {
            // Place this batch: pin its hits, give each missed expert a victim slot.
            let mut pinned: HashSet<u32> = HashSet::new();
            let mut slot_for: HashMap<u32, u32> = HashMap::new();
            for &e in batch.iter() {
                if let Some(&s) = self.slot_of.get(&self.key(layer, e)) {
                    pinned.insert(s);
                    self.victims.touched(s);
                    slot_for.insert(e, s);
                }
            }
            let mut table: Vec<(u32, Option<u32>)> = Vec::new();
            let victims = self.victims.choose(record_misses.len(), &self.owner, &pinned);
            if victims.len() != record_misses.len() {
                bail!("{} slots left for {} missed experts of MoE layer {layer}", victims.len(), record_misses.len());
            }
            for &s in &victims {
                if let Some(old) = self.owner[s as usize].take() {
                    self.slot_of.remove(&old);
                    table.push((old, None));
                }
            }
            let (store, pool) = (&self.store, &mut self.pool);
            let write_seconds = std::cell::Cell::new(0.0);
            let timed = |write: &mut dyn FnMut() -> Result<()>| -> Result<()> {
                let t = Instant::now();
                write()?;
                write_seconds.set(write_seconds.get() + t.elapsed().as_secs_f64());
                Ok(())
            };
            let written = if i == 0 {
                let wait = Instant::now();
                let covered = ahead.as_ref().map_or(0, |(_, c)| c.len());
                let to_read = &record_misses[..record_misses.len() - covered];
                let mut guess = guess.take();
                let ahead_start = self.ahead_start;
                let progress = |at: Progress| {
                    if at == Progress::Issued {
                        issued_at = Some(Instant::now());
                    }
                    if at == ahead_start {
                        started = guess.take().map(|(l, experts): (usize, Vec<u32>)| Ahead { layer: l, records: store.read_later(l, experts.clone()), experts });
                    }
                };
                // What was read ahead, once this call's own reads are issued.
                let mut ahead_secs = 0.0;
                let mut ahead = ahead.take();
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
                    // A guess that failed to read (or whose job is gone) is
                    // read again here: it is needed now.
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
                read.map(|secs| {
                    counters.read_seconds += secs;
                    // With no reads of its own, the call's tail is not counted.
                    landed_at = (!to_read.is_empty()).then(|| wait + std::time::Duration::from_secs_f64(secs));
                })
            } else {
                records.iter().enumerate().try_for_each(|(at, record)| {
                    timed(&mut || Ok(b.write_expert(pool, victims[at] as usize, &store.host_expert(record))?))
                })
            };
            counters.write_seconds += write_seconds.get();
            if let Some(a) = started.take() {
                self.ahead = Some(a);
            }
            if let Err(e) = written {
                // The evicted experts leave the device table with their slots,
                // whatever those hold now.
                let _ = b.map_experts(&mut self.pool, &table);
                return Err(e);
            }
            for (e, &s) in record_misses.iter().zip(&victims) {
                counters.bytes_read += self.store.record_bytes;
                let key = self.key(layer, *e);
                self.owner[s as usize] = Some(key);
                self.slot_of.insert(key, s);
                self.victims.touched(s);
                slot_for.insert(*e, s);
                table.push((key, Some(s)));
            }
            if batches.len() > 1 {
                // Only this batch's experts may run now: the layer's other
                // entries say "no slot" until the call ends.
                table.extend((0..experts as u32).map(|e| (self.key(layer, e), slot_for.get(&e).copied())));
            }
            b.map_experts(&mut self.pool, &table)?;
            if batches.len() == 1 {
                let out = b.moe(x, &self.pool, routes, key_base);
                let now = Instant::now();
                if let (Some((before, ended)), Some(issued)) = (ended, issued_at) {
                    if before + 1 == layer {
                        counters.lead_seconds = issued.saturating_duration_since(ended).as_secs_f64();
                    }
                }
                counters.tail_seconds = landed_at.map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
                self.ended = out.is_ok().then_some((layer, now));
                self.count_call(layer, counters);
                return Ok(out?);
            }
            // Read the next batch while this one computes.
            let next_misses = batches.get(i + 1).map(|bt| misses_of(self, bt)).unwrap_or_default();
            let store = &self.store;
            let pool = &self.pool;
            let (out, next) = std::thread::scope(|scope| {
                let reader = (!next_misses.is_empty()).then(|| scope.spawn(|| store.read_many(layer, &next_misses)));
                let out = b.moe_expert_outputs(x, pool, routes, key_base);
                let wait = Instant::now();
                let next = reader.map(|h| h.join());
                (out, next.map(|n| (n, wait.elapsed().as_secs_f64())))
            });
            let out = out?;
            total = Some(match total {
                None => out,
                Some(t) => b.add(&t, &out)?,
            });
            match next {
                Some((Ok(Ok((recs, secs))), waited)) => {
                    records = recs;
                    counters.read_seconds += secs;
                    counters.wait_seconds += waited;
                }
                Some((Ok(Err(e)), _)) => return Err(e),
                Some((Err(_), _)) => bail!("an expert read thread panicked"),
                None => records = Vec::new(),
            }
            record_misses = next_misses;
        }
        // The table back in step with the pool for this layer.
        let table: Vec<(u32, Option<u32>)> =
            (0..experts as u32).map(|e| self.key(layer, e)).map(|k| (k, self.slot_of.get(&k).copied())).collect();
        b.map_experts(&mut self.pool, &table)?;
        self.count_call(layer, counters);
        let outputs = match total {
            Some(t) => t,
            None => bail!("a MoE call with no tokens"),
        };
        Ok(b.moe_combine(&outputs, routes)?)
    }
}

/// The slot table key of `expert` of MoE layer `layer`.
fn key_of(experts_per_layer: usize, layer: usize, expert: u32) -> u32 {
    (layer * experts_per_layer) as u32 + expert
}
