//! The output items of a Responses answer and the streamed events that
//! announce (`response.output_item.added`), fill (`*.delta`) and close
//! (`response.output_item.done`) each, numbered by `sequence_number`.

use serde_json::{json, Value};

use crate::generate::FinishReason;
use crate::server::event_stream::EventWriter;
use crate::server::openai::unique_hex;
use crate::dialect::ToolCall;
use crate::server::{Event, Summary};

/// What every response object of one request says besides its output.
pub(super) struct Shape {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    /// The request's settings, as the response repeats them.
    pub echo: Value,
}

impl Shape {
    fn response(&self, status: &str, output: &[Value], usage: Option<Value>, incomplete: Option<&str>, error: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": error,
            "incomplete_details": incomplete.map(|reason| json!({"reason": reason})),
            "previous_response_id": null,
            "store": false,
            "truncation": "disabled",
            "metadata": {},
            "usage": usage,
        });
        if let (Value::Object(v), Value::Object(echo)) = (&mut v, &self.echo) {
            v.extend(echo.clone());
        }
        v
    }
}

/// The output item being written.
enum Open {
    Nothing,
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
}

/// Turns a generation's events into output items and, when streaming, the
/// events that announce and fill them.
pub(super) struct OutputWriter {
    shape: Shape,
    sequence: u64,
    output: Vec<Value>,
    open: Open,
    /// SSE text not yet sent.
    pending: String,
}

fn output_text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

impl OutputWriter {
    pub(super) fn new(shape: Shape) -> OutputWriter {
        OutputWriter { shape, sequence: 0, output: Vec::new(), open: Open::Nothing, pending: String::new() }
    }

    fn emit(&mut self, kind: &str, mut event: Value) {
        event["type"] = kind.into();
        event["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        self.pending.push_str(&format!("event: {kind}\ndata: {event}\n\n"));
    }

    /// `response.created` and `response.in_progress`.
    pub(super) fn start(&mut self) {
        let response = self.shape.response("in_progress", &[], None, None, None);
        self.emit("response.created", json!({"response": response}));
        self.emit("response.in_progress", json!({"response": response}));
    }

    /// Feeds one event; the final response object once the generation is done.
    fn feed(&mut self, ev: Event) -> Option<Value> {
        match ev {
            Event::Delta(d) => {
                if !d.thinking.is_empty() {
                    self.reasoning(&d.thinking);
                }
                if !d.content.is_empty() {
                    self.text(&d.content);
                }
                None
            }
            Event::ToolCall(call) => {
                self.call(call);
                None
            }
            Event::Done(s) => Some(self.done(&s)),
            Event::Failed(e) => {
                self.close("incomplete");
                let error = json!({"code": "server_error", "message": e.message});
                let response = self.shape.response("failed", &self.output, None, None, Some(error));
                self.emit("response.failed", json!({"response": response}));
                None
            }
        }
    }

    fn reasoning(&mut self, delta: &str) {
        if !matches!(self.open, Open::Reasoning { .. }) {
            self.close("completed");
            let id = format!("rs_{}", unique_hex());
            let index = self.output.len();
            let item = json!({"id": id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"});
            self.emit("response.output_item.added", json!({"output_index": index, "item": item}));
            let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": reasoning_part("")});
            self.emit("response.content_part.added", part);
            self.open = Open::Reasoning { id, text: String::new() };
        }
        let index = self.output.len();
        let event = {
            let Open::Reasoning { id, text } = &mut self.open else { return };
            text.push_str(delta);
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta})
        };
        self.emit("response.reasoning_text.delta", event);
    }

    fn text(&mut self, delta: &str) {
        if !matches!(self.open, Open::Message { .. }) {
            self.close("completed");
            let id = format!("msg_{}", unique_hex());
            let index = self.output.len();
            let item = json!({"id": id, "type": "message", "status": "in_progress", "role": "assistant", "content": []});
            self.emit("response.output_item.added", json!({"output_index": index, "item": item}));
            let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text_part("")});
            self.emit("response.content_part.added", part);
            self.open = Open::Message { id, text: String::new() };
        }
        let index = self.output.len();
        let event = {
            let Open::Message { id, text } = &mut self.open else { return };
            text.push_str(delta);
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []})
        };
        self.emit("response.output_text.delta", event);
    }

    fn call(&mut self, call: ToolCall) {
        self.close("completed");
        let hex = unique_hex();
        let (id, call_id) = (format!("fc_{hex}"), format!("call_{hex}"));
        let index = self.output.len();
        let item = |status: &str, arguments: &str| {
            json!({"id": id, "type": "function_call", "status": status, "call_id": call_id, "name": call.name, "arguments": arguments})
        };
        self.emit("response.output_item.added", json!({"output_index": index, "item": item("in_progress", "")}));
        // The whole call is known at once: its arguments go in one delta.
        let arguments = call.arguments_json.as_str();
        self.emit("response.function_call_arguments.delta", json!({"item_id": id, "output_index": index, "delta": arguments}));
        let done = json!({"item_id": id, "output_index": index, "name": call.name, "arguments": arguments});
        self.emit("response.function_call_arguments.done", done);
        let item = item("completed", arguments);
        self.emit("response.output_item.done", json!({"output_index": index, "item": item}));
        self.output.push(item);
    }

    /// Closes the item being written with `status`.
    fn close(&mut self, status: &str) {
        let index = self.output.len();
        let item = match std::mem::replace(&mut self.open, Open::Nothing) {
            Open::Nothing => return,
            Open::Reasoning { id, text } => {
                self.emit("response.reasoning_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}));
                let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": reasoning_part(&text)});
                self.emit("response.content_part.done", part);
                json!({"id": id, "type": "reasoning", "summary": [], "content": [reasoning_part(&text)], "status": status})
            }
            Open::Message { id, text } => {
                let done = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []});
                self.emit("response.output_text.done", done);
                let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text_part(&text)});
                self.emit("response.content_part.done", part);
                json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": [output_text_part(&text)]})
            }
        };
        self.emit("response.output_item.done", json!({"output_index": index, "item": item}));
        self.output.push(item);
    }

    /// Closes the last item and ends the response: completed, incomplete
    /// when the token limit cut it, failed when a shutdown did.
    fn done(&mut self, s: &Summary) -> Value {
        let usage = json!({
            "input_tokens": s.prompt_tokens,
            "input_tokens_details": {"cached_tokens": s.cached_tokens},
            "output_tokens": s.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.prompt_tokens + s.completion_tokens,
        });
        let (kind, response) = match s.finish {
            FinishReason::Stop => {
                self.close("completed");
                ("response.completed", self.shape.response("completed", &self.output, Some(usage), None, None))
            }
            FinishReason::Length => {
                self.close("incomplete");
                let response = self.shape.response("incomplete", &self.output, Some(usage), Some("max_output_tokens"), None);
                ("response.incomplete", response)
            }
            FinishReason::Cancelled => {
                self.close("incomplete");
                let error = json!({"code": "server_error", "message": "the server is shutting down; the answer was cut short"});
                ("response.failed", self.shape.response("failed", &self.output, Some(usage), None, Some(error)))
            }
        };
        self.emit(kind, json!({"response": response}));
        response
    }
}

impl EventWriter for OutputWriter {
    fn event(&mut self, ev: Event) -> Option<Value> {
        self.feed(ev)
    }

    fn take_sse(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}
