//! One home per chat dialect: how a model family's chat template marks up
//! reasoning and tool calls, the grammar that forces or constrains those
//! calls, and the parser that reads them back out of the output. One file per
//! format:
//!
//! - `think.rs`: reasoning between `<think>` and `</think>`;
//! - `hermes_json.rs`: calls as JSON between `<tool_call>` tags (Hermes, Qwen);
//! - `qwen3_coder_xml.rs`: Qwen3-Coder's `<function=NAME><parameter=P>` calls
//!   between the same tags.
//!
//! The rest of the server sees only this file: [`ToolCallForm`] (the dialect
//! a template writes, and the grammar of its calls) and [`AnswerReader`],
//! which turns a generation's streamed text into [`Part`]s (reasoning, text,
//! whole [`ToolCall`]s) for every front end (Ollama, OpenAI chat, Responses,
//! Messages) alike. The grammar engine (`crate::constrain`) compiles a
//! dialect's grammar; a dialect writes its markup around the JSON values the
//! engine writes ([`JsonRule`]), so it knows nothing of the engine.

mod hermes_json;
mod qwen3_coder_xml;
mod splitter;
pub mod think;

use anyhow::Result;
use serde_json::{Map, Value};

pub use hermes_json::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
pub use splitter::ToolCallSplitter;
pub use think::{Split, ThinkingSplitter};

/// How a chat template writes a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallForm {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen).
    Json,
    /// `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>` (Qwen3-Coder).
    XmlParameters,
}

/// One function the model may call: its name and its arguments' JSON schema.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
}

/// Writes the body of a grammar rule for a JSON value in a tool call that
/// follows a schema, as the grammar engine writes it (`%json {...}`).
pub type JsonRule<'a> = &'a dyn Fn(&Value) -> Result<String>;

impl ToolCallForm {
    /// How a chat template writes tool calls; `None` when it never reads `tools`.
    pub fn of_template(template: &str) -> Option<ToolCallForm> {
        if !template.contains("tools") {
            return None;
        }
        Some(if qwen3_coder_xml::written_by(template) { ToolCallForm::XmlParameters } else { ToolCallForm::Json })
    }

    /// The Lark grammar of calls of `tools` in this form, and the text that
    /// switches it on (`None`: it holds from the first token). `forced`: the
    /// output starts with a call; otherwise it is free until the model opens
    /// one. `parallel`: more calls may follow the first.
    pub fn grammar(self, tools: &[ToolSpec], forced: bool, parallel: bool, json: JsonRule) -> Result<(String, Option<String>)> {
        let calls = match self {
            ToolCallForm::Json => hermes_json::call_rule(tools, json)?,
            ToolCallForm::XmlParameters => qwen3_coder_xml::call_rule(tools, json)?,
        };
        Ok(hermes_json::between_tags(&calls, forced, parallel))
    }
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

/// A piece of the answer: reasoning, text, or a whole call.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    Reasoning(String),
    Text(String),
    Call(ToolCall),
}

/// Reads a generation's streamed text in the model's dialect: its reasoning
/// first, then the answer's text and tool calls in order.
pub struct AnswerReader {
    thinking: Option<ThinkingSplitter>,
    calls: Option<ToolCallSplitter>,
}

impl AnswerReader {
    /// Splits reasoning out with `thinking`, and calls with `calls`; without
    /// either, all the output is the answer's text.
    pub fn new(thinking: Option<ThinkingSplitter>, calls: Option<ToolCallSplitter>) -> AnswerReader {
        AnswerReader { thinking, calls }
    }

    pub fn push(&mut self, piece: &str) -> Vec<Part> {
        let split = match &mut self.thinking {
            Some(s) => s.push(piece),
            None => Split { thinking: String::new(), content: piece.to_string() },
        };
        self.parts(split, None)
    }

    /// Whatever is still held back, once the generation ended; `cut`: it
    /// ended otherwise than the model chose to (its length ran out, or a
    /// shutdown), see [`ToolCallSplitter::finish`].
    pub fn finish(&mut self, cut: bool) -> Vec<Part> {
        let rest = self.thinking.as_mut().map(ThinkingSplitter::finish).unwrap_or_default();
        self.parts(rest, Some(cut))
    }

    fn parts(&mut self, split: Split, cut: Option<bool>) -> Vec<Part> {
        let mut out = Vec::new();
        if !split.thinking.is_empty() {
            out.push(Part::Reasoning(split.thinking));
        }
        let answer = match &mut self.calls {
            Some(calls) => {
                let mut parts = calls.push(&split.content);
                if let Some(cut) = cut {
                    parts.extend(calls.finish(cut));
                }
                parts
            }
            None => vec![Part::Text(split.content)],
        };
        out.extend(answer.into_iter().filter(|p| !matches!(p, Part::Text(t) if t.is_empty())));
        out
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`
/// (text held back while a tag may be starting).
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// A Lark string literal (JSON's escaping is a subset Lark reads).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}
