//! The plan's estimate and this machine's rates, through the real binary: a
//! run with nothing measured says its estimate is from defaults;
//! `doctor --measure` measures within its bounds and keeps the figures in
//! slotstream's cache folder; a later run on the same disk and backend plans
//! with them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_mlx4")
}

/// `slotstream ARGS` with its cache folder (and home) in `home`.
fn slotstream(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args(args)
        .env("HOME", home)
        .env("XDG_CACHE_HOME", home.join("cache"))
        .stdin(Stdio::null())
        .output()
        .expect("running slotstream")
}

fn run_fixture(home: &Path) -> String {
    let model = fixture();
    let model = model.to_str().expect("a UTF-8 path");
    let output = slotstream(home, &["run", "--model", model, "--prompt", "The sea", "--raw", "--max-tokens", "2", "--backend", "cpu"]);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    stderr
}

fn rates_line(stderr: &str) -> &str {
    stderr.lines().find(|l| l.trim_start().starts_with("rates:")).unwrap_or_else(|| panic!("no rates: line in the banner:\n{stderr}"))
}

#[test]
fn measured_rates_are_kept_and_used_by_later_runs() {
    let home = tempfile::tempdir().expect("a scratch home");
    let before = run_fixture(home.path());
    let line = rates_line(&before);
    assert!(line.contains("default") && line.contains("doctor --measure") && !line.contains("measured just now"), "{line}");

    let model = fixture();
    let measure = slotstream(home.path(), &["doctor", "--measure", "--backend", "cpu", "--model", model.to_str().expect("UTF-8")]);
    let stdout = String::from_utf8_lossy(&measure.stdout).into_owned();
    assert!(measure.status.success(), "{}", String::from_utf8_lossy(&measure.stderr));
    assert!(stdout.contains("measured: weights") && stdout.contains("expert reads"), "{stdout}");

    let file = home.path().join("cache/slotstream/rates.json");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("rates.json was written"))
        .expect("rates.json is JSON");
    let compute = kept["compute"].as_object().expect("compute rates by key");
    let disks = kept["disks"].as_object().expect("disk rates by key");
    assert_eq!((compute.len(), disks.len()), (1, 1), "{kept}");
    let (key, measured) = compute.iter().next().expect("one entry");
    assert!(key.contains("cpu (") && key.ends_with("4-bit g64"), "{key}");
    let gbps = measured["rates"]["weight_gbps"].as_f64().expect("a rate");

    let after = run_fixture(home.path());
    let line = rates_line(&after);
    assert!(line.contains(&format!("weights {gbps:.1} GB/s")) && line.contains("measured just now"), "{line}");
    assert!(!line.contains("default"), "both the backend and the disk were measured: {line}");
}

#[test]
fn a_simulated_machine_is_not_measured() {
    let home = tempfile::tempdir().expect("a scratch home");
    let output = slotstream(home.path(), &["doctor", "--measure", "--sim-ram", "16"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("leave out the --sim-* flags"));
    assert!(!home.path().join("cache/slotstream/rates.json").exists(), "nothing was measured, so nothing is kept");
}
