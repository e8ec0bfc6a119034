//! Settings and measurements of this process as a whole (the allocator, the
//! compute thread pool, peak memory), which the command line sets up once
//! before any model code runs.

use anyhow::{Context, Result};

/// Keeps glibc's allocator from handing each large activation buffer back to
/// the kernel when it is freed. By default buffers above 128 KB-32 MB are
/// fresh mappings, so every op of a prefill pays page faults and zeroing for
/// its output (5-15% of a prefill measured); below 256 MB they now come from
/// the heap, which is trimmed once 512 MB lie free at its top. Peak RSS is
/// unchanged: a freed buffer is reused by the next one. Call it before any
/// thread starts.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// Sizes the global compute thread pool (the CPU backend's), where `threads`
/// is given; otherwise it uses every core. Only the first call can take effect.
pub fn set_compute_threads(threads: Option<usize>) -> Result<()> {
    if let Some(n) = threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("setting the thread count")?;
    }
    Ok(())
}

/// The process's peak resident set (VmHWM), where the OS reports it (Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}
