//! Errors a request can end in, and how each API flavour writes them.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::request_log::RequestLog;

/// What went wrong, with the status it answers.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into() }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// A feature this server refuses rather than silently ignores.
    pub fn unsupported(feature: &str) -> ApiError {
        if feature == "images" {
            return ApiError::bad_request(
                "images are not supported by slotstream: it runs the text model only (a checkpoint's vision tower is \
                 skipped); remove them from the request",
            );
        }
        ApiError::bad_request(format!("{feature} are not supported by slotstream; remove them from the request"))
    }

    pub fn model_not_found(name: &str, served: &[String]) -> ApiError {
        let message = match served {
            [] => format!("model '{name}' not found; this server has no models yet (pull one with /api/pull)"),
            names => format!("model '{name}' not found; this server has {}", names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")),
        };
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// The body could not be parsed as the endpoint's JSON; a value of the
    /// wrong type or a missing field is named by its path (`messages[0].content`).
    pub fn invalid_json(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
        let path = e.path().to_string();
        let inner = e.into_inner();
        // A syntax error, or one about the whole body, has no field to name.
        if path == "." || inner.classify() != serde_json::error::Category::Data {
            ApiError::bad_request(format!("invalid JSON body: {inner}"))
        } else {
            ApiError::bad_request(format!("invalid JSON body: {path}: {inner}"))
        }
    }
}

/// Ollama writes errors as `{"error": "message"}`.
pub struct OllamaError(pub ApiError);

/// OpenAI writes errors as `{"error": {"message", "type", "param", "code"}}`.
pub struct OpenAiError(pub ApiError);

/// Anthropic writes errors as `{"type": "error", "error": {"type", "message"}}`.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl AnthropicError {
    pub fn body(&self) -> serde_json::Value {
        let kind = match self.0.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        };
        serde_json::json!({ "type": "error", "error": { "type": kind, "message": self.0.message } })
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        RequestLog::current().failed(&self.0.message);
        json_response(self.0.status, &self.body())
    }
}

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        OllamaError(e)
    }
}

impl From<ApiError> for OpenAiError {
    fn from(e: ApiError) -> Self {
        OpenAiError(e)
    }
}

pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json; charset=utf-8")], body.to_string()).into_response()
}

impl OllamaError {
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": self.0.message })
    }
}

impl OpenAiError {
    pub fn body(&self) -> serde_json::Value {
        let kind = match self.0.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "server_busy",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        serde_json::json!({ "error": { "message": self.0.message, "type": kind, "param": null, "code": null } })
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        RequestLog::current().failed(&self.0.message);
        json_response(self.0.status, &self.body())
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        RequestLog::current().failed(&self.0.message);
        json_response(self.0.status, &self.body())
    }
}
