//! Text in and out: chat templates, UTF-8-correct streaming, stop strings.

use std::path::{Path, PathBuf};

use slotstream::tokenizer::{ChatMessage, StreamDecoder, TextCodec};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn codec() -> TextCodec {
    TextCodec::load(&fixture("qwen3_next_mlx4"), &[511]).expect("loading the fixture tokenizer")
}

#[test]
fn chat_template_renders_chatml_turns() {
    let c = codec();
    let msgs = vec![
        ChatMessage { role: "system".into(), content: "Be brief.".into() },
        ChatMessage { role: "user".into(), content: "Hello!".into() },
    ];
    let text = c.apply_chat_template(&msgs, true, None).unwrap();
    assert!(text.contains("<|im_start|>system\nBe brief.<|im_end|>"), "{text}");
    assert!(text.contains("<|im_start|>user\nHello!<|im_end|>"), "{text}");
    assert!(text.trim_end().ends_with("<|im_start|>assistant"), "{text}");
    let ids = c.encode(&text, false).unwrap();
    assert!(ids.contains(&510) && ids.contains(&511), "special tokens are single ids: {ids:?}");
}

#[test]
fn end_of_sequence_ids_merge_config_and_generation_config() {
    let c = codec();
    assert!(c.eos_ids.contains(&511) && c.eos_ids.contains(&509), "{:?}", c.eos_ids);
}

#[test]
fn streaming_never_splits_a_character() {
    let c = codec();
    let text = "Naïve café — “quoted” 日本語 ok";
    let ids = c.encode(text, false).unwrap();
    assert!(ids.len() > 10);
    let mut d = StreamDecoder::default();
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(d.push(&c, id).unwrap());
    }
    pieces.push(d.finish(&c).unwrap());
    for p in &pieces {
        assert!(!p.contains('\u{FFFD}'), "a piece holds half a character: {pieces:?}");
    }
    assert_eq!(pieces.concat(), c.decode(&ids).unwrap());
    assert_eq!(pieces.concat(), text);
    // Multi-byte characters really were split across tokens somewhere.
    assert!(pieces.iter().any(|p| p.is_empty()), "expected some tokens to end mid-character: {pieces:?}");
}

/// A template of our own that uses what real Qwen templates use (namespace,
/// reversed slices, `is string`, Python string methods, trim/lstrip blocks,
/// `tojson`, `enable_thinking`), rendered as transformers (jinja2 with
/// trim_blocks and lstrip_blocks) renders it; the expected strings came from jinja2.
#[test]
fn qwen_style_template_renders_like_transformers() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("qwen3_next_mlx4").join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("chat_template.jinja"), TEMPLATE).unwrap();
    let c = TextCodec::load(dir.path(), &[]).unwrap();
    let msg = |role: &str, content: &str| ChatMessage { role: role.into(), content: content.into() };
    let msgs = vec![
        msg("system", " Be brief. "),
        msg("user", "Hi"),
        msg("assistant", "<think>\nhmm\n</think>\n\n Hello! "),
        msg("user", "Tell me more"),
    ];
    assert_eq!(c.apply_chat_template(&msgs, true, Some(false)).unwrap(), WITH_THINKING_OFF);
    assert_eq!(c.apply_chat_template(&msgs, true, None).unwrap(), DEFAULT);
}

const TEMPLATE: &str = "{%- if messages[0].role == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0].content | trim + '<|im_end|>\\n' }}\n{%- endif %}\n{%- set ns = namespace(last_user=messages|length - 1) %}\n{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n    {%- if message.role == \"user\" and message.content is string and not message.content.startswith('<tool') %}\n        {%- if ns.last_user == messages|length - 1 %}{%- set ns.last_user = index %}{%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- set content = message.content if message.content is string else '' %}\n    {%- if message.role == \"user\" %}\n        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {%- if '</think>' in content %}\n            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n        {%- endif %}\n        {{- '<|im_start|>assistant\\n' + content.strip() + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n{{ {'n': ns.last_user} | tojson }}\n";
const WITH_THINKING_OFF: &str = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nTell me more<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{\"n\": 1}";
const DEFAULT: &str = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nTell me more<|im_end|>\n<|im_start|>assistant\n{\"n\": 1}";
