//! Qwen3-Coder's tool calls, XML between Qwen's `<tool_call>` tags:
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Their grammar, and the parser that reads them back by the same rule for
//! each parameter's value ([`ParameterText`]): a string parameter's value is
//! its text as-is (any text without `</parameter>` or `</tool_call>` in it,
//! so the call always parses), with the one newline after the opening tag
//! and the one before the closing tag left out; other types are JSON
//! (`%json` over the parameter's own schema). Parameters come in the order
//! the schema lists them, required ones always, optional ones when the model
//! chooses. A call that names no tool, passes a parameter its tool does not
//! declare, leaves out a required one or writes a value its type cannot be
//! read from is no call: the splitter keeps it as text.

use anyhow::{bail, Result};
use serde_json::{Map, Value};

use super::{lark_string, JsonRule, ToolCall, ToolSpec, TOOL_CALL_CLOSE};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAMETER_OPEN: &str = "<parameter=";
const PARAMETER_CLOSE: &str = "</parameter>";

/// Whether a chat template writes its calls in this form.
pub(super) fn written_by(template: &str) -> bool {
    template.contains(FUNCTION_OPEN)
}

/// How a parameter's value is written between its tags.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ParameterText {
    /// The text is the value (a `string` parameter).
    Text,
    /// The text is one of these strings (a string `enum` or `const`).
    OneOf(Vec<String>),
    /// The text is JSON (numbers, booleans, null, objects, arrays).
    Json,
    /// A parameter that may be a string or something else (no `type`, or
    /// `string` among others): JSON where the text parses as JSON, the text
    /// itself where it does not.
    TextOrJson,
}

impl ParameterText {
    /// Reads a parameter's JSON schema.
    fn of(schema: &Value) -> ParameterText {
        let fixed: Option<Vec<&Value>> = match (schema.get("const"), schema.get("enum")) {
            (Some(c), _) => Some(vec![c]),
            (None, Some(Value::Array(values))) => Some(values.iter().collect()),
            _ => None,
        };
        if let Some(values) = fixed {
            let strings: Vec<String> = values.iter().filter_map(|v| v.as_str().map(String::from)).collect();
            return if !values.is_empty() && strings.len() == values.len() { ParameterText::OneOf(strings) } else { ParameterText::Json };
        }
        let types: Vec<&str> = match schema.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if types.is_empty() {
            // A union of branches is text when every branch is, JSON when none is.
            let branches = schema.get("anyOf").or_else(|| schema.get("oneOf")).and_then(Value::as_array);
            let kinds: Vec<ParameterText> = branches.into_iter().flatten().map(ParameterText::of).collect();
            if !kinds.is_empty() && kinds.iter().all(|k| *k == ParameterText::Json) {
                return ParameterText::Json;
            }
            if !kinds.is_empty() && kinds.iter().all(|k| matches!(k, ParameterText::Text)) {
                return ParameterText::Text;
            }
            return ParameterText::TextOrJson;
        }
        match (types.contains(&"string"), types.len()) {
            (true, 1) => ParameterText::Text,
            (true, _) => ParameterText::TextOrJson,
            (false, _) => ParameterText::Json,
        }
    }
}

/// The parameters a tool's schema declares, in order, with whether each is required.
fn declared_parameters(tool: &ToolSpec) -> Result<Vec<(String, Value, bool)>> {
    let Some(schema) = tool.parameters.as_object() else {
        bail!("the parameters of tool '{}' are not a JSON schema (an object)", tool.name);
    };
    let required: Vec<&str> = schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    let properties = schema.get("properties").and_then(Value::as_object);
    if let Some(missing) = required.iter().find(|r| !properties.is_some_and(|p| p.contains_key(**r))) {
        bail!("tool '{}' requires the parameter '{missing}' but its 'properties' do not declare it", tool.name);
    }
    Ok(properties
        .into_iter()
        .flatten()
        .map(|(name, schema)| (name.clone(), schema.clone(), required.contains(&name.as_str())))
        .collect())
}

/// The tags that end a value, a call's function and a call: a fixed value
/// (`enum`, `const`) written as text cannot hold them.
const MARKUP: [&str; 3] = [PARAMETER_CLOSE, FUNCTION_CLOSE, TOOL_CALL_CLOSE];

/// Text never holds the tag that ends a call. (A parameter's text runs up to
/// and including its closing tag, which it holds once, at its end: the lexer
/// then cannot read past it.)
const NO_CALL_END: &str = "~/(?s:.*)<\\/tool_call>(?s:.*)/";

/// The `call` rule (and the rules it uses) for calls of `tools` in this form.
pub(super) fn call_rule(tools: &[ToolSpec], json: JsonRule) -> Result<String> {
    if tools.is_empty() {
        bail!("no tools to call");
    }
    let mut rules = String::new();
    let mut calls = Vec::with_capacity(tools.len());
    for (t, tool) in tools.iter().enumerate() {
        check_tag_name(&tool.name, &format!("the tool name '{}'", tool.name))?;
        let mut call = vec![lark_string(&format!("{FUNCTION_OPEN}{}>\n", tool.name))];
        for (p, (name, schema, required)) in declared_parameters(tool)?.into_iter().enumerate() {
            check_tag_name(&name, &format!("the parameter name '{name}' of tool '{}'", tool.name))?;
            let rule = format!("param_{t}_{p}");
            let open = lark_string(&format!("{PARAMETER_OPEN}{name}>\n"));
            let close = lark_string(&format!("\n{PARAMETER_CLOSE}\n"));
            let body = match ParameterText::of(&schema) {
                kind @ (ParameterText::Text | ParameterText::TextOrJson) => {
                    // `minLength` and `maxLength` bound a string's characters; its `pattern` holds too.
                    let bound = |key: &str| schema.get(key).and_then(Value::as_u64).filter(|_| kind == ParameterText::Text);
                    let (min, max) = (bound("minLength").unwrap_or(0), bound("maxLength").map_or(String::new(), |m| m.to_string()));
                    let pattern = match schema.get("pattern").and_then(Value::as_str).filter(|_| kind == ParameterText::Text) {
                        Some(pattern) => format!(" & /{}\\n<\\/parameter>/", whole_text_regex(pattern)),
                        None => String::new(),
                    };
                    rules.push_str(&format!("TEXT_{t}_{p}: /(?s:.{{{min},{max}}})\\n<\\/parameter>/{pattern} & ~/(?s:.*)<\\/parameter>(?s:.)+/ & {NO_CALL_END}\n"));
                    format!("{open} TEXT_{t}_{p} \"\\n\"")
                }
                ParameterText::OneOf(values) => {
                    if let Some(v) = values.iter().find(|v| MARKUP.iter().any(|m| v.contains(m))) {
                        bail!(
                            "the value {v:?} of parameter '{name}' of tool '{}' holds this model's tool-call markup ({}), \
                             which its XML tool calls cannot write inside a value",
                            tool.name,
                            MARKUP.join(", ")
                        );
                    }
                    let values: Vec<String> = values.iter().map(|v| lark_string(v)).collect();
                    format!("{open} ({}) {close}", values.join(" | "))
                }
                ParameterText::Json => {
                    rules.push_str(&format!("value_{t}_{p}: {}\n", json(&schema)?));
                    format!("{open} value_{t}_{p} {close}")
                }
            };
            rules.push_str(&format!("{rule}: {body}\n"));
            call.push(if required { rule } else { format!("{rule}?") });
        }
        call.push(lark_string(FUNCTION_CLOSE));
        rules.push_str(&format!("call_{t}: {}\n", call.join(" ")));
        calls.push(format!("call_{t}"));
    }
    Ok(format!("call: {}\n{rules}", calls.join(" | ")))
}

/// A name goes inside a tag (`<function=NAME>`), which the first `>` ends.
fn check_tag_name(name: &str, what: &str) -> Result<()> {
    if name.is_empty() || name.contains(['>', '\n']) {
        bail!("{what} cannot be written in this model's XML tool calls (<function=NAME>, <parameter=NAME>): a name there must be non-empty, without '>' or line breaks");
    }
    Ok(())
}

/// A JSON schema `pattern` (which matches anywhere in the text unless
/// anchored with `^` or `$`) as a regex over the whole text, written for a
/// Lark `/regex/` literal (`/` escaped).
fn whole_text_regex(pattern: &str) -> String {
    let (start, rest) = match pattern.strip_prefix('^') {
        Some(rest) => ("", rest),
        None => ("(?s:.*)", pattern),
    };
    // A final `$` anchors unless a backslash escapes it (an odd number of them).
    let trailing_backslashes = rest.strip_suffix('$').map(|r| r.len() - r.trim_end_matches('\\').len());
    let (body, end) = match trailing_backslashes {
        Some(n) if n % 2 == 0 => (&rest[..rest.len() - 1], ""),
        _ => (rest, "(?s:.*)"),
    };
    let mut escaped = String::with_capacity(body.len());
    let mut backslash = false;
    for c in body.chars() {
        if c == '/' && !backslash {
            escaped.push('\\');
        }
        backslash = c == '\\' && !backslash;
        escaped.push(c);
    }
    format!("{start}(?:{escaped}){end}")
}

/// Reads one call's body; the error says what did not parse.
pub(super) fn parse_call(body: &str, tools: &[ToolSpec]) -> Result<ToolCall, String> {
    let body = body.trim();
    let rest = body.strip_prefix(FUNCTION_OPEN).ok_or_else(|| format!("the call does not start with {FUNCTION_OPEN}NAME>"))?;
    let (name, rest) = tag_name(rest).ok_or("the function's name is not closed with '>'")?;
    let inner = rest.strip_suffix(FUNCTION_CLOSE).ok_or_else(|| format!("the call does not end with {FUNCTION_CLOSE}"))?;
    let tool = tools.iter().find(|t| t.name == name).ok_or_else(|| format!("'{name}' is not one of the request's tools"))?;
    let declared = declared_parameters(tool).map_err(|e| e.to_string())?;

    let mut arguments = Map::new();
    let mut written = Vec::new();
    let mut rest = inner;
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after_open = rest.strip_prefix(PARAMETER_OPEN).ok_or_else(|| format!("unexpected text in the call: {:?}", preview(rest)))?;
        let (parameter, after_tag) = tag_name(after_open).ok_or("a parameter's name is not closed with '>'")?;
        let Some((_, schema, _)) = declared.iter().find(|(n, _, _)| n == parameter) else {
            return Err(format!("'{name}' has no parameter '{parameter}'"));
        };
        if arguments.contains_key(parameter) {
            return Err(format!("the parameter '{parameter}' is given twice"));
        }
        let (value, raw, after) = read_value(after_tag, &ParameterText::of(schema))
            .map_err(|e| format!("the value of '{parameter}' {e}"))?;
        written.push(format!("{}: {raw}", Value::String(parameter.to_string())));
        arguments.insert(parameter.to_string(), value);
        rest = after;
    }
    if let Some((missing, _, _)) = declared.iter().find(|(n, _, required)| *required && !arguments.contains_key(n)) {
        return Err(format!("the required parameter '{missing}' is missing"));
    }
    Ok(ToolCall { name: name.to_string(), arguments, arguments_json: format!("{{{}}}", written.join(", ")) })
}

/// A tag's name up to its `>`, and what follows the tag. Names never span lines.
fn tag_name(s: &str) -> Option<(&str, &str)> {
    let end = s.find('>')?;
    let name = &s[..end];
    (!name.is_empty() && !name.contains('\n')).then(|| (name, &s[end + 1..]))
}

/// A value after its opening tag: the value, its JSON text (numbers as the
/// model wrote them), and what follows the closing tag.
fn read_value<'a>(s: &'a str, kind: &ParameterText) -> Result<(Value, String, &'a str), String> {
    let start = s.strip_prefix('\n').unwrap_or(s);
    if *kind == ParameterText::Json {
        // A JSON value ends where its syntax does, so a string inside it may
        // hold a closing tag.
        let mut values = serde_json::Deserializer::from_str(start).into_iter::<Value>();
        if let Some(Ok(value)) = values.next() {
            let end = values.byte_offset();
            if let Some(after) = start[end..].trim_start().strip_prefix(PARAMETER_CLOSE) {
                return Ok((value, start[..end].trim().to_string(), after));
            }
        }
    }
    let end = start.find(PARAMETER_CLOSE).ok_or_else(|| format!("is not closed with {PARAMETER_CLOSE}"))?;
    let text = &start[..end];
    let text = text.strip_suffix('\n').unwrap_or(text);
    let after = &start[end + PARAMETER_CLOSE.len()..];
    let as_text = || Value::String(text.to_string());
    let value = match kind {
        ParameterText::Text | ParameterText::OneOf(_) => as_text(),
        ParameterText::TextOrJson => serde_json::from_str(text).unwrap_or_else(|_| as_text()),
        ParameterText::Json => python_literal(text.trim())
            .or_else(|| serde_json::from_str(text).ok())
            .ok_or_else(|| format!("is not JSON: {:?}", preview(text)))?,
    };
    let raw = match (&value, kind) {
        (Value::String(_), ParameterText::Text | ParameterText::OneOf(_) | ParameterText::TextOrJson) => value.to_string(),
        (Value::Bool(_) | Value::Null, _) => value.to_string(),
        _ => text.trim().to_string(),
    };
    Ok((value, raw, after))
}

/// `True`, `False` and `None`, as a template rendering Python values writes them.
fn python_literal(text: &str) -> Option<Value> {
    match text {
        "True" => Some(Value::Bool(true)),
        "False" => Some(Value::Bool(false)),
        "None" => Some(Value::Null),
        _ => None,
    }
}

fn preview(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Whether a call's body that does not parse is one cut short (a closing
/// tag inside a value, so the call goes on), not a broken one.
pub(super) fn unfinished(body: &str) -> bool {
    !body.trim_end().ends_with(FUNCTION_CLOSE)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tools() -> Vec<ToolSpec> {
        vec![
            ToolSpec {
                name: "write_file".into(),
                parameters: json!({"type": "object", "properties": {
                    "path": {"type": "string"}, "content": {"type": "string"},
                    "mode": {"type": "integer"}, "append": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "meta": {"type": "object"}, "note": {"type": ["string", "null"]}},
                    "required": ["path", "content"]}),
            },
            ToolSpec { name: "ping".into(), parameters: json!({"type": "object", "properties": {}}) },
        ]
    }

    fn call(body: &str) -> Result<ToolCall, String> {
        parse_call(body, &tools())
    }

    #[test]
    fn values_are_read_by_their_schema_types() {
        let body = "\n<function=write_file>\n<parameter=path>\n/tmp/a.txt\n</parameter>\n<parameter=content>\nline 1\n  line 2\n\n</parameter>\n\
                    <parameter=mode>\n644\n</parameter>\n<parameter=append>\nfalse\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n\
                    <parameter=meta>\n{\"k\": {\"n\": 1}}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n";
        let c = call(body).expect("parses");
        assert_eq!(c.name, "write_file");
        assert_eq!(
            Value::Object(c.arguments.clone()),
            json!({"path": "/tmp/a.txt", "content": "line 1\n  line 2\n", "mode": 644, "append": false,
                   "tags": ["a", "b"], "meta": {"k": {"n": 1}}, "note": null})
        );
        let reread: Value = serde_json::from_str(&c.arguments_json).expect("arguments_json is JSON");
        assert_eq!(reread, Value::Object(c.arguments));
    }

    #[test]
    fn a_string_that_looks_like_json_stays_a_string_and_numbers_keep_their_digits() {
        let c = call("<function=write_file>\n<parameter=path>\n42\n</parameter>\n<parameter=content>\n{\"a\": 1}\n</parameter>\n\
                      <parameter=mode>\n155777777157777780000000001\n</parameter>\n</function>")
        .expect("parses");
        assert_eq!(c.arguments["path"], "42");
        assert_eq!(c.arguments["content"], "{\"a\": 1}");
        assert!(c.arguments_json.contains("\"mode\": 155777777157777780000000001"), "{}", c.arguments_json);
    }

    #[test]
    fn angle_brackets_and_tags_inside_values_are_text() {
        let content = "if a < b && c > d { <b>bold</b> } <parameter=x> <function=y>";
        let c = call(&format!("<function=write_file>\n<parameter=path>\nx\n</parameter>\n<parameter=content>\n{content}\n</parameter>\n</function>"))
            .expect("parses");
        assert_eq!(c.arguments["content"], content);
        // A JSON value may hold the closing tag inside a string.
        let c = call("<function=write_file>\n<parameter=path>\nx\n</parameter>\n<parameter=content>\ny\n</parameter>\n\
                      <parameter=meta>\n{\"s\": \"</parameter>\"}\n</parameter>\n</function>")
        .expect("parses");
        assert_eq!(c.arguments["meta"], json!({"s": "</parameter>"}));
    }

    #[test]
    fn python_spellings_of_booleans_and_none_are_read() {
        let c = call("<function=write_file>\n<parameter=path>\nx\n</parameter>\n<parameter=content>\n\n</parameter>\n\
                      <parameter=append>\nTrue\n</parameter>\n</function>")
        .expect("parses");
        assert_eq!(c.arguments["append"], true);
        assert_eq!(c.arguments["content"], "");
        assert!(c.arguments_json.contains("\"append\": true"), "{}", c.arguments_json);
    }

    #[test]
    fn hostile_calls_are_refused_with_a_reason() {
        let cases = [
            ("<function=write_file>\n<parameter=path>\nx\n</parameter>\n", "does not end with </function>"),
            ("<function=write_file>\n<parameter=path>\nx\n</function>", "'path' is not closed with </parameter>"),
            ("<function=rm_rf>\n</function>", "'rm_rf' is not one of the request's tools"),
            ("<function=write_file>\n<parameter=path>\nx\n</parameter>\n</function>", "required parameter 'content' is missing"),
            ("<function=ping>\n<parameter=host>\nx\n</parameter>\n</function>", "'ping' has no parameter 'host'"),
            ("<function=write_file>\n<parameter=mode>\nsix\n</parameter>\n</function>", "'mode' is not JSON"),
            (
                "<function=write_file>\n<parameter=path>\nx\n</parameter>\n<parameter=path>\ny\n</parameter>\n</function>",
                "'path' is given twice",
            ),
            ("<function=write_file\n<parameter=path>\nx\n</parameter>\n</function>", "name is not closed"),
            ("{\"name\": \"ping\", \"arguments\": {}}", "does not start with <function="),
            ("<function=ping>\nhello\n</function>", "unexpected text in the call"),
            ("<function=", "name is not closed"),
            ("", "does not start with"),
        ];
        for (body, want) in cases {
            let e = call(body).expect_err(body);
            assert!(e.contains(want), "{body:?}: {e}");
        }
        assert_eq!(call("<function=ping>\n</function>").expect("no parameters").arguments_json, "{}");
    }

    #[test]
    fn a_string_pattern_becomes_a_regex_over_the_whole_value() {
        assert_eq!(whole_text_regex("^a/b$"), "(?:a\\/b)");
        assert_eq!(whole_text_regex("ab"), "(?s:.*)(?:ab)(?s:.*)");
        assert_eq!(whole_text_regex("^x\\$"), "(?:x\\$)(?s:.*)", "an escaped $ is a dollar sign");
        assert_eq!(whole_text_regex("^x\\\\$"), "(?:x\\\\)", "after an escaped backslash, $ anchors");
        assert_eq!(whole_text_regex("a\\/b"), "(?s:.*)(?:a\\/b)(?s:.*)", "an escaped slash stays as it is");
    }
}
