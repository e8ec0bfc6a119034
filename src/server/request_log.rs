//! One line on stderr per request, once its response has been sent (or its
//! client left): method, path, status, model, tokens and time, e.g.
//! `POST /api/chat 200 slotstream-demo 12+64 tokens (8 reused, stop) 1.234s`;
//! with `--parallel` above 1 a generation adds its decode passes shared
//! with others and, per generated token, what they read of the experts
//! (`[120 of 128 steps batched, 3.8 rows a pass; experts per token: 64.0
//! hits, 0.00 misses, 0.00 MB read]`); a request answered with an error adds its message, so the operator sees
//! why (`POST /v1/chat/completions 400 0.000s: invalid JSON body: ...`).
//!
//! The middleware opens a slot for the request in a task-local; the
//! generation entry point, which runs inside the handler's task, takes the
//! slot and fills in the model and, at the end, the token counts.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};

use super::metrics::Metrics;
use super::{lock, Summary};
use crate::generate::BatchShare;
use crate::note;

tokio::task_local! {
    static CURRENT: RequestLog;
}

/// What a generation adds to its request's line.
#[derive(Clone, Debug, Default)]
struct Details {
    model: Option<String>,
    summary: Option<Summary>,
    /// Its decode steps' passes with other sequences (`--parallel` above 1).
    batched: Option<BatchShare>,
    error: Option<String>,
}

/// A request's slot in the log, shared with its generation thread.
#[derive(Clone, Default)]
pub struct RequestLog(Arc<Mutex<Details>>);

impl RequestLog {
    /// The slot of the request being handled on this task; a detached one
    /// (whose details are dropped) outside a request.
    pub fn current() -> RequestLog {
        CURRENT.try_with(RequestLog::clone).unwrap_or_default()
    }

    pub fn model(&self, model: &str) {
        lock(&self.0).model = Some(model.to_string());
    }

    pub fn finished(&self, summary: &Summary) {
        lock(&self.0).summary = Some(summary.clone());
    }

    /// The generation's share of the decode passes it took part in.
    pub fn batched(&self, share: &BatchShare) {
        lock(&self.0).batched = Some(share.clone());
    }

    /// The message of the error the request is answered with.
    pub fn failed(&self, message: &str) {
        lock(&self.0).error = Some(message.to_string());
    }
}

/// Middleware: runs the request with a fresh slot and logs its line when the
/// response body ends or is dropped.
/// Each request also counts in the HTTP metrics, by its route.
pub(super) async fn log_requests(State(metrics): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let head = format!("{} {}", req.method(), req.uri().path());
    // The route, not the path: paths clients make up would grow the metrics without bound.
    let endpoint = req.extensions().get::<MatchedPath>().map_or("other", MatchedPath::as_str).to_string();
    let log = RequestLog::default();
    let response = CURRENT.scope(log.clone(), next.run(req)).await;
    let status = response.status().as_u16();
    let line = Line { head, status, log, started, endpoint, metrics };
    response.map(|inner| Body::new(LoggedBody { inner, line: Some(line) }))
}

struct Line {
    head: String,
    status: u16,
    log: RequestLog,
    started: Instant,
    endpoint: String,
    metrics: Arc<Metrics>,
}

impl Line {
    /// The line as printed; `complete` is false when the client left before
    /// the body was sent.
    fn render(&self, complete: bool) -> String {
        let details = lock(&self.log.0).clone();
        let mut s = format!("{} {}", self.head, self.status);
        if let Some(model) = &details.model {
            s += &format!(" {model}");
        }
        if let Some(summary) = &details.summary {
            s += &format!(
                " {}+{} tokens ({} reused, {})",
                summary.prompt_tokens,
                summary.completion_tokens,
                summary.cached_tokens,
                format!("{:?}", summary.finish).to_lowercase()
            );
        }
        if let Some(b) = details.batched.as_ref().filter(|b| b.steps > 0) {
            // Per generated token: its passes' expert hits, misses and bytes read, each over the pass's rows.
            let per = |v: f64| v / b.steps as f64;
            s += &format!(
                " [{} of {} steps batched, {:.1} rows a pass; experts per token: {:.1} hits, {:.2} misses, {:.2} MB read]",
                b.shared_steps,
                b.steps,
                b.mean_rows,
                per(b.expert_hits),
                per(b.expert_misses),
                b.bytes_per_token() / 1e6
            );
        }
        s += &format!(" {:.3}s", self.started.elapsed().as_secs_f64());
        if !complete {
            s += " (client left)";
        }
        if let Some(error) = &details.error {
            // One line, and not a whole echoed request.
            let short: String = error.chars().take(200).map(|c| if c.is_control() { ' ' } else { c }).collect();
            let more = if error.chars().count() > 200 { "..." } else { "" };
            s += &format!(": {short}{more}");
        }
        s
    }
}

/// A response body that logs its request's line once.
struct LoggedBody {
    inner: Body,
    line: Option<Line>,
}

impl LoggedBody {
    fn finish(&mut self, complete: bool) {
        if let Some(line) = self.line.take() {
            line.metrics.http(&line.endpoint, line.status, line.started.elapsed());
            note!("{}", line.render(complete));
        }
    }
}

impl http_body::Body for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.finish(true);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        // A body hyper never polled to its end: empty (HEAD, 204) or abandoned.
        let complete = http_body::Body::is_end_stream(&self.inner);
        self.finish(complete);
    }
}
