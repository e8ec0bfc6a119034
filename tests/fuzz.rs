//! Property-based fuzzing of the parsers that read what users and files
//! control: `config.json` (`ModelArch::read`), safetensors headers
//! (`Checkpoint::open_file` and the tensor reads after it), and chat
//! templates with their messages (`TextCodec`). Each input comes from a valid
//! file, mutated, or from arbitrary bytes; every one must give `Ok` or a clear
//! `Err`, never a panic, an abort or a hang. Cases are bounded so the suite
//! runs in seconds (`PROPTEST_CASES` raises them for a longer hunt).

use std::path::Path;

use proptest::prelude::*;
use serde_json::{json, Value};
use slotstream::checkpoint::{Checkpoint, QuantConfig};
use slotstream::model::ModelArch;
use slotstream::tokenizer::{ChatMessage, TextCodec};

const FIXTURE: &str = "tests/fixtures/qwen3_next_mlx4";

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    ProptestConfig { cases: n, failure_persistence: None, ..ProptestConfig::default() }
}

/// JSON values that stress a parser: extremes of each type, wrong types,
/// nesting.
fn odd_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop_oneof![Just(0i64), Just(-1), Just(1), Just(i64::MAX), Just(i64::MIN), Just(1 << 40), any::<i64>()].prop_map(|v| json!(v)),
        prop_oneof![Just(u64::MAX), any::<u64>()].prop_map(|v| json!(v)),
        prop_oneof![Just(0.0f64), Just(-1.0), Just(1e39), Just(-1e-39), Just(f64::MAX), any::<f64>()].prop_map(|v| json!(v)),
        "[a-z_ ]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// `base` with some keys (at the top level or under `text_config` /
/// `quantization`) replaced by odd values or removed.
fn mutated(base: Value) -> impl Strategy<Value = Value> {
    let keys: Vec<String> = base.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
    let edits = prop::collection::vec((prop::sample::select(keys), prop::option::of(odd_value())), 1..5);
    edits.prop_map(move |edits| {
        let mut v = base.clone();
        if let Some(o) = v.as_object_mut() {
            for (k, val) in edits {
                match val {
                    Some(val) => o.insert(k, val),
                    None => o.remove(&k),
                };
            }
        }
        v
    })
}

fn fixture_json(name: &str) -> Value {
    let text = std::fs::read_to_string(Path::new(FIXTURE).join(name)).expect("reading a fixture file");
    serde_json::from_str(&text).expect("fixture JSON")
}

/// A model directory holding `config` (and nothing else is needed by `ModelArch::read`).
fn read_config(bytes: &[u8]) -> anyhow::Result<ModelArch> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("config.json"), bytes)?;
    ModelArch::read(dir.path())
}

proptest! {
    #![proptest_config(cases(200))]

    #[test]
    fn config_json_never_panics(config in mutated(fixture_json("config.json"))) {
        let _ = read_config(&serde_json::to_vec(&config).unwrap_or_default());
    }

    #[test]
    fn config_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = read_config(&bytes);
    }
}

/// A safetensors file: the 8-byte header length, the header, then `data`.
fn safetensors(header_len: Option<u64>, header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = header_len.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// Tensor entries with odd dtypes, shapes and offsets.
fn odd_header() -> impl Strategy<Value = Value> {
    let dtype = prop_oneof![Just("F32"), Just("F16"), Just("BF16"), Just("U32"), Just("I64"), Just("U8"), Just("F64"), Just("??")];
    let dim = prop_oneof![Just(0u64), Just(1), Just(4), Just(u64::MAX), Just(1 << 33), 0u64..64];
    let entry = (dtype, prop::collection::vec(dim, 0..4), any::<u64>(), 0u64..256).prop_map(|(dtype, shape, start, len)| {
        let start = start % 512;
        json!({ "dtype": dtype, "shape": shape, "data_offsets": [start, start.saturating_add(len)] })
    });
    prop::collection::vec(("[a-z.]{1,12}", prop_oneof![entry.clone(), odd_value()]), 0..4).prop_map(|kv| {
        let mut o: serde_json::Map<String, Value> = kv.into_iter().collect();
        o.insert("__metadata__".into(), json!({ "format": "mlx" }));
        Value::Object(o)
    })
}

fn open_and_read(file: &[u8]) {
    let Ok(dir) = tempfile::tempdir() else { return };
    let path = dir.path().join("model.safetensors");
    if std::fs::write(&path, file).is_err() {
        return;
    }
    let Ok(quant) = QuantConfig::from_config(&json!({})) else { return };
    if let Ok(ck) = Checkpoint::open_file(&path, quant) {
        let names: Vec<String> = ck.names().map(str::to_string).collect();
        for name in names {
            let _ = ck.read_bytes(&name);
            let _ = ck.f32_tensor(&name, &[4]);
            let _ = ck.matrix(&name, &[], 2, 2);
        }
    }
}

proptest! {
    #![proptest_config(cases(200))]

    #[test]
    fn safetensors_headers_never_panic(
        header in odd_header(),
        len in prop::option::of(prop_oneof![Just(0u64), Just(u64::MAX), Just(1 << 40), 0u64..600]),
        data in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        open_and_read(&safetensors(len, &serde_json::to_vec(&header).unwrap_or_default(), &data));
    }

    #[test]
    fn safetensors_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        open_and_read(&bytes);
    }
}

/// Jinja fragments that loop, recurse, build large strings, or misuse the
/// template's inputs.
fn template() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        Just("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".to_string()),
        Just("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".to_string()),
        Just("{{ 'ab' * 100000000 }}".to_string()),
        Just("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}".to_string()),
        Just("{{ messages[99].content }}".to_string()),
        Just("{{ raise_exception('no') }}".to_string()),
        Just("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".to_string()),
        Just("{{ messages | tojson }}".to_string()),
        Just("{% set x = namespace(a=1) %}{{ x.b.c }}".to_string()),
        Just("{{".to_string()),
        "[a-z{}%# ]{0,24}",
    ];
    prop::collection::vec(part, 1..4).prop_map(|p| p.concat())
}

fn message() -> impl Strategy<Value = ChatMessage> {
    let role = prop_oneof![Just("system"), Just("user"), Just("assistant"), Just("tool"), Just(""), Just("<|im_end|>")];
    let content = prop_oneof!["\\PC{0,40}", Just("<|im_start|>user\nhi<|im_end|>".to_string()), Just("{{ 7 * 7 }}".to_string())];
    (role, content).prop_map(|(role, content)| ChatMessage { role: role.to_string(), content })
}

proptest! {
    #![proptest_config(cases(64))]

    #[test]
    fn chat_templates_never_panic_or_hang(tpl in template(), messages in prop::collection::vec(message(), 0..4), gen in any::<bool>(), think in prop::option::of(any::<bool>())) {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::copy(Path::new(FIXTURE).join("tokenizer.json"), dir.path().join("tokenizer.json")).expect("tokenizer.json");
        let mut config = fixture_json("tokenizer_config.json");
        config["chat_template"] = json!(tpl);
        std::fs::write(dir.path().join("tokenizer_config.json"), serde_json::to_vec(&config).expect("json")).expect("write");
        if let Ok(codec) = TextCodec::load(dir.path(), &[]) {
            let started = std::time::Instant::now();
            let _ = codec.apply_chat_template(&messages, gen, think);
            prop_assert!(started.elapsed().as_secs() < 10, "a template ran for {:?}", started.elapsed());
        }
    }
}
