//! Reuse of KV and recurrent state across requests.
//!
//! Each entry is the state of the model after consuming exactly the token ids
//! it is keyed by. A request reuses the longest entry whose ids are a strict
//! prefix of its prompt (extend-only: recurrent state cannot be rewound, so a
//! partial match is no match), and feeds only the tokens after it. At least one
//! prompt token is always left to feed, because the next token's logits come
//! from feeding. Entries are bounded in count and in total tokens; the least
//! recently used goes first.

use anyhow::Result;
use serde::Serialize;

use crate::model::SequenceState;

struct Entry {
    ids: Vec<u32>,
    state: SequenceState,
    last_used: u64,
}

/// The cache's counters, as `/api/show` reports them.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PrefixCacheStats {
    pub enabled: bool,
    pub entries: usize,
    pub max_entries: usize,
    /// Tokens held across all entries.
    pub tokens: usize,
    pub token_budget: usize,
    /// Requests that reused an entry.
    pub hits: u64,
    /// Requests that started from an empty state.
    pub misses: u64,
    /// Prompt tokens that did not have to be fed thanks to a hit.
    pub reused_tokens: u64,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    max_entries: usize,
    token_budget: usize,
    clock: u64,
    hits: u64,
    misses: u64,
    reused_tokens: u64,
}

impl PrefixCache {
    pub fn new(max_entries: usize, token_budget: usize) -> PrefixCache {
        PrefixCache { entries: Vec::new(), max_entries, token_budget, clock: 0, hits: 0, misses: 0, reused_tokens: 0 }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A copy (made by `copy`) of the state of the longest cached strict
    /// prefix of `prompt`, or `None` (counted as a miss).
    pub fn lookup(
        &mut self,
        prompt: &[u32],
        copy: impl FnOnce(&SequenceState) -> Result<SequenceState>,
    ) -> Result<Option<SequenceState>> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.ids.len() < prompt.len() && prompt.starts_with(&e.ids))
            .max_by_key(|(_, e)| e.ids.len())
            .map(|(i, _)| i);
        let Some(i) = best else {
            self.misses += 1;
            return Ok(None);
        };
        let now = self.tick();
        let entry = &mut self.entries[i];
        entry.last_used = now;
        let state = copy(&entry.state)?;
        self.hits += 1;
        self.reused_tokens += entry.ids.len() as u64;
        Ok(Some(state))
    }

    /// Stores `state`, which has consumed exactly `ids`, evicting least
    /// recently used entries to stay within the entry and token bounds.
    pub fn insert(&mut self, ids: Vec<u32>, state: SequenceState) {
        if ids.is_empty() || ids.len() > self.token_budget || self.max_entries == 0 || state.position != ids.len() {
            return;
        }
        let now = self.tick();
        if let Some(e) = self.entries.iter_mut().find(|e| e.ids == ids) {
            e.state = state;
            e.last_used = now;
            return;
        }
        while !self.entries.is_empty()
            && (self.entries.len() >= self.max_entries || self.tokens() + ids.len() > self.token_budget)
        {
            let oldest = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i).unwrap_or(0);
            self.entries.swap_remove(oldest);
        }
        self.entries.push(Entry { ids, state, last_used: now });
    }

    /// Drops every entry (after a failure left the state in doubt).
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    fn tokens(&self) -> usize {
        self.entries.iter().map(|e| e.ids.len()).sum()
    }

    pub fn states(&self) -> impl Iterator<Item = &SequenceState> {
        self.entries.iter().map(|e| &e.state)
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            enabled: true,
            entries: self.entries.len(),
            max_entries: self.max_entries,
            tokens: self.tokens(),
            token_budget: self.token_budget,
            hits: self.hits,
            misses: self.misses,
            reused_tokens: self.reused_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(n: usize) -> SequenceState {
        SequenceState { layers: Vec::new(), recent: Vec::new(), draft: None, position: n }
    }

    fn copy(s: &SequenceState) -> Result<SequenceState> {
        Ok(state(s.position))
    }

    fn hit(c: &mut PrefixCache, prompt: &[u32]) -> Option<usize> {
        c.lookup(prompt, copy).expect("copying a test state").map(|s| s.position)
    }

    #[test]
    fn longest_strict_prefix_wins() {
        let mut c = PrefixCache::new(4, 100);
        c.insert(vec![1, 2], state(2));
        c.insert(vec![1, 2, 3, 4], state(4));
        c.insert(vec![9, 9, 9], state(3));
        assert_eq!(hit(&mut c, &[1, 2, 3, 4, 5]), Some(4));
        assert_eq!(hit(&mut c, &[1, 2, 3, 4]), Some(2), "an entry equal to the prompt leaves nothing to feed");
        assert_eq!(hit(&mut c, &[1, 2, 7]), Some(2));
        assert_eq!(hit(&mut c, &[1, 3]), None, "extend-only: a partial match is no match");
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.reused_tokens), (3, 1, 8));
    }

    #[test]
    fn least_recently_used_goes_first_within_bounds() {
        let mut c = PrefixCache::new(2, 100);
        c.insert(vec![1], state(1));
        c.insert(vec![2], state(1));
        assert_eq!(hit(&mut c, &[1, 5]), Some(1));
        c.insert(vec![3], state(1));
        assert_eq!(hit(&mut c, &[2, 5]), None, "entry [2] was least recently used");
        assert_eq!(hit(&mut c, &[1, 5]), Some(1));
        // The token budget evicts too, and an entry over the budget is not kept.
        let mut c = PrefixCache::new(8, 5);
        c.insert(vec![1, 1, 1], state(3));
        c.insert(vec![2, 2, 2], state(3));
        assert_eq!(c.stats().tokens, 3);
        c.insert(vec![7; 6], state(6));
        assert_eq!(c.stats().entries, 1);
    }
}
