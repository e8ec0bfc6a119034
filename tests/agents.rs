//! What agents and apps send: tool calling and structured output through
//! every API (Ollama, OpenAI chat, OpenAI Responses, Anthropic Messages),
//! over a fixture model served with a tool-calling chat template
//! (`tests/templates/tool_calling.jinja`). The fixture's weights are
//! random, so whatever the model would say, the constrained calls and JSON
//! must parse and follow their schemas.

mod common;

use serde_json::{json, Value};

use common::tools_server::*;

#[test]
fn openai_forced_and_named_tool_calls_parse_and_follow_their_schemas() {
    let dir = tool_model();
    let s = start(dir.path());
    for (seed, choice) in [(1, json!("required")), (2, json!("required")), (3, json!({"type": "function", "function": {"name": "add"}}))] {
        let body = json!({"model": MODEL, "messages": user("What is 2 + 3?"), "tools": tools(), "tool_choice": choice,
                          "max_tokens": 120, "seed": seed, "temperature": 1.0});
        let v = s.json("/v1/chat/completions", &body);
        let choice0 = &v["choices"][0];
        // Parallel calls may go on until the limit cuts them: then "length", as OpenAI answers.
        let want = if v["usage"]["completion_tokens"] == 120 { "length" } else { "tool_calls" };
        assert_eq!(choice0["finish_reason"], want, "{v}");
        let calls = choice0["message"]["tool_calls"].as_array().expect("tool_calls");
        assert!(!calls.is_empty(), "{v}");
        for call in calls {
            assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()), "{call}");
            assert_eq!(call["type"], "function");
            let name = call["function"]["name"].as_str().expect("a name");
            if body["tool_choice"].is_object() {
                assert_eq!(name, "add");
            }
            let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments as a string"))
                .expect("arguments parse");
            check_arguments(name, &args);
        }
    }
}

#[test]
fn openai_streams_tool_call_deltas_and_takes_results_back() {
    let dir = tool_model();
    let s = start(dir.path());
    let body = json!({"model": MODEL, "messages": user("Weather?"), "tools": tools(), "tool_choice": "required",
                      "parallel_tool_calls": false, "max_tokens": 120, "stream": true});
    let (status, text) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(deltas.len(), 1, "one call without parallel calls: {text}");
    assert_eq!(deltas[0]["index"], 0);
    let name = deltas[0]["function"]["name"].as_str().expect("a name");
    let args: Value = serde_json::from_str(deltas[0]["function"]["arguments"].as_str().expect("arguments")).expect("JSON");
    check_arguments(name, &args);
    let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a final chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert!(text.trim_end().ends_with("data: [DONE]"));

    // The call and its result go back in the history.
    let id = deltas[0]["id"].as_str().expect("an id");
    let history = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": name, "arguments": deltas[0]["function"]["arguments"]}}]},
        {"role": "tool", "tool_call_id": id, "content": "{\"temperature\": 21}"},
    ]);
    let v = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": history, "tools": tools(), "max_tokens": 4}));
    assert!(v["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 100), "{v}");
}

/// Markup of either call form, which never belongs in `content`.
fn has_call_markup(text: &str) -> bool {
    ["<tool", "tool_call>", "\"name\"", "<function", "<parameter"].iter().any(|m| text.contains(m))
}

/// Forces calls under limits that cut them off, streamed and not: when the
/// limit ended the generation, finish_reason is "length" (calls or not), the
/// cut call leaves no markup in the content, and calls before it come back
/// whole (checked by `check`).
fn check_cut_off_calls(s: &Server, tools: &Value, check: fn(&str, &Value)) {
    for max_tokens in [3u64, 8, 64, 100, 200] {
        let body = json!({"model": MODEL, "messages": user("Weather?"), "tools": tools, "tool_choice": "required",
                          "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": true}});
        let v = s.json("/v1/chat/completions", &body);
        let choice = &v["choices"][0];
        let want = if v["usage"]["completion_tokens"] == max_tokens { "length" } else { "tool_calls" };
        assert_eq!(choice["finish_reason"], want, "max_tokens {max_tokens}: {v}");
        let content = choice["message"]["content"].as_str().unwrap_or_default();
        assert!(!has_call_markup(content), "max_tokens {max_tokens}: the cut call is left in the content: {v}");
        let calls = choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        if max_tokens <= 8 {
            assert!(calls.is_empty() && want == "length", "{max_tokens} tokens finish no call: {v}");
        }
        if max_tokens == 200 {
            assert!(!calls.is_empty(), "the calls finished before the cut one come back: {v}");
        }
        for call in &calls {
            let name = call["function"]["name"].as_str().expect("a name");
            check(name, &serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments")).expect("JSON"));
        }

        let mut body = body;
        body["stream"] = true.into();
        let (status, text) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        let chunks: Vec<Value> =
            text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("a chunk")).collect();
        let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert!(!has_call_markup(&content), "max_tokens {max_tokens}: the cut call is streamed as content: {text}");
        for call in chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten() {
            let name = call["function"]["name"].as_str().expect("a name");
            check(name, &serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments")).expect("JSON"));
        }
        let used = chunks.iter().find_map(|c| c["usage"]["completion_tokens"].as_u64()).expect("usage");
        let want = if used == max_tokens { "length" } else { "tool_calls" };
        let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a final chunk");
        assert_eq!(last["choices"][0]["finish_reason"], want, "max_tokens {max_tokens}, streamed: {text}");
    }
}

#[test]
fn calls_the_token_limit_cuts_off_end_with_length_and_leave_no_markup() {
    let dir = tool_model();
    check_cut_off_calls(&start(dir.path()), &tools(), check_arguments);
    let dir = model_with_template("xml_tool_calling.jinja");
    check_cut_off_calls(&start(dir.path()), &coder_tools(), check_coder_arguments);
}

#[test]
fn ollama_tools_history_and_structured_output() {
    let dir = tool_model();
    let s = start(dir.path());
    let history = json!([
        {"role": "user", "content": "Add 2 and 3"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_name": "add", "content": "5"},
    ]);
    let body = json!({"model": MODEL, "messages": history, "tools": tools(), "stream": false,
                      "options": {"temperature": 0, "num_predict": 16}});
    let v = s.json("/api/chat", &body);
    assert_eq!(v["message"]["role"], "assistant");
    for call in v["message"]["tool_calls"].as_array().into_iter().flatten() {
        check_arguments(call["function"]["name"].as_str().expect("a name"), &call["function"]["arguments"]);
    }

    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": false});
    for seed in 0..3 {
        let body = json!({"model": MODEL, "messages": user("Who?"), "format": schema, "stream": false,
                          "options": {"temperature": 1, "seed": seed, "num_predict": 60}});
        let v = s.json("/api/chat", &body);
        let content: Value = serde_json::from_str(v["message"]["content"].as_str().expect("content")).expect("content is JSON");
        assert!(content["name"].as_str().is_some_and(|n| n.chars().count() <= 10), "{content}");
        assert!(content["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{content}");
    }
    let v = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": user("Who?"), "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}}}));
    let content: Value = serde_json::from_str(v["choices"][0]["message"]["content"].as_str().expect("content")).expect("JSON");
    assert!(content["age"].is_i64(), "{content}");
}

#[test]
fn bad_tools_schemas_and_results_get_400_naming_the_field() {
    let dir = tool_model();
    let s = start(dir.path());
    let chat = "/v1/chat/completions";
    let bad_params = json!([{"type": "function", "function": {"name": "f", "parameters": "a string"}}]);
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"), "tools": bad_params}));
    assert!(e.contains("tools[0].function.parameters is not a JSON schema"), "{e}");
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"), "tools": tools(),
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}));
    assert!(e.contains("'nope', which is not in 'tools'"), "{e}");
    let orphan = json!([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "5"}]);
    let e = s.error(chat, &json!({"model": MODEL, "messages": orphan, "tools": tools()}));
    assert!(e.contains("tool_call_id 'call_9', which answers no tool call"), "{e}");
    let e = s.error("/api/chat", &json!({"model": MODEL, "messages": user("x"), "format": {"type": "no-such-type"}}));
    assert!(e.contains("'format' cannot be compiled"), "{e}");
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"),
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}));
    assert!(e.contains("'response_format'"), "{e}");
    let e = s.error("/api/chat", &json!({"model": MODEL, "messages": user("x"), "format": "yaml"}));
    assert!(e.contains("format must be"), "{e}");

    // Tools large enough to fill the context (the messages alone are tiny)
    // are refused by the rendered prompt's size, before it is tokenized.
    let long = "a tool with a very long description ".repeat(4000);
    let huge = json!([{"type": "function", "function": {"name": "f", "description": long, "parameters": {"type": "object"}}}]);
    let e = s.error(chat, &json!({"model": MODEL, "messages": user("x"), "tools": huge}));
    assert!(e.contains("the rendered prompt is at least") && e.contains("judged by its size in bytes"), "{e}");

    // The plain fixture's template never reads tools.
    let plain = start(&fixture(MODEL));
    let e = plain.error("/api/chat", &json!({"model": MODEL, "messages": user("x"), "tools": tools()}));
    assert!(e.contains("does not support tools"), "{e}");
    // Nor has its vocabulary fill-in-the-middle tokens.
    let e = plain.error("/api/generate", &json!({"model": MODEL, "prompt": "def f(", "suffix": "):"}));
    assert!(e.contains("does not support insert"), "{e}");
    let e = plain.error("/v1/completions", &json!({"model": MODEL, "prompt": "def f(", "suffix": "):"}));
    assert!(e.contains("does not support insert"), "{e}");
    let e = plain.error("/v1/completions", &json!({"model": MODEL, "prompt": [1, 2], "suffix": "):"}));
    assert!(e.contains("'suffix' needs 'prompt' as text"), "{e}");
}

/// Tools for the Qwen3-Coder-style template: a string, an integer, an enum,
/// a boolean and an array, each read back by its type.
fn coder_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "write_file", "description": "Writes a file",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "maxLength": 10},
                "mode": {"type": "integer", "minimum": 0, "maximum": 777},
                "unit": {"enum": ["bytes", "lines"]},
                "ext": {"type": "string", "pattern": "^(txt|md)$"},
                "append": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2}},
                "required": ["path", "mode"]}}},
        {"type": "function", "function": {"name": "add", "description": "Adds",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}}},
    ])
}

/// Checks a call's arguments against `coder_tools`: the right JSON type for each.
fn check_coder_arguments(name: &str, args: &Value) {
    let obj = args.as_object().unwrap_or_else(|| panic!("{name}: arguments {args} are not an object"));
    match name {
        "write_file" => {
            assert!(args["path"].as_str().is_some_and(|p| p.chars().count() <= 10), "path is a string: {args}");
            assert!(args["mode"].as_i64().is_some_and(|m| (0..=777).contains(&m)), "mode is an integer: {args}");
            for (key, value) in obj {
                match key.as_str() {
                    "path" | "mode" => {}
                    "unit" => assert!(value == "bytes" || value == "lines", "{args}"),
                    "ext" => assert!(value == "txt" || value == "md", "{args}"),
                    "append" => assert!(value.is_boolean(), "{args}"),
                    "tags" => assert!(value.as_array().is_some_and(|t| t.len() <= 2 && t.iter().all(Value::is_i64)), "{args}"),
                    other => panic!("write_file has no parameter {other}: {args}"),
                }
            }
        }
        "add" => assert!(args["a"].is_i64() && args["b"].is_i64() && obj.len() == 2, "{args}"),
        other => panic!("the model called {other}, which is not a tool"),
    }
}

#[test]
fn xml_tool_calls_of_a_qwen3_coder_style_template_parse_into_typed_arguments() {
    let dir = model_with_template("xml_tool_calling.jinja");
    let s = start(dir.path());
    let show = s.json("/api/show", &json!({"model": MODEL}));
    assert!(show["capabilities"].as_array().is_some_and(|c| c.contains(&json!("tools"))), "{show}");

    for (seed, choice) in [(1, json!("required")), (2, json!("required")), (3, json!({"type": "function", "function": {"name": "write_file"}}))] {
        let body = json!({"model": MODEL, "messages": user("Save it"), "tools": coder_tools(), "tool_choice": choice,
                          "max_tokens": 400, "seed": seed, "temperature": 1.0});
        let v = s.json("/v1/chat/completions", &body);
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{v}");
        let calls = choice0["message"]["tool_calls"].as_array().expect("tool_calls");
        assert!(!calls.is_empty(), "{v}");
        for call in calls {
            let name = call["function"]["name"].as_str().expect("a name");
            if body["tool_choice"].is_object() {
                assert_eq!(name, "write_file");
            }
            let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments as a string"))
                .expect("arguments parse");
            check_coder_arguments(name, &args);
        }
        assert!(!choice0["message"]["content"].as_str().unwrap_or_default().contains("<function="), "the call is not left in the text: {v}");
    }

    // Streamed: one delta carrying the whole call.
    let body = json!({"model": MODEL, "messages": user("Save it"), "tools": coder_tools(), "tool_choice": "required",
                      "parallel_tool_calls": false, "max_tokens": 400, "stream": true});
    let (status, text) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let chunks: Vec<Value> =
        text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("a chunk")).collect();
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(deltas.len(), 1, "{text}");
    let name = deltas[0]["function"]["name"].as_str().expect("a name");
    let streamed_args = deltas[0]["function"]["arguments"].as_str().expect("arguments");
    check_coder_arguments(name, &serde_json::from_str(streamed_args).expect("JSON"));
    let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a final chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");

    // The call and its result go back through the template, in both APIs.
    let id = deltas[0]["id"].as_str().expect("an id");
    let history = json!([
        {"role": "user", "content": "Save it"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": streamed_args}}]},
        {"role": "tool", "tool_call_id": id, "content": "done"},
    ]);
    let v = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": history, "tools": coder_tools(), "max_tokens": 4}));
    assert!(v["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 100), "{v}");
    let history = json!([
        {"role": "user", "content": "Save it"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "write_file", "arguments": {"path": "a <b>.txt", "mode": 644}}}]},
        {"role": "tool", "tool_name": "write_file", "content": "done"},
    ]);
    for stream in [false, true] {
        let body = json!({"model": MODEL, "messages": history, "tools": coder_tools(), "stream": stream,
                          "options": {"temperature": 0, "num_predict": 16}});
        let (status, text) = s.post("/api/chat", &body);
        assert_eq!(status, 200, "{text}");
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"))).collect();
        assert_eq!(lines.last().map(|l| l["done"].clone()), Some(json!(true)), "{text}");
        for call in lines.iter().filter_map(|l| l["message"]["tool_calls"].as_array()).flatten() {
            check_coder_arguments(call["function"]["name"].as_str().expect("a name"), &call["function"]["arguments"]);
        }
    }

    // A name the XML form cannot write inside its tag is refused, naming the field.
    let bad = json!([{"type": "function", "function": {"name": "a>b", "parameters": {"type": "object", "properties": {}}}}]);
    let e = s.error("/v1/chat/completions", &json!({"model": MODEL, "messages": user("x"), "tools": bad, "tool_choice": "required"}));
    assert!(e.contains("'tools' cannot be compiled") && e.contains("'a>b'"), "{e}");
}

/// The fixture model with Qwen's fill-in-the-middle tokens in its
/// vocabulary: three of its last BPE tokens (and the merges that made them)
/// give their ids to `<|fim_prefix|>`, `<|fim_suffix|>` and `<|fim_middle|>`.
fn fim_model() -> (tempfile::TempDir, [u32; 3]) {
    let dir = model_with_template("tool_calling.jinja");
    let path = dir.path().join("tokenizer.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("the tokenizer")).expect("JSON");
    let ids = [505u32, 506, 507];
    let names = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];
    let vocab = json["model"]["vocab"].as_object_mut().expect("a BPE vocabulary");
    let mut freed = Vec::new();
    for (id, name) in ids.iter().zip(names) {
        let token = vocab.iter().find(|(_, v)| v.as_u64() == Some(u64::from(*id))).map(|(t, _)| t.clone());
        let token = token.unwrap_or_else(|| panic!("the fixture's vocabulary has no id {id}"));
        vocab.remove(&token);
        vocab.insert(name.to_string(), json!(id));
        freed.push(token);
    }
    let merges = json["model"]["merges"].as_array_mut().expect("merges");
    merges.retain(|m| {
        let joined: String = m.as_array().map(|p| p.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        !freed.contains(&joined)
    });
    let added = json["added_tokens"].as_array_mut().expect("added tokens");
    for (id, name) in ids.iter().zip(names) {
        added.push(json!({"id": id, "content": name, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    }
    std::fs::write(&path, json.to_string()).expect("writing the tokenizer");
    (dir, ids)
}

#[test]
fn a_suffix_asks_for_the_middle_with_the_vocabulary_s_fim_tokens_in_both_apis() {
    let (dir, [prefix_id, suffix_id, middle_id]) = fim_model();
    let codec = slotstream::tokenizer::TextCodec::load(dir.path(), &[]).expect("the tokenizer loads");
    let (prefix, suffix) = ("def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n");
    let mut want = vec![prefix_id];
    want.extend(codec.encode(prefix, false).expect("encodes"));
    want.push(suffix_id);
    want.extend(codec.encode(suffix, false).expect("encodes"));
    want.push(middle_id);
    let inner = &want[1..want.len() - 1];
    assert!(want.len() > 8 && !inner.contains(&prefix_id) && !inner.contains(&middle_id), "{want:?}");

    let s = start(dir.path());
    let show = s.json("/api/show", &json!({"model": MODEL}));
    assert!(show["capabilities"].as_array().is_some_and(|c| c.contains(&json!("insert"))), "{show}");
    let v = s.json("/api/generate", &json!({"model": MODEL, "prompt": prefix, "suffix": suffix, "stream": false,
        "options": {"temperature": 0, "num_predict": 6}}));
    let context: Vec<u32> = serde_json::from_value(v["context"].clone()).expect("the context ids");
    assert_eq!(context[..want.len()], want[..], "prefix, then suffix, then the middle is asked for: {v}");
    let generated = v["eval_count"].as_u64().expect("eval_count");
    assert!(generated > 0 && context.len() > want.len(), "{v}");
    assert_eq!(v["prompt_eval_count"], want.len(), "{v}");
    assert!(v["response"].is_string(), "{v}");

    let v = s.json("/v1/completions", &json!({"model": MODEL, "prompt": prefix, "suffix": suffix, "max_tokens": 6, "temperature": 0}));
    assert_eq!(v["usage"]["prompt_tokens"], want.len(), "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0), "{v}");
    let text = v["choices"][0]["text"].as_str().expect("the completion's text");
    // The same greedy middle from both APIs.
    let ollama = s.json("/api/generate", &json!({"model": MODEL, "prompt": prefix, "suffix": suffix, "stream": false,
        "options": {"temperature": 0, "num_predict": 6}}));
    assert_eq!(ollama["response"].as_str(), Some(text), "{v}\n{ollama}");
}

/// A raw prompt that ends in `<think>` is the client's own: what the model
/// writes comes back as the completion's text, not as unasked reasoning.
#[test]
fn a_raw_prompt_ending_in_think_gets_its_text_back() {
    let dir = tool_model();
    let s = start(dir.path());
    for prompt in ["Once upon a time", "Once upon a time <think>"] {
        let v = s.json("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}));
        assert!(!v["choices"][0]["text"].as_str().unwrap_or_default().is_empty(), "{prompt:?}: {v}");
        let v = s.json("/api/generate", &json!({"model": MODEL, "prompt": prompt, "raw": true, "stream": false,
                                                "options": {"num_predict": 12, "temperature": 0}}));
        assert!(!v["response"].as_str().unwrap_or_default().is_empty() && v.get("thinking").is_none(), "{prompt:?}: {v}");
    }
}
