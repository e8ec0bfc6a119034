//! A grammar compiles first in a child process of `slotstream` that is
//! killed when its request leaves or its deadline passes: the CPU time the
//! compile burns ends there (measured from /proc, not from wall-clock time).
#![cfg(target_os = "linux")]

use std::time::Duration;

use slotstream::constrain::{isolate_grammar_compiles, probe_until, CompileFailure};
use tokio::time::Instant;

/// A grammar whose compile takes seconds: 300 `patternProperties` (a request
/// may hold 64; the probe compiles whatever grammar it is given).
fn slow_grammar() -> String {
    let patterns: serde_json::Map<String, serde_json::Value> =
        (0..300).map(|i| (format!("^p{i}_[a-z]+$"), serde_json::json!({"type": "integer"}))).collect();
    let schema = serde_json::json!({"type": "object", "patternProperties": patterns, "additionalProperties": false});
    format!("start: %json {schema}\n")
}

/// CPU time (user and system) of process `pid` ("self": this one, all its threads), in seconds.
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command's closing parenthesis: state is the 3rd field, utime the 14th, stime the 15th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a system setting.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks as f64 / per_second)
}

/// This process's children that are grammar probes (still alive or not yet reaped).
fn probes() -> Vec<String> {
    let me = std::process::id().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_string));
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            parent.as_deref() == Some(me.as_str()) && String::from_utf8_lossy(&cmdline).contains(slotstream::constrain::GRAMMAR_PROBE_ARG)
        })
        .collect()
}

/// Waits up to `within` for `pid` to be gone (killed and reaped).
fn gone(pid: &str, within: Duration) -> bool {
    let until = std::time::Instant::now() + within;
    while std::time::Instant::now() < until {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Starts the slow compile and lets it run `running`; then, `leave`: drops
/// it (as a client that leaves does), else waits for its answer (its
/// deadline passing). Returns the answer, the probe's pid, and the CPU time
/// it had used by `running`.
fn run_probe(rt: &tokio::runtime::Runtime, deadline: Duration, running: Duration, leave: bool) -> (Option<Result<(), CompileFailure>>, String, f64) {
    rt.block_on(async {
        let probe = probe_until(slow_grammar(), Instant::now() + deadline);
        tokio::pin!(probe);
        let watch = async {
            tokio::time::sleep(running).await;
            let pids = probes();
            assert_eq!(pids.len(), 1, "one grammar probe runs: {pids:?}");
            let used = cpu_seconds(&pids[0]).unwrap_or(0.0);
            (pids[0].clone(), used)
        };
        tokio::select! {
            done = &mut probe => panic!("the slow compile ended within {running:?}: {:?}", done.err()),
            (pid, used) = watch => {
                let answer = if leave { None } else { tokio::time::timeout(Duration::from_secs(3), &mut probe).await.ok() };
                (answer, pid, used)
            }
        }
    })
}

#[test]
fn a_grammar_compile_stops_using_cpu_when_its_client_leaves_or_its_deadline_passes() {
    isolate_grammar_compiles(env!("CARGO_BIN_EXE_slotstream").into());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime");

    // A client that leaves: the probe burns CPU while it runs, and none once dropped.
    let (answer, pid, used) = run_probe(&rt, Duration::from_secs(600), Duration::from_millis(1500), true);
    assert!(answer.is_none());
    assert!(used > 0.1, "the probe used {used} s of CPU in 1.5 s: is it compiling?");
    assert!(gone(&pid, Duration::from_secs(5)), "probe {pid} still runs 5 s after its client left");
    let before = cpu_seconds("self").expect("this process's CPU time");
    std::thread::sleep(Duration::from_secs(2));
    let after = cpu_seconds("self").expect("this process's CPU time");
    assert!(after - before < 0.3, "{} s of CPU used in the 2 s after the client left: the compile goes on", after - before);

    // A deadline that passes: the probe answers Late, and is gone.
    let (answer, pid, _) = run_probe(&rt, Duration::from_millis(1500), Duration::from_millis(700), false);
    assert!(matches!(answer, Some(Err(CompileFailure::Late))), "{answer:?}");
    assert!(gone(&pid, Duration::from_secs(5)), "probe {pid} still runs 5 s past its deadline");

    // A grammar that compiles, and one that does not, are told apart.
    rt.block_on(async {
        let soon = || Instant::now() + Duration::from_secs(60);
        probe_until("start: %json {\"type\": \"integer\"}\n".into(), soon()).await.expect("a plain grammar compiles");
        match probe_until("start: undefined_rule\n".into(), soon()).await {
            Err(CompileFailure::Refused(e)) => assert!(e.to_string().contains("undefined_rule"), "{e}"),
            other => panic!("a broken grammar: {other:?}"),
        }
    });
}
