//! The `slotstream` command line.
//!
//! Parses the flags into the library's option values, calls the library and
//! prints what it returns; the work itself lives in the `slotstream` crate.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use slotstream::backend_spec::BackendArgs;
use slotstream::doctor::{DoctorReport, DoctorRequest, MachineOverrides};
use slotstream::generate::{self, Engine, GenerateRequest};
use slotstream::launch::{load_planned, resolve_model, PlannedModel, ServeLoader, ServedModels};
use slotstream::plan::{self, PlanRequest};
use slotstream::pull::{NetworkSettings, PullOptions, TransferSettings, DEFAULT_MODEL};
use slotstream::run_report::RunReport;
use slotstream::sampling::SamplingParams;
use slotstream::tokenizer::ChatMessage;
use slotstream::{console, note, process, server};

#[derive(Parser)]
#[command(name = "slotstream", version, about = "Run Mixture-of-Experts language models larger than memory")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, or chat when no prompt is given on a terminal.
    #[command(visible_alias = "chat")]
    Run(RunArgs),
    /// Check this machine and a model: memory, disk, the plan, expected speed.
    Doctor(DoctorArgs),
    /// Serve the Ollama and OpenAI HTTP APIs.
    Serve(ServeArgs),
    /// Download a model into the Hugging Face cache, resumably and verified.
    Pull(PullArgs),
    /// Perplexity of a text file, in independent windows.
    Perplexity(PerplexityArgs),
}

/// Memory knobs shared by run, serve and doctor. Precedence:
/// --experts-per-layer > --pool-gb > --memory-gb > auto.
#[derive(Args, Clone, Default)]
struct MemoryArgs {
    /// Cache this many experts per MoE layer (pool = this x MoE layers).
    #[arg(long)]
    experts_per_layer: Option<usize>,
    /// Give the expert pool this many GB.
    #[arg(long)]
    pool_gb: Option<f64>,
    /// Keep the whole process within this many GB.
    #[arg(long)]
    memory_gb: Option<f64>,
    /// Context length the KV cache is planned for; no generation (a `run`, a chat turn or a
    /// served request) goes further than this.
    /// Default: as long as the model takes and memory allows (an auto-sized pool gives
    /// slots to reach 32768 tokens; the plan says so).
    #[arg(long)]
    plan_context: Option<usize>,
    /// Show the memory plan (and, for `run` and `chat`, the speeds) also when every expert fits in memory.
    #[arg(short, long)]
    verbose: bool,
    /// Speculative decoding with the model's MTP head: auto (on when the
    /// head exists and the memory plan has room for it), on or off.
    #[arg(long, default_value = "auto")]
    mtp: plan::MtpMode,
}

impl MemoryArgs {
    /// What the planner is asked for.
    fn request(&self) -> PlanRequest {
        PlanRequest {
            experts_per_layer: self.experts_per_layer,
            pool_gb: self.pool_gb,
            memory_gb: self.memory_gb,
            mtp: self.mtp,
            ..Default::default()
        }
        .for_context(self.plan_context)
    }
}

#[derive(Args)]
struct PerplexityArgs {
    /// Model directory or name (as for `run`).
    #[arg(long)]
    model: Option<String>,
    /// UTF-8 text to score.
    #[arg(long)]
    file: PathBuf,
    /// Tokens per window (at least 2).
    #[arg(long, default_value_t = 256, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..))]
    window: usize,
    /// Score at most this many windows (default: every whole window).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_windows: Option<usize>,
    /// Feed each window one token at a time, as decoding does (the one-token
    /// kernels, e.g. a GPU's int8 activations, score the text).
    #[arg(long)]
    one_token: bool,
    #[command(flatten)]
    memory: MemoryArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Args)]
struct DoctorArgs {
    /// Model directory, `qwen3.8-flash-next:4bit` (sizes known without the weights) or
    /// `slotstream-demo`; default: the model `run` takes (the flagship if installed, else the demo).
    #[arg(long)]
    model: Option<String>,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Measure this machine's rates for the speed estimates (seconds) and keep them.
    #[arg(long)]
    measure: bool,
    #[command(flatten)]
    backend: BackendArgs,
    /// Pretend the machine has this much RAM (GB).
    #[arg(long)]
    sim_ram: Option<f64>,
    /// Pretend the GPU working-set limit is this (GB).
    #[arg(long)]
    sim_working_set: Option<f64>,
    /// Pretend this much memory is reclaimable now (GB).
    #[arg(long)]
    sim_available: Option<f64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ServeArgs {
    /// A model to serve besides every pulled one: a directory, a known model name
    /// (`qwen3.8-flash-next:4bit`) or `hf:ORG/NAME[@REV]` pulled earlier. May be given
    /// several times; the first is loaded at start. Default: the flagship if it is
    /// installed, else the bundled demo model.
    #[arg(long)]
    model: Vec<String>,
    /// Name clients use for a `--model`: the first `--name` names the first
    /// `--model`, and so on (default: the directory's name).
    #[arg(long)]
    name: Vec<String>,
    /// How long a model stays loaded after its last request: a duration (`30s`, `10m`,
    /// `1h`) or seconds; 0 unloads at once, a negative value keeps models loaded
    /// (default: from OLLAMA_KEEP_ALIVE, else 5m).
    #[arg(long, allow_hyphen_values = true)]
    keep_alive: Option<String>,
    /// Models loaded at once at most (default: from OLLAMA_MAX_LOADED_MODELS, else 3).
    #[arg(long)]
    max_loaded_models: Option<usize>,
    /// Address to listen on (default: from OLLAMA_HOST, else 127.0.0.1).
    #[arg(long)]
    host: Option<String>,
    /// Port (default: from OLLAMA_HOST, else 11434).
    #[arg(long)]
    port: Option<u16>,
    /// Most prompt plus completion tokens per request, and the context planned
    /// for unless --plan-context is given. Default: what each model's plan allows.
    #[arg(long)]
    max_context: Option<usize>,
    /// Start every request from an empty state (exact reproducibility).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Requests that may wait while one generates; more get 503.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// Generations run at once, decode steps batched (default: from
    /// OLLAMA_NUM_PARALLEL, else 4 on `--backend cpu[:exact]`, else 1).
    #[arg(long)]
    parallel: Option<usize>,
    /// Compute threads for the CPU backend (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Keep an auto-sized expert pool fixed instead of following free memory.
    #[arg(long)]
    no_elastic: bool,
    /// Seconds a client may take to send a request head (and an idle
    /// keep-alive connection stays open).
    #[arg(long, default_value_t = 30.0)]
    header_timeout_secs: f64,
    /// Seconds a client may take to send a request body.
    #[arg(long, default_value_t = 60.0)]
    body_timeout_secs: f64,
    /// Seconds a client may fall behind a response before it is dropped and
    /// its generation cancelled: reading nothing for this long, or reading so
    /// slowly that generation has waited on it this long in all.
    #[arg(long, default_value_t = 60.0)]
    write_timeout_secs: f64,
    /// After SIGTERM, seconds running and waiting generations get to finish
    /// while new requests get 503 (Ctrl-C stops them at once); then, after
    /// either, seconds open connections get to take what they were sent and close.
    #[arg(long, default_value_t = 10.0)]
    shutdown_grace_secs: f64,
    #[command(flatten)]
    backend: BackendArgs,
}

impl ServeArgs {
    fn timeouts(&self) -> Result<server::Timeouts> {
        let (header, body) = (self.header_timeout_secs, self.body_timeout_secs);
        server::Timeouts::from_secs(header, body, self.write_timeout_secs, self.shutdown_grace_secs)
    }
}

#[derive(Args)]
struct RunArgs {
    /// Model directory, a known model name (`qwen3.8-flash-next:4bit`) or
    /// `hf:ORG/NAME[@REV]` pulled earlier. Default: the flagship if it is
    /// installed, else the bundled demo model.
    #[arg(long)]
    model: Option<String>,
    /// The prompt (a user message, unless --raw); `-`, or no --prompt with
    /// stdin not a terminal, reads it from stdin.
    #[arg(long)]
    prompt: Option<String>,
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
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the K most likely tokens only (0: no limit).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample among the most likely tokens whose probabilities sum to P (1: all).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0: none).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Seed of the sampler: the same seed, prompt and flags give the same text.
    #[arg(long)]
    seed: Option<u64>,
    /// Push down the logits of the tokens among the last 64 by this factor (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repeat_penalty: f32,
    /// Subtract this from the logits of tokens seen in the last 64 (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtract this times each seen token's count in the last 64 (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
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
    #[command(flatten)]
    memory: MemoryArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

/// Download a model, or check a downloaded copy with `--verify`.
#[derive(Args, Debug, Clone)]
struct PullArgs {
    /// The model: a known name (qwen3.8-flash-next:4bit) or any Hugging Face
    /// repository as hf:ORG/NAME[@REVISION].
    #[arg(default_value = DEFAULT_MODEL)]
    model: String,
    /// Re-hash every file of the downloaded copy and report each one, instead of
    /// downloading. A file that does not match is deleted.
    #[arg(long)]
    verify: bool,
    /// Parallel connections (byte ranges in flight); with --verify, files hashed at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    connections: u16,
    /// Do not download optional files (the flagship's 1.47 GB mtp.safetensors, used
    /// only for speculative decoding).
    #[arg(long)]
    skip_optional: bool,
    /// Bytes per ranged request.
    #[arg(long, hide = true, default_value_t = 64 << 20)]
    chunk_bytes: u64,
    /// Bytes received per connection between durable progress records.
    #[arg(long, hide = true, default_value_t = 8 << 20)]
    checkpoint_bytes: u64,
    /// Seconds without any byte from the server before a request is retried.
    #[arg(long, hide = true, default_value_t = 30.0)]
    stall_timeout_secs: f64,
    /// Attempts per request without progress before giving up.
    #[arg(long, hide = true, default_value_t = 10)]
    max_attempts: u32,
    /// First retry delay in milliseconds (doubles per retry, up to 30 s).
    #[arg(long, hide = true, default_value_t = 500)]
    backoff_ms: u64,
}

impl PullArgs {
    /// What `pull` is asked to do.
    fn options(&self) -> Result<PullOptions> {
        let network = NetworkSettings {
            stall_timeout: Duration::try_from_secs_f64(self.stall_timeout_secs)
                .context("--stall-timeout-secs must be a positive number of seconds")?,
            max_attempts: self.max_attempts.max(1),
            first_backoff: Duration::from_millis(self.backoff_ms),
            ..NetworkSettings::default()
        };
        let transfer = TransferSettings {
            connections: usize::from(self.connections),
            chunk_bytes: self.chunk_bytes.max(1),
            checkpoint_bytes: self.checkpoint_bytes.max(1),
        };
        Ok(PullOptions {
            model: self.model.clone(),
            verify: self.verify,
            skip_optional: self.skip_optional,
            network,
            transfer,
        })
    }
}

impl RunArgs {
    /// The prompt's token ids: the chat template around the user's message
    /// (and system message), whose special tokens' text stays plain text, or
    /// the text as-is with `--raw` (where that text is control tokens).
    fn prompt_ids(&self, engine: &Engine, prompt: &str) -> Result<Vec<u32>> {
        if self.raw {
            return engine.codec.encode(prompt, false);
        }
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(ChatMessage { role: "system".into(), content: system.clone() });
        }
        messages.push(ChatMessage { role: "user".into(), content: prompt.to_string() });
        engine.codec.chat_ids(&messages, self.think)
    }

    /// `--prompt`, or stdin for `--prompt -` or a piped stdin; `None`: no
    /// prompt on a terminal, so a chat.
    fn read_prompt(&self) -> Result<Option<String>> {
        use std::io::{IsTerminal, Read};
        match self.prompt.as_deref() {
            Some("-") => {}
            Some(prompt) => return Ok(Some(prompt.to_string())),
            None if std::io::stdin().is_terminal() => return Ok(None),
            None => {}
        }
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).context("reading the prompt from stdin (as UTF-8 text)")?;
        if text.trim().is_empty() {
            anyhow::bail!("the prompt read from stdin is empty: pipe text in, pass --prompt TEXT, or run in a terminal to chat");
        }
        Ok(Some(text.trim_end_matches(['\n', '\r']).to_string()))
    }

    /// The chat's settings: the sampling flags, and the planned context (at most the model's).
    fn chat_settings(&self, engine: &Engine, planned: &PlannedModel) -> slotstream::chat::ChatSettings {
        slotstream::chat::ChatSettings {
            sampling: self.generate_request(Vec::new(), self.max_tokens).sampling,
            max_tokens: self.max_tokens,
            system: self.system.clone(),
            think: self.think,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            context: planned.plan.context_tokens.min(engine.context_length()),
        }
    }

    /// The request, with `--max-tokens` cut to what fits in the planned context (at most the
    /// model's); a context refused says what memory a long enough one needs (`planned`).
    fn bounded_request(&self, prompt_ids: Vec<u32>, model_context: usize, planned: &PlannedModel) -> Result<GenerateRequest> {
        let (context, what) = if planned.plan.context_tokens < model_context {
            (planned.plan.context_tokens, "the planned context")
        } else {
            (model_context, "the model's context (max_position_embeddings, with its RoPE scaling)")
        };
        let need = || planned.context_need((prompt_ids.len() + self.max_tokens).min(model_context));
        let max_tokens = match generate::tokens_within_context(prompt_ids.len(), self.max_tokens, context, what) {
            Ok(n) => n,
            Err(e) if model_context == usize::MAX => anyhow::bail!("{e}, or raise --plan-context: {}", need()),
            Err(e) if context < model_context => anyhow::bail!("{e}, or raise --plan-context (the model takes up to {model_context} tokens): {}", need()),
            Err(e) => return Err(e),
        };
        if max_tokens < self.max_tokens {
            note!("note: generating at most {max_tokens} tokens, the rest of {what} of {context} tokens");
        }
        Ok(self.generate_request(prompt_ids, max_tokens))
    }

    fn generate_request(&self, prompt_ids: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt_ids,
            max_tokens,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                seed: self.seed,
                repetition_penalty: self.repeat_penalty,
                presence_penalty: self.presence_penalty,
                frequency_penalty: self.frequency_penalty,
                ..SamplingParams::default()
            },
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
        }
    }
}

impl DoctorArgs {
    fn request(&self) -> Result<DoctorRequest> {
        Ok(DoctorRequest {
            model: self.model.clone().unwrap_or_else(slotstream::doctor::default_model),
            plan: self.memory.request(),
            machine: MachineOverrides {
                ram_gb: self.sim_ram,
                available_gb: self.sim_available,
                working_set_gb: self.sim_working_set,
            },
            backend: Some(self.backend.spec()?),
            measure: self.measure,
        })
    }
}

fn main() -> ExitCode {
    // A chat template's renderer (a child of this program) ends there.
    if let Some(code) = process::start() { return code; }
    let cli = Cli::parse();
    let done = |result: Result<()>| result.map(|()| ExitCode::SUCCESS);
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Doctor(args) => done(doctor(args)),
        Command::Serve(args) => done(serve(args)),
        Command::Pull(args) => done(args.options().and_then(|options| slotstream::pull::run_pull(&options))),
        Command::Perplexity(args) => done(perplexity(args)),
    };
    match result {
        Ok(code) => code,
        // The reader of our output left (`| head`): nothing more to say.
        Err(e) if console::is_closed_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            note!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: RunArgs) -> Result<ExitCode> {
    process::set_compute_threads(args.threads)?;
    // The generation flags are checked before a model loads.
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    args.generate_request(Vec::new(), 1).sampling.validate().map_err(|e| anyhow::anyhow!("invalid sampling flags: {e}"))?;
    let prompt = args.read_prompt()?;
    let model = resolve_model(args.model.as_deref())?;
    let (engine, planned) = load_planned(&model.dir, &args.memory.request(), &args.backend.spec()?, args.memory.verbose)?;
    let Some(prompt) = prompt else {
        return slotstream::chat::run_chat(&engine, args.chat_settings(&engine, &planned)).map(|()| ExitCode::SUCCESS);
    };
    let prompt_ids = args.prompt_ids(&engine, &prompt)?;
    let request = args.bounded_request(prompt_ids, engine.context_length(), &planned)?;
    // Ctrl-C from here on stops the answer, and the summary still comes.
    process::catch_interrupt()?;
    // A write error ends generation; it is reported once the engine returns.
    let mut write_error = None;
    let out = engine.generate(&request, |piece| {
        if process::interrupted() {
            return ControlFlow::Break(());
        }
        if !args.json && !piece.is_empty() {
            if let Err(e) = console::print(piece) {
                write_error = Some(e);
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })?;
    if let Some(e) = write_error {
        return Err(e);
    }
    engine.keep_hit_rate(&out.stats);
    let report = RunReport {
        output: &out,
        backend: engine.backend.name(),
        experts: engine.expert_stats()?,
        ngram_rows: engine.model.ngram_stats(),
        plan: &planned.plan,
        peak_rss_bytes: process::peak_rss_bytes(),
        device_memory: engine.backend.device_memory().map(Into::into),
    };
    if args.json {
        console::print_line(serde_json::to_string(&report)?)?;
    } else {
        console::print_line("")?;
        if args.memory.verbose || !slotstream::launch::is_resident(&planned.plan) {
            note!("{report}");
        }
    }
    if process::interrupted() {
        note!("interrupted (Ctrl-C)");
        return Ok(ExitCode::from(130)); // 128 + SIGINT, as shells report it
    }
    Ok(ExitCode::SUCCESS)
}

fn perplexity(args: PerplexityArgs) -> Result<()> {
    let model = resolve_model(args.model.as_deref())?;
    // Before the load, which may take minutes.
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let (engine, _) = load_planned(&model.dir, &args.memory.request(), &args.backend.spec()?, true)?;
    let ids = engine.codec.encode(&text, false)?;
    if ids.len() < args.window {
        anyhow::bail!(
            "{} has {} tokens, fewer than one window of {} (--window): nothing to score; give a longer text or a smaller --window",
            args.file.display(),
            ids.len(),
            args.window
        );
    }
    let max_windows = args.max_windows.unwrap_or(usize::MAX);
    let perplexity = if args.one_token {
        engine.perplexity_one_token(&ids, args.window, max_windows)?
    } else {
        engine.perplexity(&ids, args.window, max_windows)?
    };
    console::print_line(serde_json::to_string(&perplexity)?)
}

fn doctor(args: DoctorArgs) -> Result<()> {
    let report = DoctorReport::build(&args.request()?)?;
    let text = if args.json { serde_json::to_string_pretty(&report)? } else { report.to_string() };
    console::print_line(text)
}

fn serve(args: ServeArgs) -> Result<()> {
    let timeouts = args.timeouts()?;
    let ollama_env = server::OllamaEnv::from_env();
    let (host, port) = ollama_env.bind_address(args.host.as_deref(), args.port)?;
    for name in &args.name {
        server::check_model_name(name)?; // before the slow part, loading
    }
    let spec = args.backend.spec()?;
    let (directories, load_first) = ServedModels::resolve(&args.model, &args.name)?;
    let request = args.memory.request().for_context(args.memory.plan_context.or(args.max_context));
    // The memory plan of the model loaded at start bounds the default.
    let first = directories.iter().find(|(name, _)| Some(name) == load_first.as_ref()).map(|(_, dir)| dir.as_path());
    let options = server::ServerOptions {
        max_context: args.max_context.unwrap_or(usize::MAX), // else each model's plan bounds it
        prefix_cache: !args.no_prefix_cache,
        queue: args.queue,
        timeouts,
        origins: ollama_env.origins(),
        keep_alive: ollama_env.keep_alive(args.keep_alive.as_deref())?,
        max_loaded_models: ollama_env.max_loaded_models(args.max_loaded_models)?,
        parallel: ollama_env.num_parallel(args.parallel, slotstream::launch::default_parallel(&spec, first, &request))?,
        pulls: slotstream::pull::PullSource::from_env().map_err(|e| note!("/api/pull is off: {e:#}")).ok(),
    };
    options.check()?;
    process::set_compute_threads(args.threads)?;
    // Bound first: a port in use is found before the slow part, loading.
    let listener = server::bind(&host.to_string(), port)?;
    let cache = options.pulls.as_ref().map(|p| p.cache_root.clone());
    let catalog = server::ModelCatalog::new(directories, cache);
    let loader = ServeLoader::new(spec, request, !args.no_elastic, args.memory.verbose);
    let config = server::ServeConfig { listener, catalog, loader: std::sync::Arc::new(loader), load_first, options };
    server::serve(config)
}
