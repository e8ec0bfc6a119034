//! A server over a fixture model with a tool-calling chat template, and a
//! small HTTP client for it: what the tests of agents' APIs share.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use slotstream::server::{AppState, ModelCatalog};

pub const MODEL: &str = "qwen3_moe_mlx4";

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The fixture model's files with the (Hermes-style) tool-calling template beside them.
pub fn tool_model() -> tempfile::TempDir {
    model_with_template("tool_calling.jinja")
}

/// The fixture model's files with `template` (in `tests/templates`) as its chat template.
pub fn model_with_template(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a scratch folder");
    for entry in std::fs::read_dir(fixture(MODEL)).expect("the fixture") {
        let path = entry.expect("a fixture file").path();
        std::fs::copy(&path, dir.path().join(path.file_name().expect("a name"))).expect("copying a fixture file");
    }
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates").join(template), dir.path().join("chat_template.jinja"))
        .expect("the template");
    dir
}

pub struct Server {
    pub addr: SocketAddr,
}

pub fn start(dir: &Path) -> Server {
    let loader = std::sync::Arc::new(super::FixtureLoader { no_eos: false, mtp: false });
    let catalog = ModelCatalog::new(vec![(MODEL.to_string(), dir.to_path_buf())], None);
    let app = AppState::new(catalog, loader, super::server_options(4096, 4)).expect("valid server options");
    app.load_at_start(MODEL).unwrap_or_else(|e| panic!("loading {}: {e:#}", dir.display()));
    Server { addr: super::serve_in_background(app) }
}

impl Server {
    /// GETs `path`; returns the status and the (de-chunked) body.
    pub fn get(&self, path: &str) -> (u16, String) {
        self.request("GET", path, &[], "")
    }

    /// POSTs `body`; returns the status and the (de-chunked) body.
    pub fn post(&self, path: &str, body: &Value) -> (u16, String) {
        self.post_with(path, &[], body)
    }

    /// POSTs `body` with extra `headers`.
    pub fn post_with(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, String) {
        let mut with_type = vec![("Content-Type", "application/json")];
        with_type.extend_from_slice(headers);
        self.request("POST", path, &with_type, &body.to_string())
    }

    /// Sends one request on a connection of its own; the status and the (de-chunked) body.
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(self.addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(120))).expect("a timeout");
        let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n{extra}Content-Length: {}\r\n\r\n",
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

    pub fn json(&self, path: &str, body: &Value) -> Value {
        let (status, text) = self.post(path, body);
        assert_eq!(status, 200, "{path} {body}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"))
    }

    pub fn error(&self, path: &str, body: &Value) -> String {
        let (status, text) = self.post(path, body);
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("a JSON error");
        v["error"].as_str().or(v["error"]["message"].as_str()).expect("an error message").to_string()
    }
}

pub fn tools() -> Value {
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
pub fn check_arguments(name: &str, args: &Value) {
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

pub fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}
