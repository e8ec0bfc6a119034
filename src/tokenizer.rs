//! Text in and out: `tokenizer.json` through the `tokenizers` crate, the
//! model's Jinja chat template through `minijinja`, and UTF-8-correct
//! incremental decoding for streaming.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use serde::Serialize;

/// One chat turn.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A model's tokenizer, chat template and special tokens.
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
}

/// `bos_token`/`eos_token` are either strings or `{"content": ...}` objects.
fn special_token(cfg: &serde_json::Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        v => v.get("content").and_then(|c| c.as_str()).map(String::from),
    }
}

impl TextCodec {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (template and special
    /// tokens), `chat_template.jinja` if present, and merges end-of-sequence ids
    /// from the model config and `generation_config.json`.
    pub fn load(dir: &Path, config_eos: &[u32]) -> Result<TextCodec> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            anyhow::bail!("{} is missing: the model directory needs its tokenizer.json", tok_path.display());
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow!("reading {}: {e}", tok_path.display()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", cfg_path.display()))?
        } else {
            serde_json::Value::Null
        };
        let template_file = dir.join("chat_template.jinja");
        let chat_template = if template_file.exists() {
            Some(std::fs::read_to_string(&template_file).with_context(|| format!("reading {}", template_file.display()))?)
        } else {
            match cfg.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: use the default one.
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(String::from),
                _ => None,
            }
        };
        let bos_token = special_token(&cfg, "bos_token");
        let eos_token = special_token(&cfg, "eos_token");
        let mut eos_ids: Vec<u32> = config_eos.to_vec();
        let gen_path = dir.join("generation_config.json");
        if let Ok(text) = std::fs::read_to_string(&gen_path) {
            let gen: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", gen_path.display()))?;
            match gen.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => eos_ids.extend(n.as_u64().map(|n| n as u32)),
                Some(serde_json::Value::Array(a)) => eos_ids.extend(a.iter().filter_map(|n| n.as_u64()).map(|n| n as u32)),
                _ => {}
            }
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
            eos_ids.push(id);
        }
        eos_ids.sort();
        eos_ids.dedup();
        Ok(TextCodec { tokenizer, chat_template, bos_token, eos_token, eos_ids })
    }

    /// Token ids of `text`; `special` adds the tokenizer's own BOS/EOS wrapping.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, special).map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true).map_err(|e| anyhow!("decoding tokens: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The Jinja chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the chat template. `enable_thinking` is passed through for
    /// templates that support switching reasoning on and off.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool, enable_thinking: Option<bool>) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| anyhow!("this model has no chat template (tokenizer_config.json chat_template); use --raw"))?;
        let mut env = minijinja::Environment::new();
        // As transformers renders chat templates.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", python_tojson);
        env.add_template("chat", template).context("the model's chat template does not parse")?;
        let tmpl = env.get_template("chat").context("loading the chat template")?;
        let mut ctx = std::collections::BTreeMap::<&str, minijinja::Value>::new();
        ctx.insert("messages", minijinja::Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", add_generation_prompt.into());
        ctx.insert("bos_token", self.bos_token.clone().unwrap_or_default().into());
        ctx.insert("eos_token", self.eos_token.clone().unwrap_or_default().into());
        if let Some(t) = enable_thinking {
            ctx.insert("enable_thinking", t.into());
        }
        tmpl.render(ctx).context("rendering the chat template")
    }
}

/// `tojson` as transformers defines it for chat templates: Python's
/// `json.dumps` separators (`", "` and `": "`), non-ASCII kept as is.
fn python_tojson(value: minijinja::Value) -> std::result::Result<minijinja::Value, minijinja::Error> {
    struct PythonStyle;
    impl serde_json::ser::Formatter for PythonStyle {
        fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonStyle);
    serde::Serialize::serialize(&value, &mut ser)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(minijinja::Value::from_safe_string(text))
}

/// Turns a stream of token ids into text pieces that are always whole UTF-8
/// characters, even when a character's bytes span several tokens.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the tokens decoded together for context.
    prefix: usize,
    /// End of the tokens whose text has been emitted.
    read: usize,
}

impl StreamDecoder {
    /// Adds one token; returns newly completed text, if any.
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let now = codec.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let piece = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever text is still held back (an incomplete character at the end).
    pub fn finish(&mut self, codec: &TextCodec) -> Result<String> {
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let now = codec.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or("").to_string())
    }
}
