//! A bound on the memory of a child process that runs untrusted work (a
//! chat template's rendering, a grammar's probe): [`cap_memory`]. Its heap
//! is capped on every OS: the system allocator refuses an allocation once
//! the bytes allocated since the cap was set would pass it (Rust then aborts
//! the process with "memory allocation of N bytes failed", which its parent
//! reports). That bounds the bytes of every value such work makes, macOS
//! included, where `RLIMIT_DATA` is not enforced. On Linux `RLIMIT_DATA`
//! backs it up at twice the cap (the data segment and private mappings: the
//! allocator's own overhead, memory not allocated through Rust), so there
//! too the heap cap is what stops a template or schema that grows. Without
//! a cap (every other process) an allocation costs one extra relaxed load.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use anyhow::Result;

/// The system allocator, capped where [`cap_memory`] was called.
#[global_allocator]
static HEAP: CappedHeap = CappedHeap;

/// Bounds this process's memory to `bytes` from now on (see the module's comment).
pub fn cap_memory(bytes: u64) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        let backstop = bytes.saturating_mul(2) as libc::rlim_t;
        let limit = libc::rlimit { rlim_cur: backstop, rlim_max: backstop };
        // SAFETY: setrlimit reads the struct it is given and changes only this process's limit.
        if unsafe { libc::setrlimit(libc::RLIMIT_DATA, &limit) } != 0 {
            anyhow::bail!("limiting this process's memory: {}", std::io::Error::last_os_error());
        }
    }
    #[cfg(unix)]
    {
        // A process stopped at its cap aborts: no core file for it.
        let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) };
    }
    LEDGER.set(bytes);
    Ok(())
}

/// What the allocator counts: the cap in bytes (0: none), and the bytes
/// allocated less those freed since it was set (negative where earlier
/// allocations were freed since: those add to the cap, at most what the
/// process held when it set the cap).
struct Ledger {
    cap: AtomicIsize,
    held: AtomicIsize,
}

static LEDGER: Ledger = Ledger::new();

struct CappedHeap;

impl Ledger {
    const fn new() -> Ledger {
        Ledger { cap: AtomicIsize::new(0), held: AtomicIsize::new(0) }
    }

    fn set(&self, bytes: u64) {
        self.held.store(0, Ordering::Relaxed);
        self.cap.store(isize::try_from(bytes).unwrap_or(isize::MAX).max(1), Ordering::Relaxed);
    }

    /// Whether `bytes` more may be held (counted if so).
    fn admit(&self, bytes: usize) -> bool {
        let cap = self.cap.load(Ordering::Relaxed);
        if cap == 0 {
            return true;
        }
        let bytes = isize::try_from(bytes).unwrap_or(isize::MAX);
        if self.held.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes) > cap {
            self.held.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn release(&self, bytes: usize) {
        if self.cap.load(Ordering::Relaxed) != 0 {
            self.held.fetch_sub(isize::try_from(bytes).unwrap_or(isize::MAX), Ordering::Relaxed);
        }
    }
}

fn admit(bytes: usize) -> bool {
    LEDGER.admit(bytes)
}

fn release(bytes: usize) {
    LEDGER.release(bytes)
}

// SAFETY: every call goes to the system allocator with the caller's own
// arguments; the cap only turns some allocations into failures (null),
// which GlobalAlloc allows.
unsafe impl GlobalAlloc for CappedHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as the caller promised for `layout`.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            release(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as the caller promised for `layout`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            release(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        release(layout.size());
        // SAFETY: `ptr` came from this allocator (so from System) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !admit(new_size - old) {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` came from System with `layout`; the caller promised `new_size`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        match (p.is_null(), new_size > old) {
            (true, true) => release(new_size - old),
            (false, false) => release(old - new_size),
            _ => {}
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_refuses_what_would_pass_it_and_counts_what_is_freed() {
        let ledger = Ledger::new();
        assert!(ledger.admit(usize::MAX), "no cap until one is set");
        ledger.set(1000);
        assert!(ledger.admit(600));
        assert!(!ledger.admit(600), "1,200 bytes held would pass the cap");
        ledger.release(600);
        assert!(ledger.admit(600), "what was freed counts no more");
        assert!(ledger.admit(400));
        assert!(!ledger.admit(1));
    }
}
