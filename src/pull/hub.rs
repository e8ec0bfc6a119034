//! Talking to the Hugging Face hub (or anything that speaks its HTTP API): the
//! repository file list, per-file metadata from the `resolve` headers, and ranged GETs,
//! each with retries and backoff.
//!
//! Why not the `hf-hub` crate: its current release is async (tokio, reqwest, hf-xet),
//! a heavy build for one subcommand, and it downloads each file as a single stream
//! that cannot be split into ranges over several connections nor resumed from a record
//! of which ranges are already on disk. So the cache layout (`cache`) and the transfer
//! (`transfer`) are our own, on `ureq`, a small blocking HTTP client.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use ureq::config::RedirectAuthHeaders;
use ureq::http::{HeaderMap, Response};
use ureq::Body;

use super::cache::hf_home;
use crate::note;

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Timeouts and retry policy; short values in tests, generous ones for real networks.
#[derive(Clone, Debug)]
pub struct NetworkSettings {
    /// Longest wait for a connection, a response or the next bytes of a body; a
    /// server that stalls longer is abandoned and the request retried.
    pub stall_timeout: Duration,
    /// Attempts per request while no bytes arrive (progress resets the count).
    pub max_attempts: u32,
    /// First backoff delay; doubles on each retry up to `max_backoff`.
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// Longest wait to resolve the host's name and connect: a machine without
    /// a network finds out in seconds.
    pub connect_timeout: Duration,
}

impl Default for NetworkSettings {
    fn default() -> Self {
        NetworkSettings {
            connect_timeout: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(30),
            max_attempts: 10,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
        }
    }
}

/// A failed request, split by whether trying again can help.
#[derive(Debug)]
pub enum Failure {
    /// Network error, stall, 429 or 5xx: back off and try again. Holds the server's
    /// `Retry-After` when it sent one.
    Retry(anyhow::Error, Option<Duration>),
    /// Trying again cannot help (404, 401, a malformed answer).
    Fatal(anyhow::Error),
}

/// The hub refused what was asked for: no such repository, revision or
/// file (404), or one this token may not read (401, 403). The server answers
/// a client's pull with its status.
#[derive(Debug)]
pub struct HubRefused {
    pub status: u16,
    message: String,
}

impl std::fmt::Display for HubRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for HubRefused {}

/// What the hub says about one file at one revision.
#[derive(Clone, Debug)]
pub struct FileMetadata {
    /// The commit the revision resolved to (`X-Repo-Commit`).
    pub commit: Option<String>,
    /// `X-Linked-Etag` (the sha256 of an LFS file) or `ETag` (git sha1 of a small file).
    pub etag: String,
    /// True when the file is stored with LFS, i.e. `X-Linked-Etag` was present.
    pub is_lfs: bool,
    pub size: u64,
}

/// The repository listing of `GET /api/models/{repo}/revision/{rev}`.
#[derive(Debug, Deserialize)]
pub struct RepoInfo {
    /// The commit the revision resolved to.
    pub sha: String,
    pub siblings: Vec<Sibling>,
}

#[derive(Debug, Deserialize)]
pub struct Sibling {
    pub rfilename: String,
}

/// `HF_ENDPOINT` (else the public hub) and `HF_TOKEN` (else the token
/// `huggingface-cli login` saved in `$HF_HOME/token`).
pub fn endpoint_and_token_from_env() -> (String, Option<String>) {
    let endpoint =
        std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()).unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
    let token = std::env::var("HF_TOKEN")
        .ok()
        .or_else(|| {
            let path = hf_home().ok()?.join("token");
            std::fs::read_to_string(path).ok()
        })
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    (endpoint, token)
}

pub struct HubClient {
    endpoint: String,
    token: Option<String>,
    agent: ureq::Agent,
    pub settings: NetworkSettings,
    /// Whether any request has reached a server yet: until one has, a host
    /// that cannot be found or connected to means no network (or a wrong
    /// `HF_ENDPOINT`), which retrying for minutes would not mend.
    reached: AtomicBool,
    /// Failures to reach it so far (see [`UNREACHABLE_ATTEMPTS`]).
    unreachable: AtomicU32,
}

/// Redirects followed for one request (the hub redirects a file to its
/// storage host, a renamed repository to its new name).
const MAX_REDIRECTS: usize = 10;

/// Tries to reach a hub that no request has reached yet, before saying the
/// network is down: a name lookup or a connection that fails this many times
/// in a row (a second apart at most) will not mend in the next minutes.
const UNREACHABLE_ATTEMPTS: u32 = 3;

impl HubClient {
    /// Honours `HF_ENDPOINT` and `HF_TOKEN` (else the token `huggingface-cli login`
    /// saved in `$HF_HOME/token`).
    pub fn from_env(settings: NetworkSettings) -> HubClient {
        let (endpoint, token) = endpoint_and_token_from_env();
        HubClient::new(&endpoint, token, settings)
    }

    pub fn new(endpoint: &str, token: Option<String>, settings: NetworkSettings) -> HubClient {
        let builder = ureq::Agent::config_builder();
        // macOS builds ureq with the system's TLS (see Cargo.toml).
        #[cfg(target_os = "macos")]
        let builder = builder.tls_config(
            ureq::tls::TlsConfig::builder().provider(ureq::tls::TlsProvider::NativeTls).build(),
        );
        let agent = builder
            .http_status_as_error(false)
            // Redirects are followed by `follow`, which sends the token to the
            // endpoint only (ureq's `SameHost` would send it to any port of
            // the endpoint's host): none a redirect leads to sees it.
            .redirect_auth_headers(RedirectAuthHeaders::Never)
            .timeout_resolve(Some(settings.connect_timeout))
            .timeout_connect(Some(settings.connect_timeout.min(settings.stall_timeout)))
            .timeout_recv_response(Some(settings.stall_timeout))
            .timeout_per_read(Some(settings.stall_timeout))
            .user_agent(concat!("slotstream/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        HubClient {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token,
            agent,
            settings,
            reached: AtomicBool::new(false),
            unreachable: AtomicU32::new(0),
        }
    }

    /// URL of a file at a revision; the hub answers it with the file or a redirect to it.
    pub fn resolve_url(&self, repo: &str, revision: &str, path: &str) -> String {
        format!(
            "{}/{repo}/resolve/{}/{}",
            self.endpoint,
            percent_encode(revision, false),
            percent_encode(path, true)
        )
    }

    /// Lists a repository's files and the commit `revision` resolves to.
    pub fn repo_info(&self, repo: &str, revision: &str) -> Result<RepoInfo> {
        let url = format!(
            "{}/api/models/{repo}/revision/{}",
            self.endpoint,
            percent_encode(revision, false)
        );
        self.with_retries(&format!("listing the files of {repo} at {revision}"), || {
            let mut response = self.follow(&url, |url| self.agent.get(url).header("Accept", "application/json"))?;
            check_status(&response, &url, repo)?;
            let text = response
                .body_mut()
                .with_config()
                .limit(64 << 20)
                .read_to_string()
                .map_err(|e| Failure::Retry(anyhow!(e).context(format!("reading {url}")), None))?;
            serde_json::from_str(&text).map_err(|e| {
                Failure::Fatal(anyhow!(e).context(format!("{url} did not answer a repository listing")))
            })
        })
    }

    /// Metadata from the headers of `HEAD resolve/...`, not following the redirect to
    /// the storage host (the hub's own response carries the `X-Linked-*` headers).
    /// `None` when the repository has no such file at that revision.
    pub fn file_metadata(&self, repo: &str, revision: &str, path: &str) -> Result<Option<FileMetadata>> {
        let mut url = self.resolve_url(repo, revision, path);
        self.with_retries(&format!("asking the hub about {repo}/{path}"), || {
            // A redirect without hub headers is a renamed repository: follow it.
            for _ in 0..5 {
                let request = self
                    .agent
                    .head(&url)
                    .header("Accept-Encoding", "identity")
                    .config()
                    .max_redirects(0)
                    .build();
                let response = self.call(request)?;
                let headers = response.headers();
                let status = response.status().as_u16();
                if status == 404 {
                    return Ok(None);
                }
                if response.status().is_redirection() && header(headers, "x-repo-commit").is_none() {
                    let location = header(headers, "location").ok_or_else(|| {
                        Failure::Fatal(anyhow!("{url} redirected without a Location header"))
                    })?;
                    url = join_url(&url, location);
                    continue;
                }
                if !response.status().is_redirection() {
                    check_status(&response, &url, repo)?;
                }
                return metadata_from_headers(headers, &url).map(Some).map_err(Failure::Fatal);
            }
            Err(Failure::Fatal(anyhow!("{url} redirected too many times")))
        })
    }

    /// Starts a GET of `url` for bytes `start..end` (end exclusive), following redirects.
    /// The caller validates `Content-Range` and reads the body.
    pub fn get_range(&self, url: &str, start: u64, end: u64) -> Result<Response<Body>, Failure> {
        let response = self.follow(url, |url| {
            self.agent.get(url).header("Range", format!("bytes={start}-{}", end - 1)).header("Accept-Encoding", "identity")
        })?;
        check_status(&response, url, "")?;
        Ok(response)
    }

    /// Sends the request `make` builds for `url`, following redirects one by
    /// one, so that each request carries the token only when it goes to the
    /// endpoint itself (its scheme, host and port).
    fn follow(
        &self,
        url: &str,
        make: impl Fn(&str) -> ureq::RequestBuilder<ureq::typestate::WithoutBody>,
    ) -> Result<Response<Body>, Failure> {
        let mut url = url.to_string();
        for _ in 0..=MAX_REDIRECTS {
            let response = self.call(make(&url).config().max_redirects(0).build())?;
            if !response.status().is_redirection() || response.status() == 304 {
                return Ok(response);
            }
            let location = header(response.headers(), "location")
                .ok_or_else(|| Failure::Fatal(anyhow!("{url} redirected without a Location header")))?;
            url = join_url(&url, location);
        }
        Err(Failure::Fatal(anyhow!("{url} redirected more than {MAX_REDIRECTS} times")))
    }

    fn call(
        &self,
        request: ureq::RequestBuilder<ureq::typestate::WithoutBody>,
    ) -> Result<Response<Body>, Failure> {
        let request = match &self.token {
            // ureq drops this header when a redirect leaves the host.
            Some(token) if request.uri_ref().map(|u| self.is_endpoint(u)).unwrap_or(false) => {
                request.header("Authorization", format!("Bearer {token}"))
            }
            _ => request,
        };
        let result = request.call();
        if result.is_ok() {
            self.reached.store(true, Ordering::Relaxed);
        }
        result.map_err(|e| {
            let never_reached = !self.reached.load(Ordering::Relaxed) && is_unreachable(&e);
            if never_reached && self.unreachable.fetch_add(1, Ordering::Relaxed) + 1 < UNREACHABLE_ATTEMPTS {
                return Failure::Retry(anyhow!(e), None);
            }
            if never_reached {
                return Failure::Fatal(anyhow!(
                    "cannot reach {} ({e}): this machine seems to have no network connection, or HF_ENDPOINT \
                     names a host that does not answer. Check the network and run the command again",
                    self.endpoint
                ));
            }
            // Network trouble may pass; a bad URL or a certificate error will not.
            let transient = matches!(
                e,
                ureq::Error::Io(_)
                    | ureq::Error::Timeout(_)
                    | ureq::Error::HostNotFound
                    | ureq::Error::ConnectionFailed
                    | ureq::Error::Protocol(_)
                    | ureq::Error::BodyStalled
            );
            let error = anyhow!(e);
            if transient {
                Failure::Retry(error, None)
            } else {
                Failure::Fatal(error.context("is HF_ENDPOINT a reachable Hugging Face hub URL?"))
            }
        })
    }

    fn is_endpoint(&self, uri: &ureq::http::Uri) -> bool {
        let (scheme, rest) = self.endpoint.split_once("://").unwrap_or(("", ""));
        let endpoint_authority = rest.split('/').next();
        uri.scheme_str().is_some_and(|s| s.eq_ignore_ascii_case(scheme)) && uri.authority().map(|a| a.as_str()) == endpoint_authority
    }

    /// Runs `attempt` until it succeeds, fails fatally, or `max_attempts` retryable
    /// failures in a row, sleeping with exponential backoff in between.
    pub fn with_retries<T>(
        &self,
        what: &str,
        mut attempt: impl FnMut() -> Result<T, Failure>,
    ) -> Result<T> {
        let mut failures = 0;
        loop {
            match attempt() {
                Ok(value) => return Ok(value),
                Err(Failure::Fatal(e)) => return Err(e.context(what.to_string())),
                Err(Failure::Retry(e, retry_after)) => {
                    failures += 1;
                    if failures >= self.settings.max_attempts {
                        return Err(e.context(format!(
                            "{what}: gave up after {failures} attempts; check the network and run the command again"
                        )));
                    }
                    let wait = self.backoff(failures, retry_after);
                    note!("  retry: {what}: {e:#}; trying again in {:.1} s", wait.as_secs_f64());
                    std::thread::sleep(wait);
                }
            }
        }
    }

    /// Delay before retry number `failures` (1-based): exponential with jitter, or the
    /// server's `Retry-After` when it asked for a longer wait.
    pub fn backoff(&self, failures: u32, retry_after: Option<Duration>) -> Duration {
        let s = &self.settings;
        let exponential = s.first_backoff.saturating_mul(1 << (failures - 1).min(16)).min(s.max_backoff);
        // Jitter from the clock keeps parallel connections from retrying in lockstep.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let jittered = exponential.mul_f64(0.75 + f64::from(nanos % 1000) / 2000.0);
        match retry_after {
            Some(wait) => jittered.max(wait.min(s.max_backoff)),
            None => jittered,
        }
    }
}

/// A name that does not resolve or a host that cannot be connected to (the
/// standard library reports a failed lookup as a plain I/O error, so before
/// any request has reached the hub every I/O error counts).
fn is_unreachable(e: &ureq::Error) -> bool {
    match e {
        ureq::Error::HostNotFound | ureq::Error::ConnectionFailed | ureq::Error::Io(_) => true,
        ureq::Error::Timeout(t) => matches!(t, ureq::Timeout::Resolve | ureq::Timeout::Connect),
        _ => false,
    }
}

/// Maps an HTTP status to success, a retry or a fatal error that says what to do.
fn check_status(response: &Response<Body>, url: &str, repo: &str) -> Result<(), Failure> {
    let status = response.status().as_u16();
    match status {
        200..=299 => Ok(()),
        429 | 500..=599 | 408 => {
            let retry_after = header(response.headers(), "retry-after")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            Err(Failure::Retry(anyhow!("{url} answered HTTP {status}"), retry_after))
        }
        401 | 403 => Err(Failure::Fatal(anyhow::Error::new(HubRefused {
            status,
            message: format!(
                "{url} answered HTTP {status}: the repository {repo} is private or gated; accept its \
                 terms on the hub and set HF_TOKEN to an access token"
            ),
        }))),
        404 => Err(Failure::Fatal(anyhow::Error::new(HubRefused {
            status,
            message: format!("{url} answered HTTP 404: no such repository, revision or file"),
        }))),
        _ => Err(Failure::Fatal(anyhow!("{url} answered HTTP {status}"))),
    }
}

fn metadata_from_headers(headers: &HeaderMap, url: &str) -> Result<FileMetadata> {
    let linked_etag = header(headers, "x-linked-etag");
    let etag = linked_etag
        .or_else(|| header(headers, "etag"))
        .map(normalize_etag)
        .filter(|e| !e.is_empty())
        .with_context(|| format!("{url} sent no ETag; is HF_ENDPOINT a Hugging Face hub?"))?;
    let size = header(headers, "x-linked-size")
        .or_else(|| header(headers, "content-length"))
        .with_context(|| format!("{url} sent no file size (X-Linked-Size or Content-Length)"))?;
    let size = size
        .trim()
        .parse()
        .with_context(|| format!("{url} sent an invalid file size {size:?}"))?;
    if etag.contains(['/', '\\']) || etag.starts_with('.') {
        bail!("{url} sent an ETag {etag:?} that cannot name a file");
    }
    Ok(FileMetadata {
        commit: header(headers, "x-repo-commit").map(str::to_string),
        etag,
        is_lfs: linked_etag.is_some(),
        size,
    })
}

/// `W/"abc"` and `"abc"` both name the blob `abc`.
fn normalize_etag(etag: &str) -> String {
    etag.trim().trim_start_matches("W/").trim_matches('"').to_string()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Resolves a `Location` header against the URL that sent it.
fn join_url(base: &str, location: &str) -> String {
    if location.contains("://") {
        return location.to_string();
    }
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_end = base[scheme_end..].find('/').map(|i| scheme_end + i).unwrap_or(base.len());
    if location.starts_with('/') {
        format!("{}{location}", &base[..host_end])
    } else {
        let dir_end = base.rfind('/').filter(|&i| i >= host_end).unwrap_or(host_end);
        format!("{}/{location}", &base[..dir_end])
    }
}

/// Percent-encodes a path (keeping `/` when `keep_slash`) for use in a URL.
fn percent_encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        let plain = byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) || (keep_slash && byte == b'/');
        if plain {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_built_and_joined() {
        assert_eq!(percent_encode("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(percent_encode("a b/c.json", true), "a%20b/c.json");
        assert_eq!(join_url("http://h:1/a/b/c", "/x/y"), "http://h:1/x/y");
        assert_eq!(join_url("http://h:1/a/b/c", "d"), "http://h:1/a/b/d");
        assert_eq!(join_url("http://h:1/a", "http://o/z"), "http://o/z");
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
    }
}
