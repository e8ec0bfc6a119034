//! Many models, as Ollama serves them: two fixture models served by name in
//! turn, loaded on first use and unloaded after their `keep_alive` (or for
//! another model's room, never mid-generation), `/api/ps` saying what is
//! loaded until when, and `/api/pull` / `/api/delete` against the local
//! hub-like server of the pull tests.

mod common;
#[allow(dead_code)]
mod pull_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use slotstream::pull::{NetworkSettings, PullSource, TransferSettings};
use slotstream::server::{AppState, ModelCatalog, ServerOptions};

const MOE: &str = "qwen3_moe_mlx4";
const NEXT: &str = "qwen3_next_mlx4";

struct Server {
    addr: SocketAddr,
}

/// A server over both fixtures (MOE loaded at start, as `serve`'s first
/// `--model` is), and over pulled models in `cache` when given.
fn start(options: ServerOptions, cache: Option<PathBuf>, no_eos: bool) -> Server {
    let directories = vec![(MOE.to_string(), common::fixture(MOE)), (NEXT.to_string(), common::fixture(NEXT))];
    let catalog = ModelCatalog::new(directories, cache);
    let app = AppState::new(catalog, Arc::new(common::FixtureLoader { no_eos, mtp: false }), options).expect("valid options");
    app.load_at_start(MOE).expect("loading the first model");
    Server { addr: common::serve_in_background(app) }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    out
}

impl Server {
    /// Sends a request; returns the status and the (de-chunked) body.
    fn send(&self, method: &str, path: &str, body: &Value) -> (u16, String) {
        let body = if body.is_null() { String::new() } else { body.to_string() };
        let mut s = TcpStream::connect(self.addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(60))).expect("a timeout");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        s.write_all(head.as_bytes()).and_then(|()| s.write_all(body.as_bytes())).expect("sending");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).expect("reading the response");
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, rest) = text.split_once("\r\n\r\n").expect("a response head");
        let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("a status");
        let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
        (status, if chunked { dechunk(rest) } else { rest.to_string() })
    }

    fn json(&self, method: &str, path: &str, body: &Value) -> Value {
        let (status, text) = self.send(method, path, body);
        assert_eq!(status, 200, "{method} {path} {body}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"))
    }

    fn error(&self, method: &str, path: &str, body: &Value, status: u16) -> String {
        let (got, text) = self.send(method, path, body);
        assert_eq!(got, status, "{method} {path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
        v["error"].as_str().or(v["error"]["message"].as_str()).expect("an error message").to_string()
    }

    /// A short greedy answer of `model` (the same request always gives the same text).
    fn answer(&self, model: &str, extra: Value) -> String {
        let mut body = json!({"model": model, "prompt": "Tell me a story", "stream": false,
                              "options": {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 8}});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let v = self.json("POST", "/api/generate", &body);
        assert_eq!(v["done"], true, "{v}");
        v["response"].as_str().expect("a response").to_string()
    }

    /// `/api/ps`: name -> expires_at as seconds since the epoch.
    fn loaded(&self) -> Vec<(String, f64)> {
        let ps = self.json("GET", "/api/ps", &Value::Null);
        let models = ps["models"].as_array().expect("models").clone();
        models
            .iter()
            .map(|m| {
                assert!(m["size"].as_u64().unwrap_or(0) > 0, "a loaded model has a size: {m}");
                let expires = m["expires_at"].as_str().expect("expires_at");
                (m["name"].as_str().expect("a name").to_string(), epoch_seconds(expires))
            })
            .collect()
    }

    fn loaded_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.loaded().into_iter().map(|(n, _)| n).collect();
        names.sort();
        names
    }

    fn listed(&self) -> (Vec<String>, Vec<String>) {
        let tags = self.json("GET", "/api/tags", &Value::Null);
        let tags = tags["models"].as_array().expect("models").iter().map(|m| m["name"].as_str().unwrap_or("").to_string()).collect();
        let openai = self.json("GET", "/v1/models", &Value::Null);
        let openai = openai["data"].as_array().expect("data").iter().map(|m| m["id"].as_str().unwrap_or("").to_string()).collect();
        (tags, openai)
    }
}

/// `2026-12-01T21:23:53.123456789Z` as seconds since 1970.
fn epoch_seconds(rfc3339: &str) -> f64 {
    let number = |range: std::ops::Range<usize>| -> i64 {
        rfc3339.get(range).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{rfc3339:?} is not RFC 3339"))
    };
    let (y, m, d) = (number(0..4), number(5..7), number(8..10));
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let seconds = days * 86_400 + number(11..13) * 3600 + number(14..16) * 60 + number(17..19);
    seconds as f64
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("a clock after 1970").as_secs_f64()
}

#[test]
fn two_models_are_served_by_name_in_turn_and_loaded_on_first_use() {
    let s = start(common::server_options(8192, 4), None, false);
    let (tags, openai) = s.listed();
    assert_eq!((tags.clone(), openai), (vec![MOE.to_string(), NEXT.to_string()], vec![MOE.to_string(), NEXT.to_string()]));
    assert_eq!(s.loaded_names(), [MOE], "only the first model loads at start");
    assert_eq!(s.json("GET", &format!("/v1/models/{NEXT}"), &Value::Null)["id"], NEXT);
    // /api/show describes a model that is not loaded, without loading it.
    let show = s.json("POST", "/api/show", &json!({"model": NEXT}));
    assert_eq!(show["details"]["family"], "qwen3_next");
    assert_eq!(show["slotstream"]["loaded"], false);
    assert_eq!(s.loaded_names(), [MOE]);
    // Its context: --max-context (8192), at most the model's own (4096).
    assert!(show["parameters"].as_str().is_some_and(|p| p.starts_with("num_ctx 4096\n")), "{show}");

    // In turn, and back: each answers as it did the first time (its own weights).
    let moe = s.answer(MOE, json!({}));
    let next = s.answer(NEXT, json!({}));
    assert_eq!(s.loaded_names(), [MOE, NEXT], "both fit, so both stay");
    assert_eq!(s.answer(MOE, json!({})), moe);
    assert_eq!(s.answer(&format!("{NEXT}:latest"), json!({})), next);
    let chat = s.json("POST", "/v1/chat/completions", &json!({"model": NEXT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}));
    assert_eq!(chat["model"], NEXT);
    // Each answers as the engine alone does.
    for (name, text) in [(MOE, &moe), (NEXT, &next)] {
        let e = slotstream::generate::Engine::load(
            &common::fixture(name),
            Box::new(slotstream_cpu::CpuBackend::exact()),
            &slotstream::model::LoadOptions::default(),
        )
        .expect("loading the fixture");
        let prompt = e.codec.apply_chat_template(
            &[slotstream::tokenizer::ChatMessage { role: "user".into(), content: "Tell me a story".into() }],
            true,
            None,
        );
        let ids = e.codec.encode(&prompt.expect("the template renders"), false).expect("the prompt encodes");
        let sampling = slotstream::sampling::SamplingParams::default();
        let req = slotstream::generate::GenerateRequest { prompt_ids: ids, max_tokens: 8, sampling, stop: Vec::new(), ignore_eos: false };
        let out = e.generate(&req, |_| std::ops::ControlFlow::Continue(())).expect("generating");
        assert_eq!(&out.text, text, "{name} served something else than its own greedy answer");
    }
    let missing = s.error("POST", "/api/generate", &json!({"model": "llama3", "prompt": "x"}), 404);
    assert!(missing.contains("llama3") && missing.contains(MOE) && missing.contains(NEXT), "{missing}");
}

#[test]
fn keep_alive_sets_expires_at_and_zero_unloads() {
    let s = start(common::server_options(4096, 4), None, false);
    let default_expiry = s.loaded()[0].1 - now();
    assert!((280.0..=301.0).contains(&default_expiry), "the default keep-alive is 5 minutes: {default_expiry}s");

    s.answer(NEXT, json!({"keep_alive": "10m"}));
    let next = s.loaded().into_iter().find(|(n, _)| n == NEXT).expect("NEXT is loaded").1 - now();
    assert!((590.0..=601.0).contains(&next), "keep_alive 10m: expires in {next}s");
    s.answer(NEXT, json!({"keep_alive": 90}));
    let next = s.loaded().into_iter().find(|(n, _)| n == NEXT).expect("NEXT is loaded").1 - now();
    assert!((85.0..=91.0).contains(&next), "keep_alive 90 (seconds): expires in {next}s");
    s.answer(NEXT, json!({"keep_alive": -1}));
    let next = s.loaded().into_iter().find(|(n, _)| n == NEXT).expect("NEXT is loaded").1 - now();
    assert!(next > 50.0 * 365.0 * 86_400.0, "keep_alive -1 keeps it: expires in {next}s");

    // 0: unloaded as soon as the answer is complete.
    let chat = json!({"model": NEXT, "messages": [{"role": "user", "content": "Hi"}], "stream": false,
                      "keep_alive": 0, "options": {"num_predict": 4}});
    s.json("POST", "/api/chat", &chat);
    assert_eq!(s.loaded_names(), [MOE]);

    // A load-only request loads ("load") or, with 0, unloads ("unload").
    let unload = s.json("POST", "/api/generate", &json!({"model": MOE, "keep_alive": 0}));
    assert_eq!(unload["done_reason"], "unload");
    assert!(s.loaded_names().is_empty(), "{:?}", s.loaded_names());
    let load = s.json("POST", "/api/chat", &json!({"model": NEXT, "messages": [], "keep_alive": "1s"}));
    assert_eq!(load["done_reason"], "load");
    assert_eq!(s.loaded_names(), [NEXT]);
    // A short keep-alive runs out on its own.
    let t = Instant::now();
    while !s.loaded_names().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(5), "keep_alive 1s: still loaded after {:?}", t.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(t.elapsed() >= Duration::from_millis(500), "unloaded before its keep-alive ran out");
    // And the next request loads it again.
    s.answer(MOE, json!({}));
    assert_eq!(s.loaded_names(), [MOE]);

    for bad in [json!("soon"), json!([1]), json!(true)] {
        let e = s.error("POST", "/api/generate", &json!({"model": MOE, "prompt": "x", "keep_alive": bad}), 400);
        assert!(e.contains("keep_alive"), "{e}");
    }
}

#[test]
fn another_model_takes_the_place_of_an_idle_one_never_of_one_generating() {
    let mut options = common::server_options(32768, 1);
    options.max_loaded_models = 1;
    let s = start(options, None, true);
    s.answer(NEXT, json!({}));
    assert_eq!(s.loaded_names(), [NEXT], "loading NEXT unloaded the idle MOE");
    s.answer(MOE, json!({}));
    assert_eq!(s.loaded_names(), [MOE]);

    // A long generation on MOE: a request for NEXT waits for it, then loads.
    let mut running = TcpStream::connect(s.addr).expect("connecting");
    let body = json!({"model": MOE, "prompt": "Go on", "options": {"temperature": 0, "num_predict": 30000}}).to_string();
    let head = format!("POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    running.write_all(head.as_bytes()).expect("sending");
    running.set_read_timeout(Some(Duration::from_secs(30))).expect("a timeout");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"done\":false") {
        let n = running.read(&mut buf).expect("reading the stream");
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let addr = s.addr;
    let waiting = std::thread::spawn(move || Server { addr }.answer(NEXT, json!({})));
    std::thread::sleep(Duration::from_millis(500));
    assert!(!waiting.is_finished(), "NEXT loaded while MOE was generating");
    assert_eq!(s.loaded_names(), [MOE], "MOE unloaded mid-generation");
    // Waiting for a load counts against --queue (1 here), as waiting for the turn does.
    let busy = s.error("POST", "/api/generate", &json!({"model": NEXT, "prompt": "Hi"}), 503);
    assert!(busy.contains("--queue"), "{busy}");
    drop(running);
    let t = Instant::now();
    waiting.join().expect("the waiting request");
    assert!(t.elapsed() < Duration::from_secs(20), "NEXT waited {:?} after MOE's client left", t.elapsed());
    assert_eq!(s.loaded_names(), [NEXT]);
}

/// Fixtures that claim to need more memory than any machine has free.
struct TooLarge(common::FixtureLoader);

impl slotstream::server::ModelLoader for TooLarge {
    fn footprint(&self, _dir: &std::path::Path, _reclaimable: u64) -> anyhow::Result<u64> {
        Ok(u64::MAX)
    }

    fn load(&self, dir: &std::path::Path) -> anyhow::Result<slotstream::server::LoadedEngine> {
        self.0.load(dir)
    }
}

#[test]
fn a_model_whose_plan_does_not_fit_beside_another_unloads_the_idle_one() {
    let directories = vec![(MOE.to_string(), common::fixture(MOE)), (NEXT.to_string(), common::fixture(NEXT))];
    let loader = Arc::new(TooLarge(common::FixtureLoader { no_eos: false, mtp: false }));
    let app = AppState::new(ModelCatalog::new(directories, None), loader, common::server_options(4096, 4)).expect("valid options");
    app.load_at_start(MOE).expect("loading the first model");
    let s = Server { addr: common::serve_in_background(app) };
    s.answer(NEXT, json!({}));
    assert_eq!(s.loaded_names(), [NEXT], "three may stay loaded, but memory has room for one");
    s.answer(MOE, json!({}));
    assert_eq!(s.loaded_names(), [MOE]);
}

fn repo_files(fixture: &str) -> Vec<pull_support::RepoFile> {
    let mut files: Vec<pull_support::RepoFile> = std::fs::read_dir(common::fixture(fixture))
        .expect("reading the fixture")
        .map(|e| e.expect("a fixture file").path())
        .map(|path| {
            let name = path.file_name().expect("a file name").to_string_lossy().into_owned();
            let content = std::fs::read(&path).expect("reading a fixture file");
            pull_support::RepoFile { lfs: name.ends_with(".safetensors"), path: name, content }
        })
        .collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    files
}

#[test]
fn a_pulled_model_streams_progress_then_is_served_listed_and_deleted() {
    let hub = pull_support::HubServer::start(repo_files(NEXT));
    let scratch = tempfile::tempdir().expect("a scratch folder");
    let cache = scratch.path().join("hub");
    let mut options = common::server_options(4096, 4);
    options.pulls = Some(PullSource {
        cache_root: cache.clone(),
        endpoint: hub.endpoint(),
        token: Some(pull_support::TOKEN.to_string()),
        network: NetworkSettings {
            stall_timeout: Duration::from_secs(2),
            max_attempts: 3,
            first_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(2),
        },
        transfer: TransferSettings { connections: 2, chunk_bytes: 65536, checkpoint_bytes: 16384 },
    });
    let s = start(options, Some(cache.clone()), false);
    assert_eq!(s.listed().0, [MOE, NEXT]);

    let t = Instant::now();
    let (status, text) = s.send("POST", "/api/pull", &json!({"model": "hf:org/name"}));
    assert_eq!(status, 200, "{text}");
    assert!(t.elapsed() < Duration::from_secs(20), "the pull took {:?}", t.elapsed());
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"))).collect();
    assert_eq!(lines.first(), Some(&json!({"status": "pulling manifest"})), "{text}");
    assert_eq!(lines.last(), Some(&json!({"status": "success"})), "{text}");
    assert!(lines.iter().any(|l| l["status"] == "verifying sha256 digest"), "{text}");
    let weights = lines
        .iter()
        .filter(|l| l["status"] == "downloading model.safetensors")
        .map(|l| (l["completed"].as_u64().unwrap_or(0), l["total"].as_u64().unwrap_or(0)))
        .collect::<Vec<_>>();
    let size = std::fs::metadata(common::fixture(NEXT).join("model.safetensors")).expect("the fixture's weights").len();
    assert_eq!(weights.last(), Some(&(size, size)), "the weights' progress ends complete: {weights:?}");
    assert!(weights.windows(2).all(|w| w[0].0 <= w[1].0), "progress only grows: {weights:?}");
    let digest = lines.iter().find_map(|l| l["digest"].as_str().filter(|d| d.starts_with("sha256:"))).expect("an LFS digest");
    assert_eq!(digest.len(), "sha256:".len() + 64, "{digest}");

    // Then it is listed and served by name, answering as the same weights do from their folder.
    let (tags, openai) = s.listed();
    assert!(tags.contains(&"org/name".to_string()) && openai.contains(&"org/name".to_string()), "{tags:?} {openai:?}");
    assert_eq!(s.answer("org/name", json!({})), s.answer(NEXT, json!({})));
    assert_eq!(s.answer("hf:org/name", json!({})), s.answer(NEXT, json!({})));
    assert!(s.loaded_names().contains(&"org/name".to_string()));
    // Pulling what is there already checks it and succeeds without streaming.
    assert_eq!(s.json("POST", "/api/pull", &json!({"name": "org/name", "stream": false})), json!({"status": "success"}));

    // Bad names are refused before anything moves; a repository the hub lacks ends in an error.
    for bad in ["../../etc", "/etc/passwd", "org/name@../../x", "llama3", ""] {
        let e = s.error("POST", "/api/pull", &json!({"model": bad}), 400);
        assert!(e.contains("pull") || e.contains("required"), "{bad}: {e}");
    }
    let long = format!("org/{}", "n".repeat(10_000));
    let e = s.error("POST", "/api/pull", &json!({"model": long}), 400);
    assert!(e.contains("at most 256"), "{e}");
    // The hub's 404 is the client's error, not the server's.
    let e = s.error("POST", "/api/pull", &json!({"model": "org/missing", "stream": false}), 404);
    assert!(e.contains("org/missing") && e.contains("no such repository"), "{e}");

    // Deleted: unloaded, gone from the cache and the lists; a --model directory is refused.
    let (status, text) = s.send("DELETE", "/api/delete", &json!({"model": "org/name"}));
    assert_eq!(status, 200, "{text}");
    assert!(!cache.join("models--org--name").exists(), "the cache still holds the model");
    assert!(!s.loaded_names().contains(&"org/name".to_string()));
    assert_eq!(s.listed().0, [MOE, NEXT]);
    s.error("POST", "/api/generate", &json!({"model": "org/name", "prompt": "x"}), 404);
    s.error("DELETE", "/api/delete", &json!({"model": "org/name"}), 404);
    let refused = s.error("DELETE", "/api/delete", &json!({"model": MOE}), 400);
    assert!(refused.contains("--model"), "{refused}");
    assert!(common::fixture(MOE).join("model.safetensors").is_file(), "a --model directory was touched");
}

#[test]
fn a_shutdown_stops_a_running_pull_and_leaves_it_resumable() {
    let hub = pull_support::HubServer::start(repo_files(NEXT));
    hub.faults().bytes_per_second = Some(50_000);
    let scratch = tempfile::tempdir().expect("a scratch folder");
    let cache = scratch.path().join("hub");
    let mut options = common::server_options(4096, 4);
    options.pulls = Some(PullSource {
        cache_root: cache.clone(),
        endpoint: hub.endpoint(),
        token: Some(pull_support::TOKEN.to_string()),
        network: NetworkSettings::default(),
        transfer: TransferSettings { connections: 2, chunk_bytes: 1 << 20, checkpoint_bytes: 16384 },
    });
    let directories = vec![(MOE.to_string(), common::fixture(MOE))];
    let app = AppState::new(ModelCatalog::new(directories, Some(cache.clone())), Arc::new(common::FixtureLoader { no_eos: false, mtp: false }), options)
        .expect("valid options");
    let s = Server { addr: common::serve_in_background(app.clone()) };
    let addr = s.addr;
    let pulling = std::thread::spawn(move || Server { addr }.send("POST", "/api/pull", &json!({"model": "org/name"})));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!pulling.is_finished(), "the throttled pull should still run");
    let stopped = Instant::now();
    app.stop_generations();
    let (status, text) = pulling.join().expect("the pulling client");
    assert!(stopped.elapsed() < Duration::from_secs(5), "the pull ran {:?} past the shutdown", stopped.elapsed());
    assert_eq!(status, 200, "{text}");
    let last = text.lines().last().unwrap_or_default();
    assert!(last.contains("shutting down") && last.contains("resumes"), "{text}");
    let partial = std::fs::read_dir(cache.join("models--org--name").join("blobs"))
        .map(|files| files.flatten().any(|f| f.file_name().to_string_lossy().ends_with(".slotstream-partial")))
        .unwrap_or(false);
    assert!(partial, "the partial download was not kept to resume from");
}

#[test]
fn a_pull_in_progress_blocks_no_generation_and_runs_once_per_repository() {
    let hub = pull_support::HubServer::start(repo_files(NEXT));
    hub.faults().bytes_per_second = Some(150_000);
    let scratch = tempfile::tempdir().expect("a scratch folder");
    let cache = scratch.path().join("hub");
    let mut options = common::server_options(4096, 4);
    options.pulls = Some(PullSource {
        cache_root: cache.clone(),
        endpoint: hub.endpoint(),
        token: Some(pull_support::TOKEN.to_string()),
        network: NetworkSettings::default(),
        transfer: TransferSettings { connections: 2, chunk_bytes: 1 << 20, checkpoint_bytes: 65536 },
    });
    let s = start(options, Some(cache), false);
    let addr = s.addr;
    let t = Instant::now();
    let pulling = std::thread::spawn(move || Server { addr }.send("POST", "/api/pull", &json!({"model": "org/name"})));
    std::thread::sleep(Duration::from_millis(500));
    assert!(!pulling.is_finished(), "the throttled pull should still run");
    let again = s.error("POST", "/api/pull", &json!({"model": "hf:org/name", "stream": false}), 409);
    assert!(again.contains("org/name") && again.contains("pulled already"), "{again}");
    let generated = Instant::now();
    s.answer(MOE, json!({}));
    assert!(generated.elapsed() < Duration::from_secs(2), "a generation waited {:?} for the pull", generated.elapsed());
    assert!(!pulling.is_finished(), "the generation should have finished during the pull");
    let (status, text) = pulling.join().expect("the pulling client");
    assert_eq!(status, 200, "{text}");
    assert!(text.trim_end().ends_with(r#"{"status":"success"}"#), "{text}");
    assert!(t.elapsed() < Duration::from_secs(30), "the pull took {:?}", t.elapsed());
    assert!(s.listed().0.contains(&"org/name".to_string()));
}

#[test]
fn a_pull_whose_client_leaves_stops_and_the_next_pull_resumes_it() {
    let files = repo_files(NEXT);
    let weights = files.iter().find(|f| f.path == "model.safetensors").map(|f| f.content.len() as u64).expect("the weights");
    let hub = pull_support::HubServer::start(files);
    hub.faults().bytes_per_second = Some(30_000);
    let scratch = tempfile::tempdir().expect("a scratch folder");
    let cache = scratch.path().join("hub");
    let mut options = common::server_options(4096, 4);
    options.pulls = Some(PullSource {
        cache_root: cache.clone(),
        endpoint: hub.endpoint(),
        token: Some(pull_support::TOKEN.to_string()),
        network: NetworkSettings {
            stall_timeout: Duration::from_secs(2),
            max_attempts: 3,
            first_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(2),
        },
        transfer: TransferSettings { connections: 2, chunk_bytes: 65536, checkpoint_bytes: 16384 },
    });
    let s = start(options, Some(cache), false);

    // A client that reads until the weights are arriving, then leaves.
    let mut client = TcpStream::connect(s.addr).expect("connecting");
    client.set_read_timeout(Some(Duration::from_secs(30))).expect("a timeout");
    let body = json!({"model": "org/name"}).to_string();
    let head = format!(
        "POST /api/pull HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        s.addr,
        body.len()
    );
    client.write_all(head.as_bytes()).and_then(|()| client.write_all(body.as_bytes())).expect("sending");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("\"downloading model.safetensors\"").count() < 4 {
        let n = client.read(&mut buf).expect("progress lines");
        assert!(n > 0, "the pull ended before the client left: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(!seen.contains("success"), "the throttled pull finished too soon: {seen}");
    drop(client);

    // The download stops within a read or two: no range is asked for after
    // that. (The hub's log counts the bytes of requests made since it was
    // last taken; the throttled pull would make a new one every two seconds
    // on each connection.)
    std::thread::sleep(Duration::from_secs(3));
    let _ = hub.take_log();
    std::thread::sleep(Duration::from_secs(3));
    let sent: u64 = hub.take_log().content_bytes.values().sum();
    assert_eq!(sent, 0, "the pull went on after its client left: the hub sent {sent} bytes of new ranges");

    // The model is not held as being pulled, and a new pull resumes from the bytes the first one kept.
    hub.faults().bytes_per_second = None;
    let _ = hub.take_log();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, text) = s.send("POST", "/api/pull", &json!({"model": "org/name", "stream": false}));
        if status != 409 {
            assert_eq!(status, 200, "{text}");
            assert_eq!(serde_json::from_str::<Value>(&text).ok(), Some(json!({"status": "success"})), "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "a new pull is still refused as one in progress: {text}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let fetched = hub.take_log().content_bytes.get("model.safetensors").copied().unwrap_or(0);
    assert!(fetched < weights, "the second pull fetched {fetched} of the weights' {weights} bytes: the first pull's were not kept");
    assert!(s.listed().0.contains(&"org/name".to_string()));
    assert_eq!(s.answer("org/name", json!({})), s.answer(NEXT, json!({})));
}
