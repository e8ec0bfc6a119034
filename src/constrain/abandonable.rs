//! Compiling a request's grammar where it can be abandoned: llguidance
//! cannot stop a compile midway (its cancellation covers a parser's masks,
//! not the schema compile before it: 300 `patternProperties` take seconds,
//! 1,000 minutes), so a server compiles each grammar first in a child
//! process of this program, under a memory bound, over a one-byte
//! vocabulary (all that the engine's unbounded work, the schema compile,
//! needs). The child is killed when the request leaves or its deadline
//! passes, and its CPU time ends there. Only a grammar the child compiled in
//! time is compiled again in this process, over the model's vocabulary:
//! the same work, proven to finish, and only where the time it took fits
//! again before the deadline (the vocabulary's part is bounded by the
//! engine's own fuel limits).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{anyhow, Context, Result};
use llguidance::toktrie::ApproximateTokEnv;
use llguidance::ParserFactory;
use tokio::time::Instant;

use super::{compile, ConstraintSpec, GrammarConstraint, GrammarPlan, Grammars};

/// The argument that makes this executable a grammar's probe ([`grammar_probe_main`]).
pub const GRAMMAR_PROBE_ARG: &str = "__probe-grammar";

/// The executable that probes grammars in a process of their own; unset
/// (tests, library use), grammars compile in this process only.
static PROBE_EXE: OnceLock<PathBuf> = OnceLock::new();

/// Compiles grammars from now on in a child process of `exe` (this program,
/// which calls [`grammar_probe_main`] when given [`GRAMMAR_PROBE_ARG`])
/// before they compile here; see the module's comment.
pub fn isolate_grammar_compiles(exe: PathBuf) {
    let _ = PROBE_EXE.set(exe);
}

/// Memory the probe may use: a schema within [`super::MAX_SCHEMA_BYTES`]
/// compiles in tens of megabytes.
pub const PROBE_MEMORY_BYTES: u64 = 1 << 30;

/// Why a grammar did not compile.
#[derive(Debug)]
pub enum CompileFailure {
    /// The request's schema or tools: refused, with the reason (a client error).
    Refused(anyhow::Error),
    /// It did not compile before the deadline (a client error: too costly).
    Late,
    /// This server failed (a probe that could not start, a panic).
    Broken(anyhow::Error),
}

impl Grammars {
    /// As [`Grammars::constraint_after`], for a server: abandoned at
    /// `deadline` or when the returned future is dropped (the client left),
    /// the probe's process killed at once. `hold` (a compile slot) is kept
    /// until no work for this grammar is left running.
    pub async fn constraint_until(
        self: Arc<Self>,
        spec: ConstraintSpec,
        reasoning_open: bool,
        deadline: Instant,
        hold: impl Send + 'static,
    ) -> Result<GrammarConstraint, CompileFailure> {
        let planned = tokio::task::spawn_blocking(move || GrammarPlan::new(&spec, reasoning_open));
        let plan = match tokio::time::timeout_at(deadline, planned).await {
            Err(_) => return Err(CompileFailure::Late),
            Ok(Err(e)) => return Err(CompileFailure::Broken(anyhow!("planning the grammar: {e}"))),
            Ok(Ok(plan)) => plan.map_err(CompileFailure::Refused)?,
        };
        if PROBE_EXE.get().is_some() {
            let started = Instant::now();
            probe_until(plan.lark.clone(), deadline).await?;
            // Compiling again here takes about as long; it must end in time too.
            if Instant::now() + started.elapsed() > deadline {
                return Err(CompileFailure::Late);
            }
        }
        let built = tokio::task::spawn_blocking(move || {
            let _hold = hold;
            self.build(plan)
        });
        match tokio::time::timeout_at(deadline, built).await {
            Err(_) => Err(CompileFailure::Late),
            Ok(Err(e)) => Err(CompileFailure::Broken(anyhow!("compiling the grammar: {e}"))),
            Ok(Ok(built)) => built.map_err(CompileFailure::Refused),
        }
    }
}

/// Compiles the Lark grammar `lark` in a child process (see
/// [`isolate_grammar_compiles`]; none set, it is an error), killed at
/// `deadline` or when this future is dropped: Ok where it compiled.
pub async fn probe_until(lark: String, deadline: Instant) -> Result<(), CompileFailure> {
    let exe = PROBE_EXE.get().ok_or_else(|| CompileFailure::Broken(anyhow!("no executable set to compile grammars in")))?;
    let probe = Probe::start(exe, lark).map_err(CompileFailure::Broken)?;
    // Dropped (at the deadline, or with this future), the probe is killed.
    let _killer = probe.killer();
    let verdict = tokio::task::spawn_blocking(move || probe.verdict());
    match tokio::time::timeout_at(deadline, verdict).await {
        Err(_) => Err(CompileFailure::Late),
        Ok(Err(e)) => Err(CompileFailure::Broken(anyhow!("probing the grammar: {e}"))),
        Ok(Ok(verdict)) => verdict,
    }
}

/// A grammar being compiled in a child process.
struct Probe {
    child: Arc<Mutex<Option<Child>>>,
    lark: String,
    stdin: std::process::ChildStdin,
    stderr: std::process::ChildStderr,
}

/// Kills the probe's process when dropped, unless it has been reaped.
struct ProbeKiller(Arc<Mutex<Option<Child>>>);

impl Drop for ProbeKiller {
    fn drop(&mut self) {
        let mut child = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(child) = child.as_mut() {
            // The process is reaped (and taken) under this lock, so its id is still its own.
            let _ = child.kill();
        }
    }
}

impl Probe {
    fn start(exe: &Path, lark: String) -> Result<Probe> {
        let mut child = Command::new(exe)
            .arg(GRAMMAR_PROBE_ARG)
            // One that stops at its memory cap aborts: without a backtrace, which takes seconds and memory.
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} to compile the grammar", exe.display()))?;
        let stdin = child.stdin.take().context("the grammar probe's stdin")?;
        let stderr = child.stderr.take().context("the grammar probe's stderr")?;
        Ok(Probe { child: Arc::new(Mutex::new(Some(child))), lark, stdin, stderr })
    }

    fn killer(&self) -> ProbeKiller {
        ProbeKiller(self.child.clone())
    }

    /// Waits for the probe (a blocking call): Ok where the grammar compiled.
    fn verdict(self) -> Result<(), CompileFailure> {
        let Probe { child, lark, mut stdin, mut stderr } = self;
        // The probe reads all of its input before it writes anything.
        let _ = stdin.write_all(lark.as_bytes());
        drop(stdin);
        let mut message = String::new();
        let _ = stderr.by_ref().take(64 << 10).read_to_string(&mut message);
        let mut slot = child.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let status = slot.take().map(|mut c| c.wait()).transpose().map_err(|e| CompileFailure::Broken(e.into()))?;
        drop(slot);
        match status.and_then(|s| s.code()) {
            Some(0) => Ok(()),
            Some(2) => Err(CompileFailure::Refused(anyhow!("{}", message.trim_end()))),
            _ => Err(CompileFailure::Refused(anyhow!(
                "compiling it needed more than {} MiB of memory and was stopped ({})",
                PROBE_MEMORY_BYTES >> 20,
                status.map_or("killed".to_string(), |s| s.to_string())
            ))),
        }
    }
}

/// The probe's side: reads a Lark grammar from stdin, compiles it under
/// [`PROBE_MEMORY_BYTES`] over a one-byte vocabulary; exit 0 where it
/// compiles, 2 with the reason on stderr where it does not.
pub fn grammar_probe_main() -> ExitCode {
    let mut lark = String::new();
    let compiled = std::io::stdin()
        .read_to_string(&mut lark)
        .context("reading the grammar")
        .and_then(|_| crate::memory_cap::cap_memory(PROBE_MEMORY_BYTES))
        .and_then(|_| {
            let env = ApproximateTokEnv::single_byte_env();
            let mut factory = ParserFactory::new_simple(&env)?;
            factory.quiet();
            compile(&factory, lark).map(drop)
        });
    match compiled {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stderr().write_all(format!("{e:#}\n").as_bytes());
            ExitCode::from(2)
        }
    }
}
