//! The plan's estimate and this machine's rates, through the real binary: a
//! run with nothing measured says its estimate is from defaults;
//! `doctor --measure` measures within its bounds (the backend, the model's
//! expert reads, and the model's own decode from a small pool: its compute
//! and what each miss cost it) and keeps the figures in
//! slotstream's cache folder; a later run of the model on the same disk and
//! backend plans with them. A streaming run (and the
//! probe's decode) keeps its decode hit rate there, and the next run of the
//! same model estimates with it.

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
    let output = slotstream(home, &["run", "--model", model, "--prompt", "The sea", "--raw", "--max-tokens", "2", "--backend", "cpu", "-v"]);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    stderr
}

fn banner_line<'a>(stderr: &'a str, label: &str) -> &'a str {
    stderr.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("no {label} line in the banner:\n{stderr}"))
}

fn rates_line(stderr: &str) -> &str {
    banner_line(stderr, "rates:")
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
    assert!(stdout.contains("a missed expert") && stdout.contains("steps from 7 of 8 experts per layer"), "{stdout}");

    let file = home.path().join("cache/slotstream/rates.json");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("rates.json was written"))
        .expect("rates.json is JSON");
    let compute = kept["compute"].as_object().expect("compute rates by key");
    let disks = kept["disks"].as_object().expect("disk rates by key");
    let decodes = kept["decodes"].as_object().expect("the model's timed decodes by key");
    assert_eq!((compute.len(), disks.len(), decodes.len()), (1, 1, 1), "{kept}");
    let timed = &decodes.values().next().expect("one entry")["rates"];
    let (miss_ms, token_ms) = (timed["miss_ms"].as_f64().expect("a miss cost"), timed["token_ms"].as_f64().expect("a token's rest"));
    assert!(miss_ms >= 0.0 && token_ms > 0.0 && miss_ms + token_ms > 0.0, "{kept}");

    // The probe's decode from 7 of 8 experts per layer is the model's first streaming run.
    let hits: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(home.path().join("cache/slotstream/hits.json")).expect("hits.json"))
            .expect("hits.json is JSON");
    let runs = hits["models"].as_object().and_then(|m| m.values().next()).and_then(|m| m["runs"].as_array()).expect("runs");
    assert_eq!((runs.len(), runs[0]["share"].as_f64()), (1, Some(14.0 / 16.0)), "{hits}");
    let (key, measured) = compute.iter().next().expect("one entry");
    assert!(key.contains("cpu (") && key.ends_with("4-bit g64"), "{key}");
    let gbps = measured["rates"]["weight_gbps"].as_f64().expect("a rate");

    let after = run_fixture(home.path());
    let line = rates_line(&after);
    assert!(line.contains(&format!("weights {gbps:.1} GB/s")) && line.contains("measured just now"), "{line}");
    let timed =
        format!("a missed expert {miss_ms:.2} ms beyond {token_ms:.2} ms of compute a token in this model's decode measured just now");
    assert!(line.contains(&timed), "{line}");
    assert!(!line.contains("default"), "the backend, the disk and the misses were measured: {line}");
}

/// A model whose every expert is one token's (top-8 of 8) cannot stream, so
/// no pool smaller than it can time a miss: the report says so in a line,
/// and the rates measured before are still kept.
#[test]
fn a_model_that_cannot_stream_keeps_its_other_rates() {
    let home = tempfile::tempdir().expect("a scratch home");
    let model = home.path().join("all-experts");
    std::fs::create_dir(&model).expect("a model folder");
    for entry in std::fs::read_dir(fixture()).expect("the fixture") {
        let path = entry.expect("a fixture file").path();
        std::fs::copy(&path, model.join(path.file_name().expect("a file name"))).expect("copying the fixture");
    }
    let config = model.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config).expect("config.json")).expect("JSON");
    assert_eq!(c["num_experts"], 8, "{c}");
    c["num_experts_per_tok"] = 8.into();
    std::fs::write(&config, c.to_string()).expect("writing config.json");

    let measure = slotstream(home.path(), &["doctor", "--measure", "--backend", "cpu", "--model", model.to_str().expect("UTF-8")]);
    let stdout = String::from_utf8_lossy(&measure.stdout).into_owned();
    assert!(measure.status.success(), "{}", String::from_utf8_lossy(&measure.stderr));
    assert!(stdout.contains("measured: weights") && stdout.contains("expert reads"), "{stdout}");
    assert!(stdout.contains("a missed expert not timed in a decode (it costs its read): every expert of a layer is one token's"), "{stdout}");
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(home.path().join("cache/slotstream/rates.json")).expect("rates.json")).expect("JSON");
    assert!(kept.to_string().contains("weight_gbps"), "the backend's rates are kept: {kept}");
}

#[test]
fn a_simulated_machine_is_not_measured() {
    let home = tempfile::tempdir().expect("a scratch home");
    let output = slotstream(home.path(), &["doctor", "--measure", "--sim-ram", "16"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("leave out the --sim-* flags"));
    assert!(!home.path().join("cache/slotstream/rates.json").exists(), "nothing was measured, so nothing is kept");
}

/// A run of the fixture (2 MoE layers x 8 experts, top-2) from a pool of 3
/// experts per layer: 23 decode steps look up 92 experts, enough to be kept.
/// Its `--json` output and stderr.
fn stream_fixture(home: &Path, experts_per_layer: &str) -> (serde_json::Value, String) {
    let model = fixture();
    let model = model.to_str().expect("a UTF-8 path");
    let args = ["--prompt", "The sea", "--raw", "--max-tokens", "24", "--ignore-eos", "--json", "--backend", "cpu"];
    let output = slotstream(home, &[&["run", "--model", model, "--experts-per-layer", experts_per_layer][..], &args].concat());
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    (serde_json::from_slice(&output.stdout).expect("--json prints JSON"), stderr)
}

#[test]
fn a_streaming_run_keeps_its_hit_rate_for_the_next_runs_estimate() {
    let home = tempfile::tempdir().expect("a scratch home");
    let file = home.path().join("cache/slotstream/hits.json");
    let (first, stderr) = stream_fixture(home.path(), "3");
    let line = banner_line(&stderr, "hits:");
    assert!(line.contains("assumed found in the pool") && line.contains("power 0.6;"), "nothing kept yet: {line}");

    let decode = &first["stats"]["decode_experts"];
    let (hits, misses) = (decode["hits"].as_u64().expect("hits"), decode["misses"].as_u64().expect("misses"));
    assert_eq!(hits + misses, 23 * 2 * 2, "decode only: 23 steps x 2 MoE layers x top-2: {decode}");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("hits.json was written")).expect("JSON");
    let models = kept["models"].as_object().expect("runs by model");
    assert_eq!(models.len(), 1, "{kept}");
    let runs = models.values().next().and_then(|m| m["runs"].as_array()).expect("the model's runs");
    assert_eq!(runs.len(), 1, "{kept}");
    let hit_rate = hits as f64 / (hits + misses) as f64;
    assert_eq!(runs[0]["share"].as_f64(), Some(6.0 / 16.0), "{kept}");
    assert!((runs[0]["hit_rate"].as_f64().expect("a hit rate") - hit_rate).abs() < 1e-12, "{kept} vs {hit_rate}");

    // The next run estimates from it: one run at the same share fits its hit rate there exactly
    // (unless it found all or none, where the exponent's bounds hold it).
    let (_, stderr) = stream_fixture(home.path(), "3");
    let line = banner_line(&stderr, "hits:");
    let share: f64 = 6.0 / 16.0;
    let exponent = (hit_rate.max(1e-3).ln() / share.ln()).clamp(0.05, 10.0);
    let expected = format!("~{:.0}% of expert uses found in the pool, measured from 1 run of this model", 100.0 * share.powf(exponent));
    assert!(line.contains(&expected), "{line}\nexpected: {expected}");

    // A resident pool keeps nothing; a file that is not hit rates is a note, and the next streaming run replaces it.
    stream_fixture(home.path(), "8");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("hits.json")).expect("JSON");
    assert_eq!(kept["models"].as_object().and_then(|m| m.values().next()).and_then(|m| m["runs"].as_array()).map(Vec::len), Some(2));
    std::fs::write(&file, "{ not json").expect("writing");
    let (_, stderr) = stream_fixture(home.path(), "3");
    assert!(stderr.contains("not a file of expert hit rates") && stderr.contains("delete it"), "{stderr}");
    assert!(banner_line(&stderr, "hits:").contains("assumed"), "{stderr}");
    let (_, stderr) = stream_fixture(home.path(), "3");
    assert!(banner_line(&stderr, "hits:").contains("measured from 1 run of this model"), "{stderr}");
}

/// Rewrites hits.json with `edit` applied to each run of each model.
fn edit_runs(file: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let mut kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file).expect("hits.json")).expect("JSON");
    for model in kept["models"].as_object_mut().expect("runs by model").values_mut() {
        for run in model["runs"].as_array_mut().expect("runs") {
            edit(run);
        }
    }
    std::fs::write(file, kept.to_string()).expect("writing hits.json");
}

/// A streaming run keeps its decode's time per token, filed under this
/// machine, backend and disk; the next run of the same model from the same
/// pool estimates that time and says so. Runs timed on another host, and a
/// file of an earlier version without times, leave the estimate to the
/// rates, without a note.
#[test]
fn a_streaming_run_keeps_its_decode_time_for_the_next_runs_estimate() {
    let home = tempfile::tempdir().expect("a scratch home");
    let file = home.path().join("cache/slotstream/hits.json");
    let (first, stderr) = stream_fixture(home.path(), "3");
    assert!(banner_line(&stderr, "speed:").contains("from the rates and hit rate above"), "nothing timed yet: {stderr}");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("hits.json was written")).expect("JSON");
    let run = &kept["models"].as_object().and_then(|m| m.values().next()).expect("one model")["runs"][0];
    let timing = &run["timing"];
    let machine = timing["machine"].as_str().expect("the machine it ran on");
    assert!(machine.contains(" | cpu (") && machine.contains(" | /dev/"), "{kept}");
    assert_eq!(timing["steps"], 23, "24 tokens, the first from the prefill: {kept}");
    let seconds_per_token = timing["seconds_per_token"].as_f64().expect("a time");
    let decode = &first["stats"];
    let measured = decode["decode_seconds"].as_f64().expect("decode seconds") / 23.0;
    assert!((seconds_per_token - measured).abs() < 1e-12, "{seconds_per_token} vs {measured}");

    let (_, stderr) = stream_fixture(home.path(), "3");
    let line = banner_line(&stderr, "speed:");
    let at = format!("measured from 1 run of this model here at this pool's size ({:.1} ms a token)", seconds_per_token * 1e3);
    assert!(line.contains(&at), "{line}\nexpected: {at}");
    let expect = format!("decode ~{:.1} tok/s (estimate)", 1.0 / seconds_per_token);
    assert!(banner_line(&stderr, "expect:").contains(&expect), "{stderr}\nexpected: {expect}");

    // The same file on another host: its runs time nothing here.
    edit_runs(&file, |run| {
        run["timing"]["machine"] = machine.replacen(machine.split(" | ").next().unwrap_or(""), "another host", 1).into()
    });
    let (_, stderr) = stream_fixture(home.path(), "3");
    assert!(banner_line(&stderr, "speed:").contains("from the rates"), "{stderr}");
    assert!(banner_line(&stderr, "hits:").contains("measured from 2 runs"), "the hit rates still count: {stderr}");
    // An earlier version's file: runs without times.
    edit_runs(&file, |run| {
        run.as_object_mut().map(|r| r.remove("timing"));
    });
    let (_, stderr) = stream_fixture(home.path(), "3");
    assert!(banner_line(&stderr, "speed:").contains("from the rates"), "{stderr}");
    assert!(!stderr.contains("expert hit rates") && !stderr.contains("was not kept"), "no note about the file: {stderr}");
    let (_, stderr) = stream_fixture(home.path(), "3");
    assert!(banner_line(&stderr, "speed:").contains("measured from 1 run of this model here"), "the last run was timed: {stderr}");
}
