//! A generation's events written as one API's server-sent events, or
//! gathered into its one JSON answer: the loop the Responses and Messages
//! front ends share, each with its own [`EventWriter`].

use axum::body::Bytes;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::{stream_body, ApiError, Event, GenerationStream};

/// Turns a generation's events into an API's answer and its SSE events.
pub(super) trait EventWriter: Send + 'static {
    /// Feeds one event; the whole answer once the generation is done.
    fn event(&mut self, ev: Event) -> Option<Value>;
    /// The SSE text (`event:` and `data:` lines) written since the last call.
    fn take_sse(&mut self) -> String;
}

/// The whole answer, once the generation is done; a generation that failed
/// answers its error.
pub(super) async fn whole_answer(mut gen: GenerationStream, mut writer: impl EventWriter) -> Result<Value, ApiError> {
    while let Some(ev) = gen.next().await {
        if let Event::Failed(e) = ev {
            return Err(e);
        }
        if let Some(done) = writer.event(ev) {
            return Ok(done);
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

/// An SSE response: what `writer` already holds, then the events of `gen`
/// as they come, until its last.
pub(super) fn sse_response(gen: GenerationStream, writer: impl EventWriter) -> Response {
    let events = futures_util::stream::unfold((Some(gen), writer), |(gen, mut writer)| async move {
        let ready = writer.take_sse();
        if !ready.is_empty() {
            return Some((Bytes::from(ready), (gen, writer)));
        }
        let mut gen = gen?;
        let ev = gen.next().await?;
        let last = matches!(ev, Event::Done(_) | Event::Failed(_));
        writer.event(ev);
        Some((Bytes::from(writer.take_sse()), (if last { None } else { Some(gen) }, writer)))
    });
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], stream_body(events))
        .into_response()
}
