//! Tool calls in Qwen3-Coder's XML form, read back into name and arguments:
//!
//! ```text
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! ```
//!
//! (what lies between `<tool_call>` and `</tool_call>`). Each value is read
//! by its parameter's schema as the grammar in `constrain` writes it
//! ([`ParameterText`]): a string parameter's text is the string, with the one
//! newline after the opening tag and the one before the closing tag left
//! out; other types are JSON. A call that names no tool, passes a parameter
//! its tool does not declare, leaves out a required one or writes a value
//! its type cannot be read from is no call: the caller keeps it as text.

use serde_json::{Map, Value};

use super::ToolCall;
use crate::constrain::{declared_parameters, ParameterText, ToolSpec};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAMETER_OPEN: &str = "<parameter=";
const PARAMETER_CLOSE: &str = "</parameter>";

/// Reads one call's body; the error says what did not parse.
pub fn parse_call(body: &str, tools: &[ToolSpec]) -> Result<ToolCall, String> {
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
}
