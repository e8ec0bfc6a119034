//! The prompt of a generation: rendered through the model's chat template
//! (tools, thinking switch) and tokenized, judged by its size before it is;
//! and counted without generating.

use std::sync::Arc;

use super::{context_limit, AppState, GenerationRequest, PromptInput};
use crate::dialect::{think, ToolCallForm};
use crate::generate::Engine;
use crate::server::ApiError;
use crate::tokenizer::{ChatMessage, ChatPrompt, ChatTurn, TextCodec};

/// The request's `think`, less a `Some(true)` the template cannot honour
/// where the request allows that (`think_if_supported`).
pub(super) fn think_for(req: &GenerationRequest, codec: &TextCodec) -> Option<bool> {
    if req.think_if_supported && req.think == Some(true) && !codec.supports_thinking() {
        None
    } else {
        req.think
    }
}

/// The prompt `req` renders to, in tokens, without generating (Anthropic's
/// `count_tokens`); loads the model when it is not loaded.
pub async fn count_prompt_tokens(app: &Arc<AppState>, req: GenerationRequest) -> Result<usize, ApiError> {
    crate::server::request_log::RequestLog::current().model(&req.model);
    let model = app.lease(&req.model, req.keep_alive).await?;
    let limit = context_limit(req.context_limit, app.options.max_context);
    let think = think_for(&req, &model.engine.codec);
    let working = app.prompt_work.acquire().await.map_err(|_| ApiError::internal("the server is shutting down"))?;
    let rendered = tokio::task::spawn_blocking(move || render_prompt(&model.engine, req.prompt, &req.tools, think, limit))
        .await
        .map_err(|e| ApiError::internal(format!("rendering the prompt failed: {e}")))?;
    drop(working);
    Ok(rendered?.0.len())
}

/// Turns the prompt into token ids; also says whether the rendered prompt
/// already opens the reasoning ([`think::prompt_opens_reasoning`]).
pub(super) fn render_prompt(
    engine: &Engine,
    prompt: PromptInput,
    tools: &[serde_json::Value],
    think: Option<bool>,
    limit: usize,
) -> Result<(Vec<u32>, bool), ApiError> {
    let codec = &engine.codec;
    let template = |messages: &[ChatTurn]| -> Result<ChatPrompt, ApiError> {
        if think == Some(true) && !codec.supports_thinking() {
            return Err(ApiError::bad_request(
                "this model does not support thinking: its chat template has no enable_thinking switch",
            ));
        }
        let with_tools = !tools.is_empty() || messages.iter().any(|m| !m.tool_calls.is_empty() || m.role == "tool");
        match codec.tool_call_form() {
            _ if !with_tools => {}
            Some(ToolCallForm::Json | ToolCallForm::XmlParameters) => {}
            None => {
                return Err(ApiError::bad_request(
                    "this model does not support tools: its chat template never reads 'tools'; remove 'tools' and tool messages",
                ))
            }
        }
        codec.chat_prompt(messages, tools, true, think).map_err(|e| ApiError::bad_request(format!("{e:#}")))
    };
    // The rendered text (tools and tool calls included, which the check on
    // the request's messages does not count) is judged by its size before
    // any of it is tokenized.
    let check_size = |text: &str| {
        let fewest = codec.fewest_tokens(text.len());
        if fewest >= limit {
            return Err(ApiError::bad_request(format!(
                "the rendered prompt is at least {fewest} tokens (judged by its size in bytes), which leaves no room to \
                 generate within the context limit of {limit} tokens"
            )));
        }
        Ok(())
    };
    let tokenizing = |e: anyhow::Error| ApiError::bad_request(format!("{e:#}"));
    // Control tokens come from the chat template only: client text in it is
    // tokenized as plain text. A raw prompt is the client's own template
    // (its special tokens' text are control tokens, as Ollama reads it).
    let chat = |messages: &[ChatTurn]| -> Result<(Vec<u32>, String), ApiError> {
        let prompt = template(messages)?;
        check_size(&prompt.text)?;
        Ok((codec.encode_prompt(&prompt).map_err(tokenizing)?, prompt.text))
    };
    // `templated`: the chat template wrote the text (a raw prompt that opens
    // the reasoning is the client's own, its output plain text).
    let (ids, text, templated) = match prompt {
        PromptInput::Chat(messages) => {
            if !codec.has_chat_template() {
                return Err(ApiError::bad_request(
                    "this model has no chat template; use /api/generate with \"raw\": true or /v1/completions",
                ));
            }
            let (ids, text) = chat(&messages)?;
            (ids, text, true)
        }
        PromptInput::Text { text, system, raw, context } => {
            let templated = !raw && codec.has_chat_template();
            let (encoded, text) = if !templated {
                check_size(&text)?;
                (codec.encode(&text, false).map_err(tokenizing)?, text)
            } else {
                let mut messages = Vec::new();
                if let Some(s) = system.filter(|s| !s.is_empty()) {
                    messages.push(ChatTurn::from(ChatMessage { role: "system".into(), content: s }));
                }
                messages.push(ChatTurn::from(ChatMessage { role: "user".into(), content: text }));
                chat(&messages)?
            };
            let mut ids = context;
            ids.extend(encoded);
            (ids, text, templated)
        }
        PromptInput::Ids(ids) => (ids, String::new(), false),
        PromptInput::Fill { prefix, suffix, mut context } => {
            let ids = codec.fill_in_the_middle(&prefix, &suffix).map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
            let Some(ids) = ids else {
                return Err(ApiError::bad_request(
                    "this model does not support insert ('suffix', fill-in-the-middle): its vocabulary has no FIM tokens",
                ));
            };
            context.extend(ids);
            (context, String::new(), false)
        }
    };
    let vocab = engine.vocab_size();
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::bad_request(format!("token id {bad} is outside the model's vocabulary of {vocab}")));
    }
    if ids.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    Ok((ids, templated && think::prompt_opens_reasoning(&text)))
}
