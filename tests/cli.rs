//! The command line's promises, through the real binary: output that cannot be
//! written is an error with a non-zero exit (a reader that left is a quiet
//! exit, never a panic), `run` stays within the context it planned, and
//! flags and model names are checked before they are used.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn slotstream() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_slotstream"));
    command.stdin(Stdio::null());
    command
}

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_mlx4")
}

/// `run` on the fixture model, with `extra` flags.
fn run_command(extra: &[&str]) -> Command {
    let mut command = slotstream();
    command.arg("run").arg("--model").arg(fixture());
    command.args(["--prompt", "The sea was calm", "--raw", "--backend", "cpu"]).args(extra);
    command
}

fn dev_full() -> Stdio {
    Stdio::from(File::options().write(true).open("/dev/full").expect("opening /dev/full"))
}

/// The write end of a pipe whose read end is already closed.
fn closed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: pipe fills two descriptors we then own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "making a pipe");
    // SAFETY: both descriptors were just created and are owned here.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn output_into_a_full_disk_is_an_error_with_a_message() {
    let cases: [(&str, Command); 4] = [
        ("doctor", {
            let mut c = slotstream();
            c.arg("doctor");
            c
        }),
        ("doctor --json", {
            let mut c = slotstream();
            c.args(["doctor", "--json"]);
            c
        }),
        ("run", run_command(&["--max-tokens", "3"])),
        ("run --json", run_command(&["--max-tokens", "3", "--json"])),
    ];
    for (what, mut command) in cases {
        let output = command.stdout(dev_full()).output().expect("running slotstream");
        let stderr = stderr_of(&output);
        assert_eq!(output.status.code(), Some(1), "{what} > /dev/full: {stderr}");
        assert!(stderr.contains("writing to stdout") && !stderr.contains("panicked"), "{what}: {stderr}");
    }
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let cases: [(&str, Command); 2] = [
        ("doctor", {
            let mut c = slotstream();
            c.arg("doctor");
            c
        }),
        ("run", run_command(&["--max-tokens", "3"])),
    ];
    for (what, mut command) in cases {
        let pipe = closed_pipe();
        let output = command
            .stdout(Stdio::from(pipe.try_clone().expect("duplicating the pipe")))
            .stderr(Stdio::from(pipe))
            .output()
            .expect("running slotstream");
        assert_eq!(output.status.code(), Some(0), "{what} 2>&1 | head: {:?}", output.status);
    }
}

#[test]
fn run_generates_no_further_than_the_planned_context() {
    let output = run_command(&["--max-tokens", "100", "--ignore-eos", "--plan-context", "16", "--json"])
        .output()
        .expect("running slotstream");
    assert!(output.status.success(), "{}", stderr_of(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    let prompt = report["prompt_ids"].as_array().expect("prompt ids").len();
    let generated = report["generated_ids"].as_array().expect("generated ids").len();
    assert_eq!(prompt + generated, 16, "{report}");
    assert!(stderr_of(&output).contains("generating at most"), "{}", stderr_of(&output));

    let output = run_command(&["--plan-context", "2"]).output().expect("running slotstream");
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("leaves no room to generate") && stderr.contains("raise --plan-context"), "{stderr}");
    // What a context long enough would take.
    assert!(stderr.contains("GB of KV cache") && stderr.contains("more than the planned 2"), "{stderr}");
}

/// With no --plan-context the plan holds KV for the model's whole context
/// (the YaRN fixture: 256 trained positions x 32 = 8,192), `run --json` and
/// the banner say so, and generation may use it.
#[test]
fn run_plans_the_models_own_context_by_default() {
    let yarn = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_yarn");
    let output = slotstream()
        .args(["run", "--prompt", "The sea was calm", "--raw", "--backend", "cpu", "--max-tokens", "4", "--json", "-v", "--model"])
        .arg(&yarn)
        .output()
        .expect("running slotstream");
    assert!(output.status.success(), "{}", stderr_of(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(report["plan"]["context_tokens"], 8192, "{report}");
    assert!(report["plan"]["kv_bytes_per_token"].as_u64().is_some_and(|b| b > 0), "{report}");
    assert!(stderr_of(&output).contains("context: 8192 tokens"), "{}", stderr_of(&output));
}

#[test]
fn a_revision_that_is_a_path_is_refused_without_reading_it() {
    let scratch = tempfile::tempdir().expect("creating a scratch folder");
    let secret = scratch.path().join("secret.txt");
    std::fs::write(&secret, "top secret contents").expect("writing a file");
    let spec = format!("hf:org/name@{}", secret.display());
    let run = slotstream()
        .args(["run", "--model", &spec, "--prompt", "hi"])
        .env("HF_HUB_CACHE", scratch.path().join("hub"))
        .output()
        .expect("running slotstream");
    let pull = slotstream()
        .args(["pull", &spec])
        .env("HF_HUB_CACHE", scratch.path().join("hub"))
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .expect("running slotstream");
    for (what, output) in [("run", run), ("pull", pull)] {
        let stderr = stderr_of(&output);
        assert_eq!(output.status.code(), Some(1), "{what}: {stderr}");
        assert!(stderr.contains("is not a branch, tag or commit") && !stderr.contains("top secret"), "{what}: {stderr}");
    }
    assert_eq!(std::fs::read_to_string(&secret).expect("reading the file"), "top secret contents");
}

#[test]
fn doctor_refuses_simulated_sizes_that_are_not_sizes() {
    for value in ["-1", "NaN", "0"] {
        let flag = format!("--sim-ram={value}");
        let output = slotstream().args(["doctor", &flag]).output().expect("running slotstream");
        let stderr = stderr_of(&output);
        assert_eq!(output.status.code(), Some(1), "--sim-ram {value}: {stderr}");
        assert!(stderr.contains("--sim-ram") && stderr.contains("is not a size in GB"), "{stderr}");
    }
}

#[test]
fn serve_refuses_a_name_clients_cannot_send() {
    let mut child = slotstream()
        .args(["serve", "--name", "", "--port", "0", "--backend", "cpu", "--model"])
        .arg(fixture())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting slotstream serve");
    let started = std::time::Instant::now();
    while child.try_wait().expect("polling the server").is_none() {
        if started.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            panic!("serve --name \"\" started serving a model no client can name");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("reading the server's output");
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is not a name clients can send"), "{stderr}");
}

#[test]
fn run_refuses_generation_flags_out_of_range_before_loading() {
    let cases: [(&[&str], &str); 5] = [
        (&["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (&["--threads", "0"], "--threads 0: give at least 1"),
        (&["--temperature", "-1"], "temperature must be >= 0"),
        (&["--top-p", "0"], "top_p must be in (0, 1]"),
        (&["--repeat-penalty", "-2"], "repetition penalty must be > 0"),
    ];
    for (flags, wanted) in cases {
        let output = run_command(flags).output().expect("running slotstream");
        let stderr = stderr_of(&output);
        assert_eq!(output.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains(wanted), "{flags:?}: {stderr}");
        assert!(!stderr.contains("memory plan"), "{flags:?} must be checked before the model is planned and loaded:\n{stderr}");
    }
}

#[test]
fn perplexity_refuses_windows_that_score_nothing_before_loading() {
    for (flag, value) in [("--window", "1"), ("--max-windows", "0")] {
        let output = slotstream()
            .args(["perplexity", "--backend", "cpu", "--file", "README.md", "--model"])
            .arg(fixture())
            .args([flag, value])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("running slotstream");
        let stderr = stderr_of(&output);
        assert_eq!(output.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(stderr.contains(&format!("invalid value '{value}' for '{flag}")), "{flag} {value}: {stderr}");
        assert!(!stderr.contains("memory plan"), "{flag} must be checked before the model is planned and loaded:\n{stderr}");
    }
}

#[test]
fn run_refuses_an_empty_prompt_from_stdin() {
    // `slotstream()` gives the command an empty stdin, as `run </dev/null` or a pipe that sent nothing.
    let output = slotstream().args(["run", "--model"]).arg(fixture()).args(["--backend", "cpu"]).output().expect("running slotstream");
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the prompt read from stdin is empty"), "{stderr}");
    assert!(output.stdout.is_empty(), "an empty prompt generated text: {}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn a_folder_that_holds_no_model_is_named_before_any_gpu_is_looked_for() {
    let empty = tempfile::tempdir().expect("creating a scratch folder");
    let output = slotstream().args(["run", "--model"]).arg(empty.path()).args(["--prompt", "Hi"]).output().expect("running slotstream");
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("a model directory?"), "{stderr}");
    assert!(!stderr.contains("GPU"), "the folder must be checked before a backend is chosen:\n{stderr}");
}

/// The fixture model with `template` as its chat template, in a scratch folder.
fn fixture_with_template(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a scratch folder");
    for entry in std::fs::read_dir(fixture()).expect("listing the fixture").flatten() {
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copying the fixture");
    }
    std::fs::write(dir.path().join("chat_template.jinja"), template).expect("writing the template");
    dir
}

/// The largest resident set of any child process waited for so far, in bytes.
fn children_peak_rss() -> u64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_CHILDREN covers every descendant waited for.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) }, 0);
    usage.ru_maxrss as u64 * 1024
}

#[test]
fn a_chat_template_that_doubles_a_string_is_stopped_within_its_memory() {
    // 1000 bytes doubled 20 times is 1 GB (and 1.5 GB at its peak) in one
    // string that is never written out: fuel and the output's limit do not
    // see it, the renderer's memory limit does.
    let dir = fixture_with_template(
        "{% set ns = namespace(s='x' * 1000) %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}\
         {{ ns.s | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
    );
    let t = std::time::Instant::now();
    let output = slotstream()
        .arg("run")
        .arg("--model")
        .arg(dir.path())
        .args(["--prompt", "hi", "--max-tokens", "2", "--backend", "cpu"])
        .output()
        .expect("running slotstream");
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("chat template in chat_template.jinja needed more than 256 MiB of memory"), "{stderr}");
    let peak = children_peak_rss();
    assert!(peak < 700 << 20, "a process peaked at {} MB", peak >> 20);
    assert!(t.elapsed() < std::time::Duration::from_secs(60), "took {:?}", t.elapsed());
    // An ordinary template still renders in its own process.
    let dir = fixture_with_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n");
    let output = slotstream()
        .arg("run")
        .arg("--model")
        .arg(dir.path())
        .args(["--prompt", "hi", "--max-tokens", "2", "--backend", "cpu", "--json"])
        .output()
        .expect("running slotstream");
    assert!(output.status.success(), "{}", stderr_of(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    let prompt: Vec<u64> = report["prompt_ids"].as_array().expect("prompt ids").iter().filter_map(|v| v.as_u64()).collect();
    assert_eq!((prompt.first(), prompt.iter().filter(|&&id| id == 510).count()), (Some(&510), 2), "{prompt:?}");
}
