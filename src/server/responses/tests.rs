use super::output::{OutputWriter, Shape};
use super::*;
use crate::server::event_stream::EventWriter;
use crate::dialect::ToolCall;
use crate::server::{Event, Summary};
use crate::generate::FinishReason;
use crate::dialect::Split;

fn shape() -> Shape {
    Shape { id: "resp_1".into(), created_at: 1, model: "m".into(), echo: json!({"tools": []}) }
}

fn summary(finish: FinishReason) -> Summary {
    let zero = std::time::Duration::ZERO;
    Summary {
        prompt_tokens: 5,
        cached_tokens: 0,
        completion_tokens: 3,
        finish,
        stop_sequence: None,
        context: Vec::new(),
        prompt_eval: zero,
        eval: zero,
        load: zero,
        total: zero,
    }
}

fn delta(thinking: &str, content: &str) -> Event {
    Event::Delta(Split { thinking: thinking.into(), content: content.into() })
}

/// The `type` of each SSE event in `sse`, checking that sequence numbers count up from `first`.
fn event_types(sse: &str, first: u64) -> Vec<String> {
    let mut want = first;
    sse.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).expect("a data line");
            let v: Value = serde_json::from_str(data).expect("JSON data");
            assert_eq!(v["sequence_number"], want, "{e}");
            want += 1;
            let kind = v["type"].as_str().expect("a type").to_string();
            assert_eq!(e.lines().next(), Some(format!("event: {kind}").as_str()), "the event line names the type");
            kind
        })
        .collect()
}

#[test]
fn reasoning_text_and_a_call_stream_as_items_in_order() {
    let mut b = OutputWriter::new(shape());
    b.start();
    assert_eq!(event_types(&b.take_sse(), 0), ["response.created", "response.in_progress"]);
    assert!(b.event(delta("hmm", "")).is_none());
    assert!(b.event(delta("", "Sure.")).is_none());
    let arguments = "{\"a\": 1}".to_string();
    let call = ToolCall { name: "add".into(), arguments: serde_json::from_str(&arguments).expect("JSON"), arguments_json: arguments };
    assert!(b.event(Event::ToolCall(call)).is_none());
    let done = b.event(Event::Done(summary(FinishReason::Stop))).expect("the final response");
    let types = event_types(&b.take_sse(), 2);
    let want = [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ];
    // Each item closes (text done, part done, item done) before the next opens.
    let closing_reasoning = ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"];
    let closing_message = ["response.output_text.done", "response.content_part.done", "response.output_item.done"];
    let mut expected: Vec<&str> = want[..3].to_vec();
    expected.extend(closing_reasoning);
    expected.extend(&want[3..6]);
    expected.extend(closing_message);
    expected.extend(&want[6..]);
    assert_eq!(types, expected);
    assert_eq!(done["status"], "completed");
    let output = done["output"].as_array().expect("output items");
    let kinds: Vec<&str> = output.iter().filter_map(|i| i["type"].as_str()).collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call"]);
    assert_eq!(output[0]["content"][0]["text"], "hmm");
    assert_eq!(output[1]["content"][0]["text"], "Sure.");
    assert_eq!((output[2]["name"].as_str(), output[2]["arguments"].as_str()), (Some("add"), Some("{\"a\": 1}")));
    assert!(output[2]["call_id"].as_str().is_some_and(|id| id.starts_with("call_")));
    assert_eq!(done["usage"]["total_tokens"], 8);
}

#[test]
fn a_cut_answer_is_incomplete_for_max_output_tokens() {
    let mut b = OutputWriter::new(shape());
    b.event(delta("", "Once upon"));
    let done = b.event(Event::Done(summary(FinishReason::Length))).expect("the final response");
    assert_eq!((done["status"].as_str(), done["incomplete_details"]["reason"].as_str()), (Some("incomplete"), Some("max_output_tokens")));
    assert_eq!(done["output"][0]["status"], "incomplete");
    assert!(b.take_sse().contains("event: response.incomplete\n"));
}

#[test]
fn input_items_become_chat_turns() {
    let input = json!([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add 1 and 2."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\": 1, \"b\": 2}"},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{\"a\": 3, \"b\": 4}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "7"}]},
    ]);
    let turns = chat_turns(Some(json!("Answer in English.")), Some(input)).expect("valid input");
    let roles: Vec<&str> = turns.iter().map(|t| t.role.as_str()).collect();
    assert_eq!(roles, ["system", "system", "user", "assistant", "tool", "tool"]);
    assert_eq!(turns[2].content, "Add 1 and 2.");
    assert_eq!(turns[3].tool_calls.len(), 2, "both calls in one assistant turn");
    assert_eq!(turns[3].tool_calls[1]["function"]["arguments"], json!({"a": 3, "b": 4}));
    assert_eq!((turns[5].content.as_str(), turns[5].name.as_deref()), ("7", Some("add")));
}

#[test]
fn bad_input_items_are_named() {
    let cases = [
        (json!([]), "'input' is an empty list"),
        (json!(5), "'input' must be a string or a list"),
        (json!([{"role": "wizard", "content": "x"}]), "input[0].role 'wizard'"),
        (json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]), "input[0].arguments is not a JSON object"),
        (json!([{"type": "function_call_output", "call_id": "nope", "output": "x"}]), "call_id 'nope', which answers no function_call"),
        (json!([{"type": "item_reference", "id": "msg_1"}]), "keeps no items"),
        (json!([{"type": "computer_call"}]), "input[0].type 'computer_call' is not supported"),
        (json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "images"),
    ];
    for (input, needle) in cases {
        let e = chat_turns(None, Some(input.clone())).expect_err("refused");
        assert!(e.message.contains(needle), "{input}: {} should mention {needle:?}", e.message);
    }
}

#[test]
fn only_function_tools_are_kept_and_hosted_choices_refused() {
    let tools = json!([
        {"type": "web_search"},
        {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}, "strict": true},
        {"type": "namespace", "name": "x"},
    ]);
    let chat = function_tools(Some(tools)).expect("valid tools").expect("a list");
    assert_eq!(chat, json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]));
    let named = chat_tool_choice(Some(json!({"type": "function", "name": "add"}))).expect("valid");
    assert_eq!(named, Some(json!({"type": "function", "function": {"name": "add"}})));
    let hosted = chat_tool_choice(Some(json!({"type": "web_search"}))).expect_err("refused");
    assert!(hosted.message.contains("'web_search' tool, which this server does not run"), "{}", hosted.message);
    let nameless = function_tools(Some(json!([{"type": "function"}]))).expect_err("refused");
    assert!(nameless.message.contains("tools[0].name"), "{}", nameless.message);
}
