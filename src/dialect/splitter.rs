//! Splits a model's streamed answer into text and tool calls, by the call
//! markup of its dialect: calls between `<tool_call>` tags, each read in the
//! form the chat template writes (`hermes_json.rs`, `qwen3_coder_xml.rs`).

use serde_json::Value;

use super::{hermes_json, partial_suffix, qwen3_coder_xml, Part, ToolCall, ToolCallForm, ToolSpec, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

/// The name and parameters of each tool in a request's `tools`, as chat
/// templates get them (`{"type": "function", "function": {...}}`).
fn wire_specs(wire: &[Value]) -> Vec<ToolSpec> {
    wire.iter()
        .filter_map(|tool| {
            let function = tool.get("function")?;
            Some(ToolSpec { name: function.get("name")?.as_str()?.to_string(), parameters: function.get("parameters")?.clone() })
        })
        .collect()
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
    /// `tools` (the request's, as the template gets them).
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
            CallSyntax::Json => hermes_json::unfinished(body),
            CallSyntax::Xml(_) => qwen3_coder_xml::unfinished(body),
        }
    }

    fn parse(&self, body: &str) -> Option<ToolCall> {
        match &self.syntax {
            CallSyntax::Json => hermes_json::parse_call(body),
            CallSyntax::Xml(tools) => qwen3_coder_xml::parse_call(body, tools).ok(),
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
    use serde_json::json;

    use super::*;

    /// A request's `tools` as the template gets them.
    fn wire_tools(tools: Value) -> Vec<Value> {
        tools.as_array().cloned().unwrap_or_default()
    }

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
        let tools = wire_tools(json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
            "properties": {"a": {"type": "integer"}, "note": {"type": "string"}}, "required": ["a"]}}}]));
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
            let splitter = ToolCallSplitter::new(Some(ToolCallForm::XmlParameters), &tools);
            assert_eq!(split_with(splitter, &refs), want, "pieces of {size} characters");
        }
        // A call the length cut short is dropped; one that ended otherwise unclosed stays text.
        let cut = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</param";
        let splitter = ToolCallSplitter::new(Some(ToolCallForm::XmlParameters), &tools);
        assert_eq!(split_ended(splitter, &[&text, "\n", cut], true), want, "a cut call after whole ones");
        let splitter = ToolCallSplitter::new(Some(ToolCallForm::XmlParameters), &tools);
        assert_eq!(split_with(splitter, &[cut]), vec![Part::Text(cut.into())]);
        // The JSON form does not read XML calls.
        let json_form = split_with(ToolCallSplitter::new(Some(ToolCallForm::Json), &tools), &[&text]);
        assert!(json_form.iter().all(|p| matches!(p, Part::Text(_))), "{json_form:?}");
    }

    #[test]
    fn a_closing_tag_inside_a_call_does_not_cut_it() {
        let tools = wire_tools(json!([{"type": "function", "function": {"name": "a</tool_call>b", "parameters": {"type": "object",
            "properties": {"s": {"const": "</tool_call>"}}}}}]));
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
            let splitter = ToolCallSplitter::new(Some(ToolCallForm::Json), &tools);
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
}
