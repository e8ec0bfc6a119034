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
