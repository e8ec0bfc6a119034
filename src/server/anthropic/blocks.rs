//! The content blocks of a Messages answer and the streamed events around
//! them: `message_start`, then per block `content_block_start`, its
//! `content_block_delta`s and `content_block_stop`, then `message_delta`
//! (the stop reason and usage) and `message_stop`.

use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::generate::FinishReason;
use crate::server::event_stream::EventWriter;
use crate::server::openai::unique_hex;
use crate::dialect::ToolCall;
use crate::server::{Event, Summary};

/// The block being written.
#[derive(PartialEq)]
enum Open {
    Nothing,
    Thinking,
    Text,
}

/// Turns a generation's events into content blocks and, when streaming,
/// the events that announce and fill them.
pub(super) struct BlockWriter {
    id: String,
    model: String,
    prompt_tokens: usize,
    content: Vec<Value>,
    open: Open,
    /// SSE text not yet sent.
    pending: String,
}

impl BlockWriter {
    pub(super) fn new(model: String, prompt_tokens: usize) -> BlockWriter {
        let id = format!("msg_{}", unique_hex());
        BlockWriter { id, model, prompt_tokens, content: Vec::new(), open: Open::Nothing, pending: String::new() }
    }

    fn emit(&mut self, kind: &str, mut event: Value) {
        event["type"] = kind.into();
        self.pending.push_str(&format!("event: {kind}\ndata: {event}\n\n"));
    }

    fn message(&self, stop_reason: Value, stop_sequence: Value, usage: Value) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": self.content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage,
        })
    }

    pub(super) fn start(&mut self) {
        let usage = json!({"input_tokens": self.prompt_tokens, "output_tokens": 0});
        let message = self.message(Value::Null, Value::Null, usage);
        self.emit("message_start", json!({"message": message}));
        self.emit("ping", json!({}));
    }

    /// Feeds one event; the whole message once the generation is done.
    fn feed(&mut self, ev: Event) -> Option<Value> {
        match ev {
            Event::Delta(d) => {
                if !d.thinking.is_empty() {
                    self.append(Open::Thinking, &d.thinking);
                }
                if !d.content.is_empty() {
                    self.append(Open::Text, &d.content);
                }
                None
            }
            Event::ToolCall(call) => {
                self.tool_use(call);
                None
            }
            Event::Done(s) => Some(self.done(&s)),
            Event::Failed(e) => {
                self.close();
                let kind = if e.status == StatusCode::SERVICE_UNAVAILABLE { "overloaded_error" } else { "api_error" };
                self.emit("error", json!({"error": {"type": kind, "message": e.message}}));
                None
            }
        }
    }

    /// Adds `delta` to the open block of kind `kind`, opening one if needed.
    fn append(&mut self, kind: Open, delta: &str) {
        let (field, delta_type) = if kind == Open::Thinking { ("thinking", "thinking_delta") } else { ("text", "text_delta") };
        if self.open != kind {
            self.close();
            let block = if kind == Open::Thinking { json!({"type": "thinking", "thinking": "", "signature": ""}) } else { json!({"type": "text", "text": ""}) };
            self.emit("content_block_start", json!({"index": self.content.len(), "content_block": block}));
            self.content.push(block);
            self.open = kind;
        }
        let index = self.content.len() - 1;
        if let Some(Value::String(text)) = self.content[index].get_mut(field) {
            text.push_str(delta);
        }
        self.emit("content_block_delta", json!({"index": index, "delta": {"type": delta_type, field: delta}}));
    }

    fn close(&mut self) {
        if self.open != Open::Nothing {
            self.open = Open::Nothing;
            self.emit("content_block_stop", json!({"index": self.content.len() - 1}));
        }
    }

    fn tool_use(&mut self, call: ToolCall) {
        self.close();
        let index = self.content.len();
        let id = format!("toolu_{}", unique_hex());
        let start = json!({"type": "tool_use", "id": id, "name": call.name, "input": {}});
        self.emit("content_block_start", json!({"index": index, "content_block": start}));
        // The whole call is known at once: its input goes in one delta.
        let delta = json!({"type": "input_json_delta", "partial_json": call.arguments_json});
        self.emit("content_block_delta", json!({"index": index, "delta": delta}));
        self.emit("content_block_stop", json!({"index": index}));
        self.content.push(json!({"type": "tool_use", "id": id, "name": call.name, "input": call.arguments}));
    }

    fn done(&mut self, s: &Summary) -> Value {
        self.close();
        let called = self.content.iter().any(|b| b["type"] == "tool_use");
        let stop_reason = match (s.finish, &s.stop_sequence) {
            (FinishReason::Length, _) => "max_tokens",
            _ if called => "tool_use",
            (_, Some(_)) => "stop_sequence",
            _ => "end_turn",
        };
        let stop_sequence = s.stop_sequence.clone().map_or(Value::Null, Value::String);
        let usage = json!({
            "input_tokens": s.prompt_tokens - s.cached_tokens.min(s.prompt_tokens),
            "cache_read_input_tokens": s.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": s.completion_tokens,
        });
        let delta = json!({"stop_reason": stop_reason, "stop_sequence": stop_sequence});
        self.emit("message_delta", json!({"delta": delta, "usage": usage}));
        self.emit("message_stop", json!({}));
        self.message(stop_reason.into(), stop_sequence, usage)
    }
}

impl EventWriter for BlockWriter {
    fn event(&mut self, ev: Event) -> Option<Value> {
        self.feed(ev)
    }

    fn take_sse(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}
