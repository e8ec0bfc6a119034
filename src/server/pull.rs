//! `/api/pull` and `/api/delete`: models pulled through our verified
//! downloader (`crate::pull`) with Ollama's progress stream, and removed from
//! the hub cache again. A pull runs on a thread of its own, so generation
//! goes on meanwhile; one pull per repository at a time, a few at once. A
//! pull whose client leaves stops, as Ollama's does: its partial files stay,
//! and the next pull of the model resumes from them.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::catalog::Origin;
use super::error::{json_response, OllamaError};
use super::{lock, parse_body, stream_body, streaming, ApiError, AppState};
use crate::note;
use crate::pull::{PullEvent, PullObserver};

type Reply = Result<Response, OllamaError>;

/// Pulls that may run at once (each uses its own connections and a thread).
pub const MAX_PULLS: usize = 2;

/// The longest name a pull may ask for (the hub's repository names are 96
/// characters at most; a revision adds a few dozen).
const MAX_NAME_BYTES: usize = 256;

/// The repositories being pulled into.
#[derive(Default)]
pub struct PullsInProgress(Mutex<HashSet<String>>);

/// A pull's place in [`PullsInProgress`], given back when dropped.
struct PullSlot(Arc<PullsInProgress>, String);

impl Drop for PullSlot {
    fn drop(&mut self) {
        lock(&self.0 .0).remove(&self.1);
    }
}

impl PullsInProgress {
    fn start(self: &Arc<Self>, repo: &str) -> Result<PullSlot, ApiError> {
        let mut pulling = lock(&self.0);
        if pulling.contains(repo) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("{repo} is being pulled already; wait for that pull to finish"),
            ));
        }
        if pulling.len() >= MAX_PULLS {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{MAX_PULLS} pulls are running already; retry when one has finished"),
            ));
        }
        pulling.insert(repo.to_string());
        Ok(PullSlot(self.clone(), repo.to_string()))
    }

    fn contains(&self, repo: &str) -> bool {
        lock(&self.0).contains(repo)
    }
}

/// How `slotstream pull` spells the model a request names: a known name,
/// `hf:ORG/NAME[@REV]`, or `ORG/NAME[@REV]` (what `/api/tags` lists), with
/// an optional `:latest`. The spelling is checked, never used as a path.
fn pull_spec(requested: &str) -> Result<String, ApiError> {
    let requested = requested.trim();
    let requested = requested.strip_suffix(":latest").unwrap_or(requested);
    if requested.len() > MAX_NAME_BYTES {
        return Err(ApiError::bad_request(format!(
            "'model' is {} bytes long; a model name or Hugging Face repository (ORG/NAME[@REVISION]) is at most {MAX_NAME_BYTES}",
            requested.len()
        )));
    }
    if requested.is_empty() {
        return Err(ApiError::bad_request("'model' is required: a known model name or a Hugging Face repository, ORG/NAME"));
    }
    let spec = if requested.contains('/') && !requested.starts_with("hf:") {
        format!("hf:{requested}")
    } else {
        requested.to_string()
    };
    crate::pull::check_spec(&spec).map_err(|e| ApiError::bad_request(format!("cannot pull {requested:?}: {e:#}")))?;
    Ok(spec)
}

/// The repository a spec writes into: the name before any `@revision`.
fn repo_of(spec: &str) -> String {
    let name = crate::pull::client_name(spec);
    name.split('@').next().unwrap_or(&name).to_string()
}

/// Turns pull events into Ollama's progress objects on a channel; never
/// blocks the download threads (a client that reads slowly misses some
/// intermediate counts, never the end).
struct ProgressLines(mpsc::Sender<Value>, Arc<AppState>);

impl PullObserver for ProgressLines {
    fn event(&self, event: PullEvent) {
        let line = match event {
            PullEvent::Manifest => json!({"status": "pulling manifest"}),
            PullEvent::File { path, digest, total, completed } => {
                json!({"status": format!("downloading {path}"), "digest": digest, "total": total, "completed": completed})
            }
            PullEvent::Verifying { path } => json!({"status": "verifying sha256 digest", "file": path}),
        };
        let _ = self.0.try_send(line);
    }

    /// The client has gone once nobody reads the lines: a streamed response
    /// whose connection closed, or a waiting handler that was dropped. A
    /// shutdown stops the pull too (its partial files stay, to resume from).
    fn cancelled(&self) -> bool {
        self.0.is_closed() || self.1.stopping()
    }
}

/// The HTTP status a failed pull's last line carries to the handler (left
/// out of the streamed lines).
const STATUS_KEY: &str = "http_status";

#[derive(Deserialize)]
struct PullBody {
    model: Option<String>,
    name: Option<String>,
    stream: Option<bool>,
}

pub async fn pull(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Reply {
    let b: PullBody = parse_body(body)?;
    let Some(source) = app.options.pulls.clone() else {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "this server does not pull models").into());
    };
    let spec = pull_spec(b.model.as_deref().or(b.name.as_deref()).unwrap_or_default())?;
    let repo = repo_of(&spec);
    let slot = app.pulls.start(&repo)?;
    let (tx, mut rx) = mpsc::channel::<Value>(256);
    let stopping = app.clone();
    std::thread::Builder::new()
        .name(format!("pull {repo}"))
        .spawn(move || {
            note!("pulling {spec}");
            let observer = Arc::new(ProgressLines(tx.clone(), stopping.clone()));
            let last = match crate::pull::pull_model(&source, &spec, observer) {
                Ok(dir) => {
                    note!("pulled {spec} into {}", dir.display());
                    json!({"status": "success"})
                }
                Err(e) => {
                    note!("pulling {spec} failed: {e:#}");
                    // The hub's refusal is the client's error (no such
                    // repository, or a gated one); anything else the server's.
                    let status = match e.downcast_ref::<crate::pull::HubRefused>().map(|r| r.status) {
                        _ if stopping.stopping() => StatusCode::SERVICE_UNAVAILABLE.as_u16(),
                        Some(404) => StatusCode::NOT_FOUND.as_u16(),
                        Some(_) => StatusCode::FORBIDDEN.as_u16(),
                        None => StatusCode::INTERNAL_SERVER_ERROR.as_u16(),
                    };
                    let error = match stopping.stopping() {
                        true => format!("pulling {spec} stopped: the server is shutting down (the next pull resumes it)"),
                        false => format!("pulling {spec}: {e:#}"),
                    };
                    json!({"error": error, STATUS_KEY: status})
                }
            };
            // The pull has ended before its client hears so: a delete sent
            // on the answer must not find it still running.
            drop(slot);
            let _ = tx.blocking_send(last);
        })
        .map_err(|e| ApiError::internal(format!("starting the pull: {e}")))?;
    if streaming(b.stream, true) {
        let lines = futures_util::stream::unfold(rx, |mut rx| async move {
            let mut line = rx.recv().await?;
            if let Some(fields) = line.as_object_mut() {
                fields.remove(STATUS_KEY);
            }
            Some((Bytes::from(format!("{line}\n")), rx))
        });
        return Ok((StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")], stream_body(lines))
            .into_response());
    }
    while let Some(line) = rx.recv().await {
        if line.get("status").and_then(Value::as_str) == Some("success") {
            return Ok(json_response(StatusCode::OK, &line));
        }
        if let Some(error) = line.get("error").and_then(Value::as_str) {
            let status = line.get(STATUS_KEY).and_then(Value::as_u64).and_then(|s| StatusCode::from_u16(s as u16).ok());
            return Err(ApiError::new(status.unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), error.to_string()).into());
        }
    }
    Err(ApiError::internal("the pull stopped without a result").into())
}

#[derive(Deserialize)]
struct DeleteBody {
    model: Option<String>,
    name: Option<String>,
}

/// Removes a pulled model from the hub cache (unloading it first); a
/// `--model` directory is never deleted.
pub async fn delete(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Reply {
    let b: DeleteBody = parse_body(body)?;
    let requested = b.model.or(b.name).unwrap_or_default();
    if requested.trim().is_empty() {
        return Err(ApiError::bad_request("'model' is required").into());
    }
    let entry = app
        .catalog
        .find(&requested)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("model '{requested}' not found")))?;
    let Origin::Pulled { spec } = entry.origin.clone() else {
        return Err(ApiError::bad_request(format!(
            "'{}' is served from the directory {} given with --model; slotstream deletes only models it pulled",
            entry.name,
            entry.dir.display()
        ))
        .into());
    };
    if app.pulls.contains(&repo_of(&spec)) {
        return Err(ApiError::new(StatusCode::CONFLICT, format!("'{}' is being pulled; delete it when the pull ends", entry.name)).into());
    }
    if !app.residency.unload(&entry.name, "to delete it") {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("'{}' is in use; it is unloaded when its requests end, delete it then", entry.name),
        )
        .into());
    }
    let Some(root) = app.catalog.hub_cache().map(|r| r.to_path_buf()) else {
        return Err(ApiError::internal("this server has no model cache").into());
    };
    let model = crate::pull::InstalledModel { name: entry.name.clone(), spec, dir: entry.dir.clone() };
    tokio::task::spawn_blocking(move || crate::pull::delete_installed(&root, &model))
        .await
        .map_err(|e| ApiError::internal(format!("deleting stopped: {e}")))?
        .map_err(|e| ApiError::internal(format!("deleting '{}': {e:#}", entry.name)))?;
    app.catalog.forget(&entry.dir);
    note!("deleted {} ({})", entry.name, entry.dir.display());
    Ok(StatusCode::OK.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_names_are_checked_and_never_paths() {
        assert_eq!(pull_spec("org/name").ok().as_deref(), Some("hf:org/name"));
        assert_eq!(pull_spec("hf:org/name@v1").ok().as_deref(), Some("hf:org/name@v1"));
        assert_eq!(pull_spec("org/name:latest").ok().as_deref(), Some("hf:org/name"));
        for bad in ["", "../../etc", "/etc/passwd", "org/../x", "org/name@../../x", "llama3", "a/b/c"] {
            let error = pull_spec(bad).expect_err(bad);
            assert_eq!(error.status, StatusCode::BAD_REQUEST, "{bad}");
        }
        assert_eq!(repo_of("hf:org/name@v1"), "org/name");
        let long = format!("org/{}", "n".repeat(10_000));
        let error = pull_spec(&long).expect_err("a name longer than any file name");
        assert_eq!(error.status, StatusCode::BAD_REQUEST);
        assert!(error.message.contains("at most 256"), "{}", error.message);
    }

    #[test]
    fn one_pull_per_repository_and_a_few_at_once() {
        let pulls = Arc::new(PullsInProgress::default());
        let first = pulls.start("org/a").expect("the first pull");
        assert_eq!(pulls.start("org/a").err().map(|e| e.status), Some(StatusCode::CONFLICT));
        let _second = pulls.start("org/b").expect("another repository");
        assert_eq!(pulls.start("org/c").err().map(|e| e.status), Some(StatusCode::SERVICE_UNAVAILABLE));
        drop(first);
        assert!(pulls.start("org/a").is_ok(), "the slot is given back");
    }
}
