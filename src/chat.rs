//! The interactive chat of `slotstream run` without a prompt (or `slotstream
//! chat`), as `ollama run` has it: a line editor with history, `"""` around
//! a message of several lines (or a line ending in `\`), `/bye`, `/clear`,
//! `/set` for the sampling options. The conversation is kept; the prefix
//! cache hands each turn the state of the one before, so only the new
//! message is fed. Ctrl-C stops the answer, not the chat.

use std::ops::ControlFlow;
use std::sync::Mutex;

use anyhow::{Context, Result};
use rustyline::error::ReadlineError;
use rustyline::DefaultEditor;

use crate::generate::{self, Engine, GenerateRequest, PrefixCache, TurnEnd, TurnOutput};
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatMessage;
use crate::{console, note, process};

/// Conversation states the chat keeps: the last prompt and the last answer.
const CACHED_STATES: usize = 4;

/// What every answer is generated with; `/set` changes it.
#[derive(Clone, Debug)]
pub struct ChatSettings {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub system: Option<String>,
    pub think: Option<bool>,
    pub stop: Vec<String>,
    /// `--ignore-eos`: answers run to `max_tokens` (for tests and benchmarks).
    pub ignore_eos: bool,
    /// Prompt plus answer tokens a turn may reach (the planned context).
    pub context: usize,
}

const HELP: &str = "\
  /set temperature T | top_k K | top_p P | min_p P | seed S | max_tokens N | repeat_penalty R
  /set system TEXT     a system message (clears the conversation)
  /set think on|off    the template's thinking mode, where it has one
  /show                the current settings
  /clear               forget the conversation
  /bye                 leave (Ctrl-D too)
  \"\"\"                  begins and ends a message of several lines; a line ending in \\ continues
  Ctrl-C               stops the answer";

/// Runs the chat on the terminal until `/bye` or Ctrl-D.
pub fn run_chat(engine: &Engine, mut settings: ChatSettings) -> Result<()> {
    let mut editor = DefaultEditor::new().context("opening the terminal for the chat")?;
    let mut messages: Vec<ChatMessage> = Vec::new();
    let cache = Mutex::new(PrefixCache::new(CACHED_STATES, settings.context));
    process::catch_interrupt()?;
    note!("chat: type a message; /? for help, /bye or Ctrl-D to leave");
    while let Some(input) = read_message(&mut editor)? {
        let text = input.trim();
        if text.is_empty() {
            continue;
        }
        if let Some(command) = text.strip_prefix('/') {
            match command_of(command, &mut settings) {
                Command::Bye => break,
                Command::Clear => {
                    messages.clear();
                    note!("(the conversation is cleared)");
                }
                Command::Said(what) => note!("{what}"),
            }
            continue;
        }
        messages.push(ChatMessage { role: "user".into(), content: text.to_string() });
        match answer(engine, &settings, &messages, &cache)? {
            Some(reply) => messages.push(ChatMessage { role: "assistant".into(), content: reply }),
            // Nothing was said: the question goes too.
            None => {
                messages.pop();
            }
        }
        process::clear_interrupt();
    }
    Ok(())
}

/// One message from the terminal: a line, several between `"""`, or lines
/// joined by a trailing `\`. `None` at Ctrl-D.
fn read_message(editor: &mut DefaultEditor) -> Result<Option<String>> {
    let first = match editor.readline(">>> ") {
        Ok(line) => line,
        // Ctrl-C at the prompt clears the line, as in a shell.
        Err(ReadlineError::Interrupted) => return Ok(Some(String::new())),
        Err(ReadlineError::Eof) => return Ok(None),
        Err(e) => return Err(e).context("reading from the terminal"),
    };
    let mut message = String::new();
    if let Some(rest) = first.trim_start().strip_prefix("\"\"\"") {
        if let Some(end) = rest.find("\"\"\"") {
            message.push_str(&rest[..end]);
        } else {
            message.push_str(rest);
            loop {
                let line = match editor.readline("... ") {
                    Ok(line) => line,
                    Err(ReadlineError::Interrupted) => return Ok(Some(String::new())),
                    Err(ReadlineError::Eof) => break,
                    Err(e) => return Err(e).context("reading from the terminal"),
                };
                message.push('\n');
                match line.find("\"\"\"") {
                    Some(end) => {
                        message.push_str(&line[..end]);
                        break;
                    }
                    None => message.push_str(&line),
                }
            }
        }
    } else {
        let mut line = first;
        while let Some(head) = line.strip_suffix('\\') {
            message.push_str(head);
            message.push('\n');
            line = match editor.readline("... ") {
                Ok(line) => line,
                Err(ReadlineError::Interrupted) => return Ok(Some(String::new())),
                Err(ReadlineError::Eof) => String::new(),
                Err(e) => return Err(e).context("reading from the terminal"),
            };
        }
        message.push_str(&line);
    }
    let _ = editor.add_history_entry(message.as_str());
    Ok(Some(message))
}

enum Command {
    Bye,
    Clear,
    /// Done; this says what happened.
    Said(String),
}

/// A `/command` (without its slash).
fn command_of(command: &str, settings: &mut ChatSettings) -> Command {
    let mut words = command.splitn(3, char::is_whitespace);
    match (words.next().unwrap_or(""), words.next(), words.next()) {
        ("bye" | "exit" | "quit", _, _) => Command::Bye,
        ("clear", _, _) => Command::Clear,
        ("?" | "help", _, _) => Command::Said(HELP.to_string()),
        ("show", _, _) => Command::Said(show(settings)),
        ("set", Some(name), value) => match set(settings, name, value.unwrap_or("").trim()) {
            Ok(()) if name == "system" => Command::Said("(system message set; the conversation is cleared)".into()),
            Ok(()) => Command::Said(format!("(set {name})")),
            Err(e) => Command::Said(format!("/set {name}: {e}")),
        },
        ("set", None, _) => Command::Said(format!("/set needs a name and a value:\n{HELP}")),
        (other, _, _) => Command::Said(format!("unknown command /{other}; /? lists them")),
    }
}

fn show(s: &ChatSettings) -> String {
    let p = &s.sampling;
    format!(
        "  temperature {} top_k {} top_p {} min_p {} seed {} max_tokens {} repeat_penalty {} think {} system {:?}",
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.seed.map_or("none".to_string(), |s| s.to_string()),
        s.max_tokens,
        p.repetition_penalty,
        s.think.map_or("default", |t| if t { "on" } else { "off" }),
        s.system.as_deref().unwrap_or("")
    )
}

/// Applies `/set name value`; the sampling values are checked as a request's are.
fn set(settings: &mut ChatSettings, name: &str, value: &str) -> Result<(), String> {
    fn number<T: std::str::FromStr>(value: &str) -> Result<T, String> {
        value.parse().map_err(|_| format!("{value:?} is not a number"))
    }
    let mut next = settings.clone();
    match name {
        "temperature" => next.sampling.temperature = number(value)?,
        "top_k" => next.sampling.top_k = number(value)?,
        "top_p" => next.sampling.top_p = number(value)?,
        "min_p" => next.sampling.min_p = number(value)?,
        "seed" => next.sampling.seed = Some(number(value)?),
        "repeat_penalty" => next.sampling.repetition_penalty = number(value)?,
        "max_tokens" => next.max_tokens = number(value)?,
        "system" => next.system = (!value.is_empty()).then(|| value.to_string()),
        "think" => {
            next.think = match value {
                "on" | "true" => Some(true),
                "off" | "false" => Some(false),
                _ => return Err(format!("{value:?}: expected on or off")),
            }
        }
        other => return Err(format!("unknown setting {other:?}; /? lists them")),
    }
    next.sampling.validate()?;
    *settings = next;
    Ok(())
}

/// Generates the answer to the conversation so far, printing it as it
/// comes; `None` when Ctrl-C came before any of it.
fn answer(engine: &Engine, settings: &ChatSettings, messages: &[ChatMessage], cache: &Mutex<PrefixCache>) -> Result<Option<String>> {
    let mut conversation = Vec::new();
    if let Some(system) = &settings.system {
        conversation.push(ChatMessage { role: "system".into(), content: system.clone() });
    }
    conversation.extend(messages.iter().cloned());
    let ids = engine.codec.chat_ids(&conversation, settings.think)?;
    let max_tokens = match generate::tokens_within_context(ids.len(), settings.max_tokens, settings.context, "the planned context") {
        Ok(n) => n,
        Err(e) => {
            note!("{e:#}: /clear starts a new conversation (or raise --plan-context)");
            return Ok(None);
        }
    };
    let request = GenerateRequest {
        prompt_ids: ids,
        max_tokens,
        sampling: settings.sampling.clone(),
        stop: settings.stop.clone(),
        ignore_eos: settings.ignore_eos,
    };
    let mut write_error = None;
    let ended = engine.run_turn(Some(cache), &request, None, process::interrupted, |piece| {
        if process::interrupted() {
            return ControlFlow::Break(());
        }
        if let Err(e) = console::print(piece) {
            write_error = Some(e);
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    })?;
    let TurnOutput { out, cached_tokens: reused, .. } = match ended {
        TurnEnd::Done(turn) => turn,
        TurnEnd::CancelledInPrompt { .. } => {
            note!("(stopped)");
            return Ok(None);
        }
    };
    if let Some(e) = write_error {
        return Err(e);
    }
    console::print("\n")?;
    let stopped = if process::interrupted() { ", stopped" } else { "" };
    note!(
        "({} prompt tokens, {reused} reused; {} generated at {:.1} tok/s{stopped})",
        out.stats.prompt_tokens,
        out.stats.generated_tokens,
        out.stats.decode_tokens_per_second
    );
    Ok((!out.text.is_empty() || !process::interrupted()).then_some(out.text))
}
