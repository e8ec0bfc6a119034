//! What agents and apps send: tool calling and structured output through
//! every API (Ollama, OpenAI chat, OpenAI Responses, Anthropic Messages),
//! over a fixture model served with a tool-calling chat template
//! (`tests/templates/tool_calling.jinja`). The fixture's weights are
//! random, so whatever the model would say, the constrained calls and JSON
//! must parse and follow their schemas.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use slotstream::server::{AppState, ModelCatalog};

const MODEL: &str = "qwen3_moe_mlx4";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The fixture model's files with the (Hermes-style) tool-calling template beside them.
fn tool_model() -> tempfile::TempDir {
    model_with_template("tool_calling.jinja")
}

/// The fixture model's files with `template` (in `tests/templates`) as its chat template.
fn model_with_template(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a scratch folder");
    for entry in std::fs::read_dir(fixture(MODEL)).expect("the fixture") {
        let path = entry.expect("a fixture file").path();
        std::fs::copy(&path, dir.path().join(path.file_name().expect("a name"))).expect("copying a fixture file");
    }
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates").join(template), dir.path().join("chat_template.jinja"))
        .expect("the template");
    dir
}

struct Server {
    addr: SocketAddr,
}

fn start(dir: &Path) -> Server {
    let loader = std::sync::Arc::new(common::FixtureLoader { no_eos: false, mtp: false });
    let catalog = ModelCatalog::new(vec![(MODEL.to_string(), dir.to_path_buf())], None);
    let app = AppState::new(catalog, loader, common::server_options(4096, 4)).expect("valid server options");
    app.load_at_start(MODEL).unwrap_or_else(|e| panic!("loading {}: {e:#}", dir.display()));
    Server { addr: common::serve_in_background(app) }
}

impl Server {
    /// POSTs `body`; returns the status and the (de-chunked) body.
    fn post(&self, path: &str, body: &Value) -> (u16, String) {
        self.post_with(path, &[], body)
    }

    /// POSTs `body` with extra `headers`.
    fn post_with(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, String) {
        let body = body.to_string();
        let mut s = TcpStream::connect(self.addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(120))).expect("a timeout");
        let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        s.write_all(head.as_bytes()).and_then(|()| s.write_all(body.as_bytes())).expect("sending");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).expect("reading the response");
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, mut rest) = text.split_once("\r\n\r\n").expect("a response head");
        let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("a status");
        if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            return (status, rest.to_string());
        }
        let mut out = String::new();
        while let Some((size, after)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if size == 0 || after.len() < size {
                break;
            }
            out.push_str(&after[..size]);
            rest = after[size..].trim_start_matches("\r\n");
        }
        (status, out)
    }

    fn json(&self, path: &str, body: &Value) -> Value {
        let (status, text) = self.post(path, body);
        assert_eq!(status, 200, "{path} {body}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"))
    }

    fn error(&self, path: &str, body: &Value) -> String {
        let (status, text) = self.post(path, body);
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("a JSON error");
        v["error"].as_str().or(v["error"]["message"].as_str()).expect("an error message").to_string()
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a day",
            "parameters": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["day", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add", "description": "Adds",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                "required": ["a", "b"], "additionalProperties": false}}},
    ])
}

/// Checks a call's arguments against the tools above.
fn check_arguments(name: &str, args: &Value) {
    let obj = args.as_object().unwrap_or_else(|| panic!("{name}: arguments {args} are not an object"));
    match name {
        "get_weather" => {
            assert!(args["day"].as_i64().is_some_and(|d| (1..=7).contains(&d)), "{args}");
            assert!(args["unit"] == "celsius" || args["unit"] == "fahrenheit", "{args}");
            assert_eq!(obj.len(), 2, "{args}");
        }
        "add" => {
            assert!(args["a"].is_i64() && args["b"].is_i64() && obj.len() == 2, "{args}");
        }
        other => panic!("the model called {other}, which is not a tool"),
    }
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn openai_forced_and_named_tool_calls_parse_and_follow_their_schemas() {
    let dir = tool_model();
    let s = start(dir.path());
    for (seed, choice) in [(1, json!("required")), (2, json!("required")), (3, json!({"type": "function", "function": {"name": "add"}}))] {
        let body = json!({"model": MODEL, "messages": user("What is 2 + 3?"), "tools": tools(), "tool_choice": choice,
                          "max_tokens": 120, "seed": seed, "temperature": 1.0});
        let v = s.json("/v1/chat/completions", &body);
        let choice0 = &v["choices"][0];
        // Parallel calls may go on until the limit cuts them: then "length", as OpenAI answers.
        let want = if v["usage"]["completion_tokens"] == 120 { "length" } else { "tool_calls" };
        assert_eq!(choice0["finish_reason"], want, "{v}");
        let calls = choice0["message"]["tool_calls"].as_array().expect("tool_calls");
        assert!(!calls.is_empty(), "{v}");
        for call in calls {
            assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()), "{call}");
            assert_eq!(call["type"], "function");
            let name = call["function"]["name"].as_str().expect("a name");
            if body["tool_choice"].is_object() {
                assert_eq!(name, "add");
            }
            let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments as a string"))
                .expect("arguments parse");
            check_arguments(name, &args);
        }
    }
}

#[test]
fn openai_streams_tool_call_deltas_and_takes_results_back() {
    let dir = tool_model();
    let s = start(dir.path());
    let body = json!({"model": MODEL, "messages": user("Weather?"), "tools": tools(), "tool_choice": "required",
                      "parallel_tool_calls": false, "max_tokens": 120, "stream": true});
    let (status, text) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(deltas.len(), 1, "one call without parallel calls: {text}");
    assert_eq!(deltas[0]["index"], 0);
    let name = deltas[0]["function"]["name"].as_str().expect("a name");
    let args: Value = serde_json::from_str(deltas[0]["function"]["arguments"].as_str().expect("arguments")).expect("JSON");
    check_arguments(name, &args);
    let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a final chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert!(text.trim_end().ends_with("data: [DONE]"));

    // The call and its result go back in the history.
    let id = deltas[0]["id"].as_str().expect("an id");
    let history = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": name, "arguments": deltas[0]["function"]["arguments"]}}]},
        {"role": "tool", "tool_call_id": id, "content": "{\"temperature\": 21}"},
    ]);
    let v = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": history, "tools": tools(), "max_tokens": 4}));
    assert!(v["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 100), "{v}");
}

/// Markup of either call form, which never belongs in `content`.
fn has_call_markup(text: &str) -> bool {
    ["<tool", "tool_call>", "\"name\"", "<function", "<parameter"].iter().any(|m| text.contains(m))
}

/// Forces calls under limits that cut them off, streamed and not: when the
/// limit ended the generation, finish_reason is "length" (calls or not), the
/// cut call leaves no markup in the content, and calls before it come back
/// whole (checked by `check`).
fn check_cut_off_calls(s: &Server, tools: &Value, check: fn(&str, &Value)) {
    for max_tokens in [3u64, 8, 64, 100, 200] {
        let body = json!({"model": MODEL, "messages": user("Weather?"), "tools": tools, "tool_choice": "required",
                          "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": true}});
        let v = s.json("/v1/chat/completions", &body);
        let choice = &v["choices"][0];
        let want = if v["usage"]["completion_tokens"] == max_tokens { "length" } else { "tool_calls" };
        assert_eq!(choice["finish_reason"], want, "max_tokens {max_tokens}: {v}");
        let content = choice["message"]["content"].as_str().unwrap_or_default();
        assert!(!has_call_markup(content), "max_tokens {max_tokens}: the cut call is left in the content: {v}");
        let calls = choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        if max_tokens <= 8 {
            assert!(calls.is_empty() && want == "length", "{max_tokens} tokens finish no call: {v}");
        }
        if max_tokens == 200 {
            assert!(!calls.is_empty(), "the calls finished before the cut one come back: {v}");
        }
        for call in &calls {
            let name = call["function"]["name"].as_str().expect("a name");
            check(name, &serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments")).expect("JSON"));
        }

        let mut body = body;
        body["stream"] = true.into();
        let (status, text) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        let chunks: Vec<Value> =
            text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("a chunk")).collect();
        let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert!(!has_call_markup(&content), "max_tokens {max_tokens}: the cut call is streamed as content: {text}");
        for call in chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten() {
            let name = call["function"]["name"].as_str().expect("a name");
            check(name, &serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments")).expect("JSON"));
        }
        let used = chunks.iter().find_map(|c| c["usage"]["completion_tokens"].as_u64()).expect("usage");
        let want = if used == max_tokens { "length" } else { "tool_calls" };
        let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a final chunk");
        assert_eq!(last["choices"][0]["finish_reason"], want, "max_tokens {max_tokens}, streamed: {text}");
    }
}

#[test]
fn calls_the_token_limit_cuts_off_end_with_length_and_leave_no_markup() {
    let dir = tool_model();
    check_cut_off_calls(&start(dir.path()), &tools(), check_arguments);
    let dir = model_with_template("xml_tool_calling.jinja");
    check_cut_off_calls(&start(dir.path()), &coder_tools(), check_coder_arguments);
}

#[test]
fn ollama_tools_history_and_structured_output() {
    let dir = tool_model();
    let s = start(dir.path());
    let history = json!([
        {"role": "user", "content": "Add 2 and 3"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_name": "add", "content": "5"},
    ]);
    let body = json!({"model": MODEL, "messages": history, "tools": tools(), "stream": false,
                      "options": {"temperature": 0, "num_predict": 16}});
    let v = s.json("/api/chat", &body);
    assert_eq!(v["message"]["role"], "assistant");
    for call in v["message"]["tool_calls"].as_array().into_iter().flatten() {
        check_arguments(call["function"]["name"].as_str().expect("a name"), &call["function"]["arguments"]);
    }

    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": false});
    for seed in 0..3 {
        let body = json!({"model": MODEL, "messages": user("Who?"), "format": schema, "stream": false,
                          "options": {"temperature": 1, "seed": seed, "num_predict": 60}});
        let v = s.json("/api/chat", &body);
        let content: Value = serde_json::from_str(v["message"]["content"].as_str().expect("content")).expect("content is JSON");
        assert!(content["name"].as_str().is_some_and(|n| n.chars().count() <= 10), "{content}");
        assert!(content["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{content}");
    }
    let v = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": user("Who?"), "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}}}));
    let content: Value = serde_json::from_str(v["choices"][0]["message"]["content"].as_str().expect("content")).expect("JSON");
    assert!(content["age"].is_i64(), "{content}");
}

#[test]
fn bad_tools_schemas_and_results_get_400_naming_the_field() {
    let dir = tool_model();
    let s = start(dir.path());
    let chat = "/v1/chat/completions";
    let bad_params = json!([{"type": "function", "function": {"name": "f", "parameters": "a string"}}]);
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"), "tools": bad_params}));
    assert!(e.contains("tools[0].function.parameters is not a JSON schema"), "{e}");
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"), "tools": tools(),
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}));
    assert!(e.contains("'nope', which is not in 'tools'"), "{e}");
    let orphan = json!([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "5"}]);
    let e = s.error(chat, &json!({"model": MODEL, "messages": orphan, "tools": tools()}));
    assert!(e.contains("tool_call_id 'call_9', which answers no tool call"), "{e}");
    let e = s.error("/api/chat", &json!({"model": MODEL, "messages": user("x"), "format": {"type": "no-such-type"}}));
    assert!(e.contains("'format' cannot be compiled"), "{e}");
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"),
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}));
    assert!(e.contains("'response_format'"), "{e}");
    let e = s.error("/api/chat", &json!({"model": MODEL, "messages": user("x"), "format": "yaml"}));
    assert!(e.contains("format must be"), "{e}");

    // Tools large enough to fill the context (the messages alone are tiny)
    // are refused by the rendered prompt's size, before it is tokenized.
    let long = "a tool with a very long description ".repeat(4000);
    let huge = json!([{"type": "function", "function": {"name": "f", "description": long, "parameters": {"type": "object"}}}]);
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"), "tools": huge}));
    assert!(e.contains("the rendered prompt is at least") && e.contains("judged by its size in bytes"), "{e}");

    // The plain fixture's template never reads tools.
    let plain = start(&fixture(MODEL));
    let e = plain.error("/api/chat", &json!({"model": MODEL, "messages": user("x"), "tools": tools()}));
    assert!(e.contains("does not support tools"), "{e}");
    // Nor has its vocabulary fill-in-the-middle tokens.
    let e = plain.error("/api/generate", &json!({"model": MODEL, "prompt": "def f(", "suffix": "):"}));
    assert!(e.contains("does not support insert"), "{e}");
    let e = plain.error("/v1/completions", &json!({"model": MODEL, "prompt": "def f(", "suffix": "):"}));
    assert!(e.contains("does not support insert"), "{e}");
    let e = plain.error("/v1/completions", &json!({"model": MODEL, "prompt": [1, 2], "suffix": "):"}));
    assert!(e.contains("'suffix' needs 'prompt' as text"), "{e}");
}

/// Tools for the Qwen3-Coder-style template: a string, an integer, an enum,
/// a boolean and an array, each read back by its type.
fn coder_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "write_file", "description": "Writes a file",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "maxLength": 10},
                "mode": {"type": "integer", "minimum": 0, "maximum": 777},
                "unit": {"enum": ["bytes", "lines"]},
                "ext": {"type": "string", "pattern": "^(txt|md)$"},
                "append": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2}},
                "required": ["path", "mode"]}}},
        {"type": "function", "function": {"name": "add", "description": "Adds",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}}},
    ])
}

/// Checks a call's arguments against `coder_tools`: the right JSON type for each.
fn check_coder_arguments(name: &str, args: &Value) {
    let obj = args.as_object().unwrap_or_else(|| panic!("{name}: arguments {args} are not an object"));
    match name {
        "write_file" => {
            assert!(args["path"].as_str().is_some_and(|p| p.chars().count() <= 10), "path is a string: {args}");
            assert!(args["mode"].as_i64().is_some_and(|m| (0..=777).contains(&m)), "mode is an integer: {args}");
            for (key, value) in obj {
                match key.as_str() {
                    "path" | "mode" => {}
                    "unit" => assert!(value == "bytes" || value == "lines", "{args}"),
                    "ext" => assert!(value == "txt" || value == "md", "{args}"),
                    "append" => assert!(value.is_boolean(), "{args}"),
                    "tags" => assert!(value.as_array().is_some_and(|t| t.len() <= 2 && t.iter().all(Value::is_i64)), "{args}"),
                    other => panic!("write_file has no parameter {other}: {args}"),
                }
            }
        }
        "add" => assert!(args["a"].is_i64() && args["b"].is_i64() && obj.len() == 2, "{args}"),
        other => panic!("the model called {other}, which is not a tool"),
    }
}

#[test]
fn xml_tool_calls_of_a_qwen3_coder_style_template_parse_into_typed_arguments() {
    let dir = model_with_template("xml_tool_calling.jinja");
    let s = start(dir.path());
    let show = s.json("/api/show", &json!({"model": MODEL}));
    assert!(show["capabilities"].as_array().is_some_and(|c| c.contains(&json!("tools"))), "{show}");

    for (seed, choice) in [(1, json!("required")), (2, json!("required")), (3, json!({"type": "function", "function": {"name": "write_file"}}))] {
        let body = json!({"model": MODEL, "messages": user("Save it"), "tools": coder_tools(), "tool_choice": choice,
                          "max_tokens": 400, "seed": seed, "temperature": 1.0});
        let v = s.json("/v1/chat/completions", &body);
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{v}");
        let calls = choice0["message"]["tool_calls"].as_array().expect("tool_calls");
        assert!(!calls.is_empty(), "{v}");
        for call in calls {
            let name = call["function"]["name"].as_str().expect("a name");
            if body["tool_choice"].is_object() {
                assert_eq!(name, "write_file");
            }
            let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments as a string"))
                .expect("arguments parse");
            check_coder_arguments(name, &args);
        }
        assert!(!choice0["message"]["content"].as_str().unwrap_or_default().contains("<function="), "the call is not left in the text: {v}");
    }

    // Streamed: one delta carrying the whole call.
    let body = json!({"model": MODEL, "messages": user("Save it"), "tools": coder_tools(), "tool_choice": "required",
                      "parallel_tool_calls": false, "max_tokens": 400, "stream": true});
    let (status, text) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let chunks: Vec<Value> =
        text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("a chunk")).collect();
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(deltas.len(), 1, "{text}");
    let name = deltas[0]["function"]["name"].as_str().expect("a name");
    let streamed_args = deltas[0]["function"]["arguments"].as_str().expect("arguments");
    check_coder_arguments(name, &serde_json::from_str(streamed_args).expect("JSON"));
    let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a final chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");

    // The call and its result go back through the template, in both APIs.
    let id = deltas[0]["id"].as_str().expect("an id");
    let history = json!([
        {"role": "user", "content": "Save it"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": streamed_args}}]},
        {"role": "tool", "tool_call_id": id, "content": "done"},
    ]);
    let v = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": history, "tools": coder_tools(), "max_tokens": 4}));
    assert!(v["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 100), "{v}");
    let history = json!([
        {"role": "user", "content": "Save it"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "write_file", "arguments": {"path": "a <b>.txt", "mode": 644}}}]},
        {"role": "tool", "tool_name": "write_file", "content": "done"},
    ]);
    for stream in [false, true] {
        let body = json!({"model": MODEL, "messages": history, "tools": coder_tools(), "stream": stream,
                          "options": {"temperature": 0, "num_predict": 16}});
        let (status, text) = s.post("/api/chat", &body);
        assert_eq!(status, 200, "{text}");
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"))).collect();
        assert_eq!(lines.last().map(|l| l["done"].clone()), Some(json!(true)), "{text}");
        for call in lines.iter().filter_map(|l| l["message"]["tool_calls"].as_array()).flatten() {
            check_coder_arguments(call["function"]["name"].as_str().expect("a name"), &call["function"]["arguments"]);
        }
    }

    // A name the XML form cannot write inside its tag is refused, naming the field.
    let bad = json!([{"type": "function", "function": {"name": "a>b", "parameters": {"type": "object", "properties": {}}}}]);
    let e = s.error("/v1/chat/completions", &json!({"model": MODEL, "messages": user("x"), "tools": bad, "tool_choice": "required"}));
    assert!(e.contains("'tools' cannot be compiled") && e.contains("'a>b'"), "{e}");
}

/// The fixture model with Qwen's fill-in-the-middle tokens in its
/// vocabulary: three of its last BPE tokens (and the merges that made them)
/// give their ids to `<|fim_prefix|>`, `<|fim_suffix|>` and `<|fim_middle|>`.
fn fim_model() -> (tempfile::TempDir, [u32; 3]) {
    let dir = model_with_template("tool_calling.jinja");
    let path = dir.path().join("tokenizer.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("the tokenizer")).expect("JSON");
    let ids = [505u32, 506, 507];
    let names = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];
    let vocab = json["model"]["vocab"].as_object_mut().expect("a BPE vocabulary");
    let mut freed = Vec::new();
    for (id, name) in ids.iter().zip(names) {
        let token = vocab.iter().find(|(_, v)| v.as_u64() == Some(u64::from(*id))).map(|(t, _)| t.clone());
        let token = token.unwrap_or_else(|| panic!("the fixture's vocabulary has no id {id}"));
        vocab.remove(&token);
        vocab.insert(name.to_string(), json!(id));
        freed.push(token);
    }
    let merges = json["model"]["merges"].as_array_mut().expect("merges");
    merges.retain(|m| {
        let joined: String = m.as_array().map(|p| p.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        !freed.contains(&joined)
    });
    let added = json["added_tokens"].as_array_mut().expect("added tokens");
    for (id, name) in ids.iter().zip(names) {
        added.push(json!({"id": id, "content": name, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    }
    std::fs::write(&path, json.to_string()).expect("writing the tokenizer");
    (dir, ids)
}

#[test]
fn a_suffix_asks_for_the_middle_with_the_vocabulary_s_fim_tokens_in_both_apis() {
    let (dir, [prefix_id, suffix_id, middle_id]) = fim_model();
    let codec = slotstream::tokenizer::TextCodec::load(dir.path(), &[]).expect("the tokenizer loads");
    let (prefix, suffix) = ("def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n");
    let mut want = vec![prefix_id];
    want.extend(codec.encode(prefix, false).expect("encodes"));
    want.push(suffix_id);
    want.extend(codec.encode(suffix, false).expect("encodes"));
    want.push(middle_id);
    let inner = &want[1..want.len() - 1];
    assert!(want.len() > 8 && !inner.contains(&prefix_id) && !inner.contains(&middle_id), "{want:?}");

    let s = start(dir.path());
    let show = s.json("/api/show", &json!({"model": MODEL}));
    assert!(show["capabilities"].as_array().is_some_and(|c| c.contains(&json!("insert"))), "{show}");
    let v = s.json("/api/generate", &json!({"model": MODEL, "prompt": prefix, "suffix": suffix, "stream": false,
        "options": {"temperature": 0, "num_predict": 6}}));
    let context: Vec<u32> = serde_json::from_value(v["context"].clone()).expect("the context ids");
    assert_eq!(context[..want.len()], want[..], "prefix, then suffix, then the middle is asked for: {v}");
    let generated = v["eval_count"].as_u64().expect("eval_count");
    assert!(generated > 0 && context.len() > want.len(), "{v}");
    assert_eq!(v["prompt_eval_count"], want.len(), "{v}");
    assert!(v["response"].is_string(), "{v}");

    let v = s.json("/v1/completions", &json!({"model": MODEL, "prompt": prefix, "suffix": suffix, "max_tokens": 6, "temperature": 0}));
    assert_eq!(v["usage"]["prompt_tokens"], want.len(), "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0), "{v}");
    let text = v["choices"][0]["text"].as_str().expect("the completion's text");
    // The same greedy middle from both APIs.
    let ollama = s.json("/api/generate", &json!({"model": MODEL, "prompt": prefix, "suffix": suffix, "stream": false,
        "options": {"temperature": 0, "num_predict": 6}}));
    assert_eq!(ollama["response"].as_str(), Some(text), "{v}\n{ollama}");
}

/// A raw prompt that ends in `<think>` is the client's own: what the model
/// writes comes back as the completion's text, not as unasked reasoning.
#[test]
fn a_raw_prompt_ending_in_think_gets_its_text_back() {
    let dir = tool_model();
    let s = start(dir.path());
    for prompt in ["Once upon a time", "Once upon a time <think>"] {
        let v = s.json("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}));
        assert!(!v["choices"][0]["text"].as_str().unwrap_or_default().is_empty(), "{prompt:?}: {v}");
        let v = s.json("/api/generate", &json!({"model": MODEL, "prompt": prompt, "raw": true, "stream": false,
                                                "options": {"num_predict": 12, "temperature": 0}}));
        assert!(!v["response"].as_str().unwrap_or_default().is_empty() && v.get("thinking").is_none(), "{prompt:?}: {v}");
    }
}

/// The events of an SSE stream (`event:` and `data:` lines), as (event, data).
fn sse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let kind = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("no event line in {e:?}"));
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or_else(|| panic!("no data line in {e:?}"));
            let data: Value = serde_json::from_str(data).unwrap_or_else(|err| panic!("{data:?} is not JSON: {err}"));
            assert_eq!(data["type"], kind, "the data's type names its event: {e}");
            (kind.to_string(), data)
        })
        .collect()
}

/// A streamed Responses answer: its events in order, each with a sequence
/// number one more than the last, from `response.created` to a final
/// `response.completed` / `response.incomplete`; returns the final response.
fn responses_stream(s: &Server, body: &Value) -> (Vec<(String, Value)>, Value) {
    let mut body = body.clone();
    body["stream"] = true.into();
    let (status, text) = s.post("/v1/responses", &body);
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    for (n, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], n, "sequence numbers count from 0: {text}");
    }
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"], "{text}");
    let last = kinds.last().copied().unwrap_or_default();
    assert!(last == "response.completed" || last == "response.incomplete", "ends with {last}: {text}");
    // Every item added is done before the response ends, at the same index.
    let added: Vec<&Value> = events.iter().filter(|(k, _)| k == "response.output_item.added").map(|(_, d)| &d["output_index"]).collect();
    let done: Vec<&Value> = events.iter().filter(|(k, _)| k == "response.output_item.done").map(|(_, d)| &d["output_index"]).collect();
    assert_eq!(added, done, "{text}");
    let final_response = events.last().map(|(_, d)| d["response"].clone()).expect("a final event");
    (events, final_response)
}

/// The text of a Responses answer's message items.
fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .expect("output items")
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .map(|part| part["text"].as_str().expect("output_text").to_string())
        .collect()
}

#[test]
fn responses_answer_plain_and_streamed_alike() {
    let dir = tool_model();
    let s = start(dir.path());
    let body = json!({"model": MODEL, "instructions": "Be brief.", "input": "Say hello.", "max_output_tokens": 10, "temperature": 0});
    let v = s.json("/v1/responses", &body);
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")), "{v}");
    let used = v["usage"]["output_tokens"].as_u64().expect("usage");
    let (status, reason) = if used == 10 { ("incomplete", json!({"reason": "max_output_tokens"})) } else { ("completed", Value::Null) };
    assert_eq!((&v["status"], &v["incomplete_details"]), (&json!(status), &reason), "{v}");
    assert_eq!(v["instructions"], "Be brief.");
    let text = output_text(&v);
    assert!(!text.is_empty(), "{v}");

    let (events, done) = responses_stream(&s, &body);
    let streamed: String = events.iter().filter(|(k, _)| k == "response.output_text.delta").map(|(_, d)| d["delta"].as_str().expect("a delta")).collect();
    assert_eq!(streamed, text, "the streamed deltas make the greedy answer");
    assert_eq!(output_text(&done), text);
    assert_eq!(done["status"], status);

    // The conversation as items, earlier answer included.
    let input = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
        {"role": "user", "content": "Again."},
    ]);
    let again = s.json("/v1/responses", &json!({"model": MODEL, "input": input, "max_output_tokens": 4}));
    assert!(again["usage"]["input_tokens"].as_u64() > v["usage"]["input_tokens"].as_u64(), "{again}");
}

#[test]
fn responses_force_a_function_call_beside_hosted_tools_and_take_its_output_back() {
    let dir = tool_model();
    let s = start(dir.path());
    // Responses tools are flat; a hosted web_search beside them is skipped.
    let mut flat: Vec<Value> = tools().as_array().expect("tools").iter().map(|t| {
        let mut f = t["function"].clone();
        f["type"] = "function".into();
        f
    }).collect();
    flat.push(json!({"type": "web_search"}));
    let body = json!({"model": MODEL, "input": "What is 2 + 3?", "tools": flat, "tool_choice": {"type": "function", "name": "add"},
                      "max_output_tokens": 120, "temperature": 0});
    let v = s.json("/v1/responses", &body);
    let calls: Vec<&Value> = v["output"].as_array().expect("output").iter().filter(|i| i["type"] == "function_call").collect();
    assert_eq!(calls.len(), 1, "one forced call: {v}");
    let call = calls[0];
    assert_eq!(call["name"], "add");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments as a string")).expect("JSON arguments");
    check_arguments("add", &arguments);
    let call_id = call["call_id"].as_str().expect("a call_id");

    let (events, done) = responses_stream(&s, &body);
    let deltas: String = events
        .iter()
        .filter(|(k, _)| k == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().expect("a delta"))
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&deltas).expect("the deltas make JSON"), arguments, "greedy: the same call");
    assert_eq!(done["output"].as_array().map(Vec::len), Some(1), "{done}");

    // The call and its output go back as items.
    let input = json!([
        {"role": "user", "content": "What is 2 + 3?"},
        {"type": "function_call", "call_id": call_id, "name": "add", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call_id, "output": "5"},
    ]);
    let after = s.json("/v1/responses", &json!({"model": MODEL, "input": input, "tools": flat, "tool_choice": "none", "max_output_tokens": 4}));
    assert!(after["output"].as_array().is_some_and(|o| o.iter().all(|i| i["type"] != "function_call")), "tool_choice none: {after}");
    assert!(after["usage"]["input_tokens"].as_u64().is_some_and(|n| n > 100), "{after}");
}

#[test]
fn responses_follow_a_json_schema_and_refuse_what_they_cannot_do() {
    let dir = tool_model();
    let s = start(dir.path());
    let schema = json!({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                        "required": ["age"], "additionalProperties": false});
    let format = json!({"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": true}});
    for seed in 0..2 {
        let v = s.json("/v1/responses", &json!({"model": MODEL, "input": "How old?", "text": format, "seed": seed, "max_output_tokens": 40}));
        let answer: Value = serde_json::from_str(&output_text(&v)).unwrap_or_else(|e| panic!("not JSON ({e}): {v}"));
        assert!(answer["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{answer}");
    }
    let path = "/v1/responses";
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}));
    assert!(e.contains("previous_response_id") && e.contains("whole conversation"), "{e}");
    let e = s.error(path, &json!({"model": MODEL}));
    assert!(e.contains("'input' is required"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}));
    assert!(e.contains("input[0]") && e.contains("'c9'"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "g"}}));
    assert!(e.contains("'g', which is not in 'tools'"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}));
    assert!(e.contains("text.format.schema"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "max_output_tokens": 0}));
    assert!(e.contains("max_output_tokens must be at least 1"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "temperature": "warm"}));
    assert!(e.contains("temperature"), "{e}");
    let (status, text) = s.post(path, &json!({"model": "gpt-5", "input": "x"}));
    assert_eq!(status, 404, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("gpt-5")), "OpenAI's error shape: {v}");
}

/// The tools in Anthropic's form.
fn anthropic_tools() -> Value {
    tools()
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| json!({"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]}))
        .collect()
}

/// A streamed Messages answer: its events, from `message_start` to
/// `message_stop`, each block started, filled and stopped in order; returns
/// the events and the message they build.
fn messages_stream(s: &Server, body: &Value) -> (Vec<(String, Value)>, Value) {
    let mut body = body.clone();
    body["stream"] = true.into();
    let (status, text) = s.post("/v1/messages", &body);
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{text}");
    assert_eq!(kinds[kinds.len() - 2..], ["message_delta", "message_stop"], "{text}");
    let mut message = events[0].1["message"].clone();
    let mut open: Option<usize> = None;
    let mut json_input = String::new();
    for (kind, data) in &events[1..] {
        match kind.as_str() {
            "ping" => {}
            "content_block_start" => {
                assert!(open.is_none(), "a block starts while another is open: {text}");
                let index = data["index"].as_u64().expect("an index") as usize;
                let blocks = message["content"].as_array_mut().expect("content");
                assert_eq!(index, blocks.len(), "blocks are numbered in order: {text}");
                blocks.push(data["content_block"].clone());
                open = Some(index);
                json_input.clear();
            }
            "content_block_delta" => {
                let index = open.expect("a delta inside a block");
                assert_eq!(data["index"], index);
                let block = &mut message["content"][index];
                let delta = &data["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => block["text"] = format!("{}{}", block["text"].as_str().unwrap_or_default(), delta["text"].as_str().expect("text")).into(),
                    Some("thinking_delta") => block["thinking"] = format!("{}{}", block["thinking"].as_str().unwrap_or_default(), delta["thinking"].as_str().expect("thinking")).into(),
                    Some("input_json_delta") => json_input.push_str(delta["partial_json"].as_str().expect("partial_json")),
                    other => panic!("unknown delta {other:?}: {text}"),
                }
            }
            "content_block_stop" => {
                let index = open.take().expect("a stop inside a block");
                assert_eq!(data["index"], index);
                if message["content"][index]["type"] == "tool_use" {
                    message["content"][index]["input"] = serde_json::from_str(&json_input).expect("the input deltas make JSON");
                }
            }
            "message_delta" => {
                message["stop_reason"] = data["delta"]["stop_reason"].clone();
                message["stop_sequence"] = data["delta"]["stop_sequence"].clone();
                message["usage"]["output_tokens"] = data["usage"]["output_tokens"].clone();
            }
            "message_stop" => assert!(open.is_none(), "the message stops inside a block: {text}"),
            other => panic!("unexpected event {other}: {text}"),
        }
    }
    (events, message)
}

fn message_text(message: &Value) -> String {
    message["content"].as_array().expect("content").iter().filter(|b| b["type"] == "text").map(|b| b["text"].as_str().expect("text")).collect()
}

#[test]
fn messages_answer_plain_and_streamed_alike_and_stop_at_stop_sequences() {
    let dir = tool_model();
    let s = start(dir.path());
    let headers = [("x-api-key", "anything"), ("anthropic-version", "2023-06-01"), ("anthropic-beta", "x")];
    let body = json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "system": [{"type": "text", "text": "Be brief."}],
                      "messages": [{"role": "user", "content": "Say hello."}]});
    let (status, text) = s.post_with("/v1/messages", &headers, &body);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!((&v["type"], &v["role"]), (&json!("message"), &json!("assistant")));
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{v}");
    let used = v["usage"]["output_tokens"].as_u64().expect("usage");
    assert_eq!(v["stop_reason"], if used == 12 { "max_tokens" } else { "end_turn" }, "{v}");
    let answer = message_text(&v);
    assert!(answer.chars().count() >= 4, "a greedy answer long enough to cut: {v}");

    let (_, streamed) = messages_stream(&s, &body);
    assert_eq!(message_text(&streamed), answer, "the streamed deltas make the greedy answer");
    assert_eq!(streamed["stop_reason"], v["stop_reason"]);

    // A stop sequence from inside the greedy answer ends it there.
    let chars: Vec<char> = answer.chars().collect();
    let stop: String = chars[2..4].iter().collect();
    let cut = &answer[..answer.find(&stop).expect("the stop is in the answer")];
    let mut stopping = body.clone();
    stopping["stop_sequences"] = json!([stop]);
    let v = s.json("/v1/messages", &stopping);
    assert_eq!((&v["stop_reason"], &v["stop_sequence"]), (&json!("stop_sequence"), &json!(stop)), "{v}");
    assert_eq!(message_text(&v), cut);
    let (_, streamed) = messages_stream(&s, &stopping);
    assert_eq!((&streamed["stop_reason"], &streamed["stop_sequence"]), (&json!("stop_sequence"), &json!(stop)));

    // count_tokens counts the prompt the answer was given.
    let counted = s.json("/v1/messages/count_tokens", &json!({"model": MODEL, "system": body["system"], "messages": body["messages"]}));
    let prompt = v["usage"]["input_tokens"].as_u64().unwrap_or(0) + v["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert_eq!(counted["input_tokens"].as_u64(), Some(prompt), "{counted} vs {v}");
}

#[test]
fn messages_force_tool_use_and_take_tool_results_back() {
    let dir = tool_model();
    let s = start(dir.path());
    let body = json!({"model": MODEL, "max_tokens": 120, "temperature": 0, "tools": anthropic_tools(),
                      "tool_choice": {"type": "tool", "name": "get_weather"},
                      "messages": [{"role": "user", "content": "Weather on day 3?"}]});
    let v = s.json("/v1/messages", &body);
    let uses: Vec<&Value> = v["content"].as_array().expect("content").iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{v}");
    assert_eq!((&uses[0]["name"], &v["stop_reason"]), (&json!("get_weather"), &json!("tool_use")), "{v}");
    check_arguments("get_weather", &uses[0]["input"]);
    let id = uses[0]["id"].as_str().expect("an id");
    assert!(id.starts_with("toolu_"), "{id}");

    let (_, streamed) = messages_stream(&s, &body);
    let streamed_use = streamed["content"].as_array().expect("content").iter().find(|b| b["type"] == "tool_use").cloned().expect("a tool_use");
    assert_eq!(streamed_use["input"], uses[0]["input"], "greedy: the same call, streamed as input_json_delta");
    assert_eq!(streamed["stop_reason"], "tool_use");

    // tool_choice any with parallel use off: exactly one call of either tool.
    let mut any = body.clone();
    any["tool_choice"] = json!({"type": "any", "disable_parallel_tool_use": true});
    let v2 = s.json("/v1/messages", &any);
    let uses2: Vec<&Value> = v2["content"].as_array().expect("content").iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses2.len(), 1, "{v2}");
    check_arguments(uses2[0]["name"].as_str().expect("a name"), &uses2[0]["input"]);

    let history = json!([
        {"role": "user", "content": "Weather on day 3?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, uses[0]]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": [{"type": "text", "text": "21 C"}]}]},
    ]);
    let after = s.json("/v1/messages", &json!({"model": MODEL, "max_tokens": 4, "tools": anthropic_tools(),
        "tool_choice": {"type": "none"}, "messages": history}));
    assert!(after["content"].as_array().is_some_and(|c| c.iter().all(|b| b["type"] != "tool_use")), "tool_choice none: {after}");
    assert!(after["usage"]["input_tokens"].as_u64().is_some_and(|n| n > 100), "{after}");
}

#[test]
fn messages_errors_take_anthropic_s_shape() {
    let dir = tool_model();
    let s = start(dir.path());
    let user = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (json!({"model": MODEL, "messages": user}), "'max_tokens' is required"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": []}), "at least one message"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": user, "temperature": 1.5}), "temperature must be between 0 and 1"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}]}), "tool_use_id 't9'"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": user, "tools": anthropic_tools(), "tool_choice": {"type": "tool", "name": "nope"}}), "'nope'"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), "images"),
    ];
    for (body, needle) in cases {
        let (status, text) = s.post("/v1/messages", &body);
        assert_eq!(status, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("a JSON error");
        assert_eq!((&v["type"], &v["error"]["type"]), (&json!("error"), &json!("invalid_request_error")), "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(needle)), "{v} should mention {needle:?}");
    }
    for (path, body, status, kind) in [
        ("/v1/messages", json!({"model": "claude-sonnet-4", "max_tokens": 4, "messages": user}), 404, "not_found_error"),
        ("/v1/messages/count_tokens", json!({"model": MODEL, "messages": "x"}), 400, "invalid_request_error"),
        ("/v1/messages/batches", json!({}), 404, "not_found_error"),
    ] {
        let (got, text) = s.post(path, &body);
        assert_eq!(got, status, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).expect("a JSON error");
        assert_eq!(v["error"]["type"], kind, "{path}: {v}");
    }
}

#[test]
fn reasoning_comes_back_in_each_api_s_own_form() {
    let dir = model_with_template("thinking.jinja");
    let s = start(dir.path());
    // The generation prompt opens <think>; the random weights never close
    // it, so the whole answer is reasoning.
    let chat = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": user("Hi"), "max_tokens": 6, "temperature": 0}));
    let message = &chat["choices"][0]["message"];
    assert!(message["reasoning"].as_str().is_some_and(|r| !r.is_empty()), "{chat}");
    assert_eq!(message["reasoning_content"], message["reasoning"], "both names for the reasoning: {chat}");

    let body = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": "low"}});
    let v = s.json("/v1/responses", &body);
    assert_eq!(v["output"][0]["type"], "reasoning", "{v}");
    let reasoning = v["output"][0]["content"][0]["text"].as_str().expect("reasoning_text").to_string();
    assert_eq!(reasoning, message["reasoning"].as_str().unwrap_or_default(), "greedy: the same reasoning");
    let (events, _) = responses_stream(&s, &body);
    let streamed: String = events.iter().filter(|(k, _)| k == "response.reasoning_text.delta").map(|(_, d)| d["delta"].as_str().expect("a delta")).collect();
    assert_eq!(streamed, reasoning);

    let body = json!({"model": MODEL, "max_tokens": 6, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 1024},
                      "messages": [{"role": "user", "content": "Hi"}]});
    let v = s.json("/v1/messages", &body);
    assert_eq!((&v["content"][0]["type"], &v["content"][0]["thinking"]), (&json!("thinking"), &json!(reasoning)), "{v}");
    let (_, streamed) = messages_stream(&s, &body);
    assert_eq!(streamed["content"][0]["thinking"], json!(reasoning));

    // A model without a thinking switch answers reasoning requests of these
    // two APIs without reasoning (agents send them to every model).
    let tools_dir = tool_model();
    let plain = start(tools_dir.path());
    let v = plain.json("/v1/responses", &json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": "high"}}));
    assert!(v["output"].as_array().is_some_and(|o| o.iter().all(|i| i["type"] != "reasoning")), "{v}");
    plain.json("/v1/messages", &json!({"model": MODEL, "max_tokens": 2, "thinking": {"type": "enabled", "budget_tokens": 1024},
                                       "messages": [{"role": "user", "content": "Hi"}]}));
}

#[test]
fn messages_follow_an_output_schema() {
    let dir = tool_model();
    let s = start(dir.path());
    let schema = json!({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                        "required": ["age"], "additionalProperties": false});
    let body = json!({"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "How old?"}],
                      "output_config": {"format": {"type": "json_schema", "schema": schema}}});
    let v = s.json("/v1/messages", &body);
    let answer: Value = serde_json::from_str(&message_text(&v)).unwrap_or_else(|e| panic!("not JSON ({e}): {v}"));
    assert!(answer["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{answer}");
    let e = s.error("/v1/messages", &json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "yaml"}}}));
    assert!(e.contains("output_config.format must be"), "{e}");
}

/// What Claude Code sends: reminders as system messages between the turns
/// and a `max_tokens` of 32000 whatever the context (a cap, lowered to what
/// the context holds, as `max_output_tokens` is on the Responses API).
#[test]
fn token_limits_beyond_the_context_are_caps_in_the_agent_apis() {
    let dir = tool_model();
    let s = start(dir.path());
    let messages = json!([
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "<system-reminder>Be brief.</system-reminder>"},
        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
    ]);
    let v = s.json("/v1/messages", &json!({"model": MODEL, "max_tokens": 32000, "temperature": 0, "messages": messages}));
    let used = v["usage"]["input_tokens"].as_u64().unwrap_or(0) + v["usage"]["output_tokens"].as_u64().unwrap_or(0);
    assert!(used <= 4096, "within the context: {v}");
    assert!(v["stop_reason"] == "end_turn" || v["stop_reason"] == "max_tokens", "{v}");
    let v = s.json("/v1/responses", &json!({"model": MODEL, "input": "Hi", "max_output_tokens": 1_000_000, "temperature": 0}));
    assert!(v["usage"]["total_tokens"].as_u64().is_some_and(|n| n <= 4096), "{v}");
    // OpenAI chat keeps its word: max_tokens over the context is refused.
    let e = s.error("/v1/chat/completions", &json!({"model": MODEL, "messages": user("Hi"), "max_tokens": 1_000_000}));
    assert!(e.contains("exceeds the context limit"), "{e}");
}
