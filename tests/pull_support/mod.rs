//! A small hub-like HTTP server for the `pull` tests: the repository API, `resolve`
//! endpoints with the hub's metadata headers, LFS files redirected to a second host
//! (`localhost` instead of `127.0.0.1`) that serves byte ranges, and faults injected
//! on demand: dropped connections, bursts of 429/5xx, stalls, a corrupted byte, a
//! truncated file, a slow link.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use sha1::Sha1;
use sha2::{Digest, Sha256};

pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
pub const TOKEN: &str = "hf_test_token";

/// One file of the served repository.
#[derive(Clone)]
pub struct RepoFile {
    pub path: String,
    pub content: Vec<u8>,
    /// Stored with LFS: named by sha256 and redirected to the storage host.
    pub lfs: bool,
}

impl RepoFile {
    pub fn blob_name(&self) -> String {
        if self.lfs {
            hex(&Sha256::digest(&self.content))
        } else {
            let mut sha1 = Sha1::new();
            sha1.update(format!("blob {}\0", self.content.len()).as_bytes());
            sha1.update(&self.content);
            hex(&sha1.finalize())
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Deterministic pseudo-random bytes.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// Faults applied to the next requests that download file content.
#[derive(Default)]
pub struct Faults {
    /// Statuses answered, one per request, to the next content downloads.
    pub get_statuses: VecDeque<u16>,
    /// Statuses answered, one per request, to the next metadata (HEAD) requests.
    pub head_statuses: VecDeque<u16>,
    /// The next content downloads send this many body bytes, then drop the connection.
    pub drop_after: VecDeque<u64>,
    /// The next N content downloads hang before sending any header.
    pub stall_before_headers: usize,
    /// The next N content downloads send headers and a few bytes, then hang.
    pub stall_mid_body: usize,
    /// Flip one byte in the next download of this file.
    pub corrupt_once: Option<String>,
    /// Serve this file cut to this many bytes (its metadata still says full size).
    pub truncate: Option<(String, usize)>,
    /// Per-connection throttle.
    pub bytes_per_second: Option<u64>,
    /// Redirect LFS files to the storage listener on another port of the
    /// hub's own host (127.0.0.1), not to `localhost`.
    pub storage_on_another_port: bool,
}

#[derive(Default)]
pub struct Log {
    /// Body bytes of file content sent, by file path.
    pub content_bytes: HashMap<String, u64>,
    /// Requests to the storage host that carried an Authorization header.
    pub storage_requests_with_auth: usize,
    pub storage_requests: usize,
    /// Hub requests (API, resolve) without the expected token.
    pub hub_requests_without_token: usize,
    /// Most content downloads that were in flight at once.
    pub max_parallel_downloads: usize,
}

struct State {
    files: Vec<RepoFile>,
    faults: Faults,
    log: Log,
    /// Content downloads in flight now.
    downloads_in_flight: usize,
    /// Bumped by `take_log`, so bytes still trickling out to a killed client's
    /// connections are not counted against the next run.
    generation: u64,
}

pub struct HubServer {
    pub port: u16,
    state: Arc<Mutex<State>>,
}

impl HubServer {
    pub fn start(files: Vec<RepoFile>) -> HubServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the test hub server");
        let port = listener.local_addr().expect("test server address").port();
        let state = Arc::new(Mutex::new(State { files, faults: Faults::default(), log: Log::default(), downloads_in_flight: 0, generation: 0 }));
        let storage = TcpListener::bind("127.0.0.1:0").expect("binding the test storage server");
        let storage_port = storage.local_addr().expect("test storage address").port();
        for listener in [listener, storage] {
            let shared = Arc::clone(&state);
            thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    let state = Arc::clone(&shared);
                    thread::spawn(move || {
                        let _ = handle(stream, &state, port, storage_port);
                    });
                }
            });
        }
        HubServer { port, state }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn faults(&self) -> FaultsGuard<'_> {
        FaultsGuard(lock(&self.state))
    }

    /// The log since the last call; requests already in flight are not counted again.
    pub fn take_log(&self) -> Log {
        let mut state = lock(&self.state);
        state.generation += 1;
        std::mem::take(&mut state.log)
    }
}

pub struct FaultsGuard<'a>(MutexGuard<'a, State>);

impl std::ops::Deref for FaultsGuard<'_> {
    type Target = Faults;
    fn deref(&self) -> &Faults {
        &self.0.faults
    }
}

impl std::ops::DerefMut for FaultsGuard<'_> {
    fn deref_mut(&mut self) -> &mut Faults {
        &mut self.0.faults
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

struct Request {
    method: String,
    path: String,
    headers: HashMap<String, String>,
}

fn read_request(stream: &TcpStream) -> std::io::Result<Request> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let path = parts.next().unwrap_or_default().to_string();
    let mut headers = HashMap::new();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
        }
    }
    Ok(Request { method, path, headers })
}

fn respond(stream: &mut TcpStream, status: u16, headers: &[(&str, String)], body: &[u8]) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status} {}\r\nConnection: close\r\n", reason(status));
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("content-length")) {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        401 => "Unauthorized",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Whatever",
    }
}

fn handle(mut stream: TcpStream, state: &Mutex<State>, port: u16, storage_port: u16) -> std::io::Result<()> {
    let request = read_request(&stream)?;
    let path = request.path.clone();
    let authorized = request.headers.get("authorization").map(String::as_str) == Some(&format!("Bearer {TOKEN}"));

    if let Some(rest) = path.strip_prefix("/api/models/") {
        if !authorized {
            lock(state).log.hub_requests_without_token += 1;
        }
        // org/name/revision/rev
        let parts: Vec<&str> = rest.splitn(4, '/').collect();
        let files = lock(state).files.clone();
        if parts.len() == 4 && parts[0] == "org" && parts[1] == "name" && parts[2] == "revision" && (parts[3] == "main" || parts[3] == COMMIT) {
            let siblings: Vec<_> = files.iter().map(|f| serde_json::json!({ "rfilename": f.path })).collect();
            let body = serde_json::json!({ "id": "org/name", "sha": COMMIT, "siblings": siblings }).to_string();
            return respond(&mut stream, 200, &[("Content-Type", "application/json".into())], body.as_bytes());
        }
        return respond(&mut stream, 404, &[], b"{\"error\":\"Repository not found\"}");
    }

    if let Some(rest) = path.strip_prefix("/org/name/resolve/") {
        if !authorized {
            lock(state).log.hub_requests_without_token += 1;
        }
        let Some((revision, file_path)) = rest.split_once('/') else {
            return respond(&mut stream, 404, &[], b"");
        };
        let file = lock(state).files.iter().find(|f| f.path == file_path).cloned();
        let Some(file) = file.filter(|_| revision == "main" || revision == COMMIT) else {
            return respond(&mut stream, 404, &[("X-Error-Code", "EntryNotFound".into())], b"");
        };
        if request.method == "HEAD" {
            if let Some(status) = lock(state).faults.head_statuses.pop_front() {
                return respond(&mut stream, status, &[("Retry-After", "0".into())], b"");
            }
        }
        let blob = file.blob_name();
        if file.lfs {
            let headers = [
                ("X-Repo-Commit", COMMIT.to_string()),
                ("X-Linked-Etag", format!("\"{blob}\"")),
                ("X-Linked-Size", file.content.len().to_string()),
                ("ETag", "\"0000000000000000000000000000000000000000\"".into()),
                ("Location", match lock(state).faults.storage_on_another_port {
                    true => format!("http://127.0.0.1:{storage_port}/storage/{blob}"),
                    false => format!("http://localhost:{port}/storage/{blob}"),
                }),
            ];
            return respond(&mut stream, 302, &headers, b"");
        }
        let headers = [("X-Repo-Commit", COMMIT.to_string()), ("ETag", format!("\"{blob}\""))];
        if request.method == "HEAD" {
            let mut headers = headers.to_vec();
            headers.push(("Content-Length", file.content.len().to_string()));
            return respond(&mut stream, 200, &headers, b"");
        }
        return serve_content(&mut stream, state, &file, &request, &headers);
    }

    if let Some(blob) = path.strip_prefix("/storage/") {
        {
            let mut state = lock(state);
            state.log.storage_requests += 1;
            if request.headers.contains_key("authorization") {
                state.log.storage_requests_with_auth += 1;
            }
        }
        let file = lock(state).files.iter().find(|f| f.lfs && f.blob_name() == blob).cloned();
        let Some(file) = file else { return respond(&mut stream, 404, &[], b"") };
        return serve_content(&mut stream, state, &file, &request, &[]);
    }
    respond(&mut stream, 404, &[], b"")
}

/// Sends (part of) a file's content, honouring Range and the injected faults.
fn serve_content(
    stream: &mut TcpStream,
    state: &Mutex<State>,
    file: &RepoFile,
    request: &Request,
    extra_headers: &[(&str, String)],
) -> std::io::Result<()> {
    {
        let mut state = lock(state);
        state.downloads_in_flight += 1;
        state.log.max_parallel_downloads = state.log.max_parallel_downloads.max(state.downloads_in_flight);
    }
    let result = send_content(stream, state, file, request, extra_headers);
    lock(state).downloads_in_flight -= 1;
    result
}

fn send_content(
    stream: &mut TcpStream,
    state: &Mutex<State>,
    file: &RepoFile,
    request: &Request,
    extra_headers: &[(&str, String)],
) -> std::io::Result<()> {
    let (generation, status, stall_before, stall_mid, drop_after, corrupt, truncate, throttle) = {
        let mut state = lock(state);
        let generation = state.generation;
        let faults = &mut state.faults;
        let status = faults.get_statuses.pop_front();
        let stall_before = status.is_none() && take_one(&mut faults.stall_before_headers);
        let stall_mid = status.is_none() && !stall_before && take_one(&mut faults.stall_mid_body);
        let drop_after = if status.is_none() { faults.drop_after.pop_front() } else { None };
        let corrupt = faults.corrupt_once.as_deref() == Some(&file.path) && status.is_none();
        if corrupt {
            faults.corrupt_once = None;
        }
        let truncate = faults.truncate.as_ref().filter(|(p, _)| *p == file.path).map(|(_, len)| *len);
        (generation, status, stall_before, stall_mid, drop_after, corrupt, truncate, faults.bytes_per_second)
    };
    if let Some(status) = status {
        return respond(stream, status, &[("Retry-After", "0".into())], b"busy");
    }
    if stall_before {
        thread::sleep(Duration::from_secs(5));
        return Ok(());
    }

    let mut content = file.content.clone();
    if let Some(len) = truncate {
        content.truncate(len);
    }
    let total = content.len() as u64;
    let (start, end) = match request.headers.get("range").and_then(|r| parse_range(r, total)) {
        Some(range) => range,
        None => (0, total),
    };
    let mut body = content[start as usize..end as usize].to_vec();
    if corrupt && !body.is_empty() {
        let middle = body.len() / 2;
        body[middle] ^= 0x20;
    }
    let mut headers = extra_headers.to_vec();
    headers.push(("Content-Length", body.len().to_string()));
    headers.push(("Accept-Ranges", "bytes".into()));
    let status = if request.headers.contains_key("range") {
        headers.push(("Content-Range", format!("bytes {start}-{}/{total}", end.saturating_sub(1))));
        206
    } else {
        200
    };
    respond(stream, status, &headers, b"")?;

    let mut limit = body.len();
    if let Some(after) = drop_after {
        limit = limit.min(after as usize);
    }
    if stall_mid {
        limit = limit.min(1000);
    }
    let piece = 16 << 10;
    let mut sent = 0;
    while sent < limit {
        let n = piece.min(limit - sent);
        stream.write_all(&body[sent..sent + n])?;
        let mut state = lock(state);
        if state.generation == generation {
            *state.log.content_bytes.entry(file.path.clone()).or_default() += n as u64;
        }
        drop(state);
        sent += n;
        if let Some(rate) = throttle {
            thread::sleep(Duration::from_secs_f64(n as f64 / rate as f64));
        }
    }
    stream.flush()?;
    if stall_mid {
        thread::sleep(Duration::from_secs(5));
    }
    // Dropping the stream closes the connection, short of Content-Length if cut.
    Ok(())
}

fn take_one(count: &mut usize) -> bool {
    if *count > 0 {
        *count -= 1;
        true
    } else {
        false
    }
}

fn parse_range(header: &str, total: u64) -> Option<(u64, u64)> {
    let spec = header.strip_prefix("bytes=")?;
    let (first, last) = spec.split_once('-')?;
    let first: u64 = first.parse().ok()?;
    let last: u64 = if last.is_empty() { total - 1 } else { last.parse().ok()? };
    (first <= last && first < total).then(|| (first, (last + 1).min(total)))
}
