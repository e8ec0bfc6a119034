//! Cores kept awake while expert reads are in flight.
//!
//! A streaming decode waits mostly on reads, and each piece that lands wakes
//! the thread that waits for it. When nothing else runs on the host (the GPU
//! computes, the cores sleep), that wake-up costs the sleeping core's exit
//! from its idle state, and on a virtual machine the host's rescheduling of
//! a halted virtual CPU. On the H200 host (16 virtual CPUs, BENCHMARKS.md,
//! "streaming: cores kept awake during reads") the GPU backend's reads ran
//! at 1.32-1.43 GB/s while in flight, the CPU backend's at 1.48-1.61, and
//! the GPU backend's at 1.64 with every core kept busy by spinners at the
//! lowest priority.
//!
//! Pollers are such spinners: threads at the scheduler's idle priority
//! (`SCHED_IDLE` on Linux: a thread that wakes on a poller's core takes it
//! at once, so they cost the work nothing but power) that spin while a read
//! is in flight and for [`LINGER`] after, and sleep otherwise. Where the
//! priority cannot be lowered (other systems, a sandbox that refuses it) no
//! poller runs: one spinning at normal priority would take cores from the
//! reads and the compute.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long pollers spin after the last read lands: about one MoE layer's
/// attention and routing, so that they do not sleep and wake once per layer.
pub const LINGER: Duration = Duration::from_millis(3);

#[derive(Default)]
struct Flags {
    /// A read is in flight.
    active: AtomicBool,
    stop: AtomicBool,
    /// Pollers whose loop has not ended.
    live: AtomicUsize,
}

/// Threads that keep cores awake during reads (see the module's note).
pub struct Pollers {
    flags: Arc<Flags>,
    threads: Vec<Thread>,
}

impl Pollers {
    /// No pollers.
    pub fn none() -> Pollers {
        Pollers { flags: Arc::default(), threads: Vec::new() }
    }

    /// Pollers on this system by default: one per core on Linux, none
    /// elsewhere (not measured there).
    pub fn default_count() -> usize {
        if cfg!(target_os = "linux") {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            0
        }
    }

    /// Starts `n` pollers; those whose priority cannot be lowered end at
    /// once ([`Pollers::running`] counts the others).
    pub fn start(n: usize) -> Pollers {
        let flags = Arc::new(Flags::default());
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..n {
            let (flags, tx) = (Arc::clone(&flags), tx.clone());
            let spawned = std::thread::Builder::new().name(format!("read-poller-{i}")).spawn(move || {
                let lowered = lowest_priority();
                if lowered {
                    flags.live.fetch_add(1, Ordering::AcqRel);
                }
                // The receiver waits for every poller's answer below, until
                // each has dropped its sender.
                let _ = tx.send(lowered.then(std::thread::current));
                drop(tx);
                if lowered {
                    poll(&flags);
                    flags.live.fetch_sub(1, Ordering::AcqRel);
                }
            });
            if spawned.is_err() {
                break;
            }
        }
        drop(tx);
        let threads = rx.iter().flatten().collect();
        Pollers { flags, threads }
    }

    /// Pollers running.
    pub fn running(&self) -> usize {
        self.threads.len()
    }

    /// Reads went from none to some in flight: pollers spin.
    pub fn reads_started(&self) {
        self.flags.active.store(true, Ordering::Release);
        // Unparking a thread that is not parked only leaves it a token.
        self.threads.iter().for_each(Thread::unpark);
    }

    /// The last read in flight landed: pollers spin for [`LINGER`], then sleep.
    pub fn reads_ended(&self) {
        self.flags.active.store(false, Ordering::Release);
    }
}

impl Drop for Pollers {
    fn drop(&mut self) {
        self.flags.stop.store(true, Ordering::Release);
        self.threads.iter().for_each(Thread::unpark);
    }
}

/// A poller's loop: spin while reads are in flight and for [`LINGER`] after,
/// sleep until the next start.
fn poll(flags: &Flags) {
    while !flags.stop.load(Ordering::Acquire) {
        if flags.active.load(Ordering::Acquire) {
            std::hint::spin_loop();
            continue;
        }
        let idle = Instant::now();
        while !flags.active.load(Ordering::Acquire) && !flags.stop.load(Ordering::Acquire) && idle.elapsed() < LINGER {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
        if !flags.active.load(Ordering::Acquire) && !flags.stop.load(Ordering::Acquire) {
            // A start between the check and here left a token: no wake is lost.
            std::thread::park();
        }
    }
}

/// Puts the calling thread at the scheduler's idle priority; false where
/// that is not possible.
#[cfg(target_os = "linux")]
fn lowest_priority() -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param
    // (SCHED_IDLE takes priority 0).
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn lowest_priority() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pollers start, follow reads, and end with their owner; where the
    /// priority cannot be lowered none runs (never a normal-priority spinner).
    #[test]
    fn pollers_follow_reads_and_end_when_dropped() {
        let p = Pollers::start(2);
        // Lowering one's own priority needs no privilege on Linux.
        let expected = if cfg!(target_os = "linux") { 2 } else { 0 };
        assert_eq!(p.running(), expected);
        assert_eq!(p.flags.live.load(Ordering::Acquire), expected);
        for _ in 0..3 {
            p.reads_started();
            std::thread::sleep(Duration::from_millis(2));
            p.reads_ended();
            std::thread::sleep(LINGER * 2);
        }
        let flags = Arc::clone(&p.flags);
        drop(p);
        let t = Instant::now();
        while flags.live.load(Ordering::Acquire) > 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(flags.live.load(Ordering::Acquire), 0, "pollers outlived their owner");
        assert_eq!(Pollers::none().running(), 0);
    }
}
