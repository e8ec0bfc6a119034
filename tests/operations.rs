//! Serving operations end to end: `/health`, `/health/ready` and `/metrics`
//! moving with requests, SIGTERM's drain, and `load_duration`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use slotstream::server::{AppState, ModelCatalog};

use common::tools_server::{fixture, start, Server, MODEL};

/// The value of the sample `name{labels}` in a Prometheus exposition (0 when absent).
fn sample(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap_or_else(|e| panic!("{name_and_labels}: {v:?} is no number: {e}")))
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"))
}

/// A server over the plain fixture that loads its model on the first request.
fn unloaded_server(no_eos: bool) -> (Arc<AppState>, Server) {
    let loader = Arc::new(common::FixtureLoader { no_eos, mtp: false });
    let catalog = ModelCatalog::new(vec![(MODEL.to_string(), fixture(MODEL))], None);
    let app = AppState::new(catalog, loader, common::server_options(32768, 4)).expect("valid server options");
    let s = Server { addr: common::serve_in_background(app.clone()) };
    (app, s)
}

#[test]
fn health_and_metrics_move_with_requests() {
    let s = start(&fixture(MODEL));
    assert_eq!(s.get("/health").0, 200);
    let (status, ready) = s.get("/health/ready");
    assert_eq!((status, json_of(&ready)["status"].as_str()), (200, Some("ready")));
    assert_eq!(s.get("/metrics").0, 200);
    let model = format!("{{model_name=\"{MODEL}\"}}");
    let (mut generated, mut prompted, mut reasons) = (0.0, 0.0, Vec::new());
    for _ in 0..2 {
        let options = json!({"temperature": 0, "repeat_penalty": 1.0, "num_predict": 12});
        let v = s.json("/api/generate", &json!({"model": MODEL, "prompt": "Once upon a time", "stream": false, "options": options}));
        generated += v["eval_count"].as_f64().expect("eval_count");
        prompted += v["prompt_eval_count"].as_f64().expect("prompt_eval_count");
        reasons.push(v["done_reason"].as_str().expect("done_reason").to_string());
    }
    let text = s.get("/metrics").1;
    assert!(text.trim_end().ends_with("# EOF"), "an OpenMetrics exposition ends with # EOF");
    assert_eq!(sample(&text, &format!("slotstream:e2e_request_latency_seconds_count{model}")), 2.0, "{text}");
    assert_eq!(sample(&text, &format!("slotstream:time_to_first_token_seconds_count{model}")), 2.0, "{text}");
    assert!(sample(&text, &format!("slotstream:inter_token_latency_seconds_count{model}")) >= 2.0, "{text}");
    assert_eq!(sample(&text, &format!("slotstream:generation_tokens_total{model}")), generated, "{text}");
    assert_eq!(sample(&text, &format!("slotstream:prompt_tokens_total{model}")), prompted, "{text}");
    let finished = format!("slotstream:request_success_total{{model_name=\"{MODEL}\",finished_reason=\"{}\"}}", reasons[0]);
    assert_eq!(reasons[0], reasons[1], "greedy: the same answer twice");
    assert_eq!(sample(&text, &finished), 2.0, "{text}");
    assert_eq!(sample(&text, &format!("slotstream:prefix_cache_queries_total{model}")), 2.0, "{text}");
    assert_eq!(sample(&text, &format!("slotstream:prefix_cache_hits_total{model}")), 1.0, "the second prompt is the first's: {text}");
    assert!(sample(&text, &format!("slotstream:expert_pool_hits_total{model}")) > 0.0, "{text}");
    let kv = sample(&text, &format!("slotstream:kv_cache_usage_perc{model}"));
    assert!(kv > 0.0 && kv <= 1.0, "the prefix cache holds the prompts' states: {kv}");
    assert_eq!(sample(&text, "slotstream:http_requests_total{endpoint=\"/api/generate\",status=\"200\"}"), 2.0, "{text}");
    assert_eq!(sample(&text, &format!("slotstream:num_requests_running{model}")), 0.0, "{text}");
    // A path no route has counts as "other", so made-up paths cannot grow the metrics.
    assert_eq!(s.get("/no/such/path").0, 404);
    let text = s.get("/metrics").1;
    assert_eq!(sample(&text, "slotstream:http_requests_total{endpoint=\"other\",status=\"404\"}"), 1.0, "{text}");
    assert!(!text.contains("/no/such/path"), "{text}");
}

/// SIGTERM's drain (`AppState::start_draining`): new generations and
/// `/health/ready` get 503 while a running generation streams to its end.
#[test]
fn a_drain_refuses_new_requests_and_lets_running_ones_finish() {
    let (app, s) = unloaded_server(true);
    // A long generation, streaming: its first chunk has come.
    let mut running = TcpStream::connect(s.addr).expect("connecting");
    running.set_read_timeout(Some(Duration::from_secs(60))).expect("a timeout");
    let body = json!({"model": MODEL, "prompt": "Go on", "options": {"num_predict": 3000}}).to_string();
    let head = format!("POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    running.write_all(head.as_bytes()).expect("sending");
    let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
    let mut read_until = |done: &dyn Fn(&str) -> bool, seen: &mut Vec<u8>| {
        while !done(&String::from_utf8_lossy(seen)) {
            let n = running.read(&mut buf).expect("reading the running stream");
            assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(seen));
            seen.extend_from_slice(&buf[..n]);
        }
    };
    read_until(&|t: &str| t.contains("\"done\":false"), &mut seen);
    app.start_draining();
    let (status, ready) = s.get("/health/ready");
    assert_eq!(status, 503, "{ready}");
    let (status, refused) = s.post("/api/generate", &json!({"model": MODEL, "prompt": "Hi", "stream": false}));
    assert_eq!(status, 503, "{refused}");
    assert!(json_of(&refused)["error"].as_str().is_some_and(|e| e.contains("about to stop")), "{refused}");
    let (status, refused) = s.post("/v1/messages", &json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}));
    assert_eq!((status, json_of(&refused)["error"]["type"].as_str()), (503, Some("overloaded_error")), "{refused}");
    assert_eq!(s.get("/api/tags").0, 200, "metadata still answers");
    // The connection stays open (keep-alive): read up to the whole final chunk.
    read_until(&|t: &str| t.find("\"done\":true").is_some_and(|at| t[at..].contains('\n')), &mut seen);
    let rest = String::from_utf8_lossy(&seen);
    assert!(rest.contains("\"done_reason\":\"length\""), "the running generation ends whole: {rest}");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime");
    assert!(runtime.block_on(app.drained(Duration::from_secs(10))), "nothing runs or waits after it");
}

/// Ollama's `load_duration`: the time a request waited for its model to load.
#[test]
fn load_duration_is_the_load_a_request_waited_for() {
    let (_app, s) = unloaded_server(false);
    let ask = || {
        let v = s.json("/api/generate", &json!({"model": MODEL, "prompt": "Hi", "stream": false, "options": {"num_predict": 2}}));
        (v["load_duration"].as_u64().expect("load_duration"), v["total_duration"].as_u64().expect("total_duration"))
    };
    let (first_load, first_total) = ask();
    let (second_load, _) = ask();
    assert!(first_load > 0 && first_load <= first_total, "the first request loaded the model: {first_load} of {first_total} ns");
    assert!(second_load < first_load / 10, "the second found it loaded: {second_load} ns vs {first_load} ns");
}
