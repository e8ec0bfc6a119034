//! The `slotstream` command line.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use slotstream::generate::{Engine, GenerateRequest};
use slotstream::sampling::SamplingParams;
use slotstream::tokenizer::ChatMessage;
use slotstream_backend::Backend;

#[derive(Parser)]
#[command(name = "slotstream", version, about = "Run Mixture-of-Experts language models larger than memory")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Run(RunArgs),
    /// Serve the Ollama and OpenAI HTTP APIs.
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Model directory (config.json, tokenizer.json, *.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Name clients use for the model (default: the directory's name).
    #[arg(long)]
    name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 11434)]
    port: u16,
    /// Most prompt plus completion tokens per request.
    #[arg(long, default_value_t = 32768)]
    max_context: usize,
    /// Start every request from an empty state (exact reproducibility).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Requests that may wait while one generates; more get 503.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// Compute threads for the CPU backend (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct RunArgs {
    /// Model directory (config.json, tokenizer.json, *.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// The prompt (a user message, unless --raw).
    #[arg(long)]
    prompt: String,
    /// System message for the chat template.
    #[arg(long)]
    system: Option<String>,
    /// Feed the prompt as-is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 = greedy (deterministic).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Turn the template's thinking mode on or off, where it has one.
    #[arg(long)]
    think: Option<bool>,
    /// Print one JSON object (ids, text, stats) instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Compute threads for the CPU backend (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Serve(args) => serve(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: RunArgs) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("setting the thread count")?;
    }
    let backend: Box<dyn Backend> = Box::new(slotstream_cpu::CpuBackend::new());
    let engine = Engine::load(&args.model, backend, &slotstream::model::LoadOptions::default())?;
    let prompt_text = if args.raw {
        args.prompt.clone()
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        messages.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
        engine.codec.apply_chat_template(&messages, true, args.think)?
    };
    let prompt_ids = engine.codec.encode(&prompt_text, false)?;
    let req = GenerateRequest {
        prompt_ids,
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            seed: args.seed,
            repetition_penalty: args.repeat_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            ..SamplingParams::default()
        },
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
    };
    let stdout = std::io::stdout();
    let out = engine.generate(&req, |piece| {
        if !args.json {
            let mut lock = stdout.lock();
            // A closed stdout (e.g. piped into `head`) ends generation quietly.
            if lock.write_all(piece.as_bytes()).and_then(|_| lock.flush()).is_err() {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })?;
    if args.json {
        let mut v = serde_json::to_value(&out)?;
        v["backend"] = engine.backend.name().into();
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!();
        let s = &out.stats;
        eprintln!(
            "prompt {} tokens, generated {} tokens, prefill {:.1} tok/s, decode {:.1} tok/s [{}]",
            s.prompt_tokens,
            s.generated_tokens,
            s.prefill_tokens_per_second,
            s.decode_tokens_per_second,
            engine.backend.name()
        );
    }
    Ok(())
}

fn serve(args: ServeArgs) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("setting the thread count")?;
    }
    let backend: Box<dyn Backend> = Box::new(slotstream_cpu::CpuBackend::new());
    let engine = Engine::load(&args.model, backend, &slotstream::model::LoadOptions::default())?;
    let model_name = match args.name {
        Some(n) => n,
        None => args
            .model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".to_string()),
    };
    let options = slotstream::server::ServerOptions {
        model_name,
        max_context: args.max_context,
        prefix_cache: !args.no_prefix_cache,
        queue: args.queue,
    };
    let config = slotstream::server::ServeConfig { model_dir: args.model, host: args.host, port: args.port, options };
    slotstream::server::serve(config, engine)
}
