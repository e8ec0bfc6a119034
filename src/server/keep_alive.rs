//! How long a model stays loaded after its last request, as Ollama reads it:
//! `keep_alive` in a request, `OLLAMA_KEEP_ALIVE` and `serve --keep-alive`.
//! A duration string (`"10m"`, `"1h30m"`, `"30s"`, `"250ms"`), a number of
//! seconds (`300`, `"300"`), zero to unload at once after the request, or
//! anything negative to keep the model loaded for as long as the server runs.

use std::time::Duration;

use serde_json::Value;

/// How long an idle model stays loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAlive {
    /// Unloaded this long after its last request ends (zero: at once).
    For(Duration),
    /// Never unloaded for being idle (another model may still need its memory).
    Forever,
}

/// Ollama's default: five minutes.
pub const DEFAULT_KEEP_ALIVE: KeepAlive = KeepAlive::For(Duration::from_secs(300));

impl Default for KeepAlive {
    fn default() -> Self {
        DEFAULT_KEEP_ALIVE
    }
}

impl KeepAlive {
    /// Reads a duration string or a number of seconds (see the module's comment).
    pub fn parse(text: &str) -> Result<KeepAlive, String> {
        let text = text.trim();
        if let Ok(seconds) = text.parse::<f64>() {
            return KeepAlive::from_seconds(seconds);
        }
        let (negative, units) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text.strip_prefix('+').unwrap_or(text)),
        };
        let seconds = parse_go_duration(units).ok_or_else(|| {
            format!(
                "keep_alive {text:?} is not a duration: use a number of seconds or a duration such as \"30s\", \"10m\" \
                 or \"1h\" (0 unloads at once, a negative value keeps the model loaded)"
            )
        })?;
        KeepAlive::from_seconds(if negative { -seconds } else { seconds })
    }

    /// A request's `keep_alive`: a JSON number of seconds or a string; `null` is absent.
    pub fn from_json(value: Option<&Value>) -> Result<Option<KeepAlive>, String> {
        match value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(seconds) => KeepAlive::from_seconds(seconds).map(Some),
                None => Err(format!("keep_alive {n} is not a number of seconds")),
            },
            Some(Value::String(s)) => KeepAlive::parse(s).map(Some),
            Some(other) => Err(format!("keep_alive must be a duration string or a number of seconds, got {other}")),
        }
    }

    fn from_seconds(seconds: f64) -> Result<KeepAlive, String> {
        if seconds.is_nan() {
            return Err("keep_alive is not a number".to_string());
        }
        if seconds < 0.0 {
            return Ok(KeepAlive::Forever);
        }
        // Anything past a century is forever (and cannot overflow a deadline).
        Ok(Duration::try_from_secs_f64(seconds)
            .ok()
            .filter(|d| d.as_secs() < 100 * 365 * 86_400)
            .map_or(KeepAlive::Forever, KeepAlive::For))
    }

    /// Unload as soon as the request ends.
    pub fn is_zero(&self) -> bool {
        *self == KeepAlive::For(Duration::ZERO)
    }
}

/// Go's `time.ParseDuration` without the sign: one or more decimal numbers,
/// each with a unit (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`). Seconds, or `None`.
fn parse_go_duration(text: &str) -> Option<f64> {
    if text.is_empty() {
        return None;
    }
    let mut rest = text;
    let mut total = 0.0;
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += number * scale;
        rest = &rest[unit_len..];
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn secs(s: u64) -> KeepAlive {
        KeepAlive::For(Duration::from_secs(s))
    }

    #[test]
    fn ollama_durations_and_numbers_are_read() {
        for (text, want) in [
            ("10m", secs(600)),
            ("1h", secs(3600)),
            ("30s", secs(30)),
            ("1h30m", secs(5400)),
            ("300", secs(300)),
            ("0", secs(0)),
            ("0s", secs(0)),
            ("-1", KeepAlive::Forever),
            ("-1m", KeepAlive::Forever),
        ] {
            assert_eq!(KeepAlive::parse(text), Ok(want), "{text}");
        }
        assert_eq!(KeepAlive::parse("250ms"), Ok(KeepAlive::For(Duration::from_millis(250))));
        assert_eq!(KeepAlive::from_json(Some(&json!(45))), Ok(Some(secs(45))));
        assert_eq!(KeepAlive::from_json(Some(&json!(-1))), Ok(Some(KeepAlive::Forever)));
        assert_eq!(KeepAlive::from_json(Some(&json!("5m"))), Ok(Some(secs(300))));
        assert_eq!(KeepAlive::from_json(Some(&Value::Null)), Ok(None));
        assert_eq!(KeepAlive::from_json(None), Ok(None));
        assert!(KeepAlive::parse("1e400").is_ok_and(|k| k == KeepAlive::Forever));
    }

    #[test]
    fn what_is_not_a_duration_is_refused_by_name() {
        for bad in ["", "ten minutes", "5x", "m", "1.2.3s", "NaN"] {
            let error = KeepAlive::parse(bad).expect_err(bad);
            assert!(error.contains("keep_alive"), "{bad}: {error}");
        }
        assert!(KeepAlive::from_json(Some(&json!([1]))).is_err());
        assert!(KeepAlive::from_json(Some(&json!(true))).is_err());
    }
}
