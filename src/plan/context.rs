//! How long a context the plan holds KV cache for: the length asked for, or
//! (auto) as long as the model takes and the memory allows. Below
//! [`AUTO_CONTEXT_FLOOR`] tokens (or the model's own context, if shorter) an
//! auto-sized pool gives slots to the KV cache, down to its floor, and the
//! plan says so.

use super::GB;

/// The context an auto-sized pool makes room for by giving up slots: the
/// prompts of coding agents run to tens of thousands of tokens.
pub const AUTO_CONTEXT_FLOOR: usize = 32768;

/// The context a plan holds KV for, and the pool it leaves.
#[derive(Debug, PartialEq)]
pub(super) struct ContextPlan {
    pub tokens: usize,
    pub slots: usize,
    /// The trade, when the pool gave slots to the KV cache.
    pub note: Option<String>,
}

/// What the context may grow into.
pub(super) struct ContextRoom {
    /// Tokens already counted in `bytes_for`.
    pub base: usize,
    /// The longest context the model takes.
    pub most: usize,
    pub kv_bytes_per_token: u64,
    /// Memory the plan may use in all.
    pub limit: u64,
    /// Whether the pool may give slots (an auto-sized pool, down to `floor_slots`).
    pub may_trade: bool,
    pub floor_slots: usize,
    pub record_bytes: u64,
}

/// Grows the context from `room.base` into what `room.limit` leaves beside a
/// pool of `slots` (`bytes_for(slots)`: the plan's memory at the base
/// context), up to `room.most`; where that stays below the floor, trades
/// slots for KV.
pub(super) fn extend(room: &ContextRoom, slots: usize, bytes_for: impl Fn(usize) -> u64) -> ContextPlan {
    let kv = room.kv_bytes_per_token.max(1);
    let fits = |slots: usize| (room.base + (room.limit.saturating_sub(bytes_for(slots)) / kv) as usize).min(room.most);
    let tokens = fits(slots);
    let wanted = room.most.min(AUTO_CONTEXT_FLOOR);
    if tokens >= wanted || !room.may_trade || slots <= room.floor_slots {
        return ContextPlan { tokens, slots, note: None };
    }
    // The largest pool (at least the floor) beside which `wanted` tokens fit.
    let kept = if fits(room.floor_slots) < wanted {
        room.floor_slots
    } else {
        let (mut fitting, mut over) = (room.floor_slots, slots);
        while over - fitting > 1 {
            let mid = fitting + (over - fitting) / 2;
            if fits(mid) >= wanted {
                fitting = mid;
            } else {
                over = mid;
            }
        }
        fitting
    };
    let traded = fits(kept);
    let note = format!(
        "the pool gives {} slots ({:.2} GB) to the KV cache so that a context of {traded} tokens fits \
         (beside the whole pool only {tokens} would; --plan-context or --max-context sets it instead)",
        slots - kept,
        (slots - kept) as f64 * room.record_bytes as f64 / GB
    );
    ContextPlan { tokens: traded, slots: kept, note: Some(note) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 GB per slot, 1 MB of KV per token, 4 GB besides: the base 4096 tokens' KV in it.
    fn room(limit_gb: u64, most: usize, may_trade: bool) -> ContextRoom {
        ContextRoom { base: 4096, most, kv_bytes_per_token: 1_000_000, limit: limit_gb * 1_000_000_000, may_trade, floor_slots: 10, record_bytes: 1_000_000_000 }
    }
    fn bytes_for(slots: usize) -> u64 {
        4_000_000_000 + slots as u64 * 1_000_000_000
    }

    #[test]
    fn the_context_grows_into_spare_memory_up_to_the_models() {
        // 20 slots = 24 GB; 40 GB leaves 16 GB = 16,000 more tokens.
        assert_eq!(extend(&room(40, 1 << 20, false), 20, bytes_for), ContextPlan { tokens: 20_096, slots: 20, note: None });
        assert_eq!(extend(&room(40, 8192, true), 20, bytes_for), ContextPlan { tokens: 8192, slots: 20, note: None });
    }

    #[test]
    fn an_auto_pool_gives_slots_for_the_floor_and_says_so() {
        // 50 GB: beside 20 slots 30,096 tokens; 17 slots leave room for 33,096 (>= 32,768).
        let p = extend(&room(50, 1 << 20, true), 20, bytes_for);
        assert_eq!((p.tokens, p.slots), (33_096, 17));
        assert!(p.note.as_deref().is_some_and(|n| n.contains("gives 3 slots (3.00 GB)")), "{p:?}");
        // Never below the floor; an explicit pool keeps its slots.
        assert_eq!(extend(&room(40, 1 << 20, true), 20, bytes_for), ContextPlan { tokens: 30_096, slots: 10, note: extend(&room(40, 1 << 20, true), 20, bytes_for).note });
        assert_eq!(extend(&room(40, 1 << 20, false), 20, bytes_for), ContextPlan { tokens: 20_096, slots: 20, note: None });
    }
}
