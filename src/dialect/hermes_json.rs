//! Tool calls as Hermes and Qwen chat templates write them: one JSON object
//! per call between tags,
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! The tags are Qwen's for every form it writes (Qwen3-Coder's XML calls go
//! between them too, `qwen3_coder_xml.rs`): this file also writes the grammar
//! of calls between them.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::{lark_string, JsonRule, ToolCall, ToolSpec};

/// Opens a tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Closes it.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// The schema of one call's JSON: its name and its arguments, in that order.
fn call_schema(tools: &[ToolSpec]) -> Result<Value> {
    let mut each = Vec::with_capacity(tools.len());
    for tool in tools {
        if !tool.parameters.is_object() {
            bail!("the parameters of tool '{}' are not a JSON schema (an object)", tool.name);
        }
        each.push(json!({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    match each.len() {
        0 => bail!("no tools to call"),
        1 => Ok(each.remove(0)),
        _ => Ok(json!({"anyOf": each})),
    }
}

/// The `call` rule for calls of `tools` in this form.
pub(super) fn call_rule(tools: &[ToolSpec], json: JsonRule) -> Result<String> {
    Ok(format!("call: {}\n", json(&call_schema(tools)?)?))
}

/// The grammar of tool calls between their tags around `calls` (the `call`
/// rule in the template's form), and its trigger.
pub(super) fn between_tags(calls: &str, forced: bool, parallel: bool) -> (String, Option<String>) {
    let open = lark_string(&format!("{TOOL_CALL_OPEN}\n"));
    let close = lark_string(&format!("\n{TOOL_CALL_CLOSE}"));
    // Triggered, the opening tag is already there when the grammar starts.
    let first = if forced { format!("{open} call {close}") } else { format!("\"\\n\" call {close}") };
    let more = if parallel { format!(" (\"\\n\" {open} call {close})*") } else { String::new() };
    let trigger = (!forced).then(|| TOOL_CALL_OPEN.to_string());
    (format!("start: {first}{more}\n{calls}"), trigger)
}

/// `{"name": ..., "arguments": {...}}`, as the model writes it between the tags.
pub(super) fn parse_call(body: &str) -> Option<ToolCall> {
    #[derive(serde::Deserialize)]
    struct Written<'a> {
        name: String,
        #[serde(borrow)]
        arguments: Option<&'a serde_json::value::RawValue>,
    }
    let written: Written = serde_json::from_str(body.trim()).ok()?;
    let arguments_json = written.arguments.map_or("{}", |raw| raw.get()).to_string();
    let Ok(Value::Object(arguments)) = serde_json::from_str(&arguments_json) else { return None };
    Some(ToolCall { name: written.name, arguments, arguments_json })
}

/// Whether a call's body that does not parse is one cut short (a closing
/// tag inside a string of it, so the call goes on), not a broken one.
pub(super) fn unfinished(body: &str) -> bool {
    serde_json::from_str::<Value>(body).is_err_and(|e| e.is_eof())
}
