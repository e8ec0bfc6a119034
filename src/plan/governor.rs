//! The governor: keeps an auto-sized server's expert pool in step with the
//! machine's free memory. Every 15 s it re-plans; it shrinks when the plan
//! wants at least 1 GB less, and grows when the plan has wanted at least 2 GB
//! more for 60 s of calm. Resizes happen only between requests, and never for
//! explicitly sized pools. Output does not change with the pool size.

/// Re-check period.
pub const CHECK_EVERY_SECS: f64 = 15.0;
pub const SHRINK_BY_AT_LEAST: u64 = 1_000_000_000;
pub const GROW_BY_AT_LEAST: u64 = 2_000_000_000;
pub const CALM_SECS: f64 = 60.0;

/// What the governor decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Keep,
    Resize { from_bytes: u64, to_bytes: u64 },
}

#[derive(Debug, Default)]
pub struct Governor {
    last_check: Option<f64>,
    grow_wanted_since: Option<f64>,
    /// A resize decided while a request was running, applied when idle.
    pending: Option<u64>,
}

impl Governor {
    pub fn new() -> Governor {
        Governor::default()
    }

    /// Called periodically with the time (seconds), the pool size the plan
    /// wants now, the current pool size, and whether no request is running.
    pub fn tick(&mut self, now: f64, desired: u64, current: u64, idle: bool) -> Decision {
        let due = self.last_check.is_none_or(|t| now - t >= CHECK_EVERY_SECS);
        if due {
            self.last_check = Some(now);
            if desired + SHRINK_BY_AT_LEAST <= current {
                self.grow_wanted_since = None;
                self.pending = Some(desired);
            } else if desired >= current + GROW_BY_AT_LEAST {
                let since = *self.grow_wanted_since.get_or_insert(now);
                if now - since >= CALM_SECS {
                    self.pending = Some(desired);
                }
            } else {
                self.grow_wanted_since = None;
                self.pending = None;
            }
        }
        match self.pending {
            Some(to) if idle => {
                self.pending = None;
                self.grow_wanted_since = None;
                Decision::Resize { from_bytes: current, to_bytes: to }
            }
            _ => Decision::Keep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1_000_000_000;

    #[test]
    fn shrinks_at_once_when_memory_is_needed() {
        let mut g = Governor::new();
        assert_eq!(g.tick(0.0, 10 * G, 12 * G, true), Decision::Resize { from_bytes: 12 * G, to_bytes: 10 * G });
    }

    #[test]
    fn small_differences_are_ignored() {
        let mut g = Governor::new();
        assert_eq!(g.tick(0.0, 11 * G + G / 2, 12 * G, true), Decision::Keep);
        assert_eq!(g.tick(100.0, 13 * G, 12 * G, true), Decision::Keep);
    }

    #[test]
    fn grows_only_after_sixty_seconds_of_calm() {
        let mut g = Governor::new();
        assert_eq!(g.tick(0.0, 15 * G, 12 * G, true), Decision::Keep);
        assert_eq!(g.tick(30.0, 15 * G, 12 * G, true), Decision::Keep);
        assert_eq!(g.tick(45.0, 15 * G, 12 * G, true), Decision::Keep);
        assert_eq!(g.tick(60.0, 15 * G, 12 * G, true), Decision::Resize { from_bytes: 12 * G, to_bytes: 15 * G });
    }

    #[test]
    fn pressure_resets_the_calm_clock() {
        let mut g = Governor::new();
        g.tick(0.0, 15 * G, 12 * G, true);
        g.tick(30.0, 12 * G, 12 * G, true);
        assert_eq!(g.tick(60.0, 15 * G, 12 * G, true), Decision::Keep);
    }

    #[test]
    fn checks_only_every_fifteen_seconds_and_waits_for_idle() {
        let mut g = Governor::new();
        assert_eq!(g.tick(0.0, 12 * G, 12 * G, true), Decision::Keep);
        // Pressure appears, but the next check is not due yet.
        assert_eq!(g.tick(5.0, 8 * G, 12 * G, true), Decision::Keep);
        // Due, but a request is running: remembered, applied when idle.
        assert_eq!(g.tick(15.0, 8 * G, 12 * G, false), Decision::Keep);
        assert_eq!(g.tick(16.0, 8 * G, 12 * G, true), Decision::Resize { from_bytes: 12 * G, to_bytes: 8 * G });
    }
}
