//! OpenAI's Responses API, `POST /v1/responses` (what Codex CLI and
//! LangChain's `use_responses_api` speak), translated to and from
//! [`GenerationRequest`]. Stateless: nothing is stored, so a request carries
//! its whole conversation in `input` and `previous_response_id` is refused.
//!
//! The answer is a list of output items: a `reasoning` item (what a thinking
//! model wrote in `<think>`), a `message` with `output_text`, and a
//! `function_call` per tool call, in the order the model wrote them. Streamed,
//! each item is announced (`response.output_item.added`), filled
//! (`response.reasoning_text.delta`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`) and closed
//! (`response.output_item.done`) between `response.created` and one of
//! `response.completed`, `response.incomplete` or `response.failed`; every
//! event carries a `sequence_number`.

mod output;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::{json_response, OpenAiError};
use super::event_stream::{sse_response, whole_answer};
use super::openai::{max_tokens, sampling_params, unique_hex, unix_now};
use super::tools;
use super::{parse_body, start_generation, streaming, ApiError, AppState, GenerationRequest, OutputConstraint, PromptInput};
use crate::constrain::ConstraintSpec;
use crate::note;
use output::{OutputWriter, Shape};
use crate::tokenizer::ChatTurn;

type Reply = Result<Response, OpenAiError>;

#[derive(Deserialize)]
struct ResponsesBody {
    #[serde(default)]
    model: String,
    input: Option<Value>,
    instructions: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    max_output_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_logprobs: Option<i64>,
    stream: Option<bool>,
    previous_response_id: Option<String>,
    conversation: Option<Value>,
    background: Option<bool>,
    text: Option<TextConfig>,
    reasoning: Option<ReasoningConfig>,
    // An extension many OpenAI-compatible servers accept.
    seed: Option<i64>,
}

#[derive(Deserialize)]
struct TextConfig {
    format: Option<Value>,
}

#[derive(Deserialize)]
struct ReasoningConfig {
    effort: Option<String>,
}

/// `input`, with `instructions` first as the system turn, as chat turns.
fn chat_turns(instructions: Option<Value>, input: Option<Value>) -> Result<Vec<ChatTurn>, ApiError> {
    let mut turns = Vec::new();
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => turns.push(ChatTurn { role: "system".into(), content: s, ..ChatTurn::default() }),
        Some(_) => return Err(ApiError::bad_request("'instructions' must be a string")),
    }
    let items = match input {
        None | Some(Value::Null) => return Err(ApiError::bad_request("'input' is required: a string or a list of items")),
        Some(Value::String(s)) => {
            turns.push(ChatTurn { role: "user".into(), content: s, ..ChatTurn::default() });
            return Ok(turns);
        }
        Some(Value::Array(items)) if items.is_empty() => return Err(ApiError::bad_request("'input' is an empty list")),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::bad_request("'input' must be a string or a list of items")),
    };
    let mut call_ids: Vec<String> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let Some(obj) = item.as_object() else {
            return Err(ApiError::bad_request(format!("input[{i}] must be an object")));
        };
        // A message may leave out its type (`{"role": "user", "content": "..."}`).
        let kind = match obj.get("type") {
            None | Some(Value::Null) => "message",
            Some(Value::String(k)) => k.as_str(),
            Some(_) => return Err(ApiError::bad_request(format!("input[{i}].type must be a string"))),
        };
        match kind {
            "message" => turns.push(message_turn(obj, i)?),
            "function_call" => {
                let call = function_call(obj, i)?;
                call_ids.push(call["id"].as_str().unwrap_or_default().to_string());
                match turns.last_mut() {
                    // Calls after an assistant's text (or its other calls) belong to its turn.
                    Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                    _ => turns.push(ChatTurn { role: "assistant".into(), tool_calls: vec![call], ..ChatTurn::default() }),
                }
            }
            "function_call_output" => {
                let call_id = string_field(obj, "call_id", i)?;
                if !call_ids.contains(&call_id) {
                    return Err(ApiError::bad_request(format!(
                        "input[{i}] is the output of call_id '{call_id}', which answers no function_call earlier in 'input'"
                    )));
                }
                let content = match obj.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts_text(parts, &format!("input[{i}].output"))?,
                    _ => return Err(ApiError::bad_request(format!("input[{i}].output must be a string or a list of parts"))),
                };
                turns.push(ChatTurn { role: "tool".into(), content, tool_call_id: Some(call_id), ..ChatTurn::default() });
            }
            // Chat templates drop the reasoning of earlier turns; what the
            // model thought before is not part of the prompt.
            "reasoning" => {}
            "item_reference" => {
                return Err(ApiError::bad_request(format!(
                    "input[{i}] is an item_reference, but this server keeps no items; send the item itself"
                )))
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "input[{i}].type '{other}' is not supported; send message, function_call, function_call_output or reasoning items"
                )))
            }
        }
    }
    // Every output answers a call (checked above); this names each output's function.
    tools::check_tool_results(&mut turns)?;
    Ok(turns)
}

fn string_field(obj: &Map<String, Value>, field: &str, i: usize) -> Result<String, ApiError> {
    match obj.get(field) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::bad_request(format!("input[{i}].{field} must be a non-empty string"))),
    }
}

/// A `message` item: a role and its text.
fn message_turn(obj: &Map<String, Value>, i: usize) -> Result<ChatTurn, ApiError> {
    let role = match obj.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => "system",
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some(other) => {
            return Err(ApiError::bad_request(format!("input[{i}].role '{other}' is not user, assistant, system or developer")))
        }
        None => return Err(ApiError::bad_request(format!("input[{i}] is a message without a 'role'"))),
    };
    let content = match obj.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts_text(parts, &format!("input[{i}].content"))?,
        Some(_) => return Err(ApiError::bad_request(format!("input[{i}].content must be a string or a list of parts"))),
    };
    Ok(ChatTurn { role: role.into(), content, ..ChatTurn::default() })
}

/// The text of content parts (`input_text`, `output_text`, `refusal`);
/// images, files and audio are refused.
fn parts_text(parts: &[Value], field: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => match part.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                _ => return Err(ApiError::bad_request(format!("{field}[{j}].text must be a string"))),
            },
            Some("refusal") => text.push_str(part.get("refusal").and_then(Value::as_str).unwrap_or_default()),
            Some("input_image") => return Err(ApiError::unsupported("images")),
            Some("input_file") => return Err(ApiError::unsupported("file inputs")),
            Some("input_audio") => return Err(ApiError::unsupported("audio inputs")),
            Some(other) => return Err(ApiError::bad_request(format!("{field}[{j}].type '{other}' is not a text part"))),
            None => return Err(ApiError::bad_request(format!("{field}[{j}] has no 'type'"))),
        }
    }
    Ok(text)
}

/// A `function_call` item as a chat template's tool call (arguments as an object).
fn function_call(obj: &Map<String, Value>, i: usize) -> Result<Value, ApiError> {
    let call_id = string_field(obj, "call_id", i)?;
    let name = string_field(obj, "name", i)?;
    let arguments = match obj.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) if s.trim().is_empty() => json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)
            .ok_or_else(|| ApiError::bad_request(format!("input[{i}].arguments is not a JSON object (as a string)")))?,
        Some(_) => return Err(ApiError::bad_request(format!("input[{i}].arguments must be a string holding a JSON object"))),
    };
    Ok(json!({"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}))
}

/// The function tools in the chat form [`tools::parse_tools`] reads; tools
/// of other types (a hosted `web_search`, Codex's `namespace` or `custom`)
/// are skipped with a note, as this server cannot run them.
fn function_tools(v: Option<Value>) -> Result<Option<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::bad_request("'tools' must be a list")),
    };
    let mut chat = Vec::new();
    for (i, tool) in list.into_iter().enumerate() {
        let Value::Object(mut tool) = tool else {
            return Err(ApiError::bad_request(format!("tools[{i}] must be an object")));
        };
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                note!("/v1/responses: ignoring tools[{i}] of type '{other}': this server runs function tools only");
                continue;
            }
            None => return Err(ApiError::bad_request(format!("tools[{i}] has no 'type'"))),
        }
        match tool.get("name") {
            Some(Value::String(n)) if !n.trim().is_empty() => {}
            _ => return Err(ApiError::bad_request(format!("tools[{i}].name must be a non-empty string"))),
        }
        tool.remove("type");
        // `strict` needs no flag here: calls always follow the schema.
        tool.remove("strict");
        chat.push(json!({"type": "function", "function": tool}));
    }
    Ok(Some(Value::Array(chat)))
}

/// `tool_choice` in the chat form: "auto", "none", "required", or
/// `{"type": "function", "name": ...}`.
fn chat_tool_choice(v: Option<Value>) -> Result<Option<Value>, ApiError> {
    let obj = match v {
        Some(Value::Object(obj)) => obj,
        other => return Ok(other),
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => match obj.get("name").and_then(Value::as_str) {
            Some(name) => Ok(Some(json!({"type": "function", "function": {"name": name}}))),
            None => Err(ApiError::bad_request("tool_choice {\"type\": \"function\"} needs a 'name'")),
        },
        Some("allowed_tools") => Err(ApiError::bad_request(
            "tool_choice 'allowed_tools' is not supported; send only the allowed tools in 'tools'",
        )),
        Some(other) => Err(ApiError::bad_request(format!(
            "tool_choice asks for the '{other}' tool, which this server does not run (it runs function tools only)"
        ))),
        None => Err(ApiError::bad_request("tool_choice must be a string or an object with a 'type'")),
    }
}

/// `text.format`: text, `json_object`, or `json_schema` with its `schema`.
fn text_format(text: Option<TextConfig>) -> Result<Option<OutputConstraint>, ApiError> {
    let Some(format) = text.and_then(|t| t.format).filter(|f| !f.is_null()) else { return Ok(None) };
    let spec = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => ConstraintSpec::JsonObject,
        Some("json_schema") => match format.get("schema") {
            Some(schema @ Value::Object(_)) => ConstraintSpec::JsonSchema(schema.clone()),
            _ => return Err(ApiError::bad_request("text.format.schema must be a JSON schema object")),
        },
        _ => return Err(ApiError::bad_request("text.format.type must be text, json_object or json_schema")),
    };
    Ok(Some(OutputConstraint { spec, field: "text.format" }))
}

/// `reasoning.effort`: "none" turns thinking off, any other level on (for
/// models whose template can; others answer without).
fn reasoning_effort(r: Option<&ReasoningConfig>) -> Result<Option<bool>, ApiError> {
    match r.and_then(|r| r.effort.as_deref()) {
        None => Ok(None),
        Some("none") => Ok(Some(false)),
        Some("minimal" | "low" | "medium" | "high" | "xhigh") => Ok(Some(true)),
        Some(other) => Err(ApiError::bad_request(format!(
            "reasoning.effort '{other}' is not one of none, minimal, low, medium, high, xhigh"
        ))),
    }
}

pub async fn create(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Reply {
    let b: ResponsesBody = parse_body(body)?;
    if b.previous_response_id.as_deref().is_some_and(|id| !id.is_empty()) {
        return Err(ApiError::bad_request(
            "previous_response_id is not supported: this server keeps no responses (as with store: false); send the \
             whole conversation in 'input'",
        )
        .into());
    }
    if b.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(ApiError::bad_request("'conversation' is not supported: this server keeps no conversations; send them in 'input'").into());
    }
    if b.background == Some(true) {
        return Err(ApiError::unsupported("background responses ('background')").into());
    }
    if b.top_logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::unsupported("logprobs ('top_logprobs')").into());
    }
    let echoed_tools = b.tools.clone().unwrap_or(json!([]));
    let echoed_choice = b.tool_choice.clone().unwrap_or(json!("auto"));
    let tools = tools::parse_tools(function_tools(b.tools)?)?;
    let choice = tools::parse_tool_choice(chat_tool_choice(b.tool_choice)?, &tools)?;
    let parallel = b.parallel_tool_calls.unwrap_or(true);
    let format = text_format(b.text)?;
    let echoed_format = match &format {
        Some(OutputConstraint { spec: ConstraintSpec::JsonSchema(schema), .. }) => json!({"type": "json_schema", "schema": schema}),
        Some(_) => json!({"type": "json_object"}),
        None => json!({"type": "text"}),
    };
    let calls = tools::tool_constraint(&tools, &choice, parallel);
    if calls.is_some() && format.is_some() {
        return Err(ApiError::bad_request("'text.format' together with 'tools' is not supported; send one or the other").into());
    }
    let parse_tool_calls = calls.is_some();
    let constraint = calls.map(|spec| OutputConstraint { spec, field: "tools" }).or(format);
    let think = reasoning_effort(b.reasoning.as_ref())?;
    let sampling = sampling_params(b.temperature, b.top_p, b.seed)?;
    let max = max_tokens(b.max_output_tokens, "max_output_tokens")?;
    let instructions = b.instructions.clone().filter(|i| i.is_string()).unwrap_or(Value::Null);
    let turns = chat_turns(b.instructions, b.input)?;
    let shape = Shape {
        id: format!("resp_{}", unique_hex()),
        created_at: unix_now(),
        model: b.model.clone(),
        echo: json!({
            "instructions": instructions,
            "max_output_tokens": max,
            "parallel_tool_calls": parallel,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "tool_choice": echoed_choice,
            "tools": echoed_tools,
            "text": {"format": echoed_format},
            "reasoning": {"effort": b.reasoning.and_then(|r| r.effort), "summary": null},
        }),
    };
    let req = GenerationRequest {
        model: b.model,
        prompt: PromptInput::Chat(turns),
        max_tokens: max,
        max_tokens_is_a_cap: true,
        context_limit: None,
        sampling,
        stop: Vec::new(),
        think,
        think_if_supported: true,
        tools: tools.wire,
        parse_tool_calls,
        constraint,
        keep_alive: None,
    };
    let gen = start_generation(&app, req).await?;
    let mut output = OutputWriter::new(shape);
    if !streaming(b.stream, false) {
        return Ok(json_response(StatusCode::OK, &whole_answer(gen, output).await?));
    }
    output.start();
    Ok(sse_response(gen, output))
}

#[cfg(test)]
mod tests;
