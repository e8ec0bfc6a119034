//! The grammar engine over a real (fixture) vocabulary: whatever the logits
//! say, the constrained output parses and follows its schema.

use std::path::Path;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::*;
use crate::dialect::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

fn fixture_grammars() -> Grammars {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_mlx4");
    // The fixture's logits have 512 rows; its end-of-text token is 509.
    Grammars::load(&dir, 512, &[509, 511]).expect("building the vocabulary trie")
}

/// Drives `constraint` with random logits (a stand-in for any model) and
/// returns the text it allowed, stopping at an end-of-sequence token.
fn generate(grammars: &Grammars, constraint: &mut GrammarConstraint, free_text: &str, seed: u64) -> String {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    let eos = [509u32, 511];
    // Free text first (as a model writes before opening a call).
    for id in grammars.trie.greedy_tokenize(free_text.as_bytes()) {
        assert!(!constraint.commit(id).expect("free text commits"));
        out.extend_from_slice(grammars.trie.token(id));
    }
    for _ in 0..400 {
        let mut logits: Vec<f32> = (0..512).map(|_| rng.random_range(-4.0..4.0)).collect();
        if !constraint.mask(&mut logits).expect("a mask") {
            break;
        }
        let next = crate::sampling::argmax(&logits);
        if eos.contains(&next) {
            break;
        }
        out.extend_from_slice(grammars.trie.token(next));
        if constraint.commit(next).expect("the chosen token is allowed") {
            break;
        }
    }
    String::from_utf8(out).expect("constrained output is UTF-8")
}

#[test]
fn json_schema_output_always_parses_and_validates() {
    let grammars = fixture_grammars();
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "days", "unit"],
        "additionalProperties": false,
    });
    for seed in 0..8 {
        let mut c = grammars.constraint(&ConstraintSpec::JsonSchema(schema.clone())).expect("the schema compiles");
        let text = generate(&grammars, &mut c, "", seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        assert!(v["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{text}");
        assert!(v["days"].as_i64().is_some_and(|d| (1..=7).contains(&d)), "{text}");
        assert!(v["unit"] == "celsius" || v["unit"] == "fahrenheit", "{text}");
        assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text}");
    }
}

#[test]
fn json_mode_gives_an_object() {
    let grammars = fixture_grammars();
    let mut c = grammars.constraint(&ConstraintSpec::JsonObject).expect("JSON mode compiles");
    // Bounded by the token budget, an object may stay open: it must at least start as one.
    let text = generate(&grammars, &mut c, "", 3);
    assert!(text.starts_with('{'), "{text:?}");
}

fn weather_tools() -> Vec<ToolSpec> {
    let args = |prop: &str| {
        json!({"type": "object", "properties": {prop: {"type": "integer", "minimum": -1000, "maximum": 1000}},
               "required": [prop], "additionalProperties": false})
    };
    vec![
        ToolSpec { name: "get_weather".into(), parameters: args("day") },
        ToolSpec { name: "add".into(), parameters: args("a") },
    ]
}

fn parse_calls(text: &str) -> Vec<Value> {
    text.split(TOOL_CALL_OPEN)
        .skip(1)
        .map(|part| {
            let body = part.split(TOOL_CALL_CLOSE).next().expect("a closed call");
            serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{body:?} is not JSON: {e}"))
        })
        .collect()
}

#[test]
fn a_forced_tool_call_parses_and_names_a_tool() {
    let grammars = fixture_grammars();
    let spec = ConstraintSpec::ToolCalls { tools: weather_tools(), forced: true, parallel: false, form: ToolCallForm::Json };
    for seed in 0..6 {
        let mut c = grammars.constraint(&spec).expect("the tools compile");
        let text = generate(&grammars, &mut c, "", seed);
        assert!(text.starts_with("<tool_call>\n") && text.ends_with("\n</tool_call>"), "{text:?}");
        let calls = parse_calls(&text);
        assert_eq!(calls.len(), 1, "{text}");
        let name = calls[0]["name"].as_str().expect("a name");
        let key = if name == "get_weather" { "day" } else { "a" };
        assert!(name == "get_weather" || name == "add", "{text}");
        assert!(calls[0]["arguments"][key].is_i64(), "{text}");
    }
}

#[test]
fn a_call_opened_after_free_text_is_constrained_from_the_tag_on() {
    let grammars = fixture_grammars();
    let spec = ConstraintSpec::ToolCalls { tools: weather_tools(), forced: false, parallel: true, form: ToolCallForm::Json };
    let mut c = grammars.constraint(&spec).expect("the tools compile");
    // Before the tag nothing is masked.
    let mut logits = vec![1.0f32; 512];
    assert!(c.mask(&mut logits).expect("a mask"));
    assert!(logits.iter().all(|&l| l == 1.0), "free text is not masked");
    let text = generate(&grammars, &mut c, "Let me check. <tool_call>", 5);
    let calls = parse_calls(&text);
    assert!(!calls.is_empty(), "{text}");
    assert!(calls.iter().all(|c| c["arguments"].is_object()), "{text}");
}

#[test]
fn schemas_the_engine_cannot_compile_are_refused_with_a_reason() {
    let grammars = fixture_grammars();
    let error = grammars.constraint(&ConstraintSpec::JsonSchema(json!({"type": "no-such-type"}))).err().expect("refused");
    assert!(!error.to_string().is_empty());
    let error = grammars.constraint(&ConstraintSpec::JsonSchema(json!(["not", "a", "schema"]))).err().expect("refused");
    assert!(error.to_string().contains("must be an object"), "{error}");
    let bad_tool = ConstraintSpec::ToolCalls {
        tools: vec![ToolSpec { name: "f".into(), parameters: json!("string") }],
        forced: true,
        parallel: false,
        form: ToolCallForm::Json,
    };
    let error = grammars.constraint(&bad_tool).err().expect("refused");
    assert!(error.to_string().contains("parameters of tool 'f' are not a JSON schema"), "{error}");
}

/// Claude Code's tools name `propertyNames`, which the engine does not
/// implement: a tool's parameters compile with it left unenforced, while a
/// response format that uses it is still refused.
#[test]
fn tool_schemas_with_keywords_the_engine_lacks_still_compile() {
    let grammars = fixture_grammars();
    let schema = json!({"type": "object", "properties": {"env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"}}}});
    for form in [ToolCallForm::Json, ToolCallForm::XmlParameters] {
        let tools = vec![ToolSpec { name: "f".into(), parameters: schema.clone() }];
        let spec = ConstraintSpec::ToolCalls { tools, forced: true, parallel: false, form };
        grammars.constraint(&spec).unwrap_or_else(|e| panic!("{form:?}: a tool with propertyNames: {e:#}"));
    }
    let error = grammars.constraint(&ConstraintSpec::JsonSchema(schema)).err().expect("a format with propertyNames is refused");
    assert!(error.to_string().contains("propertyNames"), "{error}");
}

#[test]
fn tool_arguments_carry_only_declared_parameters() {
    let grammars = fixture_grammars();
    // No additionalProperties: the call may still only use `a`.
    let open = json!({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]});
    let spec = ConstraintSpec::ToolCalls { tools: vec![ToolSpec { name: "f".into(), parameters: open }], forced: true, parallel: false, form: ToolCallForm::Json };
    for seed in 0..4 {
        let mut c = grammars.constraint(&spec).expect("compiles");
        let text = generate(&grammars, &mut c, "", seed);
        let calls = parse_calls(&text);
        let args = calls[0]["arguments"].as_object().expect("an object");
        assert!(args.len() == 1 && args["a"].is_boolean(), "{text}");
    }
}

#[test]
fn a_schemas_objects_carry_only_the_properties_it_lists() {
    // As llama.cpp's (and so Ollama's) schema grammars read it: no
    // additionalProperties means none, else a weak model adds keys until its
    // tokens run out.
    let grammars = fixture_grammars();
    let open = json!({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "object", "properties": {"c": {"type": "null"}}}}});
    for seed in 0..6 {
        let mut c = grammars.constraint(&ConstraintSpec::JsonSchema(open.clone())).expect("compiles");
        let text = generate(&grammars, &mut c, "", seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        let keys = |o: &Value| o.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
        assert!(keys(&v).iter().all(|k| k == "a" || k == "b"), "seed {seed}: {text}");
        assert!(keys(&v["b"]).iter().all(|k| k == "c"), "seed {seed}: {text}");
    }
}

#[test]
fn the_trigger_is_found_across_token_boundaries() {
    let mut t = Trigger::after(&["<tool_call>"]);
    assert_eq!(t.push(b"Sure <tool"), None);
    assert_eq!(t.push(b"_ca"), None);
    assert_eq!(t.push(b"ll>\n{"), Some(b"\n{".to_vec()));
    let mut t = Trigger::after(&["<tool_call>"]);
    assert_eq!(t.push(b"<tool_call>"), Some(Vec::new()));
    // After the reasoning's end only, which may share a token with the trigger.
    let mut t = Trigger::after(&["</think>", "<tool_call>"]);
    assert_eq!(t.push(b"<tool_call> </thi"), None);
    assert_eq!(t.push(b"nk>\n<tool_"), None);
    assert_eq!(t.push(b"call>\n{"), Some(b"\n{".to_vec()));
    let mut t = Trigger::after(&["</think>", "<tool_call>"]);
    assert_eq!(t.push(b"</think><tool_call>x"), Some(b"x".to_vec()));
}

/// Tools whose parameters cover each way the XML form writes a value.
fn coder_tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "write_file".into(),
            parameters: json!({"type": "object", "properties": {
                "path": {"type": "string", "maxLength": 8},
                "mode": {"type": "integer", "minimum": 0, "maximum": 777},
                "code": {"type": "string", "pattern": "^[a-c]{2}/[0-9]$"},
                "unit": {"enum": ["bytes", "lines"]},
                "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
                "required": ["path", "mode", "code"]}),
        },
        ToolSpec { name: "ping".into(), parameters: json!({"type": "object", "properties": {}}) },
    ]
}

/// Checks one call in the XML form against `coder_tools` and returns its function's name.
fn check_coder_call(body: &str) -> String {
    let body = body.strip_prefix('\n').and_then(|b| b.strip_suffix('\n')).unwrap_or_else(|| panic!("{body:?}"));
    let (name, mut rest) = body.strip_prefix("<function=").and_then(|b| b.split_once(">\n")).unwrap_or_else(|| panic!("{body:?}"));
    rest = rest.strip_suffix("</function>").unwrap_or_else(|| panic!("{body:?}"));
    let mut seen = Vec::new();
    while let Some(param) = rest.strip_prefix("<parameter=") {
        let (key, after) = param.split_once(">\n").unwrap_or_else(|| panic!("{body:?}"));
        let (value, after) = after.split_once("\n</parameter>\n").unwrap_or_else(|| panic!("{body:?}"));
        match key {
            "path" => assert!(value.chars().count() <= 8, "{body:?}"),
            "mode" => assert!(value.parse::<i64>().is_ok_and(|m| (0..=777).contains(&m)), "{body:?}"),
            "code" => {
                let c: Vec<char> = value.chars().collect();
                let ok = c.len() == 4 && c[..2].iter().all(|x| ('a'..='c').contains(x)) && c[2] == '/' && c[3].is_ascii_digit();
                assert!(ok, "the pattern holds: {body:?}");
            }
            "unit" => assert!(value == "bytes" || value == "lines", "{body:?}"),
            "flags" => assert!(serde_json::from_str::<Vec<bool>>(value).is_ok_and(|f| f.len() <= 2), "{body:?}"),
            other => panic!("undeclared parameter {other}: {body:?}"),
        }
        seen.push(key.to_string());
        rest = after;
    }
    assert!(rest.is_empty(), "{body:?}");
    if name == "write_file" {
        assert!(seen.starts_with(&["path".to_string(), "mode".to_string(), "code".to_string()]), "required parameters, in order: {body:?}");
    } else {
        assert_eq!((name, seen.len()), ("ping", 0), "{body:?}");
    }
    name.to_string()
}

#[test]
fn xml_tool_calls_parse_and_follow_their_parameters_types() {
    let grammars = fixture_grammars();
    let spec = ConstraintSpec::ToolCalls { tools: coder_tools(), forced: true, parallel: true, form: ToolCallForm::XmlParameters };
    let mut names = Vec::new();
    for seed in 0..8 {
        let mut c = grammars.constraint(&spec).expect("the tools compile");
        let text = generate(&grammars, &mut c, "", seed);
        assert!(text.starts_with("<tool_call>\n<function=") && text.ends_with("</function>\n</tool_call>"), "seed {seed}: {text:?}");
        for part in text.split(TOOL_CALL_OPEN).skip(1) {
            let body = part.split(TOOL_CALL_CLOSE).next().expect("a closed call");
            names.push(check_coder_call(body));
        }
    }
    assert!(names.iter().any(|n| n == "write_file"), "{names:?}");
}

#[test]
fn an_xml_text_value_cannot_close_the_call_early() {
    let grammars = fixture_grammars();
    let tools = vec![ToolSpec { name: "echo".into(), parameters: json!({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}) }];
    let spec = ConstraintSpec::ToolCalls { tools, forced: true, parallel: false, form: ToolCallForm::XmlParameters };
    let consume = |text: &str| {
        let mut c = grammars.constraint(&spec).expect("compiles");
        grammars.trie.greedy_tokenize(text.as_bytes()).into_iter().try_for_each(|id| c.commit(id).map(|_| ()))
    };
    consume("<tool_call>\n<function=echo>\n<parameter=s>\na < b <c> </para\n</parameter>\n</function>\n</tool_call>").expect("angle brackets are text");
    consume("<tool_call>\n<function=echo>\n<parameter=s>\nx</tool_call>").expect_err("the call's end inside a value");
    consume("<tool_call>\n<function=echo>\n<parameter=s>\nx</parameter>y").expect_err("text after the value's end");
    consume("<tool_call>\n<function=echo>\n</function>").expect_err("a required parameter left out");
    let tag = ToolSpec { name: "a>b".into(), parameters: json!({"type": "object"}) };
    let spec = ConstraintSpec::ToolCalls { tools: vec![tag], forced: true, parallel: false, form: ToolCallForm::XmlParameters };
    let error = grammars.constraint(&spec).err().expect("a name with '>' is refused");
    assert!(error.to_string().contains("the tool name 'a>b' cannot be written"), "{error}");
}

#[test]
fn an_integer_without_bounds_stops_within_sixteen_digits() {
    // Unbounded, a weak model (random logits here) may write digits until its
    // tokens run out; JSON parsers read integers exactly only to 2^53 - 1.
    let grammars = fixture_grammars();
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"]}},
                        "required": ["n", "m"], "additionalProperties": false});
    for seed in 0..24 {
        let mut c = grammars.constraint(&ConstraintSpec::JsonSchema(schema.clone())).expect("the schema compiles");
        let text = generate(&grammars, &mut c, "", seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        for key in ["n", "m"] {
            let whole = v[key].as_f64().is_some_and(|x| x.fract() == 0.0 && x.abs() < 2f64.powi(53));
            assert!(v[key].is_null() || whole, "seed {seed}: {key} = {}", v[key]);
        }
    }
    // A schema's own bounds stay as written.
    let bounded = json!({"type": "integer", "minimum": 100000000000000000i64});
    let mut c = grammars.constraint(&ConstraintSpec::JsonSchema(bounded)).expect("the schema compiles");
    let text = generate(&grammars, &mut c, "", 1);
    assert!(text.parse::<i64>().is_ok_and(|n| n >= 100000000000000000), "{text}");
}

/// Whether `constraint` lets the output end now (an end-of-sequence token unmasked).
fn may_end(constraint: &mut GrammarConstraint) -> bool {
    let mut logits = vec![0.0f32; 512];
    !constraint.mask(&mut logits).expect("a mask") || logits[509] == 0.0
}

#[test]
fn after_a_prompt_that_opens_the_reasoning_the_constraint_holds_from_its_end() {
    // Output after `<think>` (in the prompt): reasoning, `</think>`, then the constrained part.
    let grammars = fixture_grammars();
    let reasoning = "Maybe <tool_call>{\"name\": 1}</tool_call> or {\"a\": 2}?\n</think>\n\n";
    for form in [ToolCallForm::Json, ToolCallForm::XmlParameters] {
        let spec = ConstraintSpec::ToolCalls { tools: weather_tools(), forced: true, parallel: false, form };
        for seed in 0..4 {
            let mut c = grammars.constraint_after(&spec, true).expect("the tools compile");
            assert!(!may_end(&mut c), "a forced call cannot be skipped by ending in the reasoning");
            let text = generate(&grammars, &mut c, reasoning, seed);
            let blank_and_answer = text.strip_prefix(reasoning).unwrap_or_else(|| panic!("{text:?}"));
            let answer = blank_and_answer.trim_start();
            assert!(blank_and_answer.len() - answer.len() <= 1, "at most 3 blanks after the reasoning: {text:?}");
            assert!(answer.starts_with("<tool_call>\n") && answer.ends_with("</tool_call>"), "{form:?} seed {seed}: {answer:?}");
            if form == ToolCallForm::Json {
                assert_eq!(parse_calls(answer).len(), 1, "{answer}");
            }
        }
    }
    let schema = ConstraintSpec::JsonSchema(json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}));
    let mut c = grammars.constraint_after(&schema, true).expect("the schema compiles");
    let text = generate(&grammars, &mut c, "hmm</think>", 3);
    let json: Value = serde_json::from_str(text.strip_prefix("hmm</think>").expect("the reasoning")).expect("JSON after it");
    assert!(json["n"].is_i64(), "{text}");
    // Without an open reasoning the output is constrained from its start.
    let mut c = grammars.constraint(&schema).expect("the schema compiles");
    assert!(c.commit(grammars.trie.greedy_tokenize(b"h")[0]).is_err(), "text before the JSON");
}

#[test]
fn a_call_drafted_in_the_reasoning_does_not_arm_the_trigger() {
    let grammars = fixture_grammars();
    let spec = ConstraintSpec::ToolCalls { tools: weather_tools(), forced: false, parallel: false, form: ToolCallForm::Json };
    let mut c = grammars.constraint_after(&spec, true).expect("the tools compile");
    for id in grammars.trie.greedy_tokenize(b"I could <tool_call>\nnot JSON </tool_call>\n</think>\n\nSure. ") {
        assert!(!c.commit(id).expect("free text"));
    }
    assert!(may_end(&mut c), "the answer may end without a call");
    let text = generate(&grammars, &mut c, "<tool_call>", 2);
    assert_eq!(parse_calls(&text).len(), 1, "the call after the reasoning is held to the grammar: {text:?}");
}

#[test]
fn schemas_over_the_size_limit_are_refused_naming_it() {
    let grammars = fixture_grammars();
    let properties: serde_json::Map<String, Value> = (0..20_000).map(|i| (format!("property_{i}"), json!({"type": "integer"}))).collect();
    let huge = json!({"type": "object", "properties": properties});
    let error = grammars.constraint(&ConstraintSpec::JsonSchema(huge.clone())).err().expect("refused");
    assert!(error.to_string().contains(&format!("more than {MAX_SCHEMA_BYTES} bytes of JSON")), "{error}");
    // Tools count together: each small, all of them too large.
    let tools: Vec<ToolSpec> = (0..200)
        .map(|i| ToolSpec { name: format!("tool_{i}"), parameters: json!({"type": "object", "properties": {"x": {"type": "string", "description": "d".repeat(2000)}}}) })
        .collect();
    let spec = ConstraintSpec::ToolCalls { tools, forced: true, parallel: false, form: ToolCallForm::Json };
    let error = grammars.constraint(&spec).err().expect("refused");
    assert!(error.to_string().contains("the tools' names and parameters hold more than"), "{error}");
}

#[test]
fn bounds_the_output_could_not_be_held_to_are_refused_up_front() {
    let grammars = fixture_grammars();
    let refused = |schema: Value, why: &str| {
        let error = grammars.constraint(&ConstraintSpec::JsonSchema(schema.clone())).err().unwrap_or_else(|| panic!("{schema} compiles"));
        assert!(error.to_string().contains(why), "{schema}: {error}");
    };
    refused(json!({"type": "integer", "minimum": 1e19}), "the integer bound minimum 1e+19 is beyond");
    refused(json!({"type": "integer", "maximum": 10000000000000000000u64}), "is beyond what constrained output can hold");
    refused(json!({"type": "object", "properties": {"n": {"type": "integer", "exclusiveMaximum": -1e20}}}), "is beyond");
    refused(json!({"type": "integer", "minimum": 0.2, "maximum": 0.8}), "admits no integer");
    refused(json!({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}), "admits no integer");
    refused(json!({"type": "number", "exclusiveMinimum": 1, "maximum": 1}), "admits no number");
    // Within 64 bits, bounds stay as written.
    refused(json!({"type": "integer", "minimum": i64::MIN}), "is beyond");
    refused(json!({"type": "number", "exclusiveMinimum": 0, "maximum": 1e-22}), "finer than 1e-16");
    refused(json!({"type": "integer", "minimum": -i64::MAX}), "is beyond");
    // 2^53 + 1 would be read as 2^53, below the minimum.
    refused(json!({"type": "integer", "minimum": 9007199254740993i64}), "is beyond");
    // Bounds a 64-bit float holds exactly stay as written, large or not.
    let mut c = grammars.constraint(&ConstraintSpec::JsonSchema(json!({"type": "integer", "minimum": -4611686018427387904i64}))).expect("compiles");
    let text = generate(&grammars, &mut c, "", 2);
    assert!(text.parse::<i64>().is_ok(), "{text}");
}

#[test]
fn an_exclusive_bound_at_the_safe_integer_leaves_the_schema_satisfiable() {
    // The server's own bound (2^53 - 1) is not added where it would leave no integer.
    let grammars = fixture_grammars();
    let schema = json!({"type": "integer", "exclusiveMinimum": 9007199254740991i64});
    let mut c = grammars.constraint(&ConstraintSpec::JsonSchema(schema)).expect("a satisfiable schema compiles");
    for id in grammars.trie.greedy_tokenize(b"9007199254740992") {
        c.commit(id).expect("2^53 is allowed");
    }
    assert!(may_end(&mut c), "2^53 is a whole answer");
    let upper = json!({"type": "integer", "exclusiveMaximum": -9007199254740991i64});
    grammars.constraint(&ConstraintSpec::JsonSchema(upper)).expect("a satisfiable schema compiles");
}

#[test]
fn refs_that_only_name_each_other_are_refused_up_front() {
    let grammars = fixture_grammars();
    let cycle = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}});
    let error = grammars.constraint(&ConstraintSpec::JsonSchema(cycle)).err().expect("refused");
    assert!(error.to_string().contains("admits no output") || error.to_string().contains("ref"), "{error}");
    // Deeper in the schema: the output's start is allowed, its property never is.
    let nested = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
                        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}});
    let error = grammars.constraint(&ConstraintSpec::JsonSchema(nested)).err().expect("refused");
    assert!(error.to_string().contains("$ref"), "{error}");
}

#[test]
fn an_xml_fixed_value_holding_call_markup_is_refused() {
    let grammars = fixture_grammars();
    for markup in ["</parameter>", "</function>", "</tool_call>"] {
        let tool = ToolSpec {
            name: "f".into(),
            parameters: json!({"type": "object", "properties": {"mode": {"enum": ["ok", format!("x{markup}y")]}}, "required": ["mode"]}),
        };
        let xml = ConstraintSpec::ToolCalls { tools: vec![tool.clone()], forced: true, parallel: false, form: ToolCallForm::XmlParameters };
        let error = grammars.constraint(&xml).err().expect("refused");
        assert!(error.to_string().contains("holds this model's tool-call markup"), "{error}");
        // The JSON form writes it inside a JSON string, where the server's splitter reads past it.
        let json_form = ConstraintSpec::ToolCalls { tools: vec![tool], forced: true, parallel: false, form: ToolCallForm::Json };
        grammars.constraint(&json_form).expect("the JSON form compiles");
    }
}

#[test]
fn number_output_stays_within_its_bounds_or_the_schema_is_refused() {
    // Random bounds, tiny ranges and large ones, exclusive or not: a schema
    // that compiles gives numbers within its bounds, whatever the logits.
    let grammars = fixture_grammars();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (mut failures, mut refused) = (Vec::new(), Vec::new());
    for case in 0..300 {
        let scale = 10f64.powi(rng.random_range(-12..12));
        let low = (rng.random_range(-1.0..1.0) * scale * 1000.0).round() / 1000.0;
        let width = scale * 10f64.powi(rng.random_range(-12..3));
        let high = low + width;
        let (low_open, high_open) = (rng.random_bool(0.5), rng.random_bool(0.5));
        let mut schema = json!({"type": "number"});
        schema[if low_open { "exclusiveMinimum" } else { "minimum" }] = json!(low);
        schema[if high_open { "exclusiveMaximum" } else { "maximum" }] = json!(high);
        let Ok(mut c) = grammars.constraint(&ConstraintSpec::JsonSchema(schema.clone())) else {
            // Only extreme ranges may be refused.
            if width > 1e-9 && low.abs() < 1e9 {
                refused.push(schema.to_string());
            }
            continue;
        };
        let text = generate(&grammars, &mut c, "", case);
        let Ok(x) = text.parse::<f64>() else { continue };
        let above = if low_open { x > low } else { x >= low };
        let below = if high_open { x < high } else { x <= high };
        if !(above && below) {
            failures.push(format!("{schema} gave {text}"));
        }
    }
    assert!(failures.is_empty(), "{} outputs outside their bounds:\n{}", failures.len(), failures.join("\n"));
    assert!(refused.is_empty(), "ordinary ranges refused:\n{}", refused.join("\n"));
}

#[test]
fn many_pattern_properties_are_refused_before_they_compile_for_minutes() {
    let grammars = fixture_grammars();
    let patterns = |n: usize| -> Value {
        let each: serde_json::Map<String, Value> = (0..n).map(|i| (format!("^p{i}_[a-z]+$"), json!({"type": "integer"}))).collect();
        json!({"type": "object", "patternProperties": each, "additionalProperties": false})
    };
    let t = std::time::Instant::now();
    let error = grammars.constraint(&ConstraintSpec::JsonSchema(patterns(1000))).err().expect("refused");
    assert!(error.to_string().contains("1000 patternProperties; the most this server compiles is 64"), "{error}");
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "refused after {:?}", t.elapsed());
    // Nested ones count together.
    let nested = json!({"type": "object", "properties": {"a": patterns(40), "b": patterns(40)}});
    assert!(grammars.constraint(&ConstraintSpec::JsonSchema(nested)).is_err());
    grammars.constraint(&ConstraintSpec::JsonSchema(patterns(8))).expect("a few compile");
}
