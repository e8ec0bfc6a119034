//! Anthropic's Messages API, `POST /v1/messages` and
//! `/v1/messages/count_tokens` (what Claude Code and the `anthropic` SDKs
//! speak), translated to and from [`GenerationRequest`]. Any `x-api-key` and
//! `anthropic-version` are accepted; errors take Anthropic's shape
//! (`error.rs`).
//!
//! The answer is a list of content blocks: `thinking` (what a thinking model
//! wrote in `<think>`), `text`, and a `tool_use` per tool call. Streamed, a
//! `message_start` opens the message, each block is announced
//! (`content_block_start`), filled (`content_block_delta`: `thinking_delta`,
//! `text_delta`, `input_json_delta`) and closed (`content_block_stop`), and a
//! `message_delta` with the stop reason and a `message_stop` end it.

mod blocks;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{json_response, AnthropicError};
use super::event_stream::{sse_response, whole_answer};
use super::ollama::StringOrList;
use super::tools::{self, ToolChoice};
use super::{count_prompt_tokens, parse_body, start_generation, streaming, ApiError, AppState, GenerationRequest, OutputConstraint, PromptInput};
use crate::constrain::ConstraintSpec;
use crate::note;
use blocks::BlockWriter;
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatTurn;

type Reply = Result<Response, AnthropicError>;

/// The fields both endpoints read: what the prompt is made of.
#[derive(Deserialize)]
struct PromptFields {
    #[serde(default)]
    model: String,
    #[serde(default)]
    messages: Vec<Message>,
    system: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
}

/// The fields only `/v1/messages` reads.
#[derive(Deserialize)]
struct GenerationFields {
    max_tokens: Option<i64>,
    stop_sequences: Option<StringOrList>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    stream: Option<bool>,
    output_config: Option<OutputConfig>,
}

#[derive(Deserialize)]
struct OutputConfig {
    format: Option<Value>,
}

/// `output_config.format`: `{"type": "json_schema", "schema": {...}}`.
fn output_format(config: Option<OutputConfig>) -> Result<Option<OutputConstraint>, ApiError> {
    let Some(format) = config.and_then(|c| c.format).filter(|f| !f.is_null()) else { return Ok(None) };
    match (format.get("type").and_then(Value::as_str), format.get("schema")) {
        (Some("json_schema"), Some(schema @ Value::Object(_))) => {
            Ok(Some(OutputConstraint { spec: ConstraintSpec::JsonSchema(schema.clone()), field: "output_config.format" }))
        }
        _ => Err(ApiError::bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")),
    }
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Value,
}

/// The system prompt: a string or a list of text blocks.
fn system_text(v: Option<Value>) -> Result<Option<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s).filter(|s| !s.is_empty())),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::new();
            for (j, block) in blocks.iter().enumerate() {
                match (block.get("type").and_then(Value::as_str), block.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => texts.push(text),
                    _ => return Err(ApiError::bad_request(format!("system[{j}] must be a text block"))),
                }
            }
            Ok(Some(texts.join("\n")).filter(|s| !s.is_empty()))
        }
        Some(_) => Err(ApiError::bad_request("'system' must be a string or a list of text blocks")),
    }
}

/// The text of a `tool_result`'s content: a string or text blocks.
fn tool_result_text(content: Option<&Value>, field: &str) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (k, block) in blocks.iter().enumerate() {
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => text.push_str(block.get("text").and_then(Value::as_str).unwrap_or_default()),
                    Some("image") => return Err(ApiError::unsupported("images")),
                    _ => return Err(ApiError::bad_request(format!("{field}.content[{k}] must be a text block"))),
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::bad_request(format!("{field}.content must be a string or a list of text blocks"))),
    }
}

/// The conversation as chat turns: a user message's `tool_result` blocks
/// become tool turns (before its text), an assistant's `tool_use` blocks its
/// calls; `thinking` blocks are dropped, as chat templates drop the
/// reasoning of earlier turns.
fn chat_turns(system: Option<String>, messages: Vec<Message>) -> Result<Vec<ChatTurn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("'messages' must hold at least one message"));
    }
    let mut turns = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system {
        turns.push(ChatTurn { role: "system".into(), content: system, ..ChatTurn::default() });
    }
    let mut tool_use_ids: Vec<String> = Vec::new();
    for (i, m) in messages.into_iter().enumerate() {
        // Claude Code sends its reminders as system messages between the turns.
        if !matches!(m.role.as_str(), "user" | "assistant" | "system") {
            return Err(ApiError::bad_request(format!("messages[{i}].role '{}' is not user, assistant or system", m.role)));
        }
        let blocks = match m.content {
            Value::String(s) => {
                turns.push(ChatTurn { role: m.role, content: s, ..ChatTurn::default() });
                continue;
            }
            Value::Array(blocks) => blocks,
            _ => return Err(ApiError::bad_request(format!("messages[{i}].content must be a string or a list of blocks"))),
        };
        let mut turn = ChatTurn { role: m.role.clone(), ..ChatTurn::default() };
        for (j, block) in blocks.iter().enumerate() {
            let field = format!("messages[{i}].content[{j}]");
            match block.get("type").and_then(Value::as_str) {
                Some("text") => match block.get("text") {
                    Some(Value::String(t)) => turn.content.push_str(t),
                    _ => return Err(ApiError::bad_request(format!("{field}.text must be a string"))),
                },
                Some("tool_use") if m.role == "assistant" => {
                    let id = block.get("id").and_then(Value::as_str).filter(|s| !s.is_empty());
                    let name = block.get("name").and_then(Value::as_str).filter(|s| !s.is_empty());
                    let (Some(id), Some(name)) = (id, name) else {
                        return Err(ApiError::bad_request(format!("{field} is a tool_use without 'id' and 'name'")));
                    };
                    let input = match block.get("input") {
                        None | Some(Value::Null) => json!({}),
                        Some(input @ Value::Object(_)) => input.clone(),
                        Some(_) => return Err(ApiError::bad_request(format!("{field}.input must be an object"))),
                    };
                    turn.tool_calls.push(json!({"type": "function", "id": id, "function": {"name": name, "arguments": input}}));
                    tool_use_ids.push(id.to_string());
                }
                Some("tool_result") if m.role == "user" => {
                    let Some(id) = block.get("tool_use_id").and_then(Value::as_str).filter(|s| !s.is_empty()) else {
                        return Err(ApiError::bad_request(format!("{field} is a tool_result without 'tool_use_id'")));
                    };
                    if !tool_use_ids.iter().any(|known| known == id) {
                        return Err(ApiError::bad_request(format!(
                            "{field} is the result of tool_use_id '{id}', which answers no tool_use earlier in 'messages'"
                        )));
                    }
                    let mut content = tool_result_text(block.get("content"), &field)?;
                    if block.get("is_error") == Some(&Value::Bool(true)) {
                        content = format!("Error: {content}");
                    }
                    turns.push(ChatTurn { role: "tool".into(), content, tool_call_id: Some(id.to_string()), ..ChatTurn::default() });
                }
                Some(kind @ ("tool_use" | "tool_result")) => {
                    return Err(ApiError::bad_request(format!("{field} is a {kind} block in a {} message", m.role)))
                }
                Some("thinking" | "redacted_thinking") => {}
                Some("image") => return Err(ApiError::unsupported("images")),
                Some("document") => return Err(ApiError::unsupported("documents")),
                Some(other) => return Err(ApiError::bad_request(format!("{field}.type '{other}' is not supported"))),
                None => return Err(ApiError::bad_request(format!("{field} has no 'type'"))),
            }
        }
        if !turn.content.is_empty() || !turn.tool_calls.is_empty() || turn.role == "assistant" {
            turns.push(turn);
        }
    }
    // Every result answers a call (checked above); this names each result's tool.
    tools::check_tool_results(&mut turns)?;
    Ok(turns)
}

/// Anthropic's `tools` (`{"name", "description", "input_schema"}`) in the
/// chat form [`tools::parse_tools`] reads; server tools (a `type` such as
/// `web_search_20250305`) are skipped with a note.
fn chat_tools(v: Option<Value>) -> Result<Option<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::bad_request("'tools' must be a list")),
    };
    let mut chat = Vec::new();
    for (i, tool) in list.iter().enumerate() {
        let Some(tool) = tool.as_object() else {
            return Err(ApiError::bad_request(format!("tools[{i}] must be an object")));
        };
        match tool.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                note!("/v1/messages: ignoring tools[{i}] of type '{other}': this server runs client tools only");
                continue;
            }
        }
        let name = match tool.get("name") {
            Some(Value::String(n)) if !n.trim().is_empty() => n,
            _ => return Err(ApiError::bad_request(format!("tools[{i}].name must be a non-empty string"))),
        };
        let mut function = json!({"name": name, "parameters": tool.get("input_schema").cloned().unwrap_or(Value::Null)});
        if let Some(description) = tool.get("description") {
            function["description"] = description.clone();
        }
        chat.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(Value::Array(chat)))
}

/// `tool_choice`: `{"type": "auto" | "any" | "tool" | "none"}` (with `name`
/// for "tool"), and whether calls may come several at once.
fn tool_choice(v: Option<Value>, tools: &tools::Tools) -> Result<(ToolChoice, bool), ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok((ToolChoice::Auto, true)) };
    let parallel = v.get("disable_parallel_tool_use") != Some(&Value::Bool(true));
    let chat = match v.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => return Err(ApiError::bad_request("tool_choice {\"type\": \"tool\"} needs a 'name'")),
        },
        _ => return Err(ApiError::bad_request("tool_choice.type must be auto, any, tool or none")),
    };
    let choice = tools::parse_tool_choice(Some(chat), tools).map_err(|e| ApiError::bad_request(e.message.replace("the function", "the tool")))?;
    Ok((choice, parallel))
}

/// `thinking`: `{"type": "enabled", "budget_tokens": n}` turns reasoning on
/// (for models whose template can), `{"type": "disabled"}` off.
fn thinking(v: Option<Value>) -> Result<Option<bool>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    match v.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        _ => Err(ApiError::bad_request("thinking.type must be enabled or disabled")),
    }
}

/// The parts of a request both endpoints share.
struct Prompt {
    model: String,
    turns: Vec<ChatTurn>,
    tools: tools::Tools,
    choice: ToolChoice,
    parallel: bool,
    think: Option<bool>,
    /// What the answer must follow (`output_config.format`), if anything.
    format: Option<OutputConstraint>,
}

fn read_prompt(p: PromptFields) -> Result<Prompt, ApiError> {
    let tools = tools::parse_tools(chat_tools(p.tools)?)?;
    let (choice, parallel) = tool_choice(p.tool_choice, &tools)?;
    let think = thinking(p.thinking)?;
    let turns = chat_turns(system_text(p.system)?, p.messages)?;
    Ok(Prompt { model: p.model, turns, tools, choice, parallel, think, format: None })
}

/// Anthropic's sampler: temperature 1 unless given (0 to 1), top_p and
/// top_k off unless given.
fn sampling(g: &GenerationFields) -> Result<SamplingParams, ApiError> {
    let temperature = g.temperature.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(ApiError::bad_request(format!("temperature must be between 0 and 1, got {temperature}")));
    }
    let top_k = match g.top_k {
        None => 0,
        Some(k) if k >= 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => return Err(ApiError::bad_request(format!("top_k must be at least 0, got {k}"))),
    };
    Ok(SamplingParams { temperature, top_p: g.top_p.unwrap_or(1.0), top_k, ..SamplingParams::default() })
}

fn generation_request(prompt: Prompt, max_tokens: Option<usize>, sampling: SamplingParams, stop: Vec<String>) -> GenerationRequest {
    let calls = tools::tool_constraint(&prompt.tools, &prompt.choice, prompt.parallel);
    let format = prompt.format;
    GenerationRequest {
        model: prompt.model,
        prompt: PromptInput::Chat(prompt.turns),
        max_tokens,
        max_tokens_is_a_cap: true,
        context_limit: None,
        sampling,
        stop,
        think: prompt.think,
        think_if_supported: true,
        parse_tool_calls: calls.is_some(),
        tools: prompt.tools.wire,
        constraint: calls.map(|spec| OutputConstraint { spec, field: "tools" }).or(format),
        keep_alive: None,
    }
}

pub async fn messages(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Reply {
    let (p, g): (PromptFields, GenerationFields) = super::parse_body_parts(body)?;
    let max_tokens = match g.max_tokens {
        Some(n) if n >= 1 => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => return Err(ApiError::bad_request(format!("max_tokens must be at least 1, got {n}")).into()),
        None => return Err(ApiError::bad_request("'max_tokens' is required").into()),
    };
    let sampling = sampling(&g)?;
    let stop = g.stop_sequences.map(StringOrList::into_vec).unwrap_or_default();
    let mut prompt = read_prompt(p)?;
    prompt.format = output_format(g.output_config)?;
    if prompt.format.is_some() && tools::tool_constraint(&prompt.tools, &prompt.choice, prompt.parallel).is_some() {
        return Err(ApiError::bad_request("'output_config.format' together with 'tools' is not supported; send one or the other").into());
    }
    let model = prompt.model.clone();
    let req = generation_request(prompt, Some(max_tokens), sampling, stop);
    let gen = start_generation(&app, req).await?;
    let mut blocks = BlockWriter::new(model, gen.prompt_tokens());
    if !streaming(g.stream, false) {
        return Ok(json_response(StatusCode::OK, &whole_answer(gen, blocks).await?));
    }
    blocks.start();
    Ok(sse_response(gen, blocks))
}

pub async fn count_tokens(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Reply {
    let p: PromptFields = parse_body(body)?;
    let prompt = read_prompt(p)?;
    let req = generation_request(prompt, None, SamplingParams::default(), Vec::new());
    let input_tokens = count_prompt_tokens(&app, req).await?;
    Ok(json_response(StatusCode::OK, &json!({"input_tokens": input_tokens})))
}

#[cfg(test)]
mod tests;
