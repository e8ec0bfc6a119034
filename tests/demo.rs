//! The bundled demo model: its perplexity under our engine equals the oracle's
//! (mlx-lm, float32) on held-out text, and `run` with no model installed uses
//! it and prints English.

use std::path::Path;

use slotstream::generate::Engine;

#[test]
fn demo_perplexity_matches_the_oracle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tools/demo/oracle_perplexity.json")).unwrap()).unwrap();
    let e = Engine::load(&root.join("tools/demo/model"), Box::new(slotstream_cpu::CpuBackend::exact()), &Default::default())
        .expect("loading the demo model");
    let text = std::fs::read_to_string(root.join("tools/demo/heldout_sample.txt")).unwrap();
    let ids = e.codec.encode(&text, false).unwrap();
    let window = golden["window"].as_u64().unwrap() as usize;
    let p = e.perplexity(&ids, window, usize::MAX).unwrap();
    assert_eq!(p.predicted_tokens as u64, golden["predicted_tokens"].as_u64().unwrap(), "same windows as the oracle");
    let want = golden["perplexity"].as_f64().unwrap();
    let rel = (p.perplexity - want).abs() / want;
    // Both sides compute in f32 from the same 4-bit weights; only summation
    // order differs (~1e-6). The issue allows 0.5%; we hold 0.01%.
    assert!(rel < 1e-4, "perplexity {} vs oracle {want} (rel {rel:.2e})", p.perplexity);
}

/// The CPU backend's default for 4-bit weights, int8 activations (x rounded
/// to 8 bits per block of 32, as llama.cpp's Q8_0), is not held to the 1e-4
/// above (its matmuls are ~1e-3 off) but to the issue's own bar for the demo
/// model: perplexity within 0.5% of the oracle's.
#[test]
fn demo_perplexity_with_int8_activations_within_half_a_percent() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tools/demo/oracle_perplexity.json")).unwrap()).unwrap();
    let backend = slotstream_cpu::CpuBackend::with_mode(slotstream_cpu::MatmulMode::Int8);
    let e = Engine::load(&root.join("tools/demo/model"), Box::new(backend), &Default::default()).expect("loading the demo model");
    let text = std::fs::read_to_string(root.join("tools/demo/heldout_sample.txt")).unwrap();
    let ids = e.codec.encode(&text, false).unwrap();
    let window = golden["window"].as_u64().unwrap() as usize;
    let p = e.perplexity(&ids, window, usize::MAX).unwrap();
    let want = golden["perplexity"].as_f64().unwrap();
    let rel = (p.perplexity - want).abs() / want;
    eprintln!("int8 activations: perplexity {} vs oracle {want} (rel {rel:.2e})", p.perplexity);
    assert!(rel < 5e-3, "perplexity {} vs oracle {want} (rel {rel:.2e})", p.perplexity);
}

/// Words of `text` and how many of them are among the commonest English ones.
fn english_words(text: &str) -> (usize, usize) {
    let common = ["the", "and", "of", "a", "to", "in", "he", "was", "it", "i", "you", "is", "my", "that", "not", "be", "me"];
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower.split(|c: char| !c.is_alphabetic()).filter(|w| !w.is_empty()).collect();
    (words.len(), words.iter().filter(|w| common.contains(w)).count())
}

/// Fine-tuned on chat turns (tools/demo/finetune_chat.py), the demo answers a
/// chat message in its template and ends the answer with `<|im_end|>`, so the
/// README's chat examples finish in seconds.
#[test]
fn the_demo_ends_its_answers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let e = Engine::load(&root.join("tools/demo/model"), Box::new(slotstream_cpu::CpuBackend::exact()), &Default::default())
        .expect("loading the demo model");
    let mut all = String::new();
    for message in ["Hello!", "Who are you?", "Why is the sky blue?", "Where did the ship sail?", "Tell me the whole story."] {
        let turn = slotstream::tokenizer::ChatMessage { role: "user".into(), content: message.into() };
        let prompt = e.codec.apply_chat_template(&[turn], true, None).expect("rendering the demo's chat template");
        let req = slotstream::generate::GenerateRequest {
            prompt_ids: e.codec.encode(&prompt, false).expect("encoding the prompt"),
            max_tokens: 200,
            sampling: Default::default(),
            stop: vec![],
            ignore_eos: false,
        };
        let out = e.generate(&req, |_| std::ops::ControlFlow::Continue(())).expect("generating");
        eprintln!("{message:?} -> {} tokens: {:?}", out.generated_ids.len(), out.text);
        assert_eq!(out.finish_reason, slotstream::generate::FinishReason::Stop, "{message:?}: no end of turn in 200 tokens: {:?}", out.text);
        assert!(!out.text.trim().is_empty(), "{message:?}: an empty answer");
        all.push_str(&out.text);
        all.push(' ');
    }
    let (words, hits) = english_words(&all);
    assert!(words >= 20 && hits * 6 >= words, "the answers do not read as English: {all:?}");
}

#[test]
fn run_without_a_model_uses_the_demo_and_prints_english() {
    let home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        // --ignore-eos: 40 tokens of English whatever the answer's own length.
        .args(["run", "--prompt", "The ship sailed out of the harbour and", "--max-tokens", "40", "--ignore-eos"])
        .env("HOME", home.path())
        .env("XDG_CACHE_HOME", home.path().join("cache"))
        .env("HF_HUB_CACHE", home.path().join("hub"))
        .env_remove("HF_HOME")
        .output()
        .expect("running slotstream");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("bundled") && stderr.contains("slotstream pull qwen3.8-flash-next:4bit"), "{stderr}");
    // A model held in memory whole is one line, not the plan (that is -v's).
    assert!(!stderr.contains("memory plan") && stderr.lines().any(|l| l.starts_with("every expert in memory")), "{stderr}");
    assert!(stderr.lines().count() <= 3, "{stderr}");
    let text = String::from_utf8_lossy(&out.stdout);
    let (words, hits) = english_words(&text);
    assert!(words >= 15 && hits * 6 >= words, "does not read as English: {text:?}");
}

/// The trained qwen4_exp model (tools/demo_qwen4): perplexity equals the numpy
/// oracle's on the same held-out windows, and its trained MTP head drafts
/// tokens the model accepts, without changing the greedy output.
#[test]
fn trained_qwen4_exp_matches_its_oracle_and_its_mtp_head_is_accepted() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("tools/demo_qwen4/model");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tools/demo_qwen4/oracle_perplexity.json")).unwrap()).unwrap();
    let opts = slotstream::model::LoadOptions { mtp: true, ..Default::default() };
    let e = Engine::load(&dir, Box::new(slotstream_cpu::CpuBackend::exact()), &opts).expect("loading the qwen4_exp demo");
    let text = std::fs::read_to_string(root.join("tools/demo/heldout_sample.txt")).unwrap();
    let ids = e.codec.encode(&text, false).unwrap();
    let p = e.perplexity(&ids, golden["window"].as_u64().unwrap() as usize, usize::MAX).unwrap();
    assert_eq!(p.predicted_tokens as u64, golden["predicted_tokens"].as_u64().unwrap(), "same windows as the oracle");
    let want = golden["perplexity"].as_f64().unwrap();
    let rel = (p.perplexity - want).abs() / want;
    // f32 against the oracle's float64 on the same stored weights.
    assert!(rel < 1e-4, "perplexity {} vs oracle {want} (rel {rel:.2e})", p.perplexity);

    let prompt = e.codec.encode("The sea was calm, and the ship", false).unwrap();
    let req = slotstream::generate::GenerateRequest {
        prompt_ids: prompt.clone(),
        max_tokens: 64,
        sampling: Default::default(),
        stop: vec![],
        ignore_eos: true,
    };
    let with = e.generate(&req, |_| std::ops::ControlFlow::Continue(())).unwrap();
    let plain = Engine::load(&dir, Box::new(slotstream_cpu::CpuBackend::exact()), &Default::default()).unwrap();
    let without = plain.generate(&req, |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_eq!(with.generated_ids, without.generated_ids, "MTP changed the greedy output");
    let m = with.stats.mtp.expect("MTP stats");
    eprintln!("qwen4_exp demo: perplexity {:.4} (oracle {want:.4}); MTP {m:?}, acceptance {:.0}%", p.perplexity, 100.0 * m.acceptance());
    assert!(m.acceptance() > 0.3 && !m.paused, "the trained head should be accepted often: {m:?}");
    let words: Vec<&str> = with.text.split(|c: char| !c.is_alphabetic()).filter(|w| !w.is_empty()).collect();
    assert!(words.len() >= 20, "expected English words: {:?}", with.text);
}

/// The demo's chat template reads `tools` (Open WebUI attaches its built-in
/// tools to every chat), written Qwen-style; a chat without tools renders
/// exactly the ChatML it was fine-tuned on.
#[test]
fn the_demo_template_renders_tools_qwen_style_and_plain_chats_as_trained() {
    use slotstream::tokenizer::{ChatTurn, TextCodec, ToolCallForm};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let codec = TextCodec::load(&root.join("tools/demo/model"), &[]).expect("the demo's tokenizer");
    assert_eq!(codec.tool_call_form(), Some(ToolCallForm::Json));
    let turn = |role: &str, content: &str| ChatTurn { role: role.into(), content: content.into(), ..ChatTurn::default() };
    let chat = [turn("system", "Be brief."), turn("user", " Hello! "), turn("assistant", "Hi."), turn("user", "Why?")];
    let plain = codec.render_chat(&chat, &[], true, None).expect("renders");
    assert_eq!(
        plain,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n\
         <|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    );
    let tool = serde_json::json!({"type": "function", "function": {"name": "get_current_timestamp", "parameters": {"type": "object"}}});
    let call = serde_json::json!({"id": "c1", "type": "function", "function": {"name": "get_current_timestamp", "arguments": {}}});
    let with_tools = [
        turn("system", "Be brief."),
        turn("user", "What time is it?"),
        ChatTurn { role: "assistant".into(), tool_calls: vec![call], ..ChatTurn::default() },
        ChatTurn { role: "tool".into(), content: "12:00".into(), tool_call_id: Some("c1".into()), ..ChatTurn::default() },
    ];
    let text = codec.render_chat(&with_tools, &[tool], true, None).expect("renders");
    let want = "<|im_start|>system\nBe brief.\n\nFunctions you can call, one JSON signature per line:\n<tools>\n\
        {\"function\": {\"name\": \"get_current_timestamp\", \"parameters\": {\"type\": \"object\"}}, \"type\": \"function\"}\n</tools>\n\
        To call one, answer with\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments as JSON>}}\n</tool_call><|im_end|>\n\
        <|im_start|>user\nWhat time is it?<|im_end|>\n\
        <|im_start|>assistant\n<tool_call>\n{\"name\": \"get_current_timestamp\", \"arguments\": {}}\n</tool_call><|im_end|>\n\
        <|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n\
        <|im_start|>assistant\n";
    assert_eq!(text, want);
}

/// A smaller KV cache (`--kv-cache f16|q8`) with exact matmuls, so that only
/// the cache differs from `cpu:exact`: held-out perplexity in one 2,048-token
/// window within 0.5% (issue 46's bar), and the greedy continuation of a
/// 1,500-token held-out prompt the same ids.
#[test]
fn demo_with_f16_and_q8_kv_caches_keeps_its_perplexity_and_greedy_ids() {
    use slotstream_backend::KvCacheType;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let load = |kv: Option<KvCacheType>| {
        let options = slotstream_cpu::CpuOptions { matmul: slotstream_cpu::MatmulMode::Exact, kv_cache: kv, ..slotstream_cpu::CpuOptions::from_env() };
        Engine::load(&root.join("tools/demo/model"), Box::new(slotstream_cpu::CpuBackend::with_options(options)), &Default::default())
            .expect("loading the demo model")
    };
    let exact = load(None);
    let text = std::fs::read_to_string(root.join("tools/demo/heldout_sample.txt")).unwrap();
    let ids = exact.codec.encode(&text, false).unwrap();
    assert!(ids.len() > 2048, "the sample holds {} tokens", ids.len());
    let greedy = |e: &Engine| {
        let req = slotstream::generate::GenerateRequest {
            prompt_ids: ids[..1500].to_vec(),
            max_tokens: 24,
            sampling: Default::default(),
            stop: vec![],
            ignore_eos: true,
        };
        e.generate(&req, |_| std::ops::ControlFlow::Continue(())).expect("generating").generated_ids
    };
    let want = exact.perplexity(&ids, 2048, 1).unwrap().perplexity;
    let want_ids = greedy(&exact);
    for kv in [KvCacheType::F16, KvCacheType::Q8] {
        let e = load(Some(kv));
        let p = e.perplexity(&ids, 2048, 1).unwrap().perplexity;
        let rel = (p - want).abs() / want;
        eprintln!("{kv} KV: perplexity {p} vs {want} with f32 KV (rel {rel:.2e})");
        assert!(rel < 5e-3 && rel > 0.0, "{kv} KV: perplexity {p} vs {want} (rel {rel:.2e})");
        assert_eq!(greedy(&e), want_ids, "{kv} KV: the greedy ids differ from f32 KV's");
    }
}
