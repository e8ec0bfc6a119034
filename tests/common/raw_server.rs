//! `slotstream serve` on an ephemeral port over a fixture model, and a tiny
//! HTTP/1.1 client on raw sockets (so tests can also send broken requests and
//! hang up mid-stream): what `tests/server.rs` and `tests/server_hostile.rs` share.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use slotstream::generate::Engine;
use slotstream::server::{AppState, ModelCatalog, Timeouts};

pub const MODEL: &str = "qwen3_moe_mlx4";

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

// Servers run the CPU backend's exact (f32-activation) matmuls: with int8
// activations, a prompt fed in different chunks (reused prefix or not) can
// round differently and flip a near-tie, and these tests compare outputs for
// equality (the spec's `--no-prefix-cache` is what promises reproducibility).
pub fn engine(name: &str) -> Engine {
    Engine::load(&fixture(name), Box::new(slotstream_cpu::CpuBackend::exact()), &slotstream::model::LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading fixture {name}: {e:#}"))
}

pub struct Server {
    pub addr: SocketAddr,
}

pub struct Setup {
    pub fixture: &'static str,
    /// Serve this directory instead of the fixture (named like the fixture).
    pub dir: Option<PathBuf>,
    pub prefix_cache: bool,
    pub queue: usize,
    pub max_context: usize,
    /// Never stop at end-of-sequence tokens (for long generations).
    pub no_eos: bool,
    /// Load the MTP head (speculative decoding) when the model has one.
    pub mtp: bool,
    pub timeouts: Timeouts,
    /// Generations run at once (`--parallel`).
    pub parallel: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            fixture: MODEL,
            dir: None,
            prefix_cache: true,
            queue: 16,
            max_context: 32768,
            no_eos: false,
            mtp: false,
            timeouts: Timeouts::default(),
            parallel: 1,
        }
    }
}

pub fn start(setup: Setup) -> Server {
    start_until(setup, std::future::pending()).0
}

/// A server that shuts down when `shutdown` resolves; the receiver hears
/// when `serve_on` has returned.
pub fn start_until(
    setup: Setup,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> (Server, std::sync::mpsc::Receiver<()>) {
    let dir = setup.dir.clone().unwrap_or_else(|| fixture(setup.fixture));
    let loader = std::sync::Arc::new(super::FixtureLoader { no_eos: setup.no_eos, mtp: setup.mtp });
    let mut options = super::server_options(setup.max_context, setup.queue);
    options.prefix_cache = setup.prefix_cache;
    options.timeouts = setup.timeouts;
    options.parallel = setup.parallel;
    let catalog = ModelCatalog::new(vec![(setup.fixture.to_string(), dir.clone())], None);
    let app = AppState::new(catalog, loader, options).expect("valid server options");
    app.load_at_start(setup.fixture).unwrap_or_else(|e| panic!("loading {}: {e:#}", dir.display()));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding an ephemeral port");
    let addr = listener.local_addr().expect("reading the bound address");
    listener.set_nonblocking(true).expect("making the listener non-blocking");
    let (served, returned) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("adopting the listener");
            slotstream::server::serve_on(listener, app, shutdown).await.expect("serving");
        });
        let _ = served.send(());
        rt.shutdown_background();
    });
    (Server { addr }, returned)
}

pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("response is not JSON ({e}): {}", self.text()))
    }

    /// The message of an Ollama (`{"error": "..."}`) or OpenAI error.
    pub fn error(&self) -> String {
        let v = self.json();
        match &v["error"] {
            Value::String(s) => s.clone(),
            e => e["message"].as_str().unwrap_or_else(|| panic!("no error message in {v}")).to_string(),
        }
    }
}

pub fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = body.windows(2).position(|w| w == b"\r\n") else { return out };
        let size = usize::from_str_radix(std::str::from_utf8(&body[..eol]).unwrap_or("0").trim(), 16).unwrap_or(0);
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&body[start..(start + size).min(body.len())]);
        body = &body[(start + size + 2).min(body.len())..];
    }
}

impl Server {
    pub fn raw(&self, request: &[u8]) -> Reply {
        let mut s = TcpStream::connect(self.addr).expect("connecting to the server");
        s.set_read_timeout(Some(Duration::from_secs(120))).expect("setting a timeout");
        s.write_all(request).expect("sending the request");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).expect("reading the response");
        let split = buf.windows(4).position(|w| w == b"\r\n\r\n").expect("a complete response head");
        let head = String::from_utf8_lossy(&buf[..split]).into_owned();
        let mut lines = head.lines();
        let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|c| c.parse().ok()).expect("a status line");
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        let mut body = buf[split + 4..].to_vec();
        if headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked")) {
            body = dechunk(&body);
        }
        Reply { status, headers, body }
    }

    pub fn request(&self, method: &str, path: &str, extra_headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n", self.addr, body.len());
        for (k, v) in extra_headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        let mut bytes = req.into_bytes();
        bytes.extend_from_slice(body);
        self.raw(&bytes)
    }

    pub fn get(&self, path: &str) -> Reply {
        self.request("GET", path, &[], b"")
    }

    pub fn post(&self, path: &str, body: &Value) -> Reply {
        self.request("POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes())
    }
}

pub fn greedy() -> Value {
    json!({"temperature": 0, "repeat_penalty": 1.0, "num_predict": 12})
}

/// Opens a streaming request and reads until the first generated piece.
pub fn open_stream(s: &Server, body: &Value) -> TcpStream {
    let mut t = TcpStream::connect(s.addr).expect("connecting");
    let body = body.to_string();
    let req = format!("POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    t.write_all(req.as_bytes()).expect("sending");
    t.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let mut buf = [0u8; 4096];
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"done\":false") {
        let n = t.read(&mut buf).expect("reading the stream");
        assert!(n > 0, "stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    t
}
