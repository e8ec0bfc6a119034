//! The Ollama API: `/api/generate`, `/api/chat` (NDJSON streaming by default)
//! and the metadata endpoints, translated to and from [`GenerationRequest`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{json_response, OllamaError};
use super::keep_alive::KeepAlive;
use super::model_info::rfc3339;
use super::tools::{self, ToolChoice};
use super::{
    bounded_json, parse_body, start_generation, stream_body, streaming, ApiError, AppState, Event, GenerationRequest, OutputConstraint, PromptInput,
    RawJson, Summary, MAX_SCHEMA_FIELD_BYTES, MAX_TOOLS_FIELD_BYTES,
};
use crate::constrain::ConstraintSpec;
use crate::dialect::ToolCall;
use crate::generate::FinishReason;
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatTurn;

type Body = Result<Bytes, BytesRejection>;
type Reply = Result<Response, OllamaError>;

/// `stop` may be one string or a list.
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

/// By hand rather than `#[serde(untagged)]`, whose error serde_json places
/// at the end of the enclosing object, so the field could not be named.
impl<'de> Deserialize<'de> for StringOrList {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Either;
        impl<'de> serde::de::Visitor<'de> for Either {
            type Value = StringOrList;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of strings")
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<StringOrList, E> {
                Ok(StringOrList::One(s.to_string()))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<StringOrList, A::Error> {
                let mut list = Vec::new();
                while let Some(item) = seq.next_element::<String>()? {
                    list.push(item);
                }
                Ok(StringOrList::Many(list))
            }
        }
        deserializer.deserialize_any(Either)
    }
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

/// Ollama `options`. Unknown options are ignored, as Ollama does; a sampler
/// Ollama has and slotstream lacks is refused, never silently skipped.
#[derive(Deserialize, Default)]
struct Options {
    temperature: Option<f32>,
    top_k: Option<i64>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    seed: Option<i64>,
    num_predict: Option<i64>,
    num_ctx: Option<i64>,
    stop: Option<StringOrList>,
    repeat_penalty: Option<f32>,
    repeat_last_n: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    mirostat: Option<i64>,
    typical_p: Option<f32>,
}

/// Sampler and length settings from `options`, with Ollama's defaults.
struct Mapped {
    sampling: SamplingParams,
    max_tokens: Option<usize>,
    context_limit: Option<usize>,
    stop: Vec<String>,
}

fn map_options(o: Option<Options>) -> Result<Mapped, ApiError> {
    let o = o.unwrap_or_default();
    if o.mirostat.is_some_and(|m| m != 0) {
        return Err(ApiError::unsupported("mirostat sampling modes ('mirostat')"));
    }
    if o.typical_p.is_some_and(|p| p != 1.0) {
        return Err(ApiError::unsupported("locally typical sampling ('typical_p' other than 1)"));
    }
    let context_limit = match o.num_ctx {
        None => None,
        Some(n) if n > 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => return Err(ApiError::bad_request(format!("num_ctx must be positive, got {n}"))),
    };
    let max_tokens = match o.num_predict {
        // -1: until the context is full or the model stops; -2: fill the context.
        None | Some(-1) | Some(-2) => None,
        Some(n) if n >= 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => return Err(ApiError::bad_request(format!("num_predict must be -2, -1 or >= 0, got {n}"))),
    };
    let penalty_window = match o.repeat_last_n {
        None => 64,
        Some(-1) => context_limit.unwrap_or(usize::MAX),
        Some(n) if n >= 0 => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => return Err(ApiError::bad_request(format!("repeat_last_n must be -1 or >= 0, got {n}"))),
    };
    let sampling = SamplingParams {
        temperature: o.temperature.unwrap_or(0.8),
        top_k: o.top_k.unwrap_or(40).max(0) as usize,
        top_p: o.top_p.unwrap_or(0.9),
        min_p: o.min_p.unwrap_or(0.0),
        seed: o.seed.and_then(|s| u64::try_from(s).ok()),
        repetition_penalty: o.repeat_penalty.unwrap_or(1.1),
        presence_penalty: o.presence_penalty.unwrap_or(0.0),
        frequency_penalty: o.frequency_penalty.unwrap_or(0.0),
        penalty_window,
    };
    let stop = o.stop.map(StringOrList::into_vec).unwrap_or_default();
    Ok(Mapped { sampling, max_tokens, context_limit, stop })
}

/// `think`: a boolean, or a level ("high", "medium", "low") meaning on.
fn parse_think(v: Option<Value>) -> Result<Option<bool>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(b)),
        Some(Value::String(s)) if matches!(s.as_str(), "high" | "medium" | "low") => Ok(Some(true)),
        Some(other) => Err(ApiError::bad_request(format!("think must be true, false, \"high\", \"medium\" or \"low\", got {other}"))),
    }
}

/// `format`: `"json"` (any JSON object) or a JSON schema.
fn parse_format(format: Option<Value>) -> Result<Option<OutputConstraint>, ApiError> {
    let spec = match format {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s.is_empty() => return Ok(None),
        Some(Value::String(s)) if s == "json" => ConstraintSpec::JsonObject,
        Some(schema @ Value::Object(_)) => ConstraintSpec::JsonSchema(schema),
        Some(other) => {
            return Err(ApiError::bad_request(format!("format must be \"json\" or a JSON schema object, got {other}")))
        }
    };
    Ok(Some(OutputConstraint { spec, field: "format" }))
}

/// Refuses images and logprobs.
fn refuse_unsupported(images: &Option<Value>, logprobs: Option<bool>) -> Result<(), ApiError> {
    if is_present(images) {
        return Err(ApiError::unsupported("images"));
    }
    if logprobs == Some(true) {
        return Err(ApiError::unsupported("logprobs"));
    }
    Ok(())
}

/// A field that is there and not empty (`null`, `[]`, `""` and `{}` count as absent).
pub fn is_present(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

#[derive(Deserialize)]
struct GenerateBody {
    #[serde(default)]
    model: String,
    #[serde(default)]
    prompt: String,
    suffix: Option<String>,
    images: Option<Value>,
    format: RawJson,
    options: Option<Options>,
    system: Option<String>,
    template: Option<String>,
    context: Option<Vec<u32>>,
    stream: Option<bool>,
    #[serde(default)]
    raw: bool,
    think: Option<Value>,
    logprobs: Option<bool>,
    keep_alive: Option<Value>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: String,
    images: Option<Value>,
    tool_calls: Option<Value>,
    /// A tool result's function (Ollama's name for it).
    tool_name: Option<String>,
    /// Accepted as OpenAI spells it too.
    tool_call_id: Option<String>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: String,
    #[serde(default)]
    messages: Vec<Message>,
    tools: RawJson,
    format: RawJson,
    options: Option<Options>,
    stream: Option<bool>,
    think: Option<Value>,
    logprobs: Option<bool>,
    keep_alive: Option<Value>,
}

fn done_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The fields of the final object common to generate and chat.
fn final_fields(obj: &mut serde_json::Map<String, Value>, s: &Summary) {
    obj.insert("done".into(), true.into());
    obj.insert("done_reason".into(), done_reason(s.finish).into());
    obj.insert("total_duration".into(), nanos(s.total).into());
    obj.insert("load_duration".into(), nanos(s.load).into());
    obj.insert("prompt_eval_count".into(), s.prompt_tokens.into());
    obj.insert("prompt_eval_duration".into(), nanos(s.prompt_eval).into());
    obj.insert("eval_count".into(), s.completion_tokens.into());
    obj.insert("eval_duration".into(), nanos(s.eval).into());
}

fn now() -> String {
    rfc3339(SystemTime::now())
}

fn ndjson_response(lines: impl futures_util::Stream<Item = Bytes> + Send + 'static) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/x-ndjson")], stream_body(lines)).into_response()
}

/// Streams a generation as NDJSON, one object per event, built by `object`.
fn stream_ndjson(
    gen: super::GenerationStream,
    object: impl Fn(Event) -> Value + Send + Sync + 'static,
) -> Response {
    let lines = futures_util::stream::unfold((gen, object), |(mut gen, object)| async move {
        let ev = gen.next().await?;
        let line = format!("{}\n", object(ev));
        Some((Bytes::from(line), (gen, object)))
    });
    ndjson_response(lines)
}

/// A request's `keep_alive`, refused with the field's name when it is not one.
fn parse_keep_alive(v: Option<&Value>) -> Result<Option<KeepAlive>, ApiError> {
    KeepAlive::from_json(v).map_err(ApiError::bad_request)
}

/// A request with nothing to generate (an empty prompt, no messages): Ollama
/// loads the model (`done_reason` "load"), or with `keep_alive` 0 unloads it
/// ("unload"). `body` is generate's or chat's final object.
async fn load_or_unload(app: &AppState, model: &str, keep_alive: Option<KeepAlive>, mut body: Value) -> Reply {
    let reason = if keep_alive.is_some_and(|k| k.is_zero()) {
        let (entry, _) = app.find_model(model)?;
        app.residency.unload(&entry.name, "keep_alive 0");
        "unload"
    } else {
        drop(app.lease(model, keep_alive).await?);
        "load"
    };
    body["done_reason"] = reason.into();
    Ok(json_response(StatusCode::OK, &body))
}

/// The internal request for an Ollama generate or chat body.
fn generation_request(
    model: String,
    prompt: PromptInput,
    options: Option<Options>,
    think: Option<bool>,
    constraint: Option<OutputConstraint>,
    keep_alive: Option<KeepAlive>,
) -> Result<GenerationRequest, ApiError> {
    let m = map_options(options)?;
    Ok(GenerationRequest {
        model,
        prompt,
        max_tokens: m.max_tokens,
        max_tokens_is_a_cap: false,
        context_limit: m.context_limit,
        sampling: m.sampling,
        stop: m.stop,
        think,
        think_if_supported: false,
        tools: Vec::new(),
        parse_tool_calls: false,
        constraint,
        keep_alive,
    })
}

/// A call as Ollama writes it: arguments as an object.
fn ollama_call(call: &ToolCall, index: usize) -> Value {
    json!({"function": {"index": index, "name": call.name, "arguments": call.arguments}})
}

pub async fn generate(State(app): State<Arc<AppState>>, body: Body) -> Reply {
    let b: GenerateBody = parse_body(body)?;
    refuse_unsupported(&b.images, b.logprobs)?;
    let format = parse_format(bounded_json(b.format, "format", MAX_SCHEMA_FIELD_BYTES)?)?;
    if b.template.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("custom prompt templates ('template')").into());
    }
    let think = parse_think(b.think)?;
    let keep_alive = parse_keep_alive(b.keep_alive.as_ref())?;
    let model = b.model.clone();
    let context = b.context.unwrap_or_default();
    if b.prompt.is_empty() && context.is_empty() {
        let body = json!({"model": model, "created_at": now(), "response": "", "done": true});
        return load_or_unload(&app, &model, keep_alive, body).await;
    }
    let prompt = match b.suffix.filter(|s| !s.is_empty()) {
        Some(suffix) => PromptInput::Fill { prefix: b.prompt, suffix, context },
        None => PromptInput::Text { text: b.prompt, system: b.system, raw: b.raw, context },
    };
    let req = generation_request(model.clone(), prompt, b.options, think, format, keep_alive)?;
    let gen = start_generation(&app, req).await?;
    let object = move |ev: Event| -> Value {
        let mut obj = serde_json::Map::new();
        obj.insert("model".into(), model.clone().into());
        obj.insert("created_at".into(), now().into());
        match ev {
            // Generate parses no calls; none can arrive.
            Event::ToolCall(_) => {
                obj.insert("response".into(), "".into());
                obj.insert("done".into(), false.into());
            }
            Event::Delta(d) => {
                obj.insert("response".into(), d.content.into());
                if !d.thinking.is_empty() {
                    obj.insert("thinking".into(), d.thinking.into());
                }
                obj.insert("done".into(), false.into());
            }
            Event::Done(s) => {
                obj.insert("response".into(), "".into());
                final_fields(&mut obj, &s);
                obj.insert("context".into(), json!(s.context));
            }
            Event::Failed(e) => return OllamaError(e).body(),
        }
        Value::Object(obj)
    };
    if streaming(b.stream, true) {
        return Ok(stream_ndjson(gen, object));
    }
    let (all, summary) = gen.collect().await?;
    let mut v = object(Event::Done(summary));
    v["response"] = all.content.into();
    if !all.thinking.is_empty() {
        v["thinking"] = all.thinking.into();
    }
    Ok(json_response(StatusCode::OK, &v))
}

pub async fn chat(State(app): State<Arc<AppState>>, body: Body) -> Reply {
    let b: ChatBody = parse_body(body)?;
    refuse_unsupported(&None, b.logprobs)?;
    let format = parse_format(bounded_json(b.format, "format", MAX_SCHEMA_FIELD_BYTES)?)?;
    let tools = tools::parse_tools(bounded_json(b.tools, "tools", MAX_TOOLS_FIELD_BYTES)?)?;
    if format.is_some() && !tools.specs.is_empty() {
        return Err(ApiError::bad_request("'format' together with 'tools' is not supported; send one or the other").into());
    }
    let think = parse_think(b.think)?;
    let keep_alive = parse_keep_alive(b.keep_alive.as_ref())?;
    let mut messages = Vec::with_capacity(b.messages.len());
    for (i, m) in b.messages.into_iter().enumerate() {
        if is_present(&m.images) {
            return Err(ApiError::unsupported("images").into());
        }
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(ApiError::bad_request(format!("messages[{i}].role is '{}'; expected system, user, assistant or tool", m.role)).into());
        }
        let tool_calls = tools::history_calls(m.tool_calls, &format!("messages[{i}].tool_calls"))?;
        if !tool_calls.is_empty() && m.role != "assistant" {
            return Err(ApiError::bad_request(format!("messages[{i}] has tool_calls but is not an assistant message")).into());
        }
        let (tool_call_id, name) = if m.role == "tool" { (m.tool_call_id, m.tool_name) } else { (None, None) };
        messages.push(ChatTurn { role: m.role, content: m.content, tool_calls, tool_call_id, name });
    }
    tools::check_tool_results(&mut messages)?;
    let model = b.model.clone();
    if messages.is_empty() {
        let body = json!({"model": model, "created_at": now(), "message": {"role": "assistant", "content": ""}, "done": true});
        return load_or_unload(&app, &model, keep_alive, body).await;
    }
    // Ollama has no tool_choice: the model decides, and a call it opens is
    // held to its tool's schema.
    let constraint = tools::tool_constraint(&tools, &ToolChoice::Auto, true)
        .map(|spec| OutputConstraint { spec, field: "tools" })
        .or(format);
    let mut req = generation_request(model.clone(), PromptInput::Chat(messages), b.options, think, constraint, keep_alive)?;
    req.parse_tool_calls = !tools.specs.is_empty();
    req.tools = tools.wire;
    let gen = start_generation(&app, req).await?;
    let calls_sent = std::sync::atomic::AtomicUsize::new(0);
    let object = move |ev: Event| -> Value {
        let mut obj = serde_json::Map::new();
        obj.insert("model".into(), model.clone().into());
        obj.insert("created_at".into(), now().into());
        match ev {
            Event::ToolCall(call) => {
                let index = calls_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                obj.insert("message".into(), json!({"role": "assistant", "content": "", "tool_calls": [ollama_call(&call, index)]}));
                obj.insert("done".into(), false.into());
            }
            Event::Delta(d) => {
                let mut message = json!({"role": "assistant", "content": d.content});
                if !d.thinking.is_empty() {
                    message["thinking"] = d.thinking.into();
                }
                obj.insert("message".into(), message);
                obj.insert("done".into(), false.into());
            }
            Event::Done(s) => {
                obj.insert("message".into(), json!({"role": "assistant", "content": ""}));
                final_fields(&mut obj, &s);
            }
            Event::Failed(e) => return OllamaError(e).body(),
        }
        Value::Object(obj)
    };
    if streaming(b.stream, true) {
        return Ok(stream_ndjson(gen, object));
    }
    let (all, summary) = gen.collect().await?;
    let mut v = object(Event::Done(summary));
    v["message"]["content"] = all.content.into();
    if !all.thinking.is_empty() {
        v["message"]["thinking"] = all.thinking.into();
    }
    if !all.tool_calls.is_empty() {
        v["message"]["tool_calls"] = all.tool_calls.iter().enumerate().map(|(i, c)| ollama_call(c, i)).collect();
    }
    Ok(json_response(StatusCode::OK, &v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_map_with_ollama_defaults() {
        let m = map_options(None).expect("defaults map");
        assert_eq!((m.sampling.temperature, m.sampling.top_k, m.sampling.top_p), (0.8, 40, 0.9));
        assert_eq!(m.max_tokens, None);
        let o: Options = serde_json::from_value(json!({"temperature": 0, "num_predict": 5, "stop": ["x"], "seed": 3, "num_thread": 4}))
            .expect("options parse");
        let m = map_options(Some(o)).expect("options map");
        assert_eq!((m.sampling.temperature, m.max_tokens, m.sampling.seed), (0.0, Some(5), Some(3)));
        assert_eq!(m.stop, vec!["x".to_string()]);
        let o: Options = serde_json::from_value(json!({"num_predict": -7})).expect("options parse");
        assert!(map_options(Some(o)).is_err());
    }

    #[test]
    fn a_sampler_ollama_has_and_slotstream_lacks_is_refused() {
        let o: Options = serde_json::from_value(json!({"typical_p": 0.5})).expect("options parse");
        let error = map_options(Some(o)).err().expect("typical_p 0.5 should be refused");
        assert!(error.message.contains("'typical_p' other than 1"), "{}", error.message);
        let o: Options = serde_json::from_value(json!({"typical_p": 1.0, "tfs_z": 1.0})).expect("options parse");
        assert!(map_options(Some(o)).is_ok(), "typical_p 1 is the default, no sampling change");
    }
}
