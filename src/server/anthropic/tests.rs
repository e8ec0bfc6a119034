use super::*;
use crate::generate::FinishReason;
use crate::server::event_stream::EventWriter;
use crate::dialect::ToolCall;
use crate::server::{Event, Summary};
use crate::dialect::Split;

fn summary(finish: FinishReason, stop_sequence: Option<&str>) -> Summary {
    let zero = std::time::Duration::ZERO;
    Summary {
        prompt_tokens: 9,
        cached_tokens: 4,
        completion_tokens: 3,
        finish,
        stop_sequence: stop_sequence.map(String::from),
        context: Vec::new(),
        prompt_eval: zero,
        eval: zero,
        load: zero,
        total: zero,
    }
}

fn events(sse: &str) -> Vec<Value> {
    sse.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut lines = e.lines();
            let kind = lines.next().and_then(|l| l.strip_prefix("event: ")).expect("an event line");
            let data: Value = serde_json::from_str(lines.next().and_then(|l| l.strip_prefix("data: ")).expect("a data line")).expect("JSON");
            assert_eq!(data["type"], kind, "the data's type is the event's");
            data
        })
        .collect()
}

#[test]
fn thinking_text_and_a_tool_use_stream_as_blocks() {
    let mut b = BlockWriter::new("m".into(), 9);
    b.start();
    b.event(Event::Delta(Split { thinking: "hmm".into(), content: String::new() }));
    b.event(Event::Delta(Split { thinking: String::new(), content: "Sure".into() }));
    b.event(Event::Delta(Split { thinking: String::new(), content: ".".into() }));
    let arguments = "{\"a\": 1}".to_string();
    let call = ToolCall { name: "add".into(), arguments: serde_json::from_str(&arguments).expect("JSON"), arguments_json: arguments };
    b.event(Event::ToolCall(call));
    let done = b.event(Event::Done(summary(FinishReason::Stop, None))).expect("the message");
    let evs = events(&b.take_sse());
    let kinds: Vec<&str> = evs.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            "message_start", "ping",
            "content_block_start", "content_block_delta", "content_block_stop",
            "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
            "content_block_start", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop",
        ]
    );
    assert_eq!(evs[0]["message"]["usage"]["input_tokens"], 9);
    assert_eq!(evs[3]["delta"], json!({"type": "thinking_delta", "thinking": "hmm"}));
    assert_eq!(evs[10]["delta"], json!({"type": "input_json_delta", "partial_json": "{\"a\": 1}"}));
    assert_eq!(evs[12]["delta"]["stop_reason"], "tool_use");
    assert_eq!(done["content"][1], json!({"type": "text", "text": "Sure."}));
    assert_eq!((done["content"][2]["name"].as_str(), &done["content"][2]["input"]), (Some("add"), &json!({"a": 1})));
    assert_eq!((done["usage"]["input_tokens"].as_u64(), done["usage"]["cache_read_input_tokens"].as_u64()), (Some(5), Some(4)));
}

#[test]
fn stop_reasons_follow_how_the_generation_ended() {
    let reason = |finish, stop: Option<&str>| {
        let mut b = BlockWriter::new("m".into(), 1);
        b.event(Event::Delta(Split { thinking: String::new(), content: "x".into() }));
        let done = b.event(Event::Done(summary(finish, stop))).expect("the message");
        (done["stop_reason"].as_str().map(String::from), done["stop_sequence"].as_str().map(String::from))
    };
    assert_eq!(reason(FinishReason::Stop, None), (Some("end_turn".into()), None));
    assert_eq!(reason(FinishReason::Stop, Some("END")), (Some("stop_sequence".into()), Some("END".into())));
    assert_eq!(reason(FinishReason::Length, None), (Some("max_tokens".into()), None));
}

#[test]
fn content_blocks_become_chat_turns() {
    let messages: Vec<Message> = serde_json::from_value(json!([
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "easy", "signature": "x"},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "3"}]},
            {"type": "text", "text": "Thanks."}]},
    ]))
    .expect("messages");
    let turns = chat_turns(system_text(Some(json!([{"type": "text", "text": "Be brief."}]))).expect("system"), messages).expect("valid");
    let roles: Vec<&str> = turns.iter().map(|t| t.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
    assert_eq!((turns[2].content.as_str(), turns[2].tool_calls.len()), ("Calling.", 1));
    assert_eq!((turns[3].content.as_str(), turns[3].name.as_deref()), ("3", Some("add")));
}

#[test]
fn bad_blocks_and_choices_are_named() {
    let refused = |messages: Value| {
        let messages: Vec<Message> = serde_json::from_value(messages).expect("messages");
        chat_turns(None, messages).expect_err("refused").message
    };
    let e = refused(json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "3"}]}]));
    assert!(e.contains("messages[0].content[0] is the result of tool_use_id 'toolu_9', which answers no tool_use"), "{e}");
    let e = refused(json!([{"role": "tool", "content": "x"}]));
    assert!(e.contains("messages[0].role 'tool' is not user, assistant or system"), "{e}");
    let e = refused(json!([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]));
    assert!(e.contains("messages[0].content[0] is a tool_use block in a user message"), "{e}");
    let e = refused(json!([]));
    assert!(e.contains("at least one message"), "{e}");
    let tools = tools::parse_tools(chat_tools(Some(json!([
        {"name": "add", "input_schema": {"type": "object", "properties": {}}},
        {"type": "web_search_20250305", "name": "web_search"},
    ]))).expect("tools")).expect("valid tools");
    assert_eq!(tools.specs.len(), 1, "the server tool is skipped");
    let (choice, parallel) = tool_choice(Some(json!({"type": "any", "disable_parallel_tool_use": true})), &tools).expect("any");
    assert_eq!((choice, parallel), (ToolChoice::Required, false));
    let e = tool_choice(Some(json!({"type": "tool", "name": "mul"})), &tools).expect_err("unknown tool");
    assert!(e.message.contains("names the tool 'mul'"), "{}", e.message);
}
