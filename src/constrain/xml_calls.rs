//! Qwen3-Coder's XML tool calls as a grammar, and how each parameter's value
//! is written there, which the server's parser reads back by the same rule:
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
//! A string parameter's value is its text as-is (any text without
//! `</parameter>` or `</tool_call>` in it, so the call always parses); other
//! types are JSON (`%json` over the parameter's own schema). Parameters come
//! in the order the schema lists them, required ones always, optional ones
//! when the model chooses.

use anyhow::{bail, Result};
use serde_json::Value;

use super::grammar::{declared_only, lark_string, styled, ToolSpec};

/// How a parameter's value is written between its tags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParameterText {
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
    pub fn of(schema: &Value) -> ParameterText {
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
pub fn declared_parameters(tool: &ToolSpec) -> Result<Vec<(String, Value, bool)>> {
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
const MARKUP: [&str; 3] = ["</parameter>", "</function>", "</tool_call>"];

/// Text never holds the tag that ends a call. (A parameter's text runs up to
/// and including its closing tag, which it holds once, at its end: the lexer
/// then cannot read past it.)
const NO_CALL_END: &str = "~/(?s:.*)<\\/tool_call>(?s:.*)/";

/// The `call` rule (and the rules it uses) for calls of `tools` in the XML form.
pub fn lark_calls(tools: &[ToolSpec]) -> Result<String> {
    if tools.is_empty() {
        bail!("no tools to call");
    }
    let mut rules = String::new();
    let mut calls = Vec::with_capacity(tools.len());
    for (t, tool) in tools.iter().enumerate() {
        check_tag_name(&tool.name, &format!("the tool name '{}'", tool.name))?;
        let mut call = vec![lark_string(&format!("<function={}>\n", tool.name))];
        for (p, (name, schema, required)) in declared_parameters(tool)?.into_iter().enumerate() {
            check_tag_name(&name, &format!("the parameter name '{name}' of tool '{}'", tool.name))?;
            let rule = format!("param_{t}_{p}");
            let open = lark_string(&format!("<parameter={name}>\n"));
            let close = lark_string("\n</parameter>\n");
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
                    let mut schema = schema;
                    declared_only(&mut schema);
                    rules.push_str(&format!("value_{t}_{p}: %json {}\n", styled(&schema, true)?));
                    format!("{open} value_{t}_{p} {close}")
                }
            };
            rules.push_str(&format!("{rule}: {body}\n"));
            call.push(if required { rule } else { format!("{rule}?") });
        }
        call.push(lark_string("</function>"));
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
pub(super) fn whole_text_regex(pattern: &str) -> String {
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
