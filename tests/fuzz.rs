//! Property-based fuzzing of the parsers that read what users and files
//! control: `config.json` (`ModelArch::read`), safetensors headers
//! (`Checkpoint::open_file` and the tensor reads after it), and chat
//! templates with their messages (`TextCodec`). Each input comes from a valid
//! file, mutated, or from arbitrary bytes; every one must give `Ok` or a clear
//! `Err`, never a panic, an abort or a hang; JSON schemas and tool
//! definitions (`Grammars::constraint`), which compile or are refused within
//! seconds; and HTTP request bodies sent to
//! `slotstream serve`, which must get a 2xx or a 4xx naming what was wrong.
//! Cases are bounded so the suite
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

/// `base` with some keys (at the top level or one level down, e.g. under
/// `text_config` or `quantization`) replaced by odd values or removed.
fn mutated(base: Value) -> impl Strategy<Value = Value> {
    let mut keys: Vec<(String, Option<String>)> = Vec::new();
    if let Some(o) = base.as_object() {
        for (k, v) in o {
            keys.push((k.clone(), None));
            if let Some(inner) = v.as_object() {
                keys.extend(inner.keys().map(|i| (k.clone(), Some(i.clone()))));
            }
        }
    }
    let edits = prop::collection::vec((prop::sample::select(keys), prop::option::of(odd_value())), 1..5);
    edits.prop_map(move |edits| {
        let mut v = base.clone();
        for ((outer, inner), val) in edits {
            let target = match &inner {
                None => v.as_object_mut(),
                Some(_) => v.get_mut(&outer).and_then(Value::as_object_mut),
            };
            let Some(o) = target else { continue };
            let key = inner.unwrap_or(outer);
            match val {
                Some(val) => o.insert(key, val),
                None => o.remove(&key),
            };
        }
        v
    })
}

fn fixture_json(name: &str) -> Value {
    fixture_json_of(FIXTURE, name)
}

fn fixture_json_of(dir: &str, name: &str) -> Value {
    let text = std::fs::read_to_string(Path::new(dir).join(name)).expect("reading a fixture file");
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

    /// qwen4_exp's config: `text_config`, n-gram and sparse-attention settings.
    #[test]
    fn qwen4_exp_config_json_never_panics(config in mutated(fixture_json_of("tests/fixtures/qwen4_exp_tiny", "config.json"))) {
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
            // On a thread, so that a template that never ends fails the
            // case after 10 s instead of hanging the suite.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = codec.apply_chat_template(&messages, gen, think);
                let _ = tx.send(());
            });
            match rx.recv_timeout(std::time::Duration::from_secs(10)) {
                Ok(()) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => prop_assert!(false, "a template ran for over 10 s"),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => prop_assert!(false, "rendering a template panicked"),
            }
        }
    }
}

// ---- JSON schemas and tool definitions ----
// Random schemas (nested, recursive through $ref, with patterns, bounds and
// enums) and the tools built from them: each compiles into a grammar or is
// refused with a reason, within seconds, never a panic.

/// A schema built from the keywords the grammar engine reads, nested.
fn schema() -> impl Strategy<Value = Value> {
    let number = prop_oneof![Just(json!(0)), Just(json!(-1)), Just(json!(1e-10)), Just(json!(9007199254740991i64)),
        Just(json!(1e19)), Just(json!(i64::MIN)), Just(json!(u64::MAX)), any::<i32>().prop_map(|v| json!(v)), any::<f64>().prop_map(|v| json!(v))];
    let leaf = prop_oneof![
        Just(json!({"type": "string"})),
        Just(json!({"type": "boolean"})),
        Just(json!({"$ref": "#"})),
        Just(json!({"$ref": "#/$defs/a"})),
        Just(json!({"type": "string", "pattern": "^((a|aa)*b)+$"})),
        Just(json!({"enum": ["x</tool_call>", "y</parameter>", 1, null]})),
        Just(json!({"const": "</function>"})),
        (prop_oneof![Just("integer"), Just("number")], prop::sample::select(vec!["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]), number.clone(),
            prop::sample::select(vec!["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]), number)
            .prop_map(|(t, k1, v1, k2, v2)| json!({"type": t, k1: v1, k2: v2})),
        odd_value(),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(("[a-c]{1,3}", inner.clone()), 0..4).prop_map(|props| {
                let required: Vec<Value> = props.iter().map(|(k, _)| json!(k)).collect();
                json!({"type": "object", "properties": props.into_iter().collect::<serde_json::Map<_, _>>(), "required": required})
            }),
            inner.clone().prop_map(|items| json!({"type": "array", "items": items, "maxItems": 3})),
            prop::collection::vec(inner.clone(), 1..4).prop_map(|any| json!({"anyOf": any})),
            prop::collection::vec(inner.clone(), 1..3).prop_map(|all| json!({"allOf": all})),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| json!({"$ref": "#/$defs/a", "$defs": {"a": a, "b": b}})),
            inner.clone().prop_map(|p| json!({"type": "object", "patternProperties": {"^x[0-9]+$": p}, "additionalProperties": false})),
        ]
    })
}

fn fixture_grammars() -> &'static slotstream::constrain::Grammars {
    static GRAMMARS: std::sync::OnceLock<slotstream::constrain::Grammars> = std::sync::OnceLock::new();
    GRAMMARS.get_or_init(|| {
        slotstream::constrain::Grammars::load(Path::new("tests/fixtures/qwen3_moe_mlx4"), 512, &[509, 511]).expect("the fixture's vocabulary")
    })
}

proptest! {
    #![proptest_config(cases(96))]

    #[test]
    fn json_schemas_and_tools_compile_or_are_refused_within_seconds(schema in schema(), forced in any::<bool>()) {
        use slotstream::constrain::{ConstraintSpec, ToolCallForm, ToolSpec};
        let grammars = fixture_grammars();
        let tools = vec![
            ToolSpec { name: "f".into(), parameters: json!({"type": "object", "properties": {"x": schema.clone()}, "required": ["x"]}) },
            ToolSpec { name: "g</tool_call>".into(), parameters: schema.clone() },
        ];
        let specs = [
            ConstraintSpec::JsonSchema(schema),
            ConstraintSpec::ToolCalls { tools: tools.clone(), forced, parallel: true, form: ToolCallForm::Json },
            ConstraintSpec::ToolCalls { tools, forced, parallel: false, form: ToolCallForm::XmlParameters },
        ];
        for spec in specs {
            let t = std::time::Instant::now();
            if let Err(e) = grammars.constraint(&spec) {
                prop_assert!(!e.to_string().is_empty(), "an error without a reason");
                prop_assert!(!e.to_string().contains("panic"), "the grammar engine panicked: {e}");
            }
            prop_assert!(t.elapsed() < std::time::Duration::from_secs(10), "{spec:?} took {:?}", t.elapsed());
        }
    }
}

// ---- HTTP request bodies ----
// One `slotstream serve` (the CPU backend, a random-weights fixture, a
// 48-token context so that any generation a body asks for ends at once)
// takes every case: a valid request for one of the endpoints with some
// fields replaced by odd values or removed, or arbitrary bytes. Each must get
// a 2xx, or a 4xx whose JSON body says what was wrong; never a 5xx, a dropped
// connection or a dead server.

struct Server {
    child: std::sync::Mutex<std::process::Child>,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Server {
    fn start() -> Server {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
            .args(["serve", "--model", "tests/fixtures/qwen3_moe_mlx4", "--backend", "cpu", "--port", "0"])
            .args(["--name", "fixture", "--max-context", "48"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting slotstream serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let mut lines = std::io::BufReader::new(stderr).lines();
        let port = loop {
            let line = lines.next().expect("serve exited before serving").expect("reading serve's stderr");
            if let Some(at) = line.find("serving 'fixture' on http://") {
                break line[at..].rsplit(':').next().and_then(|p| p.trim().parse().ok()).expect("the port");
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Server { child: std::sync::Mutex::new(child), port }
    }

    /// Status code and body of one POST.
    fn post(&self, path: &str, body: &[u8]) -> (u16, String) {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.port)).expect("connecting to serve");
        stream.set_read_timeout(Some(std::time::Duration::from_secs(60))).expect("a read timeout");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(body)).expect("sending the request");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).expect("reading the answer (the server dropped the connection or hung)");
        let text = String::from_utf8_lossy(&answer).to_string();
        let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status line in {text:?}"));
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    }

    fn check(&self, path: &str, body: &[u8]) {
        let (status, answer) = self.post(path, body);
        let shown = String::from_utf8_lossy(body);
        assert!((200..300).contains(&status) || (400..500).contains(&status), "{path} {shown}: status {status}: {answer}");
        if status >= 400 {
            assert!(answer.contains("\"error\""), "{path} {shown}: a {status} without an error message: {answer}");
        }
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        assert!(child.try_wait().expect("polling serve").is_none(), "serve died after {path} {shown}");
    }
}

fn request_bodies() -> impl Strategy<Value = (&'static str, Value)> {
    let bases = vec![
        ("/api/generate", json!({"model": "fixture", "prompt": "The sea", "stream": false, "options": {"num_predict": 3, "temperature": 0}})),
        ("/api/chat", json!({"model": "fixture", "messages": [{"role": "user", "content": "Hi"}], "stream": true, "options": {"num_predict": 3}})),
        ("/v1/chat/completions", json!({"model": "fixture", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": false})),
        ("/v1/completions", json!({"model": "fixture", "prompt": "The sea", "max_tokens": 3, "temperature": 0.5, "stop": ["x"]})),
        ("/api/show", json!({"model": "fixture"})),
    ];
    prop::sample::select(bases).prop_flat_map(|(path, base)| mutated(base).prop_map(move |v| (path, v)))
}

#[test]
fn http_request_bodies_get_an_answer() {
    let server = Server::start();
    let mut runner = proptest::test_runner::TestRunner::new(cases(48));
    let result = runner.run(&request_bodies(), |(path, body)| {
        server.check(path, body.to_string().as_bytes());
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn http_request_bytes_get_an_answer() {
    let server = Server::start();
    let mut runner = proptest::test_runner::TestRunner::new(cases(48));
    let bytes = (prop::collection::vec(any::<u8>(), 0..200), any::<bool>());
    let result = runner.run(&bytes, |(bytes, to_chat)| {
        server.check(if to_chat { "/v1/chat/completions" } else { "/api/generate" }, &bytes);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
