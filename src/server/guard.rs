//! Checks made on every request before a handler sees it: the `Host` header
//! (a web page cannot reach a loopback server through DNS rebinding), the
//! declared body size (refused before any byte of it is read, so
//! `Expect: 100-continue` gets no 100), and the browser `Origin`, parsed as a
//! URL.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{Request, State};
use axum::http::uri::Authority;
use axum::http::{header, StatusCode, Uri, Version};
use axum::middleware::Next;
use axum::response::Response;

use super::{error_for_path, ApiError, MAX_BODY_BYTES};

/// Refuses a request whose `Host` does not name this server: with the server
/// bound to a loopback address, only loopback names and addresses (as Ollama
/// does); bound to any other address, the operator exposed it on purpose and
/// any name is fine. HTTP/1.1 requires the header.
pub(super) async fn check_host(State(bound): State<SocketAddr>, req: Request, next: Next) -> Response {
    let hosts: Vec<_> = req.headers().get_all(header::HOST).iter().collect();
    let refusal = match hosts.as_slice() {
        [] if req.version() == Version::HTTP_11 => {
            Some((StatusCode::BAD_REQUEST, "the request has no Host header, which HTTP/1.1 requires".to_string()))
        }
        [] => None,
        [_] if !bound.ip().is_loopback() => None,
        [host] => match host.to_str().ok().filter(|h| is_loopback_host(h, bound.ip())) {
            Some(_) => None,
            None => Some((
                StatusCode::FORBIDDEN,
                format!(
                    "Host {host:?} is not allowed: this server is bound to {bound} and answers only to loopback names \
                     (localhost, 127.0.0.1, [::1]); bind another address with --host to serve other names"
                ),
            )),
        },
        _ => Some((StatusCode::BAD_REQUEST, "the request has more than one Host header".to_string())),
    };
    match refusal {
        Some((status, message)) => error_for_path(req.uri().path(), ApiError::new(status, message)),
        None => next.run(req).await,
    }
}

/// Whether a `Host` value (`name[:port]`) names this loopback-bound server.
fn is_loopback_host(host: &str, bound: IpAddr) -> bool {
    // An authority may carry user information; a Host header may not.
    if host.contains('@') {
        return false;
    }
    let Ok(authority) = host.parse::<Authority>() else { return false };
    has_valid_port(&authority)
        && (is_loopback_name(authority.host()) || ip_of(authority.host()).is_some_and(|ip| ip == bound))
}

/// Whether what follows the host is nothing or `:` and a port number.
fn has_valid_port(authority: &Authority) -> bool {
    let rest = authority.as_str().get(authority.host().len()..).unwrap_or("x");
    rest.is_empty() || rest.strip_prefix(':').is_some_and(|port| port.parse::<u16>().is_ok())
}

/// `localhost`, a `.localhost` name, or a loopback address (IPv6 in brackets or not).
fn is_loopback_name(host: &str) -> bool {
    let host = host.to_ascii_lowercase();
    host == "localhost" || host.ends_with(".localhost") || ip_of(&host).is_some_and(|ip| ip.is_loopback())
}

fn ip_of(host: &str) -> Option<IpAddr> {
    host.trim_start_matches('[').trim_end_matches(']').parse().ok()
}

/// Refuses a body whose declared length is over the limit before reading it.
pub(super) async fn check_length(req: Request, next: Next) -> Response {
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    match declared {
        Some(len) if len > MAX_BODY_BYTES as u64 => error_for_path(
            req.uri().path(),
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is {len} bytes; the most this server reads is {MAX_BODY_BYTES} bytes"),
            ),
        ),
        _ => next.run(req).await,
    }
}

/// An `Origin` header as a browser sends it: `scheme://host[:port]`, kept in
/// lowercase and without the scheme's default port, so patterns compare with
/// one spelling of each origin. Anything more is no origin: user information
/// (`http://localhost:80@evil.com` is evil.com), a path or query, a port that
/// is no number, a host that is no name or address.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct BrowserOrigin {
    scheme: String,
    host: String,
    port: Option<u16>,
}

impl BrowserOrigin {
    pub(super) fn parse(origin: &str) -> Option<BrowserOrigin> {
        let uri = origin.parse::<Uri>().ok()?;
        let scheme = uri.scheme_str()?.to_ascii_lowercase();
        let authority = uri.authority()?;
        let path_ok = uri.path_and_query().is_none_or(|p| p.as_str().is_empty() || p.as_str() == "/");
        if !path_ok || authority.as_str().contains('@') || !has_valid_port(authority) {
            return None;
        }
        let host = authority.host().to_ascii_lowercase();
        let name = !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
        let address = host.starts_with('[') && ip_of(&host).is_some();
        if !name && !address {
            return None;
        }
        let default_port = match scheme.as_str() {
            "http" => Some(80),
            "https" => Some(443),
            _ => None,
        };
        let port = authority.port_u16().filter(|&p| Some(p) != default_port);
        Some(BrowserOrigin { scheme, host, port })
    }
}

impl std::fmt::Display for BrowserOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme, self.host)?;
        match self.port {
            Some(port) => write!(f, ":{port}"),
            None => Ok(()),
        }
    }
}

/// Whether an `Origin` header names this machine: `http` or `https`, a
/// loopback host, an optional port, and nothing else.
pub(super) fn is_loopback_origin(origin: &str) -> bool {
    BrowserOrigin::parse(origin).is_some_and(|o| matches!(o.scheme.as_str(), "http" | "https") && is_loopback_name(&o.host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_origins() {
        for ok in ["http://localhost", "http://localhost:3000", "https://127.0.0.1:8080", "http://[::1]:5173", "http://app.localhost"] {
            assert!(is_loopback_origin(ok), "{ok} should be allowed");
        }
        for bad in [
            "http://example.com",
            "null",
            "file://",
            "http://localhost.evil.com",
            "http://10.0.0.1",
            "ftp://localhost",
            "",
            "http://localhost:80@evil.com",
            "http://localhost@evil.com",
            "http://evil.com@localhost",
            "http://localhost:80/x",
            "http://localhost:abc",
        ] {
            assert!(!is_loopback_origin(bad), "{bad} should be refused");
        }
    }

    #[test]
    fn origins_are_read_in_one_spelling() {
        let normal = |o: &str| BrowserOrigin::parse(o).map(|o| o.to_string());
        assert_eq!(normal("HTTP://App.Example.COM:80/").as_deref(), Some("http://app.example.com"));
        assert_eq!(normal("https://example.com:443").as_deref(), Some("https://example.com"));
        assert_eq!(normal("https://example.com:8443").as_deref(), Some("https://example.com:8443"));
        assert_eq!(normal("app://bundle:80").as_deref(), Some("app://bundle:80"));
        assert_eq!(normal("http://[::1]:3000").as_deref(), Some("http://[::1]:3000"));
        for bad in ["null", "", "example.com", "http://a@b.com", "http://b.com/x", "http://b.com?x", "http://b.com:x", "http://b%2fc.com"] {
            assert_eq!(normal(bad), None, "{bad} is no origin");
        }
    }

    #[test]
    fn hosts_must_name_the_loopback_server() {
        let bound: IpAddr = "127.0.0.1".parse().expect("an address");
        for ok in ["localhost", "localhost:11434", "127.0.0.1:11434", "[::1]:11434", "LOCALHOST", "a.localhost:1"] {
            assert!(is_loopback_host(ok, bound), "{ok} should be allowed");
        }
        for bad in ["evil.com", "evil.com:11434", "localhost.evil.com", "10.0.0.1", "localhost:80@evil.com", "", "local host"] {
            assert!(!is_loopback_host(bad, bound), "{bad} should be refused");
        }
    }
}
