//! Constrained decoding: output that must follow a JSON schema or the
//! grammar of a tool call, enforced token by token over the model's own
//! vocabulary.
//!
//! The grammar engine is [llguidance] (what llama.cpp, vLLM, SGLang and
//! Chromium use): it compiles JSON schemas and Lark grammars itself, and
//! computes the mask of allowed tokens from a trie of the vocabulary's bytes
//! in tens of microseconds per token, lazily, without precomputing every
//! state (so a large schema costs no start-up time). Hand-written JSON
//! grammars or a regex-per-token scan would be slower and less complete.
//!
//! [`Grammars`] is built once per model from `tokenizer.json`;
//! [`Grammars::constraint`] turns a [`ConstraintSpec`] into a
//! [`GrammarConstraint`], which the engine drives through
//! [`TokenConstraint`]. A constraint may wait for a trigger (the text that
//! opens a tool call) and leave the output free until it appears, so a model
//! that answers in prose instead pays nothing but a byte comparison.
//! A server compiles with [`Grammars::constraint_until`], which a client
//! that leaves (or a deadline) stops at once (`abandonable.rs`).

mod abandonable;
mod grammar;

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

pub use abandonable::{grammar_probe_main, isolate_grammar_compiles, probe_until, CompileFailure, GRAMMAR_PROBE_ARG, PROBE_MEMORY_BYTES};
pub use crate::dialect::{ToolCallForm, ToolSpec};
pub use grammar::{ConstraintSpec, MAX_SCHEMA_BYTES};

use crate::dialect::think;
use crate::generate::TokenConstraint;
use crate::model_files;

/// The grammar engine set up for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    trie: Arc<TokTrie>,
}

impl Grammars {
    /// Reads `tokenizer.json` in `dir` and builds the vocabulary trie for a
    /// model whose logits have `vocab` entries; `eos` are the ids that end
    /// generation (allowed wherever the grammar may end).
    pub fn load(dir: &Path, vocab: usize, eos: &[u32]) -> Result<Grammars> {
        let path = dir.join("tokenizer.json");
        let text = model_files::read_text(&path, model_files::TOKENIZER_MAX_BYTES)?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_tokenizer_json(&json, vocab, eos).with_context(|| format!("preparing constrained decoding for {}", path.display()))
    }

    fn from_tokenizer_json(json: &serde_json::Value, vocab: usize, eos: &[u32]) -> Result<Grammars> {
        // llguidance reads byte-level BPE vocabularies (Qwen, Llama 3, GPT-2
        // style) exactly; other decoders are refused here rather than guessed.
        let decoder = json.get("decoder").and_then(|d| d.get("type")).and_then(|t| t.as_str());
        if decoder != Some("ByteLevel") {
            bail!("constrained decoding needs a byte-level BPE tokenizer; this one's decoder is {decoder:?}");
        }
        let mut words = llguidance::token_bytes_from_tokenizer_json(json)?;
        if words.len() > vocab {
            bail!("the tokenizer has {} tokens but the model's vocabulary only {vocab}", words.len());
        }
        // Ids the tokenizer leaves unnamed (padding rows of the embedding) can
        // never match text: they become special tokens no grammar names.
        for (id, word) in words.iter_mut().enumerate() {
            if word.is_empty() {
                *word = placeholder(id);
            }
        }
        words.extend((words.len()..vocab).map(placeholder));
        let first_eos = *eos.first().context("the model names no end-of-sequence token")?;
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie.clone()));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars { factory, trie: Arc::new(trie) })
    }

    /// A constraint following `spec`; a schema or tool list the engine cannot
    /// compile is an error that says why (the caller answers 400).
    pub fn constraint(&self, spec: &ConstraintSpec) -> Result<GrammarConstraint> {
        self.constraint_after(spec, false)
    }

    /// As [`Self::constraint`]; `reasoning_open`: the prompt ends inside a
    /// `<think>` block it opened (Qwen3.5's templates do, thinking on), so the
    /// output is the model's reasoning up to `</think>` first, and the
    /// constraint holds from there on (a call drafted in the reasoning
    /// neither arms nor satisfies it).
    pub fn constraint_after(&self, spec: &ConstraintSpec, reasoning_open: bool) -> Result<GrammarConstraint> {
        self.build(GrammarPlan::new(spec, reasoning_open)?)
    }

    /// Compiles a planned grammar over this model's vocabulary.
    fn build(&self, plan: GrammarPlan) -> Result<GrammarConstraint> {
        let matcher = compile(&self.factory, plan.lark)?;
        Ok(GrammarConstraint { matcher, trie: self.trie.clone(), trigger: plan.trigger })
    }
}

/// What a constraint compiles: its Lark grammar, and the trigger that
/// switches it on (checked and written, not yet compiled).
struct GrammarPlan {
    lark: String,
    trigger: Option<Trigger>,
}

impl GrammarPlan {
    fn new(spec: &ConstraintSpec, reasoning_open: bool) -> Result<GrammarPlan> {
        spec.check()?;
        let (lark, trigger) = lark(spec)?;
        Ok(match (trigger, reasoning_open) {
            (Some(t), true) => GrammarPlan { lark, trigger: Some(Trigger::after(&[think::CLOSE, &t])) },
            (Some(t), false) => GrammarPlan { lark, trigger: Some(Trigger::after(&[&t])) },
            (None, true) => GrammarPlan { lark: think::after_reasoning(&lark)?, trigger: None },
            (None, false) => GrammarPlan { lark, trigger: None },
        })
    }
}

/// Compiles `lark` with `factory` into a matcher that allows a first token.
fn compile(factory: &ParserFactory, lark: String) -> Result<Matcher> {
    let parser = factory.create_parser(TopLevelGrammar::from_lark(lark)).map_err(|e| anyhow!("{}", first_line(&e.to_string())))?;
    let mut matcher = Matcher::new(Ok(parser));
    if let Some(e) = matcher.get_error() {
        bail!("{}", first_line(&e));
    }
    // A grammar that allows no first token (a schema whose `$ref`s only
    // name each other, say) is found here, not mid-generation.
    if let Err(e) = matcher.compute_mask() {
        bail!("it admits no output at all ({}): a schema whose $refs only refer to each other, or one no value satisfies?", first_line(&e.to_string()));
    }
    Ok(matcher)
}

/// The Lark grammar for `spec`, and the text that must be generated before
/// it applies (`None`: from the first token).
fn lark(spec: &ConstraintSpec) -> Result<(String, Option<String>)> {
    match spec {
        ConstraintSpec::JsonObject => Ok((format!("start: {}\n", grammar::json_rule(&serde_json::json!({"type": "object"}), false)?), None)),
        ConstraintSpec::JsonSchema(schema) => {
            // An object lists all its keys unless it says otherwise, as
            // llama.cpp's schema grammars (and so Ollama's) read it.
            let mut schema = schema.clone();
            grammar::declared_only(&mut schema);
            Ok((format!("start: {}\n", grammar::json_rule(&schema, false)?), None))
        }
        ConstraintSpec::ToolCalls { tools, forced, parallel, form } => form.grammar(tools, *forced, *parallel, &grammar::tool_json_rule),
    }
}

fn placeholder(id: usize) -> Vec<u8> {
    let mut name = format!(".<[{id}]>").into_bytes();
    name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
    name
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// Text that switches a constraint on: until it has been generated the
/// output is free.
struct Trigger {
    /// Texts to be generated in turn (the end of the reasoning first, where
    /// the prompt opened it); the last one switches the constraint on.
    texts: Vec<Vec<u8>>,
    /// The text looked for now.
    next: usize,
    /// The last bytes generated, at most as many as the text looked for has.
    recent: Vec<u8>,
}

impl Trigger {
    fn after(texts: &[&str]) -> Trigger {
        let texts = texts.iter().filter(|t| !t.is_empty()).map(|t| t.as_bytes().to_vec()).collect();
        Trigger { texts, next: 0, recent: Vec::new() }
    }

    /// Adds a token's bytes; returns the bytes that followed the trigger in
    /// them when the trigger is now complete.
    fn push(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        let mut start = self.recent.len();
        self.recent.extend_from_slice(bytes);
        loop {
            let Some(looked_for) = self.texts.get(self.next) else { return Some(std::mem::take(&mut self.recent)) };
            let first_end = start.saturating_sub(looked_for.len() - 1);
            let found = (first_end..=self.recent.len().saturating_sub(looked_for.len()))
                .find(|&at| self.recent[at..].starts_with(looked_for));
            let Some(at) = found else {
                let keep = looked_for.len() - 1;
                if self.recent.len() > keep {
                    self.recent.drain(..self.recent.len() - keep);
                }
                return None;
            };
            // Look for the next text in what followed this one.
            self.recent.drain(..at + looked_for.len());
            self.next += 1;
            start = 0;
        }
    }
}

/// A grammar applied to one generation.
pub struct GrammarConstraint {
    matcher: Matcher,
    trie: Arc<TokTrie>,
    /// Present while the grammar waits for its trigger.
    trigger: Option<Trigger>,
}

impl GrammarConstraint {
    fn check(&self) -> Result<()> {
        match self.matcher.get_error() {
            Some(e) => bail!("the output constraint failed: {}", first_line(&e)),
            None => Ok(()),
        }
    }
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<bool> {
        if self.trigger.is_some() {
            return Ok(true);
        }
        if self.matcher.is_stopped() {
            self.check()?;
            return Ok(false);
        }
        let allowed = self.matcher.compute_mask().map_err(|e| anyhow!("the output constraint failed: {e}"))?;
        if allowed.is_zero() {
            return Ok(false);
        }
        let n = logits.len();
        allowed.iter_unset_entries(|id| {
            if id < n {
                logits[id] = f32::NEG_INFINITY;
            }
        });
        Ok(true)
    }

    fn commit(&mut self, token: u32) -> Result<bool> {
        if let Some(trigger) = &mut self.trigger {
            let bytes = if self.trie.is_special_token(token) { &[][..] } else { self.trie.token(token) };
            let Some(rest) = trigger.push(bytes) else { return Ok(false) };
            self.trigger = None;
            if !rest.is_empty() {
                // The token that completed the trigger carried text past it:
                // that text is the grammar's start.
                let ids = self.trie.greedy_tokenize(&rest);
                self.matcher
                    .consume_tokens(&ids)
                    .map_err(|e| anyhow!("the constrained output cannot start with {:?}: {e}", String::from_utf8_lossy(&rest)))?;
            }
            return Ok(self.matcher.is_stopped());
        }
        self.matcher.consume_token(token).map_err(|e| anyhow!("the output constraint failed: {e}"))?;
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests;
