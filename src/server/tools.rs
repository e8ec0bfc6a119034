//! Tool calling on the wire: the `tools` every API sends (checked, then
//! handed to the chat template as transformers does), `tool_choice` and the
//! constraint it asks for, and the tool calls and results in a chat's
//! history. How a model writes its calls, and how they are read back out of
//! its output, is its chat dialect's (`crate::dialect`).

use serde_json::{json, Value};

use super::ApiError;
use crate::constrain::ConstraintSpec;
use crate::dialect::{ToolCallForm, ToolSpec};
use crate::tokenizer::ChatTurn;

/// The tools of a request: as the template gets them, and as the grammar does.
#[derive(Clone, Debug, Default)]
pub struct Tools {
    pub wire: Vec<Value>,
    pub specs: Vec<ToolSpec>,
}

/// The most tools one request may give (their schemas together are bounded
/// too: `crate::constrain::MAX_SCHEMA_BYTES`).
pub const MAX_TOOLS: usize = 128;

/// Reads `tools` (`[{"type": "function", "function": {"name", "description",
/// "parameters"}}]`, the same in both APIs).
pub fn parse_tools(v: Option<Value>) -> Result<Tools, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Tools::default()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::bad_request("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects")),
    };
    if list.len() > MAX_TOOLS {
        return Err(ApiError::bad_request(format!(
            "'tools' lists {} tools; the most a request may give is {MAX_TOOLS} (as OpenAI's API allows)",
            list.len()
        )));
    }
    let mut tools = Tools::default();
    for (i, tool) in list.into_iter().enumerate() {
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or("function");
        if kind != "function" {
            return Err(ApiError::bad_request(format!("tools[{i}].type is '{kind}'; only \"function\" tools are supported")));
        }
        let Some(function) = tool.get("function").and_then(Value::as_object) else {
            return Err(ApiError::bad_request(format!("tools[{i}].function must be an object with a 'name'")));
        };
        let name = match function.get("name").and_then(Value::as_str) {
            Some(n) if !n.trim().is_empty() && !n.chars().any(char::is_control) => n.to_string(),
            _ => return Err(ApiError::bad_request(format!("tools[{i}].function.name must be a non-empty string"))),
        };
        if tools.specs.iter().any(|t| t.name == name) {
            return Err(ApiError::bad_request(format!("tools[{i}].function.name '{name}' is given twice")));
        }
        // A call's arguments are an object: its schema is an object's.
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(o)) if o.get("type").is_none_or(|t| t == "object") => p.clone(),
            Some(p) => {
                let what = if p.is_object() { "a schema of something other than an object" } else { "not a JSON schema" };
                return Err(ApiError::bad_request(format!(
                    "tools[{i}].function.parameters is {what}: a call's arguments are an object, so give an object schema \
                     such as {{\"type\": \"object\", \"properties\": {{...}}}}"
                )));
            }
        };
        let mut function = function.clone();
        function.insert("parameters".into(), parameters.clone());
        tools.wire.push(json!({"type": "function", "function": function}));
        // Without a `type` the schema still describes the arguments' object.
        let mut parameters = parameters;
        if let Some(schema) = parameters.as_object_mut() {
            schema.entry("type").or_insert_with(|| "object".into());
        }
        tools.specs.push(ToolSpec { name, parameters });
    }
    Ok(tools)
}

/// Whether and which tool the model must call.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

/// OpenAI's `tool_choice`: "auto", "none", "required" or
/// `{"type": "function", "function": {"name": ...}}` naming one of `tools`.
pub fn parse_tool_choice(v: Option<Value>, tools: &Tools) -> Result<ToolChoice, ApiError> {
    let choice = match &v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_request(format!("tool_choice '{other}' is not auto, none, required or a named function")))
            }
        },
        Some(obj) => match obj.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => ToolChoice::Named(name.to_string()),
            None => return Err(ApiError::bad_request("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}")),
        },
    };
    match &choice {
        ToolChoice::Named(name) if !tools.specs.iter().any(|t| &t.name == name) => {
            Err(ApiError::bad_request(format!("tool_choice names the function '{name}', which is not in 'tools'")))
        }
        ToolChoice::Required | ToolChoice::Named(_) if tools.specs.is_empty() => {
            Err(ApiError::bad_request("tool_choice asks for a tool call but the request has no 'tools'"))
        }
        _ => Ok(choice),
    }
}

/// The constraint for a tool choice (`None`: no tools, or calls not wanted).
/// Calls are written in the JSON form until the model is known and
/// [`ConstraintSpec::in_form`] sets its template's form.
pub fn tool_constraint(tools: &Tools, choice: &ToolChoice, parallel: bool) -> Option<ConstraintSpec> {
    if tools.specs.is_empty() {
        return None;
    }
    let form = ToolCallForm::Json;
    match choice {
        ToolChoice::None => None,
        ToolChoice::Auto => Some(ConstraintSpec::ToolCalls { tools: tools.specs.clone(), forced: false, parallel, form }),
        ToolChoice::Required => Some(ConstraintSpec::ToolCalls { tools: tools.specs.clone(), forced: true, parallel, form }),
        ToolChoice::Named(name) => {
            let specs = tools.specs.iter().filter(|t| &t.name == name).cloned().collect();
            Some(ConstraintSpec::ToolCalls { tools: specs, forced: true, parallel: false, form })
        }
    }
}

/// An assistant turn's calls as chat templates read them. `arguments` may
/// be an object (Ollama) or a JSON string holding one (OpenAI); `field`
/// names the list in errors.
pub fn history_calls(calls: Option<Value>, field: &str) -> Result<Vec<Value>, ApiError> {
    let list = match calls {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::bad_request(format!("{field} must be a list"))),
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let function = call.get("function").and_then(Value::as_object);
        let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
        let (Some(function), Some(name)) = (function, name) else {
            return Err(ApiError::bad_request(format!("{field}[{j}] needs function.name")));
        };
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| ApiError::bad_request(format!("{field}[{j}].function.arguments is not a JSON object")))?,
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => return Err(ApiError::bad_request(format!("{field}[{j}].function.arguments is not a JSON object"))),
        };
        let mut entry = json!({"type": "function", "function": {"name": name, "arguments": arguments}});
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            entry["id"] = id.into();
        }
        out.push(entry);
    }
    Ok(out)
}

/// Checks that every tool result answers a call made before it: by id
/// (OpenAI's `tool_call_id`) or, without one, by name (Ollama's
/// `tool_name`), or at least that a call was made. Fills in the result's
/// `name` from its call where the client left it out.
pub fn check_tool_results(turns: &mut [ChatTurn]) -> Result<(), ApiError> {
    let mut calls: Vec<(Option<String>, String)> = Vec::new();
    for (i, turn) in turns.iter_mut().enumerate() {
        for call in &turn.tool_calls {
            let id = call.get("id").and_then(Value::as_str).map(String::from);
            let name = call["function"]["name"].as_str().unwrap_or_default().to_string();
            calls.push((id, name));
        }
        if turn.role != "tool" {
            continue;
        }
        let matched = match (&turn.tool_call_id, &turn.name) {
            (Some(id), _) => calls.iter().find(|(cid, _)| cid.as_deref() == Some(id.as_str())),
            (None, Some(name)) => calls.iter().find(|(_, cname)| cname == name),
            (None, None) => calls.last(),
        };
        let Some((_, name)) = matched else {
            let what = match (&turn.tool_call_id, &turn.name) {
                (Some(id), _) => format!("tool_call_id '{id}'"),
                (None, Some(name)) => format!("tool_name '{name}'"),
                (None, None) => "a tool result".to_string(),
            };
            return Err(ApiError::bad_request(format!(
                "messages[{i}] is {what}, which answers no tool call made earlier in 'messages'"
            )));
        };
        if turn.name.is_none() {
            turn.name = Some(name.clone());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_and_choices_are_checked() {
        let tools = parse_tools(Some(json!([
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "g"}},
        ])))
        .expect("valid tools");
        assert_eq!(tools.specs.len(), 2);
        assert_eq!(tools.specs[1].parameters, json!({"type": "object", "properties": {}}));
        let many: Vec<Value> = (0..=MAX_TOOLS).map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}})).collect();
        let bad = parse_tools(Some(Value::Array(many))).expect_err("too many tools");
        assert!(bad.message.contains("lists 129 tools; the most a request may give is 128"), "{}", bad.message);
        let bad = parse_tools(Some(json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]))).expect_err("a string is no schema");
        assert!(bad.message.contains("tools[0].function.parameters is not a JSON schema"), "{}", bad.message);
        let bad = parse_tools(Some(json!([{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]))).expect_err("type 3");
        assert!(bad.message.contains("a schema of something other than an object"), "{}", bad.message);
        for not_object in [json!({"type": "string"}), json!({"type": ["object", "null"]}), json!({"type": "array", "items": {}})] {
            let bad = parse_tools(Some(json!([{"type": "function", "function": {"name": "f", "parameters": not_object}}])))
                .expect_err("arguments that are no object");
            assert!(bad.message.contains("a call's arguments are an object"), "{}", bad.message);
        }
        let untyped = parse_tools(Some(json!([{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}])))
            .expect("a schema without a type");
        assert_eq!(untyped.specs[0].parameters["type"], "object", "the grammar holds the arguments to an object");
        let unknown = parse_tool_choice(Some(json!({"type": "function", "function": {"name": "h"}})), &tools).expect_err("unknown");
        assert!(unknown.message.contains("'h', which is not in 'tools'"), "{}", unknown.message);
        assert_eq!(parse_tool_choice(Some(json!("required")), &tools).expect("required"), ToolChoice::Required);
        let named = parse_tool_choice(Some(json!({"type": "function", "function": {"name": "g"}})), &tools).expect("named");
        match tool_constraint(&tools, &named, true) {
            Some(ConstraintSpec::ToolCalls { tools, forced: true, parallel: false, .. }) => assert_eq!(tools[0].name, "g"),
            other => panic!("{other:?}"),
        }
        assert_eq!(tool_constraint(&tools, &ToolChoice::None, true), None);
    }

    #[test]
    fn tool_results_must_answer_a_call() {
        let calls = history_calls(Some(json!([{"id": "call_1", "function": {"name": "f", "arguments": "{\"x\": 1}"}}])), "calls")
            .expect("OpenAI-style calls");
        assert_eq!(calls[0]["function"]["arguments"], json!({"x": 1}));
        let turn = |role: &str| ChatTurn { role: role.into(), ..ChatTurn::default() };
        let mut ok = vec![turn("user"), ChatTurn { tool_calls: calls, ..turn("assistant") }, ChatTurn { tool_call_id: Some("call_1".into()), ..turn("tool") }];
        check_tool_results(&mut ok).expect("answers call_1");
        assert_eq!(ok[2].name.as_deref(), Some("f"));
        let mut orphan = vec![turn("user"), ChatTurn { tool_call_id: Some("call_9".into()), ..turn("tool") }];
        let e = check_tool_results(&mut orphan).expect_err("no such call");
        assert!(e.message.contains("messages[1] is tool_call_id 'call_9', which answers no tool call"), "{}", e.message);
        let bad = history_calls(Some(json!([{"function": {"name": "f", "arguments": "{oops"}}])), "messages[1].tool_calls").expect_err("bad");
        assert!(bad.message.contains("messages[1].tool_calls[0].function.arguments is not a JSON object"), "{}", bad.message);
    }
}
