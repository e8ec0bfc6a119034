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

/// Dropped, hands the heap's free memory back to the OS (glibc: `malloc_trim`).
/// [`tune_allocator`]'s trim threshold keeps up to 512 MB freed in each
/// thread's arena for reuse, which suits one model's buffers; a server that
/// unloads a model and loads another kept what the first freed (a 30-minute
/// soak that reloaded models all along: RSS 180 -> 343 MB). A served model
/// holds one as its last field, so unloading it trims once the engine is gone.
pub struct ReleaseFreedMemory;

impl Drop for ReleaseFreedMemory {
    fn drop(&mut self) {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only returns free pages to the OS; it is thread-safe.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// Sizes the global compute thread pool (the CPU backend's), where `threads`
/// is given; otherwise it uses every core. Only the first call can take effect.
pub fn set_compute_threads(threads: Option<usize>) -> Result<()> {
    if threads == Some(0) {
        anyhow::bail!("--threads 0: give at least 1 (leave --threads out to use every core)");
    }
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

/// Set by the first Ctrl-C after [`catch_interrupt`]: the run stops its
/// answer and reports what it did.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_interrupt(_signal: libc::c_int) {
    use std::sync::atomic::Ordering;
    if INTERRUPTED.swap(true, Ordering::SeqCst) {
        // A second Ctrl-C: the user wants out now.
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) }
    }
}

/// From now on, the first Ctrl-C (SIGINT) sets the flag [`interrupted`]
/// reads instead of killing the process; a second exits at once.
pub fn catch_interrupt() -> Result<()> {
    #[cfg(unix)]
    {
        let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only touches an atomic and calls _exit.
        let previous = unsafe { libc::signal(libc::SIGINT, handler) };
        if previous == libc::SIG_ERR {
            anyhow::bail!("installing the Ctrl-C handler: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether Ctrl-C was pressed since [`catch_interrupt`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
}

/// Gives the Vulkan loader's window-system layers a runtime directory when
/// the session has none (a server, a container, ssh without a login
/// session): without one, libwayland prints `error: XDG_RUNTIME_DIR is
/// invalid or not set` each time a GPU instance is created, although
/// nothing is wrong. A private folder under the temporary directory serves.
/// Call it before any thread starts (it sets an environment variable).
pub fn ensure_runtime_dir() {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::DirBuilderExt;
        let usable = std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| std::path::Path::new(&d).is_dir());
        if usable {
            return;
        }
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let dir = std::env::temp_dir().join(format!("slotstream-runtime-{uid}"));
        let made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
        if made.is_ok() || dir.is_dir() {
            // Single-threaded still (see above), so no reader races this write.
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
    }
}

/// Forgets a Ctrl-C that has been dealt with (the chat's answer stopped), so
/// the next one stops the next answer instead of exiting.
pub fn clear_interrupt() {
    INTERRUPTED.store(false, std::sync::atomic::Ordering::SeqCst);
}

/// What the command line does first, before any thread starts: either this
/// process is a chat template's renderer or a grammar's probe (the exit code
/// to return), or the allocator's settings and the runtime directory are
/// set, and chat templates render and grammars compile first in child
/// processes from now on (`None`).
pub fn start() -> Option<std::process::ExitCode> {
    // A child keeps glibc's defaults: its large values go back to the system when freed.
    if let Some(code) = run_as_child() {
        return Some(code);
    }
    tune_allocator();
    ensure_runtime_dir();
    isolate_chat_templates();
    None
}

/// Runs this process as a chat template's renderer or a grammar's probe
/// when its first argument asks for one
/// ([`crate::tokenizer::TEMPLATE_RENDERER_ARG`],
/// [`crate::constrain::GRAMMAR_PROBE_ARG`]): the exit code to return, or
/// `None` for every other command.
pub fn run_as_child() -> Option<std::process::ExitCode> {
    let first = std::env::args_os().nth(1)?;
    if first == crate::tokenizer::TEMPLATE_RENDERER_ARG {
        Some(crate::tokenizer::template_renderer_main())
    } else if first == crate::constrain::GRAMMAR_PROBE_ARG {
        Some(crate::constrain::grammar_probe_main())
    } else {
        None
    }
}

/// Chat templates come with models, which a client may pull, and schemas
/// with requests: from now on each template renders, and each grammar
/// compiles first, in a child process of this program whose memory is
/// bounded and which can be killed (Linux's /proc/self/exe runs this
/// program even once an upgrade has replaced its file).
pub fn isolate_chat_templates() {
    let exe = if cfg!(target_os = "linux") { Ok(std::path::PathBuf::from("/proc/self/exe")) } else { std::env::current_exe() };
    if let Ok(exe) = exe {
        crate::tokenizer::isolate_chat_templates(exe.clone());
        crate::constrain::isolate_grammar_compiles(exe);
    }
}
