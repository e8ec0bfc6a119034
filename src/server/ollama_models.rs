//! The Ollama API's model endpoints: `/api/version`, `/api/tags` (every
//! model the server has), `/api/ps` (the loaded ones and until when) and
//! `/api/show` (what a model is and can do, loaded or not).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{json_response, OllamaError};
use super::model_info::rfc3339;
use super::{parse_body, AppState, ModelInfo};
use crate::model::ModelArch;
use crate::tokenizer::TextCodec;

type Reply = Result<Response, OllamaError>;

/// The Ollama API version this server speaks: clients gate features on it
/// (VS Code's agent mode wants at least 0.6.4; Codex CLI's `--oss` refuses
/// anything older than 0.13.4, the first with `/v1/responses`). Tool calling,
/// structured outputs, `/api/show` capabilities and the Responses API are all
/// there by this one.
pub const OLLAMA_API_VERSION: &str = "0.13.4";

pub async fn version() -> Response {
    json_response(StatusCode::OK, &json!({"version": OLLAMA_API_VERSION, "slotstream": env!("CARGO_PKG_VERSION")}))
}

fn model_entry(m: &ModelInfo) -> serde_json::Map<String, Value> {
    let mut obj = serde_json::Map::new();
    obj.insert("name".into(), m.name.clone().into());
    obj.insert("model".into(), m.name.clone().into());
    obj.insert("size".into(), m.file_bytes.into());
    obj.insert("digest".into(), m.digest.clone().into());
    obj.insert("details".into(), json!(m.details));
    obj
}

/// Every model the server answers for, loaded or not.
pub async fn tags(State(app): State<Arc<AppState>>) -> Response {
    let described = tokio::task::spawn_blocking(move || {
        app.catalog.entries().iter().filter_map(|e| app.catalog.describe(e)).collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    let models: Vec<Value> = described
        .iter()
        .map(|m| {
            let mut entry = model_entry(m);
            entry.insert("modified_at".into(), rfc3339(m.modified_at).into());
            Value::Object(entry)
        })
        .collect();
    json_response(StatusCode::OK, &json!({ "models": models }))
}

/// The loaded models, most recently used first, with their memory and when
/// each unloads if no request comes.
pub async fn ps(State(app): State<Arc<AppState>>) -> Response {
    let models: Vec<Value> = app
        .residency
        .loaded()
        .iter()
        .map(|m| {
            let memory = m.memory();
            let mut entry = model_entry(&m.info);
            entry.insert("size".into(), memory.total_bytes.into());
            entry.insert("expires_at".into(), rfc3339(m.expires_at()).into());
            entry.insert("size_vram".into(), 0.into());
            // What a request may use: --max-context, at most the model's own and its plan's.
            entry.insert("context_length".into(), m.context_limit(app.options.max_context).into());
            entry.insert("memory".into(), json!(memory));
            Value::Object(entry)
        })
        .collect();
    json_response(StatusCode::OK, &json!({ "models": models }))
}

#[derive(Deserialize)]
struct ShowBody {
    model: Option<String>,
    name: Option<String>,
}

/// What a model is and can do; a model that is not loaded is described from
/// its files (its tokenizer is read, its weights are not).
pub async fn show(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Reply {
    let b: ShowBody = parse_body(body)?;
    let requested = b.model.or(b.name).unwrap_or_default();
    let (entry, info) = app.find_model(&requested)?;
    let loaded = app.residency.get(&entry.name);
    let app2 = app.clone();
    let shown = tokio::task::spawn_blocking(move || -> Result<Value, super::ApiError> {
        let read_codec;
        let codec = match &loaded {
            Some(model) => &model.engine.codec,
            None => {
                let arch = ModelArch::read(&entry.dir).map_err(|e| super::ApiError::internal(format!("{e:#}")))?;
                read_codec = TextCodec::load(&entry.dir, &arch.eos_ids())
                    .map_err(|e| super::ApiError::internal(format!("reading the tokenizer of {}: {e:#}", entry.name)))?;
                &read_codec
            }
        };
        let context = loaded.as_ref().map(|m| m.context_limit(app2.options.max_context));
        Ok(describe(&app2, &info, codec, loaded.as_ref().map(|m| m.memory()), context))
    })
    .await
    .map_err(|e| super::ApiError::internal(format!("describing the model stopped: {e}")))??;
    Ok(json_response(StatusCode::OK, &shown))
}

/// `context`: what a request may use of the loaded model (its plan's bound
/// included); unloaded, --max-context at most the model's own.
fn describe(app: &AppState, m: &ModelInfo, codec: &TextCodec, memory: Option<super::MemoryReport>, context: Option<usize>) -> Value {
    let template = codec.chat_template().unwrap_or("").to_string();
    let mut capabilities = vec!["completion"];
    if codec.template_supports_tools() {
        capabilities.push("tools");
    }
    if codec.supports_thinking() {
        capabilities.push("thinking");
    }
    if codec.fim_tokens().is_some() {
        capabilities.push("insert");
    }
    // Ollama's `parameters`: one `name value` per line, the values the
    // server uses unless a request says otherwise.
    let own = m.context_length.map_or(usize::MAX, |c| usize::try_from(c).unwrap_or(usize::MAX));
    let num_ctx = context.unwrap_or(app.options.max_context.min(own));
    let mut parameters = format!("num_ctx {num_ctx}");
    for stop in codec.eos_ids.iter().filter_map(|&id| codec.decode_special(id)) {
        parameters.push_str(&format!("\nstop {}", json!(stop)));
    }
    json!({
        "license": "",
        "modelfile": format!("# served by slotstream {}\nFROM {}\n", env!("CARGO_PKG_VERSION"), m.name),
        "parameters": parameters,
        "template": template,
        "details": m.details,
        "model_info": m.model_info,
        "capabilities": capabilities,
        "modified_at": rfc3339(m.modified_at),
        "config": m.config,
        "slotstream": {
            "max_context": num_ctx,
            "queue": app.options.queue,
            "loaded": memory.is_some(),
            "memory": memory,
        },
    })
}
