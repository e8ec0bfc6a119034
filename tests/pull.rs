//! `slotstream pull` end to end: the real binary against a local hub-like server that
//! injects faults. Nothing corrupt may be accepted, every interrupted download must
//! complete on a later run, and the cache must look as `huggingface_hub` lays it out.

mod pull_support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use pull_support::{noise, HubServer, RepoFile, COMMIT, TOKEN};
use slotstream::pull::locate_model_in;

const MODEL: &str = "hf:org/name";

fn repo_files() -> Vec<RepoFile> {
    vec![
        RepoFile { path: "config.json".into(), content: br#"{"model_type":"qwen3_moe"}"#.to_vec(), lfs: false },
        RepoFile { path: "tokenizer/vocab.txt".into(), content: noise(3000, 1), lfs: false },
        // Same content as config.json: one blob, two snapshot entries.
        RepoFile { path: "tokenizer/config.json".into(), content: br#"{"model_type":"qwen3_moe"}"#.to_vec(), lfs: false },
        RepoFile { path: "model-00001.safetensors".into(), content: noise(3 << 20, 2), lfs: true },
        RepoFile { path: "model-00002.safetensors".into(), content: noise((3 << 19) + 12345, 3), lfs: true },
    ]
}

/// A scratch cache folder, removed when the test ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("slotstream-pull-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("creating a scratch folder");
        Scratch(dir)
    }

    fn cache(&self) -> PathBuf {
        self.0.join("hub")
    }

    fn repo_dir(&self) -> PathBuf {
        self.cache().join("models--org--name")
    }

    fn snapshot(&self) -> PathBuf {
        self.repo_dir().join("snapshots").join(COMMIT)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn pull_command(server: &HubServer, scratch: &Scratch, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_slotstream"));
    command
        .arg("pull")
        .arg(MODEL)
        .args([
            "--connections", "4",
            "--chunk-bytes", "262144",
            "--checkpoint-bytes", "65536",
            "--stall-timeout-secs", "0.5",
            "--backoff-ms", "10",
            "--max-attempts", "8",
        ])
        .args(extra)
        .env("HF_ENDPOINT", server.endpoint())
        .env("HF_HUB_CACHE", scratch.cache())
        .env("HF_HOME", scratch.0.join("hf-home"))
        .env("HF_TOKEN", TOKEN)
        .stdin(Stdio::null());
    command
}

fn pull(server: &HubServer, scratch: &Scratch, extra: &[&str]) -> Output {
    pull_command(server, scratch, extra).output().expect("running slotstream pull")
}

fn text(output: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn assert_success(output: &Output) {
    assert!(output.status.success(), "pull failed:\n{}", text(output));
}

/// The cache holds exactly the served files, in `huggingface_hub`'s layout, with no
/// leftovers from interrupted transfers.
fn assert_complete_cache(scratch: &Scratch, files: &[RepoFile]) {
    let repo = scratch.repo_dir();
    let reference = fs::read_to_string(repo.join("refs/main")).expect("refs/main is written");
    assert_eq!(reference.trim(), COMMIT);
    for file in files {
        let entry = scratch.snapshot().join(&file.path);
        let target = fs::read_link(&entry).unwrap_or_else(|e| panic!("{} is not a symlink: {e}", entry.display()));
        let depth = file.path.split('/').count() + 1;
        let expected = format!("{}blobs/{}", "../".repeat(depth), file.blob_name());
        assert_eq!(target, Path::new(&expected), "snapshot link of {}", file.path);
        let content = fs::read(&entry).expect("reading through the snapshot link");
        assert!(content == file.content, "{} differs from what the server holds", file.path);
    }
    let leftovers: Vec<String> = fs::read_dir(repo.join("blobs"))
        .expect("blobs folder")
        .map(|e| e.expect("blob entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains('.'))
        .collect();
    assert!(leftovers.is_empty(), "partial files left behind: {leftovers:?}");
    let located = locate_model_in(&scratch.cache(), MODEL).expect("a complete model is located");
    assert_eq!(located, scratch.snapshot());
}

#[test]
fn fresh_pull_lays_out_the_cache_like_huggingface_hub() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    let scratch = Scratch::new("fresh");
    let output = pull(&server, &scratch, &[]);
    assert_success(&output);
    assert_complete_cache(&scratch, &files);

    let log = server.take_log();
    assert_eq!(log.hub_requests_without_token, 0, "HF_TOKEN must reach the hub");
    assert!(log.storage_requests > 0, "LFS files must come through the redirect");
    assert_eq!(log.storage_requests_with_auth, 0, "the token must not leak to the storage host");
    assert!(log.max_parallel_downloads >= 2, "ranges were not fetched in parallel ({} at most)", log.max_parallel_downloads);

    // A second pull finds everything and moves no file bytes.
    assert_success(&pull(&server, &scratch, &[]));
    let served: u64 = server.take_log().content_bytes.values().sum();
    assert_eq!(served, 0, "a complete model was downloaded again");
}

#[test]
fn the_token_does_not_follow_a_redirect_to_another_port_of_the_hub_s_host() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    server.faults().storage_on_another_port = true;
    let scratch = Scratch::new("other-port");
    assert_success(&pull(&server, &scratch, &[]));
    assert_complete_cache(&scratch, &files);
    let log = server.take_log();
    assert_eq!(log.hub_requests_without_token, 0, "HF_TOKEN must reach the hub");
    assert!(log.storage_requests > 0, "LFS files must come through the redirect");
    assert_eq!(log.storage_requests_with_auth, 0, "another port of the hub's host is another server: the token must not reach it");
}

/// Sets `path` and everything in it read-only (or back to writable).
fn set_read_only(path: &Path, read_only: bool) {
    use std::os::unix::fs::PermissionsExt;
    let meta = fs::symlink_metadata(path).expect("reading a cache entry");
    if meta.file_type().is_symlink() {
        return;
    }
    if meta.is_dir() {
        for entry in fs::read_dir(path).expect("listing the cache").flatten() {
            set_read_only(&entry.path(), read_only);
        }
    }
    let mode = match (meta.is_dir(), read_only) {
        (true, true) => 0o555,
        (true, false) => 0o755,
        (false, true) => 0o444,
        (false, false) => 0o644,
    };
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("changing a cache entry's mode");
}

#[test]
fn a_complete_model_in_a_moved_read_only_cache_is_found() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    let scratch = Scratch::new("moved");
    assert_success(&pull(&server, &scratch, &[]));
    let moved = scratch.0.join("elsewhere");
    fs::rename(scratch.cache(), &moved).expect("moving the cache");
    set_read_only(&moved, true);
    let found = locate_model_in(&moved, MODEL);
    set_read_only(&moved, false);
    let found = found.unwrap_or_else(|e| panic!("the moved cache's model is not found: {e:#}"));
    assert_eq!(found, moved.join("models--org--name").join("snapshots").join(COMMIT));
}

#[test]
fn flaky_server_still_yields_a_verified_model() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    {
        let mut faults = server.faults();
        faults.head_statuses.extend([500, 429, 503]);
        faults.get_statuses.extend([429, 429, 429, 500, 503, 500]);
        faults.drop_after.extend([1000, 70_000, 150_000, 0]);
        faults.stall_before_headers = 1;
        faults.stall_mid_body = 2;
    }
    let scratch = Scratch::new("flaky");
    let started = Instant::now();
    let output = pull(&server, &scratch, &[]);
    assert_success(&output);
    assert_complete_cache(&scratch, &files);
    assert!(String::from_utf8_lossy(&output.stderr).contains("retry"), "retries are reported:\n{}", text(&output));
    assert!(started.elapsed() < Duration::from_secs(20), "stalls were not cut short by the timeout");
}

#[test]
fn corrupted_byte_is_rejected_deleted_and_fetched_again() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    server.faults().corrupt_once = Some("model-00001.safetensors".into());
    let scratch = Scratch::new("corrupt");

    let output = pull(&server, &scratch, &[]);
    assert!(!output.status.success(), "a corrupted download was accepted:\n{}", text(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("model-00001.safetensors") && stderr.contains("sha256") && stderr.contains("deleted"), "{}", text(&output));
    assert!(!scratch.snapshot().join("model-00001.safetensors").exists(), "the corrupt file is in the snapshot");
    let blobs: Vec<_> = fs::read_dir(scratch.repo_dir().join("blobs")).expect("blobs").collect();
    assert_eq!(blobs.len(), 3, "only the three good files remain in blobs/");
    let missing = locate_model_in(&scratch.cache(), MODEL).expect_err("an incomplete model was located");
    let message = format!("{missing:#}");
    assert!(message.contains("model-00001.safetensors") && message.contains("slotstream pull hf:org/name"), "{message}");

    assert_success(&pull(&server, &scratch, &[]));
    assert_complete_cache(&scratch, &files);
}

#[test]
fn truncated_file_on_the_server_is_never_accepted() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    server.faults().truncate = Some(("model-00002.safetensors".into(), 1 << 20));
    let scratch = Scratch::new("truncated");

    let output = pull(&server, &scratch, &[]);
    assert!(!output.status.success(), "a truncated file was accepted:\n{}", text(&output));
    assert!(String::from_utf8_lossy(&output.stderr).contains("model-00002.safetensors"), "{}", text(&output));
    assert!(!scratch.snapshot().join("model-00002.safetensors").exists());
    assert!(scratch.snapshot().join("model-00001.safetensors").exists(), "the other files still complete");

    server.faults().truncate = None;
    assert_success(&pull(&server, &scratch, &[]));
    assert_complete_cache(&scratch, &files);
}

/// Bytes of each LFS file the record on disk says are already there.
fn bytes_on_disk(scratch: &Scratch, file: &RepoFile) -> u64 {
    let blobs = scratch.repo_dir().join("blobs");
    if blobs.join(file.blob_name()).exists() {
        return file.content.len() as u64;
    }
    let Ok(record) = fs::read(blobs.join(format!("{}.slotstream-ranges", file.blob_name()))) else { return 0 };
    let record: serde_json::Value = serde_json::from_slice(&record).expect("the range record is JSON");
    record["done"].as_array().expect("done list").iter().map(|v| v.as_u64().expect("byte count")).sum()
}

#[test]
fn kill_9_mid_download_resumes_exactly_where_it_stopped() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    server.faults().bytes_per_second = Some(400 << 10);
    let scratch = Scratch::new("kill9");

    let mut child = pull_command(&server, &scratch, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting slotstream pull");
    let lfs: Vec<&RepoFile> = files.iter().filter(|f| f.lfs).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let on_disk: u64 = lfs.iter().map(|f| bytes_on_disk(&scratch, f)).sum();
        if on_disk >= 1 << 20 {
            break;
        }
        assert!(Instant::now() < deadline, "the download made no durable progress");
        assert!(child.try_wait().expect("polling the child").is_none(), "pull finished before it could be killed");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("kill -9"); // SIGKILL on Unix: no cleanup runs
    child.wait().expect("reaping the killed pull");

    let total: u64 = lfs.iter().map(|f| f.content.len() as u64).sum();
    let kept: Vec<u64> = lfs.iter().map(|f| bytes_on_disk(&scratch, f)).collect();
    assert!(kept.iter().sum::<u64>() < total, "the download finished before the kill");
    let located = locate_model_in(&scratch.cache(), MODEL);
    assert!(located.is_err(), "a half-downloaded model was located");

    server.faults().bytes_per_second = None;
    server.take_log();
    let output = pull(&server, &scratch, &[]);
    assert_success(&output);
    assert_complete_cache(&scratch, &files);
    let log = server.take_log();
    for (file, kept) in lfs.iter().zip(kept) {
        let fetched = log.content_bytes.get(&file.path).copied().unwrap_or(0);
        assert_eq!(
            fetched,
            file.content.len() as u64 - kept,
            "{}: {kept} bytes were on disk, so exactly the rest should be fetched",
            file.path
        );
    }
}

#[test]
fn verify_reports_each_file_and_deletes_a_damaged_one() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    let scratch = Scratch::new("verify");
    assert_success(&pull(&server, &scratch, &[]));

    let clean = pull(&server, &scratch, &["--verify"]);
    assert_success(&clean);
    let report = String::from_utf8_lossy(&clean.stdout);
    for file in &files {
        assert!(report.contains(&format!("ok        {}", file.path)), "{}", text(&clean));
    }

    // Damage one byte of a blob in place (same size, as bit rot would).
    let damaged = scratch.snapshot().join("model-00002.safetensors");
    let mut bytes = fs::read(&damaged).expect("reading the blob");
    bytes[1000] ^= 1;
    fs::write(&damaged, &bytes).expect("damaging the blob");

    let output = pull(&server, &scratch, &["--verify"]);
    assert!(!output.status.success(), "damage went unnoticed:\n{}", text(&output));
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(report.contains("MISMATCH  model-00002.safetensors"), "{}", text(&output));
    assert!(report.contains("ok        model-00001.safetensors"), "{}", text(&output));
    assert!(!damaged.exists(), "the damaged file was not deleted");
    let message = format!("{:#}", locate_model_in(&scratch.cache(), MODEL).expect_err("damaged model located"));
    assert!(message.contains("model-00002.safetensors") && message.contains("slotstream pull hf:org/name"), "{message}");

    assert_success(&pull(&server, &scratch, &[]));
    assert_complete_cache(&scratch, &files);
}

#[test]
fn a_copy_downloaded_by_another_tool_is_checked_not_fetched() {
    let files = repo_files();
    let server = HubServer::start(files.clone());
    let scratch = Scratch::new("foreign");
    // Lay the files out as huggingface_hub would, one of them cut short.
    let repo = scratch.repo_dir();
    fs::create_dir_all(repo.join("refs")).expect("refs");
    fs::write(repo.join("refs/main"), COMMIT).expect("refs/main");
    for file in &files {
        let blob = repo.join("blobs").join(file.blob_name());
        fs::create_dir_all(blob.parent().expect("blobs")).expect("blobs");
        let short = file.path == "model-00001.safetensors";
        fs::write(&blob, if short { &file.content[..1000] } else { &file.content[..] }).expect("blob");
        let entry = scratch.snapshot().join(&file.path);
        fs::create_dir_all(entry.parent().expect("snapshot")).expect("snapshot");
        let depth = file.path.split('/').count() + 1;
        std::os::unix::fs::symlink(format!("{}blobs/{}", "../".repeat(depth), file.blob_name()), &entry).expect("link");
    }
    // Before slotstream has checked them, the files are not trusted.
    let message = format!("{:#}", locate_model_in(&scratch.cache(), MODEL).expect_err("unchecked model located"));
    assert!(message.contains("slotstream pull hf:org/name"), "{message}");

    let output = pull(&server, &scratch, &[]);
    assert_success(&output);
    assert_complete_cache(&scratch, &files);
    let log = server.take_log();
    let fetched: Vec<&String> = log.content_bytes.keys().collect();
    assert_eq!(fetched, ["model-00001.safetensors"], "only the short file is fetched again");
}

#[test]
fn a_known_model_that_is_missing_names_its_files_and_the_pull_command() {
    let scratch = Scratch::new("known");
    let error = locate_model_in(&scratch.cache(), "qwen3.8-flash-next:4bit").expect_err("nothing is downloaded");
    let message = format!("{error:#}");
    assert!(message.contains("model-00001.safetensors"), "{message}");
    assert!(message.contains("slotstream pull qwen3.8-flash-next:4bit"), "{message}");
    assert!(!message.contains("mtp.safetensors"), "an optional file is not required: {message}");
}
