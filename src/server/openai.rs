//! The OpenAI API: `/v1/chat/completions`, `/v1/completions` (SSE ending in
//! `data: [DONE]` when streaming) and `/v1/models`, translated to and from
//! [`GenerationRequest`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{json_response, OpenAiError};
use super::ollama::{is_present, StringOrList};
use super::tools;
use super::{
    bounded_json, parse_body_parts, start_generation, stream_body, streaming, ApiError, AppState, Event, GenerationRequest, OutputConstraint,
    PromptInput, RawJson, Summary, MAX_SCHEMA_FIELD_BYTES, MAX_TOOLS_FIELD_BYTES,
};
use crate::constrain::ConstraintSpec;
use crate::dialect::ToolCall;
use crate::generate::FinishReason;
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatTurn;

type Body = Result<Bytes, BytesRejection>;
type Reply = Result<Response, OpenAiError>;

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields both endpoints share, read from the body beside the endpoint's
/// own (not `#[serde(flatten)]`, whose errors cannot say which field broke).
#[derive(Deserialize)]
struct Common {
    #[serde(default)]
    model: String,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<StringOrList>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<Value>,
    // Extensions many OpenAI-compatible servers accept.
    top_k: Option<i64>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    messages: Vec<Message>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    tools: RawJson,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    functions: Option<Value>,
    function_call: Option<Value>,
    response_format: RawJson,
    reasoning_effort: Option<String>,
    modalities: Option<Value>,
    audio: Option<Value>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Value>,
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    function_call: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Option<Value>,
    max_tokens: Option<i64>,
    logprobs: Option<Value>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<i64>,
}

/// Checks the shared fields and maps them onto the sampler (OpenAI defaults:
/// temperature 1, top_p 1, no penalties).
fn map_common(c: &mut Common) -> Result<(SamplingParams, Vec<String>), ApiError> {
    match c.n {
        None | Some(1) => {}
        Some(n) if n > 1 => return Err(ApiError::unsupported("multiple choices (n > 1)")),
        Some(n) => return Err(ApiError::bad_request(format!("n must be 1, got {n}"))),
    }
    if is_present(&c.logit_bias) {
        return Err(ApiError::unsupported("logit biases ('logit_bias')"));
    }
    let sampling = SamplingParams {
        top_k: c.top_k.unwrap_or(0).max(0) as usize,
        min_p: c.min_p.unwrap_or(0.0),
        repetition_penalty: c.repeat_penalty.unwrap_or(1.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        ..sampling_params(c.temperature, c.top_p, c.seed)?
    };
    let stop = c.stop.take().map(StringOrList::into_vec).unwrap_or_default();
    Ok((sampling, stop))
}

/// OpenAI's sampler (temperature 1 and top_p 1 unless given), checked.
pub(super) fn sampling_params(temperature: Option<f32>, top_p: Option<f32>, seed: Option<i64>) -> Result<SamplingParams, ApiError> {
    let sampling = SamplingParams {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        seed: seed.map(|s| s as u64),
        ..SamplingParams::default()
    };
    if !(0.0..=2.0).contains(&sampling.temperature) {
        return Err(ApiError::bad_request(format!("temperature must be between 0 and 2, got {}", sampling.temperature)));
    }
    Ok(sampling)
}

pub(super) fn max_tokens(v: Option<i64>, name: &str) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => Err(ApiError::bad_request(format!("{name} must be at least 1, got {n}"))),
    }
}

/// Message content: a string, or a list of parts of which only text is supported.
fn message_text(content: Option<Value>, i: usize) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match part.get("type").and_then(|t| t.as_str()) {
                    Some("text") => text.push_str(part.get("text").and_then(|t| t.as_str()).unwrap_or("")),
                    Some("image_url") | Some("input_image") => return Err(ApiError::unsupported("images")),
                    Some("input_audio") => return Err(ApiError::unsupported("audio inputs")),
                    Some("file") => return Err(ApiError::unsupported("file inputs")),
                    _ => return Err(ApiError::bad_request(format!("messages[{i}].content has a part without a known 'type'"))),
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::bad_request(format!("messages[{i}].content must be a string or a list of parts"))),
    }
}

/// OpenAI's `finish_reason`: "length" whenever the limit cut the
/// generation, calls or not (as OpenAI answers), else "tool_calls" if the
/// model called a tool.
fn finish_reason(f: FinishReason, called: bool) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ if called => "tool_calls",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// `response_format`: text, `json_object`, or `json_schema` with its schema.
fn parse_response_format(rf: Option<Value>) -> Result<Option<OutputConstraint>, ApiError> {
    let Some(rf) = rf.filter(|v| !v.is_null()) else { return Ok(None) };
    let spec = match rf.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => ConstraintSpec::JsonObject,
        Some("json_schema") => match rf.get("json_schema").and_then(|j| j.get("schema")) {
            Some(schema @ Value::Object(_)) => ConstraintSpec::JsonSchema(schema.clone()),
            _ => return Err(ApiError::bad_request("response_format.json_schema.schema must be a JSON schema object")),
        },
        _ => return Err(ApiError::bad_request("response_format.type must be text, json_object or json_schema")),
    };
    Ok(Some(OutputConstraint { spec, field: "response_format" }))
}

/// A call as OpenAI writes it: an id, and arguments as a JSON string.
fn openai_call(call: &ToolCall, id: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}})
}

fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Hex digits no other id of this process has: the time and a counter.
pub(super) fn unique_hex() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("{t:x}{n:04x}")
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", unique_hex())
}

/// Which endpoint a response belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Builds response objects and stream chunks for one request.
struct Shaper {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Tool calls streamed so far.
    calls: usize,
}

impl Shaper {
    fn new(kind: Kind, model: String, include_usage: bool) -> Shaper {
        let id = new_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" });
        Shaper { kind, id, created: unix_now(), model, include_usage, calls: 0 }
    }

    fn call_id(&self, index: usize) -> String {
        format!("call_{}_{index}", self.id.trim_start_matches("chatcmpl-"))
    }

    fn object(&self, streaming: bool) -> &'static str {
        match (self.kind, streaming) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, streaming: bool, choices: Value) -> Value {
        let mut v = json!({
            "id": self.id, "object": self.object(streaming), "created": self.created,
            "model": self.model, "system_fingerprint": "slotstream", "choices": choices,
        });
        if streaming && self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// A stream chunk with one choice carrying `delta` (chat) or `text`.
    fn chunk(&self, content: &str, thinking: &str, role: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if !content.is_empty() || role {
                    delta.insert("content".into(), content.into());
                }
                if !thinking.is_empty() {
                    // Both names: `reasoning` (Ollama, OpenRouter) and
                    // `reasoning_content` (vLLM, DeepSeek, LM Studio, langchain-openai).
                    delta.insert("reasoning".into(), thinking.into());
                    delta.insert("reasoning_content".into(), thinking.into());
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Completion => json!({"index": 0, "text": content, "logprobs": null, "finish_reason": finish}),
        };
        self.envelope(true, json!([choice]))
    }

    /// The SSE text for one event; the stream ends after `Done` or `Failed`.
    fn sse(&mut self, ev: Event) -> String {
        let data = |v: &Value| format!("data: {v}\n\n");
        match ev {
            Event::Delta(d) => data(&self.chunk(&d.content, &d.thinking, false, None)),
            Event::ToolCall(call) => {
                // One delta carries the whole call: clients concatenate
                // `arguments` pieces, and one piece is a valid split.
                let index = self.calls;
                self.calls += 1;
                let mut entry = openai_call(&call, &self.call_id(index));
                entry["index"] = index.into();
                let choice = json!({"index": 0, "delta": {"tool_calls": [entry]}, "logprobs": null, "finish_reason": null});
                data(&self.envelope(true, json!([choice])))
            }
            Event::Done(s) => {
                let mut out = data(&self.chunk("", "", false, Some(finish_reason(s.finish, self.calls > 0))));
                if self.include_usage {
                    let mut last = self.envelope(true, json!([]));
                    last["usage"] = usage(&s);
                    out.push_str(&data(&last));
                }
                out + "data: [DONE]\n\n"
            }
            Event::Failed(e) => data(&OpenAiError(e).body()),
        }
    }

    fn full(&self, answer: super::Answer, s: &Summary) -> Value {
        let called = !answer.tool_calls.is_empty();
        let choice = match self.kind {
            Kind::Chat => {
                let content = if called && answer.content.is_empty() { Value::Null } else { answer.content.into() };
                let mut message = json!({"role": "assistant", "content": content});
                if !answer.thinking.is_empty() {
                    message["reasoning"] = answer.thinking.clone().into();
                    message["reasoning_content"] = answer.thinking.into();
                }
                if called {
                    let calls: Vec<Value> =
                        answer.tool_calls.iter().enumerate().map(|(i, c)| openai_call(c, &self.call_id(i))).collect();
                    message["tool_calls"] = calls.into();
                }
                json!({"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason(s.finish, called)})
            }
            Kind::Completion => {
                json!({"index": 0, "text": answer.content, "logprobs": null, "finish_reason": finish_reason(s.finish, false)})
            }
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage(s);
        v
    }
}

/// Runs the request and answers with SSE or one JSON object.
async fn respond(app: &Arc<AppState>, req: GenerationRequest, shaper: Shaper, stream: bool) -> Reply {
    let gen = start_generation(app, req).await?;
    if !stream {
        let (all, summary) = gen.collect().await?;
        return Ok(json_response(StatusCode::OK, &shaper.full(all, &summary)));
    }
    let opening = (shaper.kind == Kind::Chat).then(|| format!("data: {}\n\n", shaper.chunk("", "", true, None)));
    let events = futures_util::stream::unfold((Some(gen), shaper, opening), |(gen, mut shaper, opening)| async move {
        if let Some(first) = opening {
            return Some((Bytes::from(first), (gen, shaper, None)));
        }
        let mut gen = gen?;
        let ev = gen.next().await?;
        let last = matches!(ev, Event::Done(_) | Event::Failed(_));
        let text = shaper.sse(ev);
        Some((Bytes::from(text), (if last { None } else { Some(gen) }, shaper, None)))
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")],
        stream_body(events),
    )
        .into_response())
}

pub async fn chat_completions(State(app): State<Arc<AppState>>, body: Body) -> Reply {
    let (mut common, mut b): (Common, ChatBody) = parse_body_parts(body)?;
    if is_present(&b.functions) || is_present(&b.function_call) {
        return Err(ApiError::unsupported("legacy functions ('functions', 'function_call'); send 'tools'").into());
    }
    let tools = tools::parse_tools(bounded_json(b.tools.take(), "tools", MAX_TOOLS_FIELD_BYTES)?)?;
    let choice = tools::parse_tool_choice(b.tool_choice.take(), &tools)?;
    if b.logprobs == Some(true) || b.top_logprobs.is_some() {
        return Err(ApiError::unsupported("logprobs").into());
    }
    let format = parse_response_format(bounded_json(b.response_format.take(), "response_format", MAX_SCHEMA_FIELD_BYTES)?)?;
    let calls = tools::tool_constraint(&tools, &choice, b.parallel_tool_calls.unwrap_or(true));
    if calls.is_some() && format.is_some() {
        return Err(ApiError::bad_request("'response_format' together with 'tools' is not supported; send one or the other").into());
    }
    let parse_tool_calls = calls.is_some();
    let constraint = calls.map(|spec| OutputConstraint { spec, field: "tools" }).or(format);
    if is_present(&b.audio) || b.modalities.as_ref().is_some_and(|m| m.as_array().is_none_or(|a| a.iter().any(|x| x != "text"))) {
        return Err(ApiError::unsupported("audio outputs").into());
    }
    let (sampling, stop) = map_common(&mut common)?;
    let think = match b.reasoning_effort.as_deref() {
        None => None,
        Some("none") => Some(false),
        Some("minimal" | "low" | "medium" | "high") => Some(true),
        Some(other) => return Err(ApiError::bad_request(format!("reasoning_effort '{other}' is not one of none, minimal, low, medium, high")).into()),
    };
    let mut messages = Vec::with_capacity(b.messages.len());
    for (i, m) in b.messages.into_iter().enumerate() {
        if is_present(&m.function_call) {
            return Err(ApiError::unsupported("legacy function calls ('function_call'); send 'tool_calls'").into());
        }
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            "function" => return Err(ApiError::unsupported("legacy function messages (role 'function'); send role 'tool'").into()),
            other => {
                return Err(ApiError::bad_request(format!("messages[{i}].role '{other}' is not system, developer, user, assistant or tool")).into())
            }
        };
        let tool_calls = tools::history_calls(m.tool_calls, &format!("messages[{i}].tool_calls"))?;
        if !tool_calls.is_empty() && role != "assistant" {
            return Err(ApiError::bad_request(format!("messages[{i}] has tool_calls but is not an assistant message")).into());
        }
        if role == "tool" && m.tool_call_id.is_none() {
            return Err(ApiError::bad_request(format!("messages[{i}] is a tool result without 'tool_call_id'")).into());
        }
        let tool_call_id = if role == "tool" { m.tool_call_id } else { None };
        messages.push(ChatTurn { role: role.into(), content: message_text(m.content, i)?, tool_calls, tool_call_id, name: None });
    }
    tools::check_tool_results(&mut messages)?;
    if messages.is_empty() {
        return Err(ApiError::bad_request("'messages' must hold at least one message").into());
    }
    // Both are checked, though max_completion_tokens wins: a bad value is never ignored.
    let legacy_max = max_tokens(b.max_tokens, "max_tokens")?;
    let max = max_tokens(b.max_completion_tokens, "max_completion_tokens")?.or(legacy_max);
    let include_usage = common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let shaper = Shaper::new(Kind::Chat, common.model.clone(), include_usage);
    let req = GenerationRequest {
        model: common.model,
        prompt: PromptInput::Chat(messages),
        max_tokens: max,
        max_tokens_is_a_cap: false,
        context_limit: None,
        sampling,
        stop,
        think,
        think_if_supported: false,
        tools: tools.wire,
        parse_tool_calls,
        constraint,
        keep_alive: None,
    };
    respond(&app, req, shaper, streaming(common.stream, false)).await
}

/// The prompt of a completion: a string, a list of one string, a list of
/// token ids, or a list of one list of token ids.
fn completion_prompt(v: Option<Value>) -> Result<PromptInput, ApiError> {
    let text = |s: String| PromptInput::Text { text: s, system: None, raw: true, context: Vec::new() };
    let ids = |a: &[Value]| -> Option<Vec<u32>> { a.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect() };
    match v {
        None | Some(Value::Null) => Err(ApiError::bad_request("'prompt' is required")),
        Some(Value::String(s)) => Ok(text(s)),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] => Ok(text(s.clone())),
            [Value::Array(inner)] => ids(inner).map(PromptInput::Ids).ok_or_else(|| ApiError::bad_request("'prompt' token ids must be non-negative integers")),
            items if !items.is_empty() && items.iter().all(|x| x.is_number()) => {
                ids(items).map(PromptInput::Ids).ok_or_else(|| ApiError::bad_request("'prompt' token ids must be non-negative integers"))
            }
            [] => Err(ApiError::bad_request("'prompt' is empty")),
            _ => Err(ApiError::unsupported("batches of several prompts")),
        },
        Some(_) => Err(ApiError::bad_request("'prompt' must be a string, a list of strings or a list of token ids")),
    }
}

pub async fn completions(State(app): State<Arc<AppState>>, body: Body) -> Reply {
    let (mut common, b): (Common, CompletionBody) = parse_body_parts(body)?;
    if is_present(&b.logprobs) {
        return Err(ApiError::unsupported("logprobs").into());
    }
    if b.echo == Some(true) {
        return Err(ApiError::unsupported("echoed prompts ('echo')").into());
    }
    if b.best_of.is_some_and(|n| n > 1) {
        return Err(ApiError::unsupported("multiple choices (best_of > 1)").into());
    }
    let (sampling, stop) = map_common(&mut common)?;
    let prompt = match (completion_prompt(b.prompt)?, b.suffix.filter(|s| !s.is_empty())) {
        (PromptInput::Text { text, .. }, Some(suffix)) => PromptInput::Fill { prefix: text, suffix, context: Vec::new() },
        (_, Some(_)) => return Err(ApiError::bad_request("'suffix' needs 'prompt' as text, not token ids").into()),
        (prompt, None) => prompt,
    };
    // OpenAI's default for completions is 16 tokens.
    let max = max_tokens(b.max_tokens, "max_tokens")?.unwrap_or(16);
    let include_usage = common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let shaper = Shaper::new(Kind::Completion, common.model.clone(), include_usage);
    let req = GenerationRequest {
        model: common.model,
        prompt,
        max_tokens: Some(max),
        max_tokens_is_a_cap: false,
        context_limit: None,
        sampling,
        stop,
        think: None,
        think_if_supported: false,
        tools: Vec::new(),
        parse_tool_calls: false,
        constraint: None,
        keep_alive: None,
    };
    respond(&app, req, shaper, streaming(common.stream, false)).await
}

fn model_object(m: &super::ModelInfo) -> Value {
    let created = m.modified_at.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    json!({"id": m.name, "object": "model", "created": created, "owned_by": "slotstream"})
}

/// Every model the server answers for, loaded or not.
pub async fn models(State(app): State<Arc<AppState>>) -> Response {
    let data = tokio::task::spawn_blocking(move || {
        app.catalog.entries().iter().filter_map(|e| app.catalog.describe(e)).map(|m| model_object(&m)).collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

pub async fn model(State(app): State<Arc<AppState>>, Path(name): Path<String>) -> Reply {
    let (_, info) = app.find_model(&name)?;
    Ok(json_response(StatusCode::OK, &model_object(&info)))
}

