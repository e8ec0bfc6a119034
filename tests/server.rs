//! `slotstream serve` end to end: a server on an ephemeral port over a fixture
//! model, driven by a tiny HTTP/1.1 client on raw sockets (so tests can also
//! send broken requests and hang up mid-stream).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use slotstream::generate::GenerateRequest;
use slotstream::sampling::SamplingParams;
use slotstream::server::Timeouts;
use slotstream::tokenizer::ChatMessage;

use common::raw_server::*;

#[test]
fn metadata_endpoints_describe_the_model() {
    let s = start(Setup::default());
    let root = s.get("/");
    assert_eq!((root.status, root.text().as_str()), (200, "Ollama is running"));
    assert_eq!(s.request("HEAD", "/", &[], b"").status, 200);
    let version = s.get("/api/version").json()["version"].as_str().map(String::from).expect("a version string");
    let parts: Vec<u32> = version.split('.').map(|p| p.parse().expect("a number")).collect();
    assert!(parts >= vec![0, 13, 4], "Codex CLI refuses Ollama below 0.13.4; we say {version}");
    let tags = s.get("/api/tags").json();
    assert_eq!(tags["models"][0]["name"], MODEL);
    assert_eq!(tags["models"][0]["details"]["family"], "qwen3_moe");
    let ps = s.get("/api/ps").json();
    assert!(ps["models"][0]["size"].as_u64().unwrap_or(0) > 0, "ps reports memory: {ps}");
    let show = s.post("/api/show", &json!({"model": MODEL}));
    assert_eq!(show.status, 200);
    let show = show.json();
    assert!(show["slotstream"]["memory"]["resident_weight_bytes"].as_u64().unwrap_or(0) > 0, "{show}");
    assert!(show["slotstream"]["memory"]["prefix_cache"]["enabled"].as_bool().unwrap_or(false));
    assert!(show["template"].as_str().unwrap_or("").contains("im_start"));
    let missing = s.post("/api/show", &json!({"model": "nope"}));
    assert_eq!(missing.status, 404);
    assert!(missing.error().contains("nope"));
    assert_eq!(s.get("/v1/models").json()["data"][0]["id"], MODEL);
    assert_eq!(s.get(&format!("/v1/models/{MODEL}")).status, 200);
    assert_eq!(s.get("/v1/models/other").status, 404);
}

/// The text `Engine::generate` produces for one user message, greedily.
fn direct_chat(messages: &[ChatMessage], max_tokens: usize) -> String {
    let e = engine(MODEL);
    let prompt = e.codec.apply_chat_template(messages, true, None).expect("template renders");
    let prompt_ids = e.codec.encode(&prompt, false).expect("prompt encodes");
    let req = GenerateRequest { prompt_ids, max_tokens, sampling: SamplingParams::default(), stop: Vec::new(), ignore_eos: false };
    e.generate(&req, |_| std::ops::ControlFlow::Continue(())).expect("generation runs").text
}

#[test]
fn ollama_chat_and_generate_match_the_engine() {
    let s = start(Setup::default());
    let user = vec![ChatMessage { role: "user".into(), content: "Tell me a story".into() }];
    let want = direct_chat(&user, 12);
    let chat = s.post("/api/chat", &json!({"model": MODEL, "messages": user, "stream": false, "options": greedy()}));
    assert_eq!(chat.status, 200, "{}", chat.text());
    let chat = chat.json();
    assert_eq!(chat["message"]["content"], want.as_str());
    assert_eq!(chat["done"], true);
    assert!(chat["eval_count"].as_u64().is_some() && chat["prompt_eval_duration"].as_u64().is_some());

    // Streaming (the default): NDJSON whose pieces add up to the same text.
    let gen = s.post("/api/generate", &json!({"model": MODEL, "prompt": "Tell me a story", "options": greedy()}));
    assert_eq!(gen.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<Value> = gen.text().lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect();
    let last = lines.last().expect("at least one line");
    assert_eq!(last["done"], true);
    assert!(matches!(last["done_reason"].as_str(), Some("stop" | "length")));
    let text: String = lines.iter().filter_map(|l| l["response"].as_str()).collect();
    assert_eq!(text, want);
    let context = last["context"].as_array().expect("generate returns context");
    assert_eq!(context.len() as u64, last["prompt_eval_count"].as_u64().unwrap_or(0) + last["eval_count"].as_u64().unwrap_or(0));

    // An empty prompt loads the model, as in Ollama.
    let load = s.post("/api/generate", &json!({"model": MODEL})).json();
    assert_eq!(load["done_reason"], "load");
}

#[test]
fn openai_endpoints_stream_sse_and_report_usage() {
    let s = start(Setup::default());
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0});
    let full = s.post("/v1/chat/completions", &body);
    assert_eq!(full.status, 200, "{}", full.text());
    let full = full.json();
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    let completion_tokens = full["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!((1..=6).contains(&completion_tokens), "{completion_tokens} completion tokens");

    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    streamed["stream_options"] = json!({"include_usage": true});
    let sse = s.post("/v1/chat/completions", &streamed);
    assert_eq!(sse.header("content-type"), Some("text/event-stream"));
    let text = sse.text();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").expect("data lines")).expect("chunks are JSON"))
        .collect();
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, full["choices"][0]["message"]["content"].as_str().unwrap_or(""));
    let usage = &chunks.last().expect("a usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"].as_u64(), Some(completion_tokens));

    let done = s.post("/v1/completions", &json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "temperature": 0}));
    let done = done.json();
    assert_eq!(done["object"], "text_completion");
    assert!(done["choices"][0]["text"].is_string());
}

#[test]
fn unsupported_features_and_bad_requests_answer_400() {
    let s = start(Setup { max_context: 256, ..Setup::default() });
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/api/chat", json!({"model": MODEL, "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}), "tools"),
        ("/api/chat", json!({"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}), "images"),
        ("/api/generate", json!({"model": MODEL, "prompt": "x", "format": "yaml"}), "format must be"),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "n": 2}), "n > 1"),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "logprobs": true}), "logprobs"),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "response_format": {"type": "json_schema"}}), "json_schema.schema"),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "tools": [{"type": "function"}]}), "tools"),
        ("/v1/embeddings", json!({"model": MODEL, "input": "x"}), "embeddings"),
        ("/api/chat", json!({"model": MODEL, "messages": msgs, "options": {"temperature": "hot"}}), "invalid"),
        ("/api/generate", json!({"model": MODEL, "prompt": "word ".repeat(400)}), "context"),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "max_tokens": 1000}), "context"),
        // A num_ctx above the server's maximum is capped to it, as Ollama does.
        ("/api/chat", json!({"model": MODEL, "messages": msgs, "options": {"num_ctx": 1_000_000, "num_predict": 1000}}), "context limit of 256"),
    ];
    for (path, body, needle) in cases {
        let r = s.post(path, &body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        assert!(r.error().contains(needle), "{path}: error {:?} should mention {needle:?}", r.error());
    }
    let capped = s.post("/api/chat", &json!({"model": MODEL, "messages": msgs, "stream": false, "options": {"num_ctx": 1_000_000, "num_predict": 2}}));
    assert_eq!(capped.status, 200, "num_ctx 1,000,000 is served within --max-context: {}", capped.text());
    let malformed = s.request("POST", "/api/chat", &[], b"{\"model\": ");
    assert_eq!(malformed.status, 400);
    assert!(malformed.error().contains("invalid JSON"));
    let unknown = s.post("/v1/chat/completions", &json!({"model": "gpt-4", "messages": msgs}));
    assert_eq!(unknown.status, 404);
    assert!(unknown.json()["error"]["message"].as_str().unwrap_or("").contains("gpt-4"));
    for (path, takes) in [("/v1/chat/completions", "POST"), ("/api/chat", "POST"), ("/api/tags", "GET")] {
        let method = if takes == "GET" { "PUT" } else { "GET" };
        let wrong = s.request(method, path, &[], b"");
        assert_eq!(wrong.status, 405, "{method} {path}: {}", wrong.text());
        assert!(wrong.error().contains("is not allowed on"), "{method} {path}: {:?}", wrong.error());
        assert!(wrong.header("allow").is_some_and(|a| a.contains(takes)), "{method} {path}: Allow {:?}", wrong.header("allow"));
    }
}

#[test]
fn foreign_origins_and_huge_bodies_are_refused() {
    let s = start(Setup::default());
    let foreign = s.request("GET", "/api/tags", &[("Origin", "https://evil.example")], b"");
    assert_eq!(foreign.status, 403);
    let local = s.request("GET", "/api/tags", &[("Origin", "http://localhost:3000")], b"");
    assert_eq!(local.status, 200);
    assert_eq!(local.header("access-control-allow-origin"), Some("http://localhost:3000"));
    let preflight = s.request(
        "OPTIONS",
        "/api/chat",
        &[("Origin", "http://127.0.0.1:8080"), ("Access-Control-Request-Method", "POST"), ("Access-Control-Request-Headers", "content-type")],
        b"",
    );
    assert_eq!(preflight.status, 204);
    assert_eq!(preflight.header("access-control-allow-headers"), Some("content-type"));

    // Refused from its length alone, before the client has sent it.
    let huge = format!("POST /api/chat HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n", (32 << 20) + 10);
    assert!(status_of_head(&s, &huge).contains(" 413 "));
    assert_eq!(s.get("/api/version").status, 200, "still serving");
}

#[test]
fn disconnects_cancel_and_the_queue_is_bounded() {
    let s = start(Setup { no_eos: true, queue: 1, ..Setup::default() });
    let endless = json!({"model": MODEL, "prompt": "Go on", "options": {"temperature": 0, "num_predict": 30000}});
    let running = open_stream(&s, &endless);
    // One request may wait; the next gets 503.
    let addr = s.addr;
    let waiter = std::thread::spawn(move || {
        Server { addr }.post("/api/generate", &json!({"model": MODEL, "prompt": "Hi", "stream": false, "options": greedy()}))
    });
    std::thread::sleep(Duration::from_millis(300));
    let refused = s.post("/api/generate", &json!({"model": MODEL, "prompt": "Hi", "stream": false, "options": greedy()}));
    assert_eq!(refused.status, 503, "{}", refused.text());
    // Metadata answers while a generation runs.
    let t = Instant::now();
    assert_eq!(s.get("/api/ps").status, 200);
    assert!(t.elapsed() < Duration::from_secs(2), "metadata took {:?} during a generation", t.elapsed());
    // Hanging up cancels the endless generation, so the waiter gets its turn.
    drop(running);
    let t = Instant::now();
    let served = waiter.join().expect("waiter thread");
    assert_eq!(served.status, 200, "{}", served.text());
    assert!(t.elapsed() < Duration::from_secs(20), "the queued request waited {:?}", t.elapsed());
}

/// An 8-turn greedy chat gives the same replies with and without the prefix
/// cache, and later turns reuse earlier state; `mtp` adds speculative decoding
/// to the cached server (the other decodes plainly).
fn chat_with_and_without_cache(fixture: &'static str, mtp: bool) {
    let cached = start(Setup { fixture, mtp, ..Setup::default() });
    let fresh = start(Setup { fixture, prefix_cache: false, ..Setup::default() });
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    for turn in 0..8 {
        messages.push(json!({"role": "user", "content": format!("Question number {turn}: what next?")}));
        let body = json!({"model": fixture, "messages": messages, "max_tokens": 10, "temperature": 0});
        let a = cached.post("/v1/chat/completions", &body).json();
        let b = fresh.post("/v1/chat/completions", &body).json();
        let reply = a["choices"][0]["message"]["content"].clone();
        assert_eq!(reply, b["choices"][0]["message"]["content"], "{fixture} turn {turn}: cache changed the output");
        let reused = a["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        if turn > 0 {
            assert!(reused > 0, "{fixture} turn {turn} reused nothing: {a}");
        }
        assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(0));
        messages.push(json!({"role": "assistant", "content": reply}));
    }
}

#[test]
fn prefix_cache_keeps_greedy_output_on_moe() {
    chat_with_and_without_cache("qwen3_moe_mlx4", false);
}

#[test]
fn prefix_cache_keeps_greedy_output_on_hybrid_attention() {
    chat_with_and_without_cache("qwen3_next_mlx4", false);
}

#[test]
fn prefix_cache_and_mtp_keep_greedy_output_on_qwen4_exp() {
    chat_with_and_without_cache("qwen4_exp_tiny", true);
}

#[test]
fn arbitrary_bytes_never_break_the_server() {
    let s = start(Setup::default());
    let bodies: Vec<&[u8]> = vec![b"", b"null", b"[]", b"\"x\"", b"{\"model\": 5}", b"\xff\xfe", b"{\"messages\": {}}", b"{\"model\":\"qwen3_moe_mlx4\",\"messages\":[{\"role\":5}],\"prompt\":7,\"options\":{\"num_predict\":1e99}}"];
    for path in ["/api/generate", "/api/chat", "/api/show", "/v1/chat/completions", "/v1/completions"] {
        for body in &bodies {
            let r = s.request("POST", path, &[], body);
            // /api/show ignores fields it does not know, so a body naming the model is fine there.
            let ok = r.status == 400 || r.status == 404 || (path == "/api/show" && r.status == 200);
            assert!(ok, "{path} {:?} -> {} {}", String::from_utf8_lossy(body), r.status, r.text());
        }
    }
    assert_eq!(s.get("/api/version").status, 200);
}

#[test]
fn thinking_follows_the_template() {
    let plain = start(Setup::default());
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let r = plain.post("/api/chat", &json!({"model": MODEL, "messages": msgs, "think": true, "stream": false}));
    assert_eq!(r.status, 400);
    assert!(r.error().contains("thinking"), "{}", r.error());

    // A copy of the fixture whose template has a thinking switch.
    let dir = tempfile::tempdir().expect("a temporary directory");
    for entry in std::fs::read_dir(fixture(MODEL)).expect("reading the fixture") {
        let entry = entry.expect("a fixture file");
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copying the fixture");
    }
    let cfg_path = dir.path().join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("reading")).expect("JSON");
    let template = cfg["chat_template"].as_str().expect("a template").to_string()
        + "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}";
    cfg["chat_template"] = template.into();
    std::fs::write(&cfg_path, cfg.to_string()).expect("writing");
    let s = start(Setup { dir: Some(dir.path().to_path_buf()), ..Setup::default() });
    let show = s.post("/api/show", &json!({"model": MODEL})).json();
    assert!(show["capabilities"].as_array().is_some_and(|c| c.contains(&json!("thinking"))), "{show}");
    let ask = |think: bool| {
        let r = s.post("/api/chat", &json!({"model": MODEL, "messages": msgs, "think": think, "stream": false, "options": greedy()}));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let on = ask(true);
    let off = ask(false);
    let count = |v: &Value| v["prompt_eval_count"].as_u64().unwrap_or(0);
    assert!(count(&off) > count(&on), "think=false should add the empty think block: {} vs {}", count(&off), count(&on));
}

/// Sends `head` (a request head without its body) and reads the reply's status
/// line, waiting at most a few seconds.
fn status_of_head(s: &Server, head: &str) -> String {
    let mut t = TcpStream::connect(s.addr).expect("connecting");
    t.set_read_timeout(Some(Duration::from_secs(5))).expect("setting a timeout");
    t.write_all(head.as_bytes()).expect("sending the head");
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n") {
        match t.read(&mut byte) {
            Ok(1) => got.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got).trim().to_string()
}

#[test]
fn dns_rebinding_and_smuggled_origins_are_refused() {
    let s = start(Setup::default());
    for path in ["/api/tags", "/api/ps", "/v1/models", "/api/version"] {
        let r = s.raw(format!("GET {path} HTTP/1.1\r\nHost: evil.com\r\nConnection: close\r\n\r\n").as_bytes());
        assert_eq!(r.status, 403, "{path} answered Host: evil.com");
    }
    let no_host = s.raw(b"GET /api/tags HTTP/1.1\r\nConnection: close\r\n\r\n");
    assert_eq!(no_host.status, 400, "HTTP/1.1 without Host");
    let local = s.raw(b"GET /api/tags HTTP/1.1\r\nHost: localhost:11434\r\nConnection: close\r\n\r\n");
    assert_eq!(local.status, 200);

    let userinfo = s.request("GET", "/api/tags", &[("Origin", "http://localhost:80@evil.com")], b"");
    assert_eq!(userinfo.status, 403, "an origin whose host is evil.com");
    assert_eq!(userinfo.header("access-control-allow-origin"), None);
    let two = s.request("GET", "/api/tags", &[("Origin", "http://localhost:3000"), ("Origin", "https://evil.example")], b"");
    assert_eq!(two.status, 403, "two Origin headers");
}

#[test]
fn a_body_declared_over_the_limit_is_refused_before_it_is_read() {
    let s = start(Setup::default());
    let head = "POST /api/chat HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
                Content-Length: 40000000\r\nExpect: 100-continue\r\n\r\n";
    let status = status_of_head(&s, head);
    assert!(status.contains(" 413 "), "expected 413 at once, got {status:?}");
}

#[test]
fn a_value_of_the_wrong_type_is_refused_naming_its_field() {
    let s = start(Setup::default());
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let cases: [(&str, Value, &str); 5] = [
        ("/api/chat", json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}), "messages[0].content: invalid type"),
        ("/api/chat", json!({"model": MODEL, "messages": [{"content": "Hi"}]}), "messages[0]: missing field `role`"),
        ("/api/generate", json!({"model": MODEL, "prompt": "Hi", "options": {"stop": [1]}}), "options.stop[0]: invalid type"),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "stop": 5}), "stop: invalid type: integer `5`, expected a string or a list"),
        ("/v1/completions", json!({"model": MODEL, "prompt": "Hi", "stream_options": {"include_usage": "yes"}}), "stream_options.include_usage: invalid type"),
    ];
    for (path, body, needle) in cases {
        let r = s.post(path, &body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        assert!(r.error().contains(needle), "{path} {body}: error {:?} should contain {needle:?}", r.error());
    }
}

#[test]
fn a_bad_max_tokens_is_refused_even_beside_max_completion_tokens() {
    let s = start(Setup::default());
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let r = s.post("/v1/chat/completions", &json!({"model": MODEL, "messages": msgs, "max_tokens": -5, "max_completion_tokens": 4}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.error().contains("max_tokens must be at least 1"), "{}", r.error());
}

#[test]
fn idle_and_slow_connections_are_closed_on_time() {
    let timeouts = Timeouts { header: Duration::from_secs(1), body: Duration::from_secs(1), ..Timeouts::default() };
    let s = start(Setup { timeouts, ..Setup::default() });
    let t = Instant::now();
    let mut idle = TcpStream::connect(s.addr).expect("connecting");
    idle.set_read_timeout(Some(Duration::from_secs(10))).expect("setting a timeout");
    let mut rest = Vec::new();
    let _ = idle.read_to_end(&mut rest);
    assert!(t.elapsed() < Duration::from_secs(5), "an idle connection stayed open {:?}", t.elapsed());
    let head = "POST /api/chat HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{\"model\":";
    let status = status_of_head(&s, head);
    assert!(status.contains(" 408 "), "a body that never arrives: {status:?}");
}

#[test]
fn shutdown_ends_streams_with_a_final_chunk_within_its_grace() {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let timeouts = Timeouts { shutdown_grace: Duration::from_secs(2), ..Timeouts::default() };
    let setup = Setup { no_eos: true, timeouts, ..Setup::default() };
    let (s, returned) = start_until(setup, async move {
        let _ = stopped.await;
    });
    let mut stream = open_stream(&s, &json!({"model": MODEL, "prompt": "Go on", "options": {"num_predict": 4000}}));
    let _idle = TcpStream::connect(s.addr).expect("connecting");
    let t = Instant::now();
    stop.send(()).expect("signalling shutdown");
    returned.recv_timeout(Duration::from_secs(10)).expect("serve_on returned");
    assert!(t.elapsed() < Duration::from_secs(5), "shutdown took {:?}", t.elapsed());
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(String::from_utf8_lossy(&rest).contains("\"done\":true"), "no final chunk: {}", String::from_utf8_lossy(&rest));
}

#[test]
fn a_prompt_surely_too_long_is_refused_by_its_size_before_tokenizing() {
    let s = start(Setup { max_context: 256, ..Setup::default() });
    let t = Instant::now();
    let r = s.post("/api/generate", &json!({"model": MODEL, "prompt": "hello world ".repeat(400_000), "raw": true}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.error().contains("judged by its size in bytes"), "{}", r.error());
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

