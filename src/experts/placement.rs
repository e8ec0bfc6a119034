//! Where each expert of a streaming MoE call runs from: the pool slot that
//! already holds it (a hit), a pool slot it is read into, or the transient
//! staging it is read into and dropped from after the call.
//!
//! A decode-sized call gives its misses the slots of the experts needed least
//! lately: what decode reads is what decode will need again. A longer call (a
//! prefill chunk) takes only slots no expert holds, and runs the rest of its
//! misses from staging, so that a long prompt, which touches nearly every
//! expert, leaves the pool's decode working set where it was and reads each
//! missed expert once per chunk.

use std::collections::HashSet;

use anyhow::{bail, Result};

use super::{evict, key_of, ExpertCache, READ_AHEAD_MAX_TOKENS};

/// A streaming call's experts by where they run from.
pub(super) struct Placement {
    /// Experts already in a pool slot.
    pub hits: Vec<u32>,
    /// Missed experts read into pool slots, and each one's slot.
    pub to_pool: Vec<u32>,
    pub slots: Vec<u32>,
    /// Slot table entries of the experts whose slots `to_pool` takes (`None` each).
    pub evicted: Vec<(u32, Option<u32>)>,
    /// Missed experts run from staging.
    pub staged: Vec<u32>,
}

impl ExpertCache {
    /// Places the experts `routed` (every token's ids) of a call of `tokens`
    /// tokens to MoE layer `layer`, telling the eviction policy and the
    /// routing trace what the call needs. The slots given to misses leave
    /// the pool's bookkeeping now (the call fails or fills them).
    pub(super) fn place(&mut self, layer: usize, tokens: usize, mut routed: Vec<u32>) -> Result<Placement> {
        let experts = self.store.experts_per_layer;
        routed.sort_unstable();
        let uses = evict::uses(&routed);
        routed.dedup();
        if let Some(&e) = routed.iter().find(|&&e| e as usize >= experts) {
            bail!("router chose expert {e} of {experts}");
        }
        self.victims.needed(tokens, self.store.layers, uses.iter().map(|&(e, n)| (key_of(experts, layer, e), n)));
        if let Some(trace) = &mut self.trace {
            trace.call(layer, tokens, &uses)?;
        }
        let (hits, misses): (Vec<u32>, Vec<u32>) = routed.iter().partition(|&&e| self.slot_of.contains_key(&self.key(layer, e)));
        let mut pinned: HashSet<u32> = HashSet::new();
        for &e in &hits {
            if let Some(&s) = self.slot_of.get(&self.key(layer, e)) {
                pinned.insert(s);
                self.victims.touched(s);
            }
        }
        for &e in &misses {
            let key = self.key(layer, e) as usize;
            if let Some(seen) = self.missed_in.get_mut(key) {
                *seen = self.epoch + 1;
            }
        }
        let slots = if tokens <= READ_AHEAD_MAX_TOKENS {
            self.victims.choose(misses.len(), &self.owner, &pinned)
        } else {
            self.owner.iter().enumerate().filter(|(_, o)| o.is_none()).map(|(s, _)| s as u32).take(misses.len()).collect()
        };
        let mut evicted = Vec::new();
        for &s in &slots {
            if let Some(old) = self.owner[s as usize].take() {
                self.slot_of.remove(&old);
                evicted.push((old, None));
            }
        }
        let (to_pool, staged) = misses.split_at(slots.len().min(misses.len()));
        Ok(Placement { hits, to_pool: to_pool.to_vec(), slots, evicted, staged: staged.to_vec() })
    }

    /// Records that missed expert `e` of `layer` now sits in pool slot `slot`.
    pub(super) fn settle(&mut self, layer: usize, e: u32, slot: u32) -> (u32, Option<u32>) {
        let key = self.key(layer, e);
        self.owner[slot as usize] = Some(key);
        self.slot_of.insert(key, slot);
        self.victims.touched(slot);
        (key, Some(slot))
    }
}
