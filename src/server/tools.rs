//! Tool calling on the wire: the `tools` both APIs send (checked, then
//! handed to the chat template as transformers does), `tool_choice`, the
//! tool calls and results in a chat's history, and the calls parsed back out
//! of the model's output in the chat template's form (the Hermes / Qwen
//! `<tool_call>{json}</tool_call>`, or Qwen3-Coder's XML in `xml_form.rs`;
//! the grammar in `constrain` guarantees either parses).

mod xml_form;

use serde_json::{json, Map, Value};

use super::thinking::partial_suffix;
use super::ApiError;
use crate::constrain::{ConstraintSpec, ToolCallForm, ToolSpec, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
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

/// A call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
    /// The arguments exactly as the model wrote them (a 30-digit integer
    /// stays an integer, which a round trip through `f64` would not keep).
    pub arguments_json: String,
}

impl ToolCall {
    /// `{"name": ..., "arguments": {...}}`, as the model writes it.
    fn parse(body: &str) -> Option<ToolCall> {
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
}

/// The name and parameters of each tool in [`Tools::wire`].
fn wire_specs(wire: &[Value]) -> Vec<ToolSpec> {
    wire.iter()
        .filter_map(|tool| {
            let function = tool.get("function")?;
            Some(ToolSpec { name: function.get("name")?.as_str()?.to_string(), parameters: function.get("parameters")?.clone() })
        })
        .collect()
}

/// A piece of the answer: text, or a whole call.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    Text(String),
    Call(ToolCall),
}

/// How the calls between the tags are written.
#[derive(Default)]
enum CallSyntax {
    /// `{"name": ..., "arguments": {...}}`.
    #[default]
    Json,
    /// `<function=NAME><parameter=P>...`, read by these tools' schemas.
    Xml(Vec<ToolSpec>),
}

/// Splits streamed answer text into text and tool calls. Text that might
/// open a call is held back until it is known; blank text around calls is
/// dropped; a call that does not parse stays text, and so does one that
/// never closes, unless the generation was cut short (see [`Self::finish`]).
#[derive(Default)]
pub struct ToolCallSplitter {
    syntax: CallSyntax,
    pending: String,
    inside: bool,
    /// Where in `pending` to look for the call's closing tag.
    close_from: usize,
    /// Blank text waiting to learn whether a call or more text follows.
    blank: String,
    saw_call: bool,
}

impl ToolCallSplitter {
    /// A splitter for calls in `form` (the model's chat template's) of
    /// `tools` (the request's, as [`parse_tools`] wrote them for the template).
    pub fn new(form: Option<ToolCallForm>, tools: &[Value]) -> ToolCallSplitter {
        let syntax = match form {
            Some(ToolCallForm::XmlParameters) => CallSyntax::Xml(wire_specs(tools)),
            Some(ToolCallForm::Json) | None => CallSyntax::Json,
        };
        ToolCallSplitter { syntax, ..ToolCallSplitter::default() }
    }

    /// Whether a call's body that does not parse is one cut at a closing tag
    /// it holds (so the call goes on), not a broken one.
    fn unfinished(&self, body: &str) -> bool {
        match &self.syntax {
            CallSyntax::Json => serde_json::from_str::<Value>(body).is_err_and(|e| e.is_eof()),
            CallSyntax::Xml(_) => !body.trim_end().ends_with("</function>"),
        }
    }

    fn parse(&self, body: &str) -> Option<ToolCall> {
        match &self.syntax {
            CallSyntax::Json => ToolCall::parse(body),
            CallSyntax::Xml(tools) => xml_form::parse_call(body, tools).ok(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Vec<Part> {
        self.pending.push_str(piece);
        let mut out = Vec::new();
        loop {
            if self.inside {
                // A closing tag inside the call (in a string of its
                // arguments, or its tool's name) does not end it: the call
                // ends at the first closing tag after a whole call.
                let Some(at) = self.pending[self.close_from..].find(TOOL_CALL_CLOSE).map(|i| i + self.close_from) else {
                    // A tag split between pieces is found whole next time.
                    let mut from = self.pending.len().saturating_sub(TOOL_CALL_CLOSE.len() - 1).max(self.close_from);
                    while !self.pending.is_char_boundary(from) {
                        from -= 1;
                    }
                    self.close_from = from;
                    return out;
                };
                let body = &self.pending[..at];
                let call = self.parse(body);
                if call.is_none() && self.unfinished(body) {
                    self.close_from = at + TOOL_CALL_CLOSE.len();
                    continue;
                }
                let body = body.to_string();
                self.pending.drain(..at + TOOL_CALL_CLOSE.len());
                self.inside = false;
                self.close_from = 0;
                match call {
                    Some(call) => {
                        self.blank.clear();
                        self.saw_call = true;
                        out.push(Part::Call(call));
                    }
                    None => self.text(format!("{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"), &mut out),
                }
                continue;
            }
            if let Some(at) = self.pending.find(TOOL_CALL_OPEN) {
                let before: String = self.pending.drain(..at + TOOL_CALL_OPEN.len()).take(at).collect();
                self.text(before, &mut out);
                self.inside = true;
                continue;
            }
            let keep = partial_suffix(&self.pending, TOOL_CALL_OPEN);
            let ready: String = self.pending.drain(..self.pending.len() - keep).collect();
            self.text(ready, &mut out);
            return out;
        }
    }

    /// Whatever is still held back, as text. When the generation was `cut`
    /// short (the length ran out, or a shutdown), a call still open, or the start of its
    /// tag, is dropped with the blank text before it: it is no call, and
    /// returned as text it would put the template's markup in the answer.
    pub fn finish(&mut self, cut: bool) -> Vec<Part> {
        let mut out = Vec::new();
        let mut rest = std::mem::take(&mut self.pending);
        if cut && (self.inside || !rest.is_empty()) {
            self.inside = false;
            self.close_from = 0;
            self.blank.clear();
            return out;
        }
        if self.inside {
            rest.insert_str(0, TOOL_CALL_OPEN);
            self.inside = false;
            self.close_from = 0;
        }
        self.text(rest, &mut out);
        if !self.saw_call && !self.blank.is_empty() {
            out.push(Part::Text(std::mem::take(&mut self.blank)));
        }
        out
    }

    fn text(&mut self, text: String, out: &mut Vec<Part>) {
        if text.is_empty() {
            return;
        }
        if text.trim().is_empty() {
            self.blank.push_str(&text);
            return;
        }
        let mut all = std::mem::take(&mut self.blank);
        all.push_str(&text);
        out.push(Part::Text(all));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts of `pieces`, neighbouring texts joined (streaming may cut text anywhere).
    fn split(pieces: &[&str]) -> Vec<Part> {
        split_with(ToolCallSplitter::default(), pieces)
    }

    fn split_with(s: ToolCallSplitter, pieces: &[&str]) -> Vec<Part> {
        split_ended(s, pieces, false)
    }

    /// As [`split_with`], for a generation that was `cut` short or not.
    fn split_ended(mut s: ToolCallSplitter, pieces: &[&str], cut: bool) -> Vec<Part> {
        let mut parts: Vec<Part> = pieces.iter().flat_map(|p| s.push(p)).collect();
        parts.extend(s.finish(cut));
        let mut out: Vec<Part> = Vec::new();
        for part in parts {
            match (out.last_mut(), part) {
                (Some(Part::Text(all)), Part::Text(t)) => all.push_str(&t),
                (_, part) => out.push(part),
            }
        }
        out
    }

    fn call(name: &str, arguments: Value) -> Part {
        let arguments_json = arguments.to_string().replace(':', ": ");
        Part::Call(ToolCall { name: name.into(), arguments: arguments.as_object().cloned().unwrap_or_default(), arguments_json })
    }

    #[test]
    fn arguments_keep_the_numbers_the_model_wrote() {
        let big = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 155777777157777780000000001}}\n</tool_call>";
        match split(&[big]).as_slice() {
            [Part::Call(c)] => assert_eq!(c.arguments_json, "{\"a\": 155777777157777780000000001}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn calls_are_cut_out_of_streamed_text_wherever_the_pieces_break() {
        let text = "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let want = vec![
            Part::Text("Checking.".into()),
            call("get_weather", json!({"city": "Paris"})),
            call("add", json!({"a": 1})),
        ];
        for size in [1, 2, 3, 7, 64, text.len()] {
            let chars: Vec<char> = text.chars().collect();
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(split(&refs), want, "pieces of {size} characters");
        }
    }

    #[test]
    fn xml_calls_are_cut_out_of_streamed_text_and_typed_by_their_schemas() {
        let tools = parse_tools(Some(json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
            "properties": {"a": {"type": "integer"}, "note": {"type": "string"}}, "required": ["a"]}}}])))
        .expect("valid tools");
        let unknown = "<tool_call>\n<function=rm>\n</function>\n</tool_call>";
        let text = format!("Sure.<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=note>\n1 < 2\n</parameter>\n</function>\n</tool_call>\n{unknown}");
        let add = Part::Call(ToolCall {
            name: "add".into(),
            arguments: json!({"a": 2, "note": "1 < 2"}).as_object().cloned().unwrap_or_default(),
            arguments_json: "{\"a\": 2, \"note\": \"1 < 2\"}".into(),
        });
        let want = vec![Part::Text("Sure.".into()), add, Part::Text(format!("\n{unknown}"))];
        for size in [1, 2, 5, 64, text.len()] {
            let chars: Vec<char> = text.chars().collect();
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let splitter = ToolCallSplitter::new(Some(ToolCallForm::XmlParameters), &tools.wire);
            assert_eq!(split_with(splitter, &refs), want, "pieces of {size} characters");
        }
        // A call the length cut short is dropped; one that ended otherwise unclosed stays text.
        let cut = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</param";
        let splitter = ToolCallSplitter::new(Some(ToolCallForm::XmlParameters), &tools.wire);
        assert_eq!(split_ended(splitter, &[&text, "\n", cut], true), want, "a cut call after whole ones");
        let splitter = ToolCallSplitter::new(Some(ToolCallForm::XmlParameters), &tools.wire);
        assert_eq!(split_with(splitter, &[cut]), vec![Part::Text(cut.into())]);
        // The JSON form does not read XML calls.
        let json_form = split_with(ToolCallSplitter::new(Some(ToolCallForm::Json), &tools.wire), &[&text]);
        assert!(json_form.iter().all(|p| matches!(p, Part::Text(_))), "{json_form:?}");
    }

    #[test]
    fn a_closing_tag_inside_a_call_does_not_cut_it() {
        let tools = parse_tools(Some(json!([{"type": "function", "function": {"name": "a</tool_call>b", "parameters": {"type": "object",
            "properties": {"s": {"const": "</tool_call>"}}}}}])))
        .expect("valid tools");
        let text = "<tool_call>\n{\"name\": \"a</tool_call>b\", \"arguments\": {\"s\": \"</tool_call>\"}}\n</tool_call> after";
        let want = vec![
            Part::Call(ToolCall {
                name: "a</tool_call>b".into(),
                arguments: json!({"s": "</tool_call>"}).as_object().cloned().unwrap_or_default(),
                arguments_json: "{\"s\": \"</tool_call>\"}".into(),
            }),
            Part::Text(" after".into()),
        ];
        for size in [1, 3, 11, text.len()] {
            let chars: Vec<char> = text.chars().collect();
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let splitter = ToolCallSplitter::new(Some(ToolCallForm::Json), &tools.wire);
            assert_eq!(split_with(splitter, &refs), want, "pieces of {size} characters");
        }
        // A broken call still becomes text at its closing tag.
        assert_eq!(split(&["<tool_call>oops</tool_call> more"]), vec![Part::Text("<tool_call>oops</tool_call> more".into())]);
    }

    #[test]
    fn text_without_calls_passes_unchanged() {
        let got = split(&["a <tool", " b", "  "]);
        let all: String = got.iter().map(|p| if let Part::Text(t) = p { t.clone() } else { panic!("{p:?}") }).collect();
        assert_eq!(all, "a <tool b  ");
    }

    #[test]
    fn a_call_the_length_cut_short_is_dropped_and_the_calls_before_it_kept() {
        let whole = "Checking.<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let cut = "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \" ";
        let want = vec![Part::Text("Checking.".into()), call("add", json!({"a": 1}))];
        let text = format!("{whole}{cut}");
        for size in [1, 2, 7, text.len()] {
            let chars: Vec<char> = text.chars().collect();
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(split_ended(ToolCallSplitter::default(), &refs, true), want, "pieces of {size} characters");
        }
        // Cut before the first call closed, or inside its opening tag: no call and no markup.
        assert_eq!(split_ended(ToolCallSplitter::default(), &["\n<tool_call>\n{\"name\": \"f\", \"argu"], true), vec![]);
        assert_eq!(split_ended(ToolCallSplitter::default(), &["Sure. <tool_c"], true), vec![Part::Text("Sure. ".into())]);
        // Text the cut ends in stays text.
        assert_eq!(split_ended(ToolCallSplitter::default(), &["plain text, cut"], true), vec![Part::Text("plain text, cut".into())]);
    }

    #[test]
    fn an_unclosed_or_broken_call_stays_text() {
        assert_eq!(split(&["<tool_call>\n{\"name\": \"f\", \"argu"]), vec![Part::Text("<tool_call>\n{\"name\": \"f\", \"argu".into())]);
        assert_eq!(split(&["<tool_call>not json</tool_call>"]), vec![Part::Text("<tool_call>not json</tool_call>".into())]);
    }

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
