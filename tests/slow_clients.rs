//! Clients that hold the one generation turn without using it, against a
//! server on an ephemeral port: one that reads its stream a trickle at a time,
//! and one that leaves while every word of its answer is held back for a stop
//! string. Each must let the next request through in seconds (issue 17,
//! causes 2 and 3).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use slotstream::server::{AppState, ModelCatalog, Timeouts};

const MODEL: &str = "qwen3_moe_mlx4";

/// A server over a copy of the fixture whose context is 32k tokens (the
/// fixture's 4k tokens fit in the socket buffers a server may keep), that
/// never stops at end-of-sequence, with `write` as its write timeout. The
/// folder lives as long as the server is used.
fn start(write: Duration) -> (SocketAddr, tempfile::TempDir) {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(MODEL);
    let copy = tempfile::tempdir().expect("creating a scratch folder");
    for entry in std::fs::read_dir(&fixture).expect("listing the fixture") {
        let path = entry.expect("a directory entry").path();
        std::fs::copy(&path, copy.path().join(path.file_name().expect("a file name"))).expect("copying a fixture file");
    }
    let config_path = copy.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).expect("config.json")).expect("JSON");
    config["max_position_embeddings"] = json!(32768);
    std::fs::write(&config_path, config.to_string()).expect("writing config.json");
    let loader = Arc::new(common::FixtureLoader { no_eos: true, mtp: false });
    let mut options = common::server_options(32768, 16);
    options.timeouts = Timeouts { write, ..Timeouts::default() };
    let catalog = ModelCatalog::new(vec![(MODEL.to_string(), copy.path().to_path_buf())], None);
    let app = AppState::new(catalog, loader, options).expect("server options");
    app.load_at_start(MODEL).expect("loading the fixture");
    (common::serve_in_background(app), copy)
}

fn request_bytes(addr: SocketAddr, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!("POST /api/generate HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len())
        .into_bytes()
}

/// Sends a non-streaming request and reads the whole answer: (status line
/// and body, how long it took).
fn generate(addr: SocketAddr, body: &Value, limit: Duration) -> (String, Duration) {
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(limit)).expect("setting a read timeout");
    s.write_all(&request_bytes(addr, body)).expect("sending the request");
    let mut answer = Vec::new();
    let read = s.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(read.is_ok(), "no whole answer within {limit:?} ({read:?}): {answer}");
    (answer, started.elapsed())
}

/// A connection to `addr` whose receive buffer is about `bytes` (set before
/// connecting, so the window it offers is that small).
fn connect_with_small_buffer(addr: SocketAddr, bytes: libc::c_int) -> TcpStream {
    let SocketAddr::V4(v4) = addr else { panic!("the test server listens on IPv4") };
    // SAFETY: plain socket calls on a descriptor this function owns until it
    // hands it to TcpStream; every result is checked.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let size = std::ptr::addr_of!(bytes).cast();
        let set = libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, size, std::mem::size_of::<libc::c_int>() as _);
        assert_eq!(set, 0, "SO_RCVBUF: {}", std::io::Error::last_os_error());
        let mut to: libc::sockaddr_in = std::mem::zeroed();
        to.sin_family = libc::AF_INET as libc::sa_family_t;
        to.sin_port = v4.port().to_be();
        to.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
        let connected =
            libc::connect(fd, std::ptr::addr_of!(to).cast(), std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t);
        assert_eq!(connected, 0, "connect: {}", std::io::Error::last_os_error());
        TcpStream::from_raw_fd(fd)
    }
}

/// A client that never reads its stream (its small receive buffer full) must
/// lose the generation turn about the write timeout after the buffers between
/// it and the engine fill (within seconds: the server keeps a small send
/// buffer), and the request behind it be served.
#[test]
fn a_client_that_never_reads_lets_the_next_request_through() {
    stuck_reader_lets_the_next_request_through(false);
}

/// A client that reads its stream a few KB at a time, often enough that no
/// single write waits the write timeout but slower than the engine writes, so
/// the engine waits on it: it must lose the turn once those waits add up to
/// the write timeout.
#[test]
fn a_client_that_reads_a_trickle_lets_the_next_request_through() {
    stuck_reader_lets_the_next_request_through(true);
}

fn stuck_reader_lets_the_next_request_through(trickle: bool) {
    let write_timeout = Duration::from_secs(2);
    let (addr, _model) = start(write_timeout);
    let mut slow = connect_with_small_buffer(addr, 4096);
    let endless = json!({"model": MODEL, "prompt": "Go on", "options": {"temperature": 0, "num_predict": 30000}});
    slow.write_all(&request_bytes(addr, &endless)).expect("sending the slow request");
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    let reader = std::thread::spawn(move || {
        slow.set_read_timeout(Some(Duration::from_millis(400))).expect("setting a read timeout");
        let mut buf = [0u8; 2048];
        let (mut total, mut ended) = (0usize, false);
        while trickle && !stopping.load(Ordering::SeqCst) {
            match slow.read(&mut buf) {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => total += n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(_) => {
                    ended = true;
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        // Held until the test ends, so a client that never reads stays connected.
        while !stopping.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
        }
        (total, ended)
    });
    // Let the slow stream start, then queue a short request behind it.
    std::thread::sleep(Duration::from_millis(500));
    let quick = json!({"model": MODEL, "prompt": "Hi", "stream": false, "options": {"temperature": 0, "num_predict": 4}});
    let (answer, waited) = generate(addr, &quick, Duration::from_secs(45));
    stop.store(true, Ordering::SeqCst);
    let (read, ended) = reader.join().expect("the slow client");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(!trickle || read > 0, "the trickling client read nothing: the test did not exercise a trickle");
    // The buffers between the engine and the client (the socket's, some
    // 64 KB; the channel's) fill first, within seconds, then the engine's
    // waits add up to the timeout. Were the socket's 3 MB, or the trickle
    // allowed, the generation would run for a minute or more.
    assert!(
        waited < write_timeout + Duration::from_secs(12),
        "the request behind a slow client waited {waited:?} (write timeout {write_timeout:?}; the client read {read} bytes, \
         its stream ended: {ended})"
    );
    eprintln!("served after {waited:?} behind a client that read {read} bytes (its stream ended: {ended})");
}

/// The fixture's greedy continuation of `prompt` over `tokens` tokens, and
/// how long generating it took.
fn greedy_text(addr: SocketAddr, prompt: &str, tokens: usize) -> (String, Duration) {
    let body = json!({"model": MODEL, "prompt": prompt, "raw": true, "stream": false,
                      "options": {"temperature": 0, "num_predict": tokens}});
    let (answer, took) = generate(addr, &body, Duration::from_secs(120));
    let json_start = answer.find("\r\n\r\n").map(|i| i + 4).expect("a response head");
    let reply: Value = serde_json::from_str(&answer[json_start..]).unwrap_or_else(|e| panic!("{e}: {answer}"));
    (reply["response"].as_str().expect("a response").to_string(), took)
}

/// With a stop string that begins with the whole answer, every word is held
/// back and nothing is written; a client that leaves after the response head
/// must still stop the generation at once (cancellation is checked every
/// step), not after all its tokens.
#[test]
fn a_client_that_leaves_while_output_is_held_back_stops_the_generation() {
    let (addr, _model) = start(Duration::from_secs(60));
    let prompt = "The sea was calm, and the ship";
    let tokens = 1500;
    let (text, full) = greedy_text(addr, prompt, tokens);
    assert!(text.len() > 100, "the fixture wrote only {:?}", text);
    // Generating the same tokens again (the prefix cache holds the prompt).
    let (_, again) = greedy_text(addr, prompt, tokens);
    let generation = full.min(again);

    let stop = format!("{text}\u{1}never written");
    let held = json!({"model": MODEL, "prompt": prompt, "raw": true, "stream": true,
                      "options": {"temperature": 0, "num_predict": tokens + 10, "stop": [stop]}});
    let mut leaving = TcpStream::connect(addr).expect("connecting");
    leaving.set_read_timeout(Some(Duration::from_secs(30))).expect("setting a read timeout");
    leaving.write_all(&request_bytes(addr, &held)).expect("sending the held-back request");
    let mut head = [0u8; 12];
    leaving.read_exact(&mut head).expect("the response head");
    assert_eq!(&head, b"HTTP/1.1 200", "{}", String::from_utf8_lossy(&head));
    drop(leaving);

    let quick = json!({"model": MODEL, "prompt": "Hi", "stream": false, "options": {"temperature": 0, "num_predict": 2}});
    let (answer, waited) = generate(addr, &quick, Duration::from_secs(120));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        waited < generation / 3,
        "the next request waited {waited:?}; generating the held-back answer takes {generation:?}: the abandoned generation ran on"
    );
    eprintln!("served after {waited:?}; the held-back answer takes {generation:?} to generate");
}
