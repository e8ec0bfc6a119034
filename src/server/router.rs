//! The HTTP routes, and the layers every request passes: request log, Host
//! and length checks, CORS, body limits and timeouts, and errors in the
//! flavour of the API a path belongs to.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post};
use axum::Router;

use super::error::{self, AnthropicError, OllamaError, OpenAiError};
use super::{anthropic, guard, listen, metrics, ollama, ollama_env, ollama_models, openai, pull, request_log, responses};
use super::{ApiError, AppState};

/// Request bodies larger than this get 413.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// CORS: loopback origins and those `OLLAMA_ORIGINS` names are allowed (and
/// preflights answered); any other origin is refused with 403 before the
/// request reaches a handler.
async fn cors(State(extra): State<Arc<Vec<String>>>, req: Request, next: Next) -> Response {
    let origins: Vec<HeaderValue> = req.headers().get_all(header::ORIGIN).iter().cloned().collect();
    let Some(origin) = origins.first().cloned() else { return next.run(req).await };
    // Two origins are no origin: which one the browser meant cannot be known.
    let allowed = origins.len() == 1
        && origin.to_str().is_ok_and(|o| guard::is_loopback_origin(o) || ollama_env::origin_allowed(o, &extra));
    if !allowed {
        let e = ApiError::new(
            StatusCode::FORBIDDEN,
            format!("origin {:?} is not allowed: this server accepts browser requests from loopback origins only", origin),
        );
        return error_for_path(req.uri().path(), e);
    }
    let preflight = req.method() == Method::OPTIONS;
    let request_headers = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    let mut resp = if preflight { StatusCode::NO_CONTENT.into_response() } else { next.run(req).await };
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    if preflight {
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, HEAD, POST, DELETE, OPTIONS"));
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            request_headers.unwrap_or_else(|| HeaderValue::from_static("Authorization, Content-Type")),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    }
    resp
}

/// An error in the flavour of the API the path belongs to.
pub(super) fn error_for_path(path: &str, e: ApiError) -> Response {
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        AnthropicError(e).into_response()
    } else if path.starts_with("/v1/") {
        OpenAiError(e).into_response()
    } else {
        OllamaError(e).into_response()
    }
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    error_for_path(&path, ApiError::new(StatusCode::NOT_FOUND, format!("no endpoint {} {path}", req.method())))
}

/// A known path asked with another method: axum answers an empty 405 (and
/// adds the `Allow` header after this layer); the client gets the reason in
/// its API's error form too.
async fn explain_wrong_method(req: Request, next: Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let response = next.run(req).await;
    if response.status() != StatusCode::METHOD_NOT_ALLOWED {
        return response;
    }
    let message = format!("{method} is not allowed on {path} (the Allow header lists what is)");
    error_for_path(&path, ApiError::new(StatusCode::METHOD_NOT_ALLOWED, message))
}

async fn embeddings_refused(req: Request) -> Response {
    error_for_path(req.uri().path(), ApiError::unsupported("embeddings"))
}

async fn root() -> &'static str {
    "Ollama is running"
}

/// `/health`: the server is up and answering.
async fn health() -> Response {
    error::json_response(StatusCode::OK, &serde_json::json!({"status": "ok"}))
}

/// `/health/ready`: whether it takes requests; 503 once it drains or shuts down.
async fn ready(State(app): State<Arc<AppState>>) -> Response {
    if app.refusing() {
        return error::json_response(StatusCode::SERVICE_UNAVAILABLE, &serde_json::json!({"status": "shutting down"}));
    }
    error::json_response(StatusCode::OK, &serde_json::json!({"status": "ready"}))
}

/// The full router over `app`, served on `bound`.
pub fn router(app: Arc<AppState>, bound: SocketAddr) -> Router {
    let body_timeout = app.options.timeouts.body;
    let origins = Arc::new(app.options.origins.clone());
    Router::new()
        .route("/", get(root))
        .route("/health", get(health))
        .route("/health/ready", get(ready))
        .route("/metrics", get(metrics::metrics))
        .route("/api/version", get(ollama_models::version))
        .route("/api/tags", get(ollama_models::tags))
        .route("/api/ps", get(ollama_models::ps))
        .route("/api/show", post(ollama_models::show))
        .route("/api/pull", post(pull::pull))
        .route("/api/delete", delete(pull::delete).post(pull::delete))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/embed", any(embeddings_refused))
        .route("/api/embeddings", any(embeddings_refused))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        .route("/v1/embeddings", any(embeddings_refused))
        .fallback(not_found)
        .layer(axum::middleware::from_fn(explain_wrong_method))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(body_timeout, listen::read_body_within))
        .layer(axum::middleware::from_fn(guard::check_length))
        .layer(axum::middleware::from_fn_with_state(origins, cors))
        .layer(axum::middleware::from_fn_with_state(bound, guard::check_host))
        .layer(axum::middleware::from_fn_with_state(app.metrics.clone(), request_log::log_requests))
        .with_state(app)
}
