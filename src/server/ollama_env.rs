//! The Ollama environment variables `serve` honours as Ollama does, read in
//! this one place: `OLLAMA_HOST` (where to listen, when `--host`/`--port`
//! do not say), `OLLAMA_ORIGINS` (browser origins allowed besides the
//! loopback ones), `OLLAMA_KEEP_ALIVE` (how long an idle model stays loaded)
//! `OLLAMA_MAX_LOADED_MODELS` and `OLLAMA_NUM_PARALLEL` (generations decoded
//! together), each when its flag does not say.

use std::net::IpAddr;

use anyhow::{bail, Context, Result};

use super::guard::BrowserOrigin;

/// Ollama's default port.
pub const DEFAULT_PORT: u16 = 11434;

/// What the environment says, unparsed until asked.
#[derive(Clone, Debug, Default)]
pub struct OllamaEnv {
    pub host: Option<String>,
    pub origins: Option<String>,
    pub keep_alive: Option<String>,
    pub max_loaded_models: Option<String>,
    pub num_parallel: Option<String>,
}

impl OllamaEnv {
    pub fn from_env() -> OllamaEnv {
        let read = |name: &str| std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        OllamaEnv {
            host: read("OLLAMA_HOST"),
            origins: read("OLLAMA_ORIGINS"),
            keep_alive: read("OLLAMA_KEEP_ALIVE"),
            max_loaded_models: read("OLLAMA_MAX_LOADED_MODELS"),
            num_parallel: read("OLLAMA_NUM_PARALLEL"),
        }
    }

    /// How long an idle model stays loaded: `--keep-alive`, else
    /// `OLLAMA_KEEP_ALIVE`, else five minutes.
    pub fn keep_alive(&self, flag: Option<&str>) -> Result<super::KeepAlive> {
        match (flag, &self.keep_alive) {
            (Some(value), _) => super::KeepAlive::parse(value).map_err(|e| anyhow::anyhow!("--keep-alive: {e}")),
            (None, Some(value)) => super::KeepAlive::parse(value).map_err(|e| anyhow::anyhow!("OLLAMA_KEEP_ALIVE: {e}")),
            (None, None) => Ok(super::DEFAULT_KEEP_ALIVE),
        }
    }

    /// Models loaded at once at most: `--max-loaded-models`, else
    /// `OLLAMA_MAX_LOADED_MODELS` (0 there means the default, as in Ollama),
    /// else [`super::DEFAULT_MAX_LOADED_MODELS`].
    pub fn max_loaded_models(&self, flag: Option<usize>) -> Result<usize> {
        if let Some(n) = flag {
            return Ok(n);
        }
        match &self.max_loaded_models {
            None => Ok(super::DEFAULT_MAX_LOADED_MODELS),
            Some(value) => match value.parse::<usize>() {
                Ok(0) => Ok(super::DEFAULT_MAX_LOADED_MODELS),
                Ok(n) => Ok(n),
                Err(_) => bail!("OLLAMA_MAX_LOADED_MODELS={value:?} is not a number of models"),
            },
        }
    }

    /// Generations decoded together: `--parallel`, else `OLLAMA_NUM_PARALLEL`
    /// (0 there means the default, as in Ollama), else `default`.
    pub fn num_parallel(&self, flag: Option<usize>, default: usize) -> Result<usize> {
        if let Some(n) = flag {
            return Ok(n);
        }
        match &self.num_parallel {
            None => Ok(default),
            Some(value) => match value.parse::<usize>() {
                Ok(0) => Ok(default),
                Ok(n) => Ok(n),
                Err(_) => bail!("OLLAMA_NUM_PARALLEL={value:?} is not a number of generations"),
            },
        }
    }

    /// The address to listen on: the flags first, then `OLLAMA_HOST`
    /// (`HOST`, `HOST:PORT`, `:PORT`, `[V6]:PORT`, an `http://` or
    /// `https://` scheme, whose default ports are 80 and 443), then
    /// 127.0.0.1:11434.
    pub fn bind_address(&self, host: Option<&str>, port: Option<u16>) -> Result<(IpAddr, u16)> {
        let (env_host, env_port) = match &self.host {
            Some(value) => parse_host(value).with_context(|| format!("OLLAMA_HOST={value:?}"))?,
            None => (None, None),
        };
        let host = match host {
            Some(h) => ip_of(h).with_context(|| format!("--host {h}"))?,
            None => env_host.unwrap_or(IpAddr::from([127, 0, 0, 1])),
        };
        Ok((host, port.or(env_port).unwrap_or(DEFAULT_PORT)))
    }

    /// `OLLAMA_ORIGINS`: comma-separated origins, each exact or with `*`
    /// wildcards (`chrome-extension://*`, `https://*.example.com`, `*`).
    pub fn origins(&self) -> Vec<String> {
        self.origins
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|o| !o.is_empty())
            .map(String::from)
            .collect()
    }
}

/// An IP address, or `localhost`.
fn ip_of(host: &str) -> Result<IpAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(IpAddr::from([127, 0, 0, 1]));
    }
    host.parse().map_err(|_| anyhow::anyhow!("{host:?} is not an IP address (or localhost)"))
}

/// `OLLAMA_HOST` as Ollama reads it: the address part (empty means the
/// default) and the port, when either is given.
fn parse_host(value: &str) -> Result<(Option<IpAddr>, Option<u16>)> {
    let (scheme_port, rest) = match value.split_once("://") {
        Some(("http", rest)) => (Some(80), rest),
        Some(("https", rest)) => (Some(443), rest),
        Some((scheme, _)) => bail!("the scheme {scheme:?} is not http or https"),
        None => (None, value),
    };
    let rest = rest.trim_end_matches('/');
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (addr, after) = v6.split_once(']').context("an IPv6 address needs its closing ']'")?;
        (addr, after.strip_prefix(':'))
    } else if rest.matches(':').count() > 1 {
        (rest, None) // a bare IPv6 address
    } else {
        match rest.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (rest, None),
        }
    };
    let port = match port {
        Some(p) => Some(p.parse::<u16>().map_err(|_| anyhow::anyhow!("the port {p:?} is not a number from 0 to 65535"))?),
        None => scheme_port,
    };
    let host = if host.is_empty() { None } else { Some(ip_of(host)?) };
    Ok((host, port))
}

/// Whether `origin` matches one of `patterns`, as Ollama matches
/// `OLLAMA_ORIGINS`: `*` stands for any text, and a pattern must match the
/// whole origin. The origin is read as a URL first and compared in one
/// spelling (see `guard::BrowserOrigin`), so text a pattern's wildcard would
/// swallow (user information, a path) refuses it instead; `*` alone allows
/// any origin at all, and an origin that is no URL (`null`) only a pattern
/// that is exactly it.
pub fn origin_allowed(origin: &str, patterns: &[String]) -> bool {
    let normal = BrowserOrigin::parse(origin).map(|o| o.to_string());
    patterns.iter().any(|pattern| {
        let pattern = pattern.to_ascii_lowercase();
        match &normal {
            _ if pattern == "*" => true,
            Some(normal) => {
                let exact = BrowserOrigin::parse(&pattern).map(|p| p.to_string());
                exact.as_deref() == Some(normal.as_str()) || wildcard_match(&pattern, normal)
            }
            None => pattern == origin.to_ascii_lowercase(),
        }
    })
}

/// Whether `pattern`, in which each `*` stands for any run of characters
/// (none included), matches all of `text`. Greedy, going back only to the
/// last `*`: time in proportion to the lengths' product at worst.
fn wildcard_match(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    let (mut pi, mut ti) = (0, 0);
    // After the last `*` seen: where the pattern resumes, and where in the text that `*` stops.
    let mut resume: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            pi += 1;
            resume = Some((pi, ti));
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((after_star, star_end)) = resume {
            pi = after_star;
            ti = star_end + 1;
            resume = Some((after_star, star_end + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(host: &str) -> OllamaEnv {
        OllamaEnv { host: Some(host.to_string()), ..OllamaEnv::default() }
    }

    #[test]
    fn ollama_host_is_read_as_ollama_reads_it() {
        let at = |h: &str| env(h).bind_address(None, None).map(|(ip, port)| format!("{ip} {port}")).expect(h);
        assert_eq!(at("0.0.0.0"), "0.0.0.0 11434");
        assert_eq!(at("0.0.0.0:8080"), "0.0.0.0 8080");
        assert_eq!(at(":9000"), "127.0.0.1 9000");
        assert_eq!(at("http://127.0.0.1"), "127.0.0.1 80");
        assert_eq!(at("https://localhost:8443/"), "127.0.0.1 8443");
        assert_eq!(at("[::1]:7000"), "::1 7000");
        assert_eq!(at("::1"), "::1 11434");
        let flags = env("0.0.0.0:8080").bind_address(Some("127.0.0.1"), Some(1234)).expect("flags win");
        assert_eq!(flags, (IpAddr::from([127, 0, 0, 1]), 1234));
        assert_eq!(OllamaEnv::default().bind_address(None, None).expect("default"), (IpAddr::from([127, 0, 0, 1]), 11434));
        for bad in ["example.com", "127.0.0.1:port", "ftp://127.0.0.1", "[::1"] {
            let error = env(bad).bind_address(None, None).expect_err(bad);
            assert!(format!("{error:#}").contains("OLLAMA_HOST"), "{error:#}");
        }
    }

    #[test]
    fn ollama_origins_allow_exact_and_wildcard_origins() {
        let e = OllamaEnv { origins: Some(" https://app.example.com, chrome-extension://* ,".into()), ..OllamaEnv::default() };
        let patterns = e.origins();
        assert_eq!(patterns.len(), 2);
        assert!(origin_allowed("https://app.example.com", &patterns));
        assert!(origin_allowed("HTTPS://App.Example.com:443/", &patterns), "one spelling of the same origin");
        assert!(origin_allowed("chrome-extension://abcdef", &patterns));
        assert!(!origin_allowed("https://evil.example.com", &patterns));
        assert!(!origin_allowed("https://app.example.com.evil", &patterns));
        assert!(!origin_allowed("http://app.example.com", &patterns), "another scheme");
        assert!(origin_allowed("anything", &["*".to_string()]));
        assert!(origin_allowed("null", &["null".to_string()]));
        assert!(!origin_allowed("null", &["n*".to_string()]));
    }

    #[test]
    fn wildcards_match_the_parsed_origin_not_the_header_text() {
        let patterns: Vec<String> = ["http://*.example.com", "app://*", "http://localhost:*"].map(String::from).to_vec();
        for ok in ["http://a.example.com", "http://a.b.example.com", "HTTP://A.Example.Com", "app://bundle", "app://x:9",
                   "http://localhost:3000"] {
            assert!(origin_allowed(ok, &patterns), "{ok} should be allowed");
        }
        for bad in [
            "http://localhost:80@evil.com",
            "http://evil.com@a.example.com",
            "http://x@a.example.com",
            "http://evil.com/.example.com",
            "http://evil.com?.example.com",
            "http://evil.com#.example.com",
            "http://evil.com\\.example.com",
            "http://example.com",
            "https://a.example.com",
            "http://a.example.com.evil.com",
            "http://a.example.com:8080",
            "app://x@evil.com",
            "app://bundle/path",
            "https://app",
            "http://localhost",
            "null",
        ] {
            assert!(!origin_allowed(bad, &patterns), "{bad} should be refused");
        }
    }

    #[test]
    fn wildcards_match_whole_texts() {
        assert!(wildcard_match("a*b*c", "abc") && wildcard_match("a*b*c", "axxbyyc") && wildcard_match("*", ""));
        assert!(wildcard_match("a**", "a") && wildcard_match("*c", "abcbc"));
        assert!(!wildcard_match("a*b*c", "axxbyy") && !wildcard_match("a*c", "acb") && !wildcard_match("", "a"));
        let long = "a".repeat(5000);
        assert!(!wildcard_match(&format!("{}b", "*a".repeat(50)), &long), "a hostile pattern still ends");
    }

    #[test]
    fn num_parallel_comes_from_the_flag_then_the_environment() {
        let e = OllamaEnv { num_parallel: Some("3".into()), ..OllamaEnv::default() };
        assert_eq!(e.num_parallel(None, 4).expect("3"), 3);
        assert_eq!(e.num_parallel(Some(2), 4).expect("2"), 2);
        assert_eq!(OllamaEnv::default().num_parallel(None, 4).expect("default"), 4);
        let zero = OllamaEnv { num_parallel: Some("0".into()), ..OllamaEnv::default() };
        assert_eq!(zero.num_parallel(None, 1).expect("0 is the default"), 1);
        let bad = OllamaEnv { num_parallel: Some("lots".into()), ..OllamaEnv::default() };
        assert!(bad.num_parallel(None, 1).unwrap_err().to_string().contains("OLLAMA_NUM_PARALLEL"));
    }

    #[test]
    fn keep_alive_and_max_loaded_models_come_from_the_flag_then_the_environment() {
        use std::time::Duration;
        let e = OllamaEnv { keep_alive: Some("1h".into()), max_loaded_models: Some("2".into()), ..OllamaEnv::default() };
        assert_eq!(e.keep_alive(None).expect("1h"), super::super::KeepAlive::For(Duration::from_secs(3600)));
        assert_eq!(e.keep_alive(Some("-1")).expect("-1"), super::super::KeepAlive::Forever);
        assert_eq!(e.max_loaded_models(None).expect("2"), 2);
        assert_eq!(e.max_loaded_models(Some(5)).expect("5"), 5);
        let defaults = OllamaEnv::default();
        assert_eq!(defaults.keep_alive(None).expect("default"), super::super::DEFAULT_KEEP_ALIVE);
        let bad = OllamaEnv { keep_alive: Some("soon".into()), max_loaded_models: Some("many".into()), ..OllamaEnv::default() };
        assert!(format!("{:#}", bad.keep_alive(None).expect_err("soon")).contains("OLLAMA_KEEP_ALIVE"));
        assert!(format!("{:#}", bad.max_loaded_models(None).expect_err("many")).contains("OLLAMA_MAX_LOADED_MODELS"));
    }
}
