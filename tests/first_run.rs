//! What a new user meets first, through the real binary: Ctrl-C stops `serve`
//! within a second (SIGTERM after draining) and `run` with its summary, a port in use and a missing
//! network are found at once, the prompt can come from stdin, and the server
//! logs a line per request.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn slotstream() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_slotstream"));
    command.stdin(Stdio::null());
    command
}

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_mlx4")
}

fn interrupt(child: &Child) {
    signal(child, libc::SIGINT);
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill only sends a signal to the child we started.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0, "sending signal {sig}");
}

/// Waits up to `limit` for `child` to exit; kills it (and fails) past that.
fn wait_within(child: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("polling the child") {
            return status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running {limit:?} after the signal");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Lines of a child's stderr, read on a thread as they come.
fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().expect("stderr is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Reads `lines` until one contains `needle`; all lines read so far are kept in `seen`.
fn wait_for_line(lines: &mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        match lines.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => {
                seen.push(line.clone());
                if line.contains(needle) {
                    return line;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    panic!("no line with {needle:?} on stderr:\n{}", seen.join("\n"));
}

fn http(port: u16, request: &str) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connecting to the server");
    stream.write_all(request.as_bytes()).expect("sending the request");
    stream
}

fn post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// A copy of the demo model that names no end-of-sequence token: it writes
/// English until `num_predict` (the demo ends its answers within a few dozen
/// tokens and the random-weight fixtures soon pick EOS; the server has no
/// `--ignore-eos`).
fn demo_without_eos(scratch: &std::path::Path) -> PathBuf {
    let demo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/demo/model");
    let copy = scratch.join("demo");
    std::fs::create_dir_all(&copy).expect("creating the copy's folder");
    for entry in std::fs::read_dir(&demo).expect("listing tools/demo/model") {
        let path = entry.expect("a directory entry").path();
        std::fs::copy(&path, copy.join(path.file_name().expect("a file name"))).expect("copying a demo file");
    }
    for (file, key) in [("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")] {
        let path = copy.join(file);
        let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect(file)).expect(file);
        json.as_object_mut().expect("a JSON object").remove(key);
        std::fs::write(&path, json.to_string()).expect(file);
    }
    copy
}

#[test]
fn ctrl_c_stops_serve_mid_generation_within_a_second() {
    stops_serve_mid_generation(libc::SIGINT, "Ctrl-C", Duration::ZERO, 1);
}

/// SIGTERM (what service managers, `docker stop` and Kubernetes send) first
/// drains (new requests get 503) for `--shutdown-grace-secs`, then stops
/// `serve` as Ctrl-C does: a generation that outlasts the grace is cancelled.
#[test]
fn sigterm_drains_then_stops_serve_mid_generation_within_its_grace() {
    stops_serve_mid_generation(libc::SIGTERM, "SIGTERM", Duration::from_secs(1), 1);
}

/// With `--parallel 4` both generations run (two turns left free), and the
/// drain waits for both.
#[test]
fn sigterm_drains_every_running_generation_with_parallel() {
    stops_serve_mid_generation(libc::SIGTERM, "SIGTERM", Duration::from_secs(1), 4);
}

/// `drain`: how long the signal lets generations finish first; `parallel`:
/// generations at once (1: the second request waits).
fn stops_serve_mid_generation(sig: libc::c_int, what: &str, drain: Duration, parallel: usize) {
    let scratch = tempfile::tempdir().expect("creating a scratch folder");
    let mut server = slotstream()
        .args(["serve", "--model"])
        .arg(demo_without_eos(scratch.path()))
        .args(["--backend", "cpu", "--parallel", &parallel.to_string(), "--port", "0", "--name", "fixture", "--shutdown-grace-secs", "1"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting slotstream serve");
    let lines = stderr_lines(&mut server);
    let mut seen = Vec::new();
    let serving = wait_for_line(&lines, "serving 'fixture' on http://", &mut seen);
    let port: u16 = serving.rsplit(':').next().and_then(|p| p.trim().parse().ok()).expect("the port in the serving line");

    // A metadata request gets its line in the log.
    let mut tags = http(port, "GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    let mut answer = String::new();
    tags.read_to_string(&mut answer).expect("reading /api/tags");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    wait_for_line(&lines, "GET /api/tags 200", &mut seen);

    // A long generation, and one waiting behind it.
    let body = r#"{"model": "fixture", "prompt": "The sea was calm, and the ship", "raw": true, "options": {"num_predict": 4000, "temperature": 0}}"#;
    let mut running = http(port, &post("/api/generate", body));
    let mut first = [0u8; 64];
    let n = running.read(&mut first).expect("the first bytes of the answer");
    assert!(n > 0 && first.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&first[..n]));
    let mut waiting = http(port, &post("/api/generate", body));
    std::thread::sleep(Duration::from_millis(300));

    signal(&server, sig);
    let started = Instant::now();
    if !drain.is_zero() {
        wait_for_line(&lines, "draining", &mut seen);
        let mut refused = http(port, &post("/api/generate", body));
        let mut status_line = [0u8; 12];
        refused.read_exact(&mut status_line).expect("the status line of a request during the drain");
        assert_eq!(&status_line, b"HTTP/1.1 503", "a new request during the drain");
    }
    let status = wait_within(&mut server, Duration::from_secs(5), "serve");
    let took = started.elapsed();
    let said = wait_for_line(&lines, "shutting down", &mut seen);
    assert!(took < drain + Duration::from_secs(1), "serve took {took:?} to exit after {what}:\n{}", seen.join("\n"));
    assert!(status.success(), "{status:?}");
    // The generations outlast the drain, which waits for them all.
    assert!(took >= drain, "serve exited {took:?} after {what}, before its drain of {drain:?}");
    let expected = if parallel == 1 { "cancelling 1 running and 1 waiting" } else { "cancelling 2 running and 0 waiting" };
    assert!(said.contains(expected), "{said}");
    // Both clients got an answer that ends, not a hang.
    for (what, stream) in [("running", &mut running), ("waiting", &mut waiting)] {
        stream.set_read_timeout(Some(Duration::from_secs(5))).expect("setting a read timeout");
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        assert!(!rest.is_empty() || what == "running", "{what}: nothing came back");
    }
}

/// A second Ctrl-C or SIGTERM exits at once, even while the first one's
/// graceful shutdown waits: here on a request whose body never comes, with a
/// body timeout and a grace of a minute.
#[test]
fn a_second_signal_exits_serve_at_once_while_shutdown_waits() {
    for (sig, what) in [(libc::SIGINT, "Ctrl-C"), (libc::SIGTERM, "SIGTERM")] {
        let mut server = slotstream()
            .args(["serve", "--model"])
            .arg(fixture())
            .args(["--backend", "cpu", "--port", "0", "--name", "fixture"])
            .args(["--shutdown-grace-secs", "60", "--body-timeout-secs", "60"])
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting slotstream serve");
        let lines = stderr_lines(&mut server);
        let mut seen = Vec::new();
        let serving = wait_for_line(&lines, "serving 'fixture' on http://", &mut seen);
        let port: u16 = serving.rsplit(':').next().and_then(|p| p.trim().parse().ok()).expect("the port in the serving line");
        let _stuck = http(port, "POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{\"model\":");
        std::thread::sleep(Duration::from_millis(300));

        signal(&server, sig);
        wait_for_line(&lines, "shutting down", &mut seen);
        std::thread::sleep(Duration::from_millis(500));
        let waiting = server.try_wait().expect("polling serve");
        assert!(waiting.is_none(), "{what}: serve exited ({waiting:?}) with a request open: the test needs a shutdown that waits");

        signal(&server, sig);
        let started = Instant::now();
        wait_within(&mut server, Duration::from_secs(10), "serve after a second signal");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "{what}: serve took {took:?} to exit after a second signal:\n{}", seen.join("\n"));
    }
}

#[test]
fn serve_finds_a_port_in_use_before_loading_the_model() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a port");
    let port = taken.local_addr().expect("its address").port().to_string();
    let output = slotstream()
        .args(["serve", "--model"])
        .arg(fixture())
        .args(["--backend", "cpu", "--port", &port])
        .output()
        .expect("running slotstream serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("already using the port") && stderr.contains("--port"), "{stderr}");
    assert!(!stderr.contains("memory plan"), "the port must be checked before the model is planned and loaded:\n{stderr}");
}

#[test]
fn ctrl_c_in_run_stops_the_answer_and_prints_the_summary() {
    let mut run = slotstream()
        .args(["run", "--model"])
        .arg(fixture())
        .args(["--prompt", "The sea was calm", "--raw", "--backend", "cpu", "--ignore-eos", "--max-tokens", "3000"])
        .args(["--plan-context", "4096", "-v"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting slotstream run");
    let mut stdout = run.stdout.take().expect("stdout is piped");
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).expect("the answer starts");
    interrupt(&run);
    let status = wait_within(&mut run, Duration::from_secs(10), "run");
    let mut stderr = String::new();
    run.stderr.take().expect("stderr is piped").read_to_string(&mut stderr).expect("reading stderr");
    assert_eq!(status.code(), Some(130), "a run stopped by Ctrl-C exits 130, as shells expect:\n{stderr}");
    assert!(stderr.contains("generated") && stderr.contains("decode"), "no summary after Ctrl-C:\n{stderr}");
    assert!(stderr.contains("interrupted (Ctrl-C)"), "{stderr}");
}

#[test]
fn pull_without_a_network_fails_in_seconds_naming_the_network() {
    let scratch = tempfile::tempdir().expect("creating a scratch folder");
    // `.invalid` never resolves (RFC 6761); port 9 on loopback refuses.
    for endpoint in ["http://no-such-host.invalid", "http://127.0.0.1:9"] {
        let started = Instant::now();
        let output = slotstream()
            .args(["pull", "hf:org/name"])
            .env("HF_HUB_CACHE", scratch.path().join("hub"))
            .env("HF_HOME", scratch.path().join("hf-home"))
            .env("HF_ENDPOINT", endpoint)
            .env_remove("HF_TOKEN")
            .output()
            .expect("running slotstream pull");
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{endpoint}: {stderr}");
        assert!(stderr.contains("no network connection") && stderr.contains(endpoint), "{endpoint}: {stderr}");
        assert!(took < Duration::from_secs(10), "{endpoint}: pull took {took:?} to give up:\n{stderr}");
        // Nothing came, so nothing is left: not the model's folders, nor the cache's.
        assert!(!scratch.path().join("hub").exists(), "{endpoint}: a failed pull left folders behind");
    }
}

#[test]
fn verify_of_a_model_never_pulled_says_so_in_one_line() {
    let scratch = tempfile::tempdir().expect("creating a scratch folder");
    let output = slotstream()
        .args(["pull", "--verify", "qwen3.8-flash-next:4bit"])
        .env("HF_HUB_CACHE", scratch.path().join("hub"))
        .env("HF_HOME", scratch.path().join("hf-home"))
        .output()
        .expect("running slotstream pull --verify");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(output.stdout.is_empty(), "{}", String::from_utf8_lossy(&output.stdout));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("never pulled") && stderr.contains("slotstream pull qwen3.8-flash-next:4bit"), "{stderr}");
}

#[test]
fn the_prompt_can_come_from_stdin() {
    let ids = |command: &mut Command, stdin: &str| {
        let mut child = command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting run");
        child.stdin.take().expect("stdin is piped").write_all(stdin.as_bytes()).expect("writing the prompt");
        let output = child.wait_with_output().expect("running slotstream run");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("run --json prints JSON");
        json["prompt_ids"].clone()
    };
    let base = || {
        let mut command = slotstream();
        command.args(["run", "--model"]).arg(fixture()).args(["--raw", "--backend", "cpu", "--max-tokens", "2", "--json"]);
        command
    };
    let given = ids(base().args(["--prompt", "The sea was calm"]), "");
    let dash = ids(base().args(["--prompt", "-"]), "The sea was calm\n");
    let piped = ids(&mut base(), "The sea was calm");
    assert!(given.as_array().is_some_and(|a| !a.is_empty()), "{given}");
    assert_eq!(dash, given, "--prompt - reads stdin");
    assert_eq!(piped, given, "a piped stdin is the prompt");
}

#[test]
fn perplexity_on_a_short_text_names_the_window() {
    let scratch = tempfile::tempdir().expect("creating a scratch folder");
    let file = scratch.path().join("short.txt");
    std::fs::write(&file, "Hello there.").expect("writing the text");
    let output = slotstream()
        .args(["perplexity", "--model"])
        .arg(fixture())
        .args(["--backend", "cpu", "--file"])
        .arg(&file)
        .output()
        .expect("running slotstream perplexity");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("fewer than one window of 256 (--window)") && stderr.contains("smaller --window"), "{stderr}");
    let help = slotstream().args(["perplexity", "--help"]).output().expect("running --help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(!help.contains("18446744073709551615"), "{help}");
}
