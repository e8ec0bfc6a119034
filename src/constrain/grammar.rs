//! What a request may constrain its output to, written as the Lark grammar
//! llguidance compiles (JSON schemas embedded with `%json`).

use anyhow::{bail, Result};
use serde_json::{json, Value};

pub use crate::tokenizer::ToolCallForm;

/// Opens a tool call in the Hermes / Qwen chat format.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Closes it.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// One function the model may call: its name and its arguments' JSON schema.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
}

/// What the output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object (JSON mode).
    JsonObject,
    /// A JSON value that validates against this schema.
    JsonSchema(Value),
    /// Calls of `tools` between `<tool_call>` tags, written in `form`: the
    /// Hermes / Qwen JSON (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`)
    /// or Qwen3-Coder's XML (`<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>`).
    /// `forced`: the output starts with a call; otherwise it is free until the
    /// model opens one, and from there the call must parse. `parallel`: more
    /// calls may follow the first.
    ToolCalls { tools: Vec<ToolSpec>, forced: bool, parallel: bool, form: ToolCallForm },
}

impl ConstraintSpec {
    /// This constraint with its tool calls written in the form the model's
    /// chat template uses (`None`: the template has no tool calls, and the
    /// request is refused before any grammar is built).
    pub fn in_form(&self, template_form: Option<ToolCallForm>) -> ConstraintSpec {
        match (self, template_form) {
            (ConstraintSpec::ToolCalls { tools, forced, parallel, .. }, Some(form)) => {
                ConstraintSpec::ToolCalls { tools: tools.clone(), forced: *forced, parallel: *parallel, form }
            }
            _ => self.clone(),
        }
    }
}

/// How JSON is written: compact separators as Python's `json.dumps` writes
/// them (as chat templates render earlier calls), no free whitespace (a
/// small model could otherwise spend its tokens on blanks).
fn json_style() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The schema with the JSON style attached.
pub(super) fn styled(schema: &Value) -> Result<Value> {
    let mut schema = match schema {
        Value::Bool(true) => json!({}),
        Value::Object(_) => schema.clone(),
        _ => bail!("a JSON schema must be an object"),
    };
    bounded_integers(&mut schema);
    if let Some(obj) = schema.as_object_mut() {
        obj.insert("x-guidance".into(), json_style());
    }
    Ok(schema)
}

/// The largest integer every JSON parser reads exactly (2^53 - 1).
const SAFE_INTEGER: i64 = (1 << 53) - 1;

/// An integer the schema leaves unbounded is held to +-(2^53 - 1), here and
/// in nested schemas: at most 16 digits, where a weak model could otherwise
/// write digits until its tokens run out (llama.cpp's JSON grammars cap
/// them likewise). Bounds a schema sets stay as written.
fn bounded_integers(schema: &mut Value) {
    each_schema(schema, &mut |obj| {
        let integer = match obj.get("type") {
            Some(Value::String(t)) => t == "integer",
            Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
            _ => false,
        };
        if !integer {
            return;
        }
        // The bound of `keys` the schema sets, if any.
        let set = |keys: [&str; 2]| keys.iter().find_map(|k| obj.get(*k)).map(|v| v.as_f64().unwrap_or(f64::NAN));
        let (low, high) = (set(["minimum", "exclusiveMinimum"]), set(["maximum", "exclusiveMaximum"]));
        // A bound added never contradicts the other one the schema sets.
        if low.is_none() && high.is_none_or(|h| h >= -SAFE_INTEGER as f64) {
            obj.insert("minimum".into(), (-SAFE_INTEGER).into());
        }
        if high.is_none() && low.is_none_or(|l| l <= SAFE_INTEGER as f64) {
            obj.insert("maximum".into(), SAFE_INTEGER.into());
        }
    });
}

/// Calls `f` on every object of `schema` and of the schemas nested in it
/// (not on data a schema holds: `const`, `enum`, `default`, `examples`).
fn each_schema(schema: &mut Value, f: &mut impl FnMut(&mut serde_json::Map<String, Value>)) {
    match schema {
        Value::Object(obj) => {
            f(obj);
            for (key, child) in obj.iter_mut() {
                if !matches!(key.as_str(), "const" | "enum" | "default" | "examples") {
                    each_schema(child, f);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| each_schema(item, f)),
        _ => {}
    }
}

/// An object schema that lists `properties` and says nothing of others gets
/// `additionalProperties: false`, here and in nested objects: a call's
/// arguments carry only the parameters its tool declares, and a response
/// only the keys its schema lists (as llama.cpp's schema grammars read a
/// schema). The output still validates against the schema as given; it just
/// never invents keys (which a small model otherwise does, until its tokens
/// run out).
pub(super) fn declared_only(schema: &mut Value) {
    each_schema(schema, &mut |obj| {
        let open = obj.contains_key("properties")
            && !obj.contains_key("additionalProperties")
            && !obj.contains_key("patternProperties")
            && !obj.contains_key("unevaluatedProperties");
        if open {
            obj.insert("additionalProperties".into(), false.into());
        }
    });
}

/// The schema of one call's JSON: its name and its arguments, in that order.
fn call_schema(tools: &[ToolSpec]) -> Result<Value> {
    let mut each = Vec::with_capacity(tools.len());
    for tool in tools {
        if !tool.parameters.is_object() {
            bail!("the parameters of tool '{}' are not a JSON schema (an object)", tool.name);
        }
        let mut arguments = tool.parameters.clone();
        declared_only(&mut arguments);
        each.push(json!({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments},
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

/// A rule's body for JSON following `schema`.
pub(super) fn json_rule(schema: &Value) -> Result<String> {
    Ok(format!("%json {}", styled(schema)?))
}

/// The `call` rule for calls of `tools` in the Hermes / Qwen JSON form.
pub(super) fn json_calls(tools: &[ToolSpec]) -> Result<String> {
    Ok(format!("call: {}\n", json_rule(&call_schema(tools)?)?))
}

/// The grammar of tool calls between their tags around `calls` (the `call`
/// rule in the template's form), and its trigger.
pub(super) fn tool_calls(calls: &str, forced: bool, parallel: bool) -> (String, Option<String>) {
    let open = lark_string(&format!("{TOOL_CALL_OPEN}\n"));
    let close = lark_string(&format!("\n{TOOL_CALL_CLOSE}"));
    // Triggered, the opening tag is already there when the grammar starts.
    let first = if forced { format!("{open} call {close}") } else { format!("\"\\n\" call {close}") };
    let more = if parallel { format!(" (\"\\n\" {open} call {close})*") } else { String::new() };
    let trigger = (!forced).then(|| TOOL_CALL_OPEN.to_string());
    (format!("start: {first}{more}\n{calls}"), trigger)
}

/// A Lark string literal (JSON's escaping is a subset Lark reads).
pub(super) fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}
