//! The stream of events a generation's pieces make, and its helpers.

use super::*;
use crate::dialect::ToolCallForm;

/// The answer both APIs get from a generation whose engine wrote
/// `pieces` and ended for `finish`.
fn answer(pieces: &[&str], finish: FinishReason) -> Answer {
    answer_split(pieces, finish, None, ToolCallSplitter::new(Some(ToolCallForm::Json), &[]))
}

fn answer_split(pieces: &[&str], finish: FinishReason, splitter: Option<ThinkingSplitter>, calls: ToolCallSplitter) -> Answer {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let (outbox, rx) = delivery::channel(64, Duration::from_secs(5), runtime.handle().clone());
    for piece in pieces {
        assert!(outbox.send(Piece::Text(piece.to_string())), "the channel has room");
    }
    let (zero, completion_tokens) = (Duration::ZERO, pieces.len());
    let summary = Summary { prompt_tokens: 1, cached_tokens: 0, completion_tokens, finish, stop_sequence: None, context: Vec::new(), prompt_eval: zero, eval: zero, load: zero, total: zero };
    assert!(outbox.send(Piece::Done(summary)), "the channel has room");
    let reader = AnswerReader::new(splitter, Some(calls));
    let stream = GenerationStream { rx, reader, ready: VecDeque::new(), done: None, finished: false, prompt_tokens: 1 };
    runtime.block_on(stream.collect()).map(|(answer, _)| answer).unwrap_or_else(|e| panic!("{}", e.message))
}

#[test]
fn the_stop_string_that_ended_a_generation_is_found() {
    let stops = vec!["END".to_string(), "\n\n".to_string()];
    assert_eq!(matched_stop("Hello\n\nmore END", "Hello", &stops).as_deref(), Some("\n\n"), "the first one in the text");
    assert_eq!(matched_stop("HelloEND", "Hello", &stops).as_deref(), Some("END"));
    assert_eq!(matched_stop("Hello", "Hello", &stops), None, "ended otherwise");
    assert_eq!(context_limit(Some(1_000_000), 4096), 4096, "capped at the server's maximum");
    assert_eq!((context_limit(Some(100), 4096), context_limit(None, 4096)), (100, 4096));
}

#[test]
fn a_call_the_length_cut_off_is_dropped_and_the_calls_before_it_kept() {
    let whole = "\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
    let pieces = ["Sure.", whole, "\n<tool_call>\n{\"name\": \"add\", \"argu"];
    let cut = answer(&pieces, FinishReason::Length);
    assert_eq!((cut.content.as_str(), cut.tool_calls.len()), ("Sure.", 1), "the cut call is neither text nor a call");
    // Stopped otherwise (a stop sequence), what the model wrote stays text.
    let stopped = answer(&pieces, FinishReason::Stop);
    assert!(stopped.content.ends_with("\"argu") && stopped.tool_calls.len() == 1, "{}", stopped.content);
}

#[test]
fn a_call_after_reasoning_the_prompt_opened_is_a_call_and_the_reasoning_is_not_text() {
    let tool = serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}});
    let calls = ToolCallSplitter::new(Some(ToolCallForm::XmlParameters), &[tool]);
    let pieces = ["I should call f.\n</th", "ink>\n\n<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"];
    let got = answer_split(&pieces, FinishReason::Stop, Some(ThinkingSplitter::new(true)), calls);
    assert_eq!((got.thinking.as_str(), got.content.as_str()), ("I should call f.\n", ""));
    assert_eq!((got.tool_calls.len(), got.tool_calls[0].arguments_json.as_str()), (1, "{\"n\": 2}"));
}
