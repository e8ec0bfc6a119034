//! Reasoning ("thinking") wrapped in `<think>` ... `</think>` (Qwen3,
//! Qwen3.5, DeepSeek-R1 and the templates that copy them): the template's
//! switch, the prompt that opens the reasoning itself, the grammar that lets
//! reasoning run free before a constraint holds, and the splitter that
//! parts streamed output into reasoning and the answer.

use anyhow::{bail, Result};

use super::partial_suffix;

const OPEN: &str = "<think>";
/// Ends the reasoning (a constraint waits for it where the prompt opened it).
pub const CLOSE: &str = "</think>";

/// Whether a chat template has the `enable_thinking` switch (Qwen3's).
pub fn template_has_switch(template: &str) -> bool {
    template.contains("enable_thinking")
}

/// Whether a prompt the chat template rendered ends inside a reasoning block
/// it opened (Qwen3.5's templates do, thinking on): the output starts as
/// reasoning.
pub fn prompt_opens_reasoning(rendered: &str) -> bool {
    rendered.trim_end().ends_with(OPEN)
}

/// `lark` (whose `start` rule is the constrained output) preceded by free
/// reasoning that ends at its first `</think>`, and a little blank (a weak
/// model could otherwise spend its tokens on blanks).
pub fn after_reasoning(lark: &str) -> Result<String> {
    let Some(body) = lark.strip_prefix("start:") else { bail!("the grammar does not begin with its start rule") };
    Ok(format!(
        "start: REASONING BLANK? constrained\n\
         REASONING: /(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.)+/\n\
         BLANK: /[ \\t\\r\\n]{{1,3}}/\n\
         constrained:{body}"
    ))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace seen yet; an opening tag may still come.
    Start,
    Thinking,
    /// Just after the closing tag: leading whitespace of the answer is dropped.
    AfterThinking,
    Answer,
}

/// Text routed to one side or the other.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub thinking: String,
    pub content: String,
}

/// Parts streamed output into reasoning and the answer.
pub struct ThinkingSplitter {
    phase: Phase,
    pending: String,
}

impl ThinkingSplitter {
    /// `prompt_opens_thinking`: the rendered prompt already ends with `<think>`,
    /// so output starts inside the reasoning.
    pub fn new(prompt_opens_thinking: bool) -> ThinkingSplitter {
        let phase = if prompt_opens_thinking { Phase::Thinking } else { Phase::Start };
        ThinkingSplitter { phase, pending: String::new() }
    }

    pub fn push(&mut self, piece: &str) -> Split {
        self.pending.push_str(piece);
        let mut out = Split::default();
        loop {
            match self.phase {
                Phase::Start => {
                    let trimmed = self.pending.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.pending = rest.trim_start().to_string();
                        self.phase = Phase::Thinking;
                    } else if OPEN.starts_with(trimmed) {
                        return out; // maybe the start of the tag
                    } else {
                        self.phase = Phase::Answer;
                    }
                }
                Phase::Thinking => {
                    if let Some(at) = self.pending.find(CLOSE) {
                        out.thinking.push_str(&self.pending[..at]);
                        self.pending = self.pending[at + CLOSE.len()..].to_string();
                        self.phase = Phase::AfterThinking;
                    } else {
                        let keep = partial_suffix(&self.pending, CLOSE);
                        let cut = self.pending.len() - keep;
                        out.thinking.push_str(&self.pending[..cut]);
                        self.pending.drain(..cut);
                        return out;
                    }
                }
                Phase::AfterThinking => {
                    let trimmed = self.pending.trim_start();
                    if trimmed.is_empty() {
                        self.pending.clear();
                        return out;
                    }
                    self.pending = trimmed.to_string();
                    self.phase = Phase::Answer;
                }
                Phase::Answer => {
                    out.content.push_str(&self.pending);
                    self.pending.clear();
                    return out;
                }
            }
        }
    }

    /// Whatever is still held back.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        match self.phase {
            Phase::Thinking => Split { thinking: rest, content: String::new() },
            Phase::AfterThinking => Split::default(),
            Phase::Start | Phase::Answer => Split { thinking: String::new(), content: rest },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(opens: bool, pieces: &[&str]) -> Split {
        let mut s = ThinkingSplitter::new(opens);
        let mut all = Split::default();
        for p in pieces {
            let o = s.push(p);
            all.thinking += &o.thinking;
            all.content += &o.content;
        }
        let o = s.finish();
        all.thinking += &o.thinking;
        all.content += &o.content;
        all
    }

    #[test]
    fn tags_split_across_pieces() {
        let got = run(false, &["<th", "ink>\nhmm, ", "let me see</th", "ink>\n\nThe answer", " is 4."]);
        assert_eq!(got, Split { thinking: "hmm, let me see".into(), content: "The answer is 4.".into() });
    }

    #[test]
    fn without_tags_everything_is_content() {
        assert_eq!(run(false, &["Hello", " <b>world</b>"]).content, "Hello <b>world</b>");
        assert_eq!(run(false, &["<thin"]).content, "<thin");
    }

    #[test]
    fn prompt_that_opens_thinking() {
        let got = run(true, &["a < b", "</think>", "yes"]);
        assert_eq!(got, Split { thinking: "a < b".into(), content: "yes".into() });
    }
}
