//! The agents' APIs end to end: OpenAI's Responses (`/v1/responses`) and
//! Anthropic's Messages (`/v1/messages`, `/v1/messages/count_tokens`),
//! streamed and not, with tool calls, structured output, reasoning and
//! errors, over the fixture model with a tool-calling chat template.

mod common;

use serde_json::{json, Value};

use common::tools_server::*;

/// The events of an SSE stream (`event:` and `data:` lines), as (event, data).
fn sse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let kind = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("no event line in {e:?}"));
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or_else(|| panic!("no data line in {e:?}"));
            let data: Value = serde_json::from_str(data).unwrap_or_else(|err| panic!("{data:?} is not JSON: {err}"));
            assert_eq!(data["type"], kind, "the data's type names its event: {e}");
            (kind.to_string(), data)
        })
        .collect()
}

/// A streamed Responses answer: its events in order, each with a sequence
/// number one more than the last, from `response.created` to a final
/// `response.completed` / `response.incomplete`; returns the final response.
fn responses_stream(s: &Server, body: &Value) -> (Vec<(String, Value)>, Value) {
    let mut body = body.clone();
    body["stream"] = true.into();
    let (status, text) = s.post("/v1/responses", &body);
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    for (n, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], n, "sequence numbers count from 0: {text}");
    }
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"], "{text}");
    let last = kinds.last().copied().unwrap_or_default();
    assert!(last == "response.completed" || last == "response.incomplete", "ends with {last}: {text}");
    // Every item added is done before the response ends, at the same index.
    let added: Vec<&Value> = events.iter().filter(|(k, _)| k == "response.output_item.added").map(|(_, d)| &d["output_index"]).collect();
    let done: Vec<&Value> = events.iter().filter(|(k, _)| k == "response.output_item.done").map(|(_, d)| &d["output_index"]).collect();
    assert_eq!(added, done, "{text}");
    let final_response = events.last().map(|(_, d)| d["response"].clone()).expect("a final event");
    (events, final_response)
}

/// The text of a Responses answer's message items.
fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .expect("output items")
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .map(|part| part["text"].as_str().expect("output_text").to_string())
        .collect()
}

#[test]
fn responses_answer_plain_and_streamed_alike() {
    let dir = tool_model();
    let s = start(dir.path());
    let body = json!({"model": MODEL, "instructions": "Be brief.", "input": "Say hello.", "max_output_tokens": 10, "temperature": 0});
    let v = s.json("/v1/responses", &body);
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")), "{v}");
    let used = v["usage"]["output_tokens"].as_u64().expect("usage");
    let (status, reason) = if used == 10 { ("incomplete", json!({"reason": "max_output_tokens"})) } else { ("completed", Value::Null) };
    assert_eq!((&v["status"], &v["incomplete_details"]), (&json!(status), &reason), "{v}");
    assert_eq!(v["instructions"], "Be brief.");
    let text = output_text(&v);
    assert!(!text.is_empty(), "{v}");

    let (events, done) = responses_stream(&s, &body);
    let streamed: String = events.iter().filter(|(k, _)| k == "response.output_text.delta").map(|(_, d)| d["delta"].as_str().expect("a delta")).collect();
    assert_eq!(streamed, text, "the streamed deltas make the greedy answer");
    assert_eq!(output_text(&done), text);
    assert_eq!(done["status"], status);

    // The conversation as items, earlier answer included.
    let input = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
        {"role": "user", "content": "Again."},
    ]);
    let again = s.json("/v1/responses", &json!({"model": MODEL, "input": input, "max_output_tokens": 4}));
    assert!(again["usage"]["input_tokens"].as_u64() > v["usage"]["input_tokens"].as_u64(), "{again}");
}

#[test]
fn responses_force_a_function_call_beside_hosted_tools_and_take_its_output_back() {
    let dir = tool_model();
    let s = start(dir.path());
    // Responses tools are flat; a hosted web_search beside them is skipped.
    let mut flat: Vec<Value> = tools().as_array().expect("tools").iter().map(|t| {
        let mut f = t["function"].clone();
        f["type"] = "function".into();
        f
    }).collect();
    flat.push(json!({"type": "web_search"}));
    let body = json!({"model": MODEL, "input": "What is 2 + 3?", "tools": flat, "tool_choice": {"type": "function", "name": "add"},
                      "max_output_tokens": 120, "temperature": 0});
    let v = s.json("/v1/responses", &body);
    let calls: Vec<&Value> = v["output"].as_array().expect("output").iter().filter(|i| i["type"] == "function_call").collect();
    assert_eq!(calls.len(), 1, "one forced call: {v}");
    let call = calls[0];
    assert_eq!(call["name"], "add");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments as a string")).expect("JSON arguments");
    check_arguments("add", &arguments);
    let call_id = call["call_id"].as_str().expect("a call_id");

    let (events, done) = responses_stream(&s, &body);
    let deltas: String = events
        .iter()
        .filter(|(k, _)| k == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().expect("a delta"))
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&deltas).expect("the deltas make JSON"), arguments, "greedy: the same call");
    assert_eq!(done["output"].as_array().map(Vec::len), Some(1), "{done}");

    // The call and its output go back as items.
    let input = json!([
        {"role": "user", "content": "What is 2 + 3?"},
        {"type": "function_call", "call_id": call_id, "name": "add", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call_id, "output": "5"},
    ]);
    let after = s.json("/v1/responses", &json!({"model": MODEL, "input": input, "tools": flat, "tool_choice": "none", "max_output_tokens": 4}));
    assert!(after["output"].as_array().is_some_and(|o| o.iter().all(|i| i["type"] != "function_call")), "tool_choice none: {after}");
    assert!(after["usage"]["input_tokens"].as_u64().is_some_and(|n| n > 100), "{after}");
}

#[test]
fn responses_follow_a_json_schema_and_refuse_what_they_cannot_do() {
    let dir = tool_model();
    let s = start(dir.path());
    let schema = json!({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                        "required": ["age"], "additionalProperties": false});
    let format = json!({"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": true}});
    for seed in 0..2 {
        let v = s.json("/v1/responses", &json!({"model": MODEL, "input": "How old?", "text": format, "seed": seed, "max_output_tokens": 40}));
        let answer: Value = serde_json::from_str(&output_text(&v)).unwrap_or_else(|e| panic!("not JSON ({e}): {v}"));
        assert!(answer["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{answer}");
    }
    let path = "/v1/responses";
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}));
    assert!(e.contains("previous_response_id") && e.contains("whole conversation"), "{e}");
    let e = s.error(path, &json!({"model": MODEL}));
    assert!(e.contains("'input' is required"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}));
    assert!(e.contains("input[0]") && e.contains("'c9'"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "g"}}));
    assert!(e.contains("'g', which is not in 'tools'"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}));
    assert!(e.contains("text.format.schema"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "max_output_tokens": 0}));
    assert!(e.contains("max_output_tokens must be at least 1"), "{e}");
    let e = s.error(path, &json!({"model": MODEL, "input": "x", "temperature": "warm"}));
    assert!(e.contains("temperature"), "{e}");
    let (status, text) = s.post(path, &json!({"model": "gpt-5", "input": "x"}));
    assert_eq!(status, 404, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("gpt-5")), "OpenAI's error shape: {v}");
}

/// The tools in Anthropic's form.
fn anthropic_tools() -> Value {
    tools()
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| json!({"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]}))
        .collect()
}

/// A streamed Messages answer: its events, from `message_start` to
/// `message_stop`, each block started, filled and stopped in order; returns
/// the events and the message they build.
fn messages_stream(s: &Server, body: &Value) -> (Vec<(String, Value)>, Value) {
    let mut body = body.clone();
    body["stream"] = true.into();
    let (status, text) = s.post("/v1/messages", &body);
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{text}");
    assert_eq!(kinds[kinds.len() - 2..], ["message_delta", "message_stop"], "{text}");
    let mut message = events[0].1["message"].clone();
    let mut open: Option<usize> = None;
    let mut json_input = String::new();
    for (kind, data) in &events[1..] {
        match kind.as_str() {
            "ping" => {}
            "content_block_start" => {
                assert!(open.is_none(), "a block starts while another is open: {text}");
                let index = data["index"].as_u64().expect("an index") as usize;
                let blocks = message["content"].as_array_mut().expect("content");
                assert_eq!(index, blocks.len(), "blocks are numbered in order: {text}");
                blocks.push(data["content_block"].clone());
                open = Some(index);
                json_input.clear();
            }
            "content_block_delta" => {
                let index = open.expect("a delta inside a block");
                assert_eq!(data["index"], index);
                let block = &mut message["content"][index];
                let delta = &data["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => block["text"] = format!("{}{}", block["text"].as_str().unwrap_or_default(), delta["text"].as_str().expect("text")).into(),
                    Some("thinking_delta") => block["thinking"] = format!("{}{}", block["thinking"].as_str().unwrap_or_default(), delta["thinking"].as_str().expect("thinking")).into(),
                    Some("input_json_delta") => json_input.push_str(delta["partial_json"].as_str().expect("partial_json")),
                    other => panic!("unknown delta {other:?}: {text}"),
                }
            }
            "content_block_stop" => {
                let index = open.take().expect("a stop inside a block");
                assert_eq!(data["index"], index);
                if message["content"][index]["type"] == "tool_use" {
                    message["content"][index]["input"] = serde_json::from_str(&json_input).expect("the input deltas make JSON");
                }
            }
            "message_delta" => {
                message["stop_reason"] = data["delta"]["stop_reason"].clone();
                message["stop_sequence"] = data["delta"]["stop_sequence"].clone();
                message["usage"]["output_tokens"] = data["usage"]["output_tokens"].clone();
            }
            "message_stop" => assert!(open.is_none(), "the message stops inside a block: {text}"),
            other => panic!("unexpected event {other}: {text}"),
        }
    }
    (events, message)
}

fn message_text(message: &Value) -> String {
    message["content"].as_array().expect("content").iter().filter(|b| b["type"] == "text").map(|b| b["text"].as_str().expect("text")).collect()
}

#[test]
fn messages_answer_plain_and_streamed_alike_and_stop_at_stop_sequences() {
    let dir = tool_model();
    let s = start(dir.path());
    let headers = [("x-api-key", "anything"), ("anthropic-version", "2023-06-01"), ("anthropic-beta", "x")];
    let body = json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "system": [{"type": "text", "text": "Be brief."}],
                      "messages": [{"role": "user", "content": "Say hello."}]});
    let (status, text) = s.post_with("/v1/messages", &headers, &body);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!((&v["type"], &v["role"]), (&json!("message"), &json!("assistant")));
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{v}");
    let used = v["usage"]["output_tokens"].as_u64().expect("usage");
    assert_eq!(v["stop_reason"], if used == 12 { "max_tokens" } else { "end_turn" }, "{v}");
    let answer = message_text(&v);
    assert!(answer.chars().count() >= 4, "a greedy answer long enough to cut: {v}");

    let (_, streamed) = messages_stream(&s, &body);
    assert_eq!(message_text(&streamed), answer, "the streamed deltas make the greedy answer");
    assert_eq!(streamed["stop_reason"], v["stop_reason"]);

    // A stop sequence from inside the greedy answer ends it there.
    let chars: Vec<char> = answer.chars().collect();
    let stop: String = chars[2..4].iter().collect();
    let cut = &answer[..answer.find(&stop).expect("the stop is in the answer")];
    let mut stopping = body.clone();
    stopping["stop_sequences"] = json!([stop]);
    let v = s.json("/v1/messages", &stopping);
    assert_eq!((&v["stop_reason"], &v["stop_sequence"]), (&json!("stop_sequence"), &json!(stop)), "{v}");
    assert_eq!(message_text(&v), cut);
    let (_, streamed) = messages_stream(&s, &stopping);
    assert_eq!((&streamed["stop_reason"], &streamed["stop_sequence"]), (&json!("stop_sequence"), &json!(stop)));

    // count_tokens counts the prompt the answer was given.
    let counted = s.json("/v1/messages/count_tokens", &json!({"model": MODEL, "system": body["system"], "messages": body["messages"]}));
    let prompt = v["usage"]["input_tokens"].as_u64().unwrap_or(0) + v["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert_eq!(counted["input_tokens"].as_u64(), Some(prompt), "{counted} vs {v}");
}

#[test]
fn messages_force_tool_use_and_take_tool_results_back() {
    let dir = tool_model();
    let s = start(dir.path());
    let body = json!({"model": MODEL, "max_tokens": 120, "temperature": 0, "tools": anthropic_tools(),
                      "tool_choice": {"type": "tool", "name": "get_weather"},
                      "messages": [{"role": "user", "content": "Weather on day 3?"}]});
    let v = s.json("/v1/messages", &body);
    let uses: Vec<&Value> = v["content"].as_array().expect("content").iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{v}");
    assert_eq!((&uses[0]["name"], &v["stop_reason"]), (&json!("get_weather"), &json!("tool_use")), "{v}");
    check_arguments("get_weather", &uses[0]["input"]);
    let id = uses[0]["id"].as_str().expect("an id");
    assert!(id.starts_with("toolu_"), "{id}");

    let (_, streamed) = messages_stream(&s, &body);
    let streamed_use = streamed["content"].as_array().expect("content").iter().find(|b| b["type"] == "tool_use").cloned().expect("a tool_use");
    assert_eq!(streamed_use["input"], uses[0]["input"], "greedy: the same call, streamed as input_json_delta");
    assert_eq!(streamed["stop_reason"], "tool_use");

    // tool_choice any with parallel use off: exactly one call of either tool.
    let mut any = body.clone();
    any["tool_choice"] = json!({"type": "any", "disable_parallel_tool_use": true});
    let v2 = s.json("/v1/messages", &any);
    let uses2: Vec<&Value> = v2["content"].as_array().expect("content").iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses2.len(), 1, "{v2}");
    check_arguments(uses2[0]["name"].as_str().expect("a name"), &uses2[0]["input"]);

    let history = json!([
        {"role": "user", "content": "Weather on day 3?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, uses[0]]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": [{"type": "text", "text": "21 C"}]}]},
    ]);
    let after = s.json("/v1/messages", &json!({"model": MODEL, "max_tokens": 4, "tools": anthropic_tools(),
        "tool_choice": {"type": "none"}, "messages": history}));
    assert!(after["content"].as_array().is_some_and(|c| c.iter().all(|b| b["type"] != "tool_use")), "tool_choice none: {after}");
    assert!(after["usage"]["input_tokens"].as_u64().is_some_and(|n| n > 100), "{after}");
}

#[test]
fn messages_errors_take_anthropic_s_shape() {
    let dir = tool_model();
    let s = start(dir.path());
    let user = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (json!({"model": MODEL, "messages": user}), "'max_tokens' is required"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": []}), "at least one message"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": user, "temperature": 1.5}), "temperature must be between 0 and 1"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}]}), "tool_use_id 't9'"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": user, "tools": anthropic_tools(), "tool_choice": {"type": "tool", "name": "nope"}}), "'nope'"),
        (json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), "images"),
    ];
    for (body, needle) in cases {
        let (status, text) = s.post("/v1/messages", &body);
        assert_eq!(status, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("a JSON error");
        assert_eq!((&v["type"], &v["error"]["type"]), (&json!("error"), &json!("invalid_request_error")), "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(needle)), "{v} should mention {needle:?}");
    }
    for (path, body, status, kind) in [
        ("/v1/messages", json!({"model": "claude-sonnet-4", "max_tokens": 4, "messages": user}), 404, "not_found_error"),
        ("/v1/messages/count_tokens", json!({"model": MODEL, "messages": "x"}), 400, "invalid_request_error"),
        ("/v1/messages/batches", json!({}), 404, "not_found_error"),
    ] {
        let (got, text) = s.post(path, &body);
        assert_eq!(got, status, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).expect("a JSON error");
        assert_eq!(v["error"]["type"], kind, "{path}: {v}");
    }
}

#[test]
fn reasoning_comes_back_in_each_api_s_own_form() {
    let dir = model_with_template("thinking.jinja");
    let s = start(dir.path());
    // The generation prompt opens <think>; the random weights never close
    // it, so the whole answer is reasoning.
    let chat = s.json("/v1/chat/completions", &json!({"model": MODEL, "messages": user("Hi"), "max_tokens": 6, "temperature": 0}));
    let message = &chat["choices"][0]["message"];
    assert!(message["reasoning"].as_str().is_some_and(|r| !r.is_empty()), "{chat}");
    assert_eq!(message["reasoning_content"], message["reasoning"], "both names for the reasoning: {chat}");

    let body = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": "low"}});
    let v = s.json("/v1/responses", &body);
    assert_eq!(v["output"][0]["type"], "reasoning", "{v}");
    let reasoning = v["output"][0]["content"][0]["text"].as_str().expect("reasoning_text").to_string();
    assert_eq!(reasoning, message["reasoning"].as_str().unwrap_or_default(), "greedy: the same reasoning");
    let (events, _) = responses_stream(&s, &body);
    let streamed: String = events.iter().filter(|(k, _)| k == "response.reasoning_text.delta").map(|(_, d)| d["delta"].as_str().expect("a delta")).collect();
    assert_eq!(streamed, reasoning);

    let body = json!({"model": MODEL, "max_tokens": 6, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 1024},
                      "messages": [{"role": "user", "content": "Hi"}]});
    let v = s.json("/v1/messages", &body);
    assert_eq!((&v["content"][0]["type"], &v["content"][0]["thinking"]), (&json!("thinking"), &json!(reasoning)), "{v}");
    let (_, streamed) = messages_stream(&s, &body);
    assert_eq!(streamed["content"][0]["thinking"], json!(reasoning));

    // A model without a thinking switch answers reasoning requests of these
    // two APIs without reasoning (agents send them to every model).
    let tools_dir = tool_model();
    let plain = start(tools_dir.path());
    let v = plain.json("/v1/responses", &json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": "high"}}));
    assert!(v["output"].as_array().is_some_and(|o| o.iter().all(|i| i["type"] != "reasoning")), "{v}");
    plain.json("/v1/messages", &json!({"model": MODEL, "max_tokens": 2, "thinking": {"type": "enabled", "budget_tokens": 1024},
                                       "messages": [{"role": "user", "content": "Hi"}]}));
}

#[test]
fn messages_follow_an_output_schema() {
    let dir = tool_model();
    let s = start(dir.path());
    let schema = json!({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                        "required": ["age"], "additionalProperties": false});
    let body = json!({"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "How old?"}],
                      "output_config": {"format": {"type": "json_schema", "schema": schema}}});
    let v = s.json("/v1/messages", &body);
    let answer: Value = serde_json::from_str(&message_text(&v)).unwrap_or_else(|e| panic!("not JSON ({e}): {v}"));
    assert!(answer["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{answer}");
    let e = s.error("/v1/messages", &json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "yaml"}}}));
    assert!(e.contains("output_config.format must be"), "{e}");
}

/// What Claude Code sends: reminders as system messages between the turns
/// and a `max_tokens` of 32000 whatever the context (a cap, lowered to what
/// the context holds, as `max_output_tokens` is on the Responses API).
#[test]
fn token_limits_beyond_the_context_are_caps_in_the_agent_apis() {
    let dir = tool_model();
    let s = start(dir.path());
    let messages = json!([
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "<system-reminder>Be brief.</system-reminder>"},
        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
    ]);
    let v = s.json("/v1/messages", &json!({"model": MODEL, "max_tokens": 32000, "temperature": 0, "messages": messages}));
    let used = v["usage"]["input_tokens"].as_u64().unwrap_or(0) + v["usage"]["output_tokens"].as_u64().unwrap_or(0);
    assert!(used <= 4096, "within the context: {v}");
    assert!(v["stop_reason"] == "end_turn" || v["stop_reason"] == "max_tokens", "{v}");
    let v = s.json("/v1/responses", &json!({"model": MODEL, "input": "Hi", "max_output_tokens": 1_000_000, "temperature": 0}));
    assert!(v["usage"]["total_tokens"].as_u64().is_some_and(|n| n <= 4096), "{v}");
    // OpenAI chat keeps its word: max_tokens over the context is refused.
    let e = s.error("/v1/chat/completions", &json!({"model": MODEL, "messages": user("Hi"), "max_tokens": 1_000_000}));
    assert!(e.contains("exceeds the context limit"), "{e}");
}
