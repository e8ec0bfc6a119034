//! Special tokens' text in client strings kept as plain text: the escape
//! that marks it through the chat template, and the tokenization that
//! spells it in ordinary tokens.

use anyhow::{anyhow, Context, Result};

/// Control tokens only from the chat template: the text of a special token
/// (`<|im_end|>`, `<|fim_middle|>`) that a client wrote is tokenized as the
/// plain text it is, never as the token, so a message cannot forge a turn.
///
/// Client strings go into the template with each special token's text
/// replaced by an escape (`escape` and then a character naming the token)
/// that templates pass along as they do any text; the rendered prompt is
/// then tokenized run by run, each escape as its token's text spelt in
/// ordinary tokens.
pub(super) struct PlainSpecials {
    /// Special tokens' texts, longest first (a longer one wins where two start
    /// at one place), with their ids when tokenized as plain text.
    pub(super) texts: Vec<(String, Vec<u32>)>,
    /// A private-use character the chat template does not contain.
    escape: char,
    /// Finds the escape character (pattern 0) and special text `i` (pattern `i + 1`).
    finder: aho_corasick::AhoCorasick,
}

/// The character after the escape that names special text `i`: from plane 16's private-use area.
const FIRST_SPECIAL_MARK: u32 = 0x10_0000;
/// Special texts the escape can name (plane 16's private-use characters).
const MAX_SPECIAL_MARKS: usize = 0xFFFE;

impl PlainSpecials {
    pub(super) fn new(tokenizer: &mut tokenizers::Tokenizer, template: Option<&str>) -> Result<PlainSpecials> {
        let mut texts: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        texts.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        texts.dedup();
        texts.truncate(MAX_SPECIAL_MARKS);
        tokenizer.set_encode_special_tokens(true);
        let spelt: Result<Vec<(String, Vec<u32>)>> = texts
            .into_iter()
            .map(|text| {
                let ids = tokenizer.encode(text.as_str(), false).map_err(|e| anyhow!("tokenizing {text:?} as plain text: {e}"))?;
                Ok((text, ids.get_ids().to_vec()))
            })
            .collect();
        tokenizer.set_encode_special_tokens(false);
        let template = template.unwrap_or("");
        let escape = ('\u{E000}'..='\u{F8FF}').find(|c| !template.contains(*c)).ok_or_else(|| {
            anyhow!("the chat template uses every private-use character, leaving none to mark client text with; it is broken or hostile")
        })?;
        let texts = spelt?;
        let patterns = std::iter::once(escape.to_string()).chain(texts.iter().map(|(t, _)| t.clone()));
        let finder = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(patterns)
            .context("indexing the special tokens' texts")?;
        Ok(PlainSpecials { texts, escape, finder })
    }

    /// `text` with each special token's text replaced by its escape (and the
    /// escape character itself doubled).
    pub(super) fn escape(&self, text: &str) -> String {
        let mut out = String::new();
        let mut done = 0;
        for found in self.finder.find_iter(text) {
            out.push_str(&text[done..found.start()]);
            match found.pattern().as_usize() {
                0 => {
                    out.push(self.escape);
                    out.push(self.escape);
                }
                n => {
                    out.push(self.escape);
                    out.push(char::from_u32(FIRST_SPECIAL_MARK + (n - 1) as u32).unwrap_or(self.escape));
                }
            }
            done = found.end();
        }
        if done == 0 {
            return text.to_string();
        }
        out.push_str(&text[done..]);
        out
    }

    /// Every string in `value` (object keys too) escaped.
    pub(super) fn escape_json(&self, value: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match value {
            Value::String(s) => Value::String(self.escape(s)),
            Value::Array(items) => Value::Array(items.iter().map(|v| self.escape_json(v)).collect()),
            Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (self.escape(k), self.escape_json(v))).collect()),
            other => other.clone(),
        }
    }

    /// The pieces of a rendered prompt: template text (its special tokens'
    /// text stays control tokens) and client special text (`Err`: the index
    /// of the special text, to be written as plain text). An escape the
    /// template cut apart stays text.
    pub(super) fn pieces(&self, rendered: &str) -> Vec<Result<String, usize>> {
        let mut pieces = Vec::new();
        let mut run = String::new();
        let mut chars = rendered.chars().peekable();
        while let Some(c) = chars.next() {
            if c != self.escape {
                run.push(c);
                continue;
            }
            let named = chars.peek().and_then(|&n| {
                if n == self.escape {
                    return Some(None);
                }
                let i = (n as u32).checked_sub(FIRST_SPECIAL_MARK)? as usize;
                (i < self.texts.len()).then_some(Some(i))
            });
            match named {
                Some(None) => {
                    chars.next();
                    run.push(c);
                }
                Some(Some(i)) => {
                    chars.next();
                    pieces.push(Ok(std::mem::take(&mut run)));
                    pieces.push(Err(i));
                }
                None => run.push(c),
            }
        }
        pieces.push(Ok(run));
        pieces
    }

    /// The rendered prompt as text, escapes written back as what they stand for.
    pub(super) fn text(&self, rendered: &str) -> String {
        self.pieces(rendered)
            .into_iter()
            .map(|p| match p {
                Ok(text) => text,
                Err(i) => self.texts[i].0.clone(),
            })
            .collect()
    }
}

