//! The `slotstream` command line.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use slotstream::generate::{Engine, GenerateRequest};
use slotstream::model::{ExpertSlots, LoadOptions};
use slotstream::plan::{self, MachineMemory, ModelCosts, PlanRequest};
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
    /// Check this machine and a model: memory, disk, the plan, expected speed.
    Doctor(DoctorArgs),
    /// Serve the Ollama and OpenAI HTTP APIs.
    Serve(ServeArgs),
    /// Download a model into the Hugging Face cache, resumably and verified.
    Pull(slotstream::pull::PullArgs),
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
    /// Context length the KV cache is planned for.
    #[arg(long, default_value_t = 4096)]
    plan_context: usize,
    /// Speculative decoding with the model's MTP head: auto (on when the
    /// head exists and the memory plan has room for it), on or off.
    #[arg(long, default_value = "auto")]
    mtp: plan::MtpMode,
}

/// Which compute backend runs the model.
#[derive(Args, Clone)]
struct BackendArgs {
    /// `auto` (a real GPU through wgpu if there is one, else the CPU), `cpu`
    /// (int8 activations for 4-bit weights, like llama.cpp), `cpu:exact` (f32
    /// activations everywhere: the reference the oracle tests use), `wgpu` (a
    /// real GPU or fail), `wgpu:software` (allow a software rasterizer such as
    /// lavapipe, for tests) or `wgpu:NAME` (an adapter whose name contains NAME).
    /// On a real GPU one-token 4-bit matmuls take int8 activations; a `:exact`
    /// suffix (`wgpu:exact`, `wgpu:software:exact`, ...) or
    /// `SLOTSTREAM_WGPU_MATMUL=exact` keeps f32 (a software rasterizer, only
    /// used by tests, defaults to f32; `SLOTSTREAM_WGPU_MATMUL=int8` overrides).
    #[arg(long, default_value = "auto")]
    backend: String,
}

impl BackendArgs {
    fn create(&self) -> Result<Box<dyn Backend>> {
        use slotstream_wgpu::{AdapterChoice, WgpuBackend};
        use slotstream_wgpu::MatmulMode;
        let spec = self.backend.trim();
        // A wgpu spec with `:exact` keeps f32 activations; otherwise int8 on a
        // real GPU (where it was measured faster, BENCHMARKS.md GPU (a)).
        let (spec, exact) = match spec.strip_suffix(":exact") {
            Some(rest) if rest.starts_with("wgpu") => (rest, true),
            _ => (spec, false),
        };
        let mode = |b: WgpuBackend| -> WgpuBackend {
            let mode = if exact {
                MatmulMode::Exact
            } else if b.device_type() == slotstream_wgpu::wgpu::DeviceType::Cpu {
                MatmulMode::from_env(MatmulMode::Exact)
            } else {
                MatmulMode::from_env(MatmulMode::Int8)
            };
            b.with_matmul_mode(mode)
        };
        match spec {
            "cpu" => Ok(Box::new(slotstream_cpu::CpuBackend::new())),
            "cpu:exact" => Ok(Box::new(slotstream_cpu::CpuBackend::exact())),
            "auto" => match WgpuBackend::new(&AdapterChoice::auto()) {
                Ok(b) => Ok(Box::new(mode(b))),
                Err(e) => {
                    eprintln!("note: no usable GPU ({e}); using the CPU backend");
                    Ok(Box::new(slotstream_cpu::CpuBackend::new()))
                }
            },
            "wgpu" => Ok(Box::new(mode(WgpuBackend::new(&AdapterChoice::auto()).context("--backend wgpu")?))),
            other => match other.strip_prefix("wgpu:") {
                Some(choice) => {
                    let choice: AdapterChoice = choice.parse().context("--backend")?;
                    Ok(Box::new(mode(WgpuBackend::new(&choice).with_context(|| format!("--backend {other}"))?)))
                }
                None => anyhow::bail!(
                    "--backend {other}: expected auto, cpu, cpu:exact, wgpu, wgpu:software or wgpu:NAME (a wgpu spec may end in :exact)"
                ),
            },
        }
    }
}

impl MemoryArgs {
    fn request(&self) -> PlanRequest {
        PlanRequest {
            experts_per_layer: self.experts_per_layer,
            pool_gb: self.pool_gb,
            memory_gb: self.memory_gb,
            context_tokens: self.plan_context,
            mtp: self.mtp,
        }
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
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    window: usize,
    /// Score at most this many windows.
    #[arg(long, default_value_t = usize::MAX)]
    max_windows: usize,
    #[command(flatten)]
    memory: MemoryArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Args)]
struct DoctorArgs {
    /// Model directory, or `qwen3.8-flash-next:4bit` (sizes known without the weights).
    #[arg(long, default_value = "qwen3.8-flash-next:4bit")]
    model: String,
    #[command(flatten)]
    memory: MemoryArgs,
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
    /// Model directory, a known model name (`qwen3.8-flash-next:4bit`) or
    /// `hf:ORG/NAME[@REV]` pulled earlier. Default: the flagship if it is
    /// installed, else the bundled demo model.
    #[arg(long)]
    model: Option<String>,
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
    #[command(flatten)]
    memory: MemoryArgs,
    /// Keep an auto-sized expert pool fixed instead of following free memory.
    #[arg(long)]
    no_elastic: bool,
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Args)]
struct RunArgs {
    /// Model directory, a known model name (`qwen3.8-flash-next:4bit`) or
    /// `hf:ORG/NAME[@REV]` pulled earlier. Default: the flagship if it is
    /// installed, else the bundled demo model.
    #[arg(long)]
    model: Option<String>,
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
    #[command(flatten)]
    memory: MemoryArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

/// Keeps glibc's allocator from handing each large activation buffer back to
/// the kernel when it is freed. By default buffers above 128 KB-32 MB are
/// fresh mappings, so every op of a prefill pays page faults and zeroing for
/// its output (5-15% of a prefill measured); below 256 MB they now come from
/// the heap, which is trimmed once 512 MB lie free at its top. Peak RSS is
/// unchanged: a freed buffer is reused by the next one.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Doctor(args) => doctor(args),
        Command::Serve(args) => serve(args),
        Command::Pull(args) => slotstream::pull::run_pull(&args),
        Command::Perplexity(args) => perplexity(args),
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
    let model_dir = resolve_model(args.model.as_deref())?;
    let (engine, plan, _) = load_planned(&model_dir, &args.memory, &args.backend)?;
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
    let cache = engine.expert_stats()?;
    if args.json {
        let mut v = serde_json::to_value(&out)?;
        v["backend"] = engine.backend.name().into();
        v["experts"] = serde_json::to_value(&cache)?;
        if let Some(n) = engine.model.ngram_stats() {
            v["ngram_rows"] = serde_json::to_value(n)?;
        }
        v["plan"] = serde_json::to_value(&plan)?;
        v["peak_rss_bytes"] = peak_rss_bytes().into();
        // A closed stdout is the reader's choice, not an error worth a panic.
        let _ = writeln!(std::io::stdout(), "{}", serde_json::to_string(&v)?);
    } else {
        let _ = writeln!(std::io::stdout());
        let s = &out.stats;
        let t = &cache.total;
        eprintln!(
            "prompt {} tokens, generated {} tokens, prefill {:.1} tok/s, decode {:.1} tok/s [{}]",
            s.prompt_tokens,
            s.generated_tokens,
            s.prefill_tokens_per_second,
            s.decode_tokens_per_second,
            engine.backend.name()
        );
        if let Some(n) = engine.model.ngram_stats() {
            eprintln!(
                "n-gram rows: {} hits, {} read ({:.1} KB), {} of {} cached",
                n.hits,
                n.misses,
                n.bytes_read as f64 / 1e3,
                n.cached_rows,
                n.capacity_rows
            );
        }
        if let Some(m) = &s.mtp {
            eprintln!(
                "mtp: {} drafted, {} accepted ({:.0}%), {} decode passes for {} tokens{}",
                m.drafted,
                m.accepted,
                100.0 * m.acceptance(),
                m.forward_passes,
                s.generated_tokens,
                if m.paused { "; drafting paused: too few drafts accepted" } else { "" }
            );
        }
        eprintln!(
            "experts: {} slots, hit rate {:.1}% ({} hits, {} misses), read {:.2} GB at {:.2} GB/s ({}), waited {:.2} s",
            cache.slots,
            100.0 * t.hit_rate(),
            t.hits,
            t.misses,
            t.bytes_read as f64 / 1e9,
            t.read_gb_per_second(),
            if cache.direct_io { "direct I/O" } else { "buffered I/O" },
            t.wait_seconds
        );
    }
    Ok(())
}

fn perplexity(args: PerplexityArgs) -> Result<()> {
    let model_dir = resolve_model(args.model.as_deref())?;
    let (engine, _, _) = load_planned(&model_dir, &args.memory, &args.backend)?;
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let ids = engine.codec.encode(&text, false)?;
    let p = engine.perplexity(&ids, args.window, args.max_windows)?;
    let _ = writeln!(std::io::stdout(), "{}", serde_json::to_string(&p)?);
    Ok(())
}

/// The model directory a `--model` value names: an existing directory, or a
/// known or `hf:` model in the Hugging Face cache (complete and verified, or
/// an error that says what is missing and how to pull it).
fn resolve_model(spec: Option<&str>) -> Result<PathBuf> {
    resolve_named_model(spec).map(|(dir, _)| dir)
}

/// [`resolve_model`], plus the name clients should use for the model: the
/// directory's name, the known model's name, `ORG/NAME` for `hf:` models, or
/// `slotstream-demo`.
fn resolve_named_model(spec: Option<&str>) -> Result<(PathBuf, String)> {
    let dir_name = |p: &std::path::Path| {
        p.canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".to_string())
    };
    match spec {
        Some(s) if std::path::Path::new(s).is_dir() => Ok((PathBuf::from(s), dir_name(std::path::Path::new(s)))),
        Some(s) if s.contains('/') && !s.starts_with("hf:") => {
            anyhow::bail!("--model {s}: no such directory (for a Hugging Face repo, write hf:{s} and pull it first)")
        }
        Some(s) => {
            let name = s.strip_prefix("hf:").unwrap_or(s).split('@').next().unwrap_or(s).to_string();
            Ok((slotstream::pull::locate_model(s)?, name))
        }
        None => match slotstream::pull::locate_model(slotstream::pull::DEFAULT_MODEL) {
            Ok(dir) => Ok((dir, slotstream::pull::DEFAULT_MODEL.to_string())),
            Err(_) => {
                eprintln!("{}", slotstream::demo::NOTE);
                Ok((slotstream::demo::model_dir()?, "slotstream-demo".to_string()))
            }
        },
    }
}

/// Plans memory for a model directory, prints the plan banner and loads it.
fn load_planned(model: &std::path::Path, memory: &MemoryArgs, backend: &BackendArgs) -> Result<(Engine, plan::Plan, ModelCosts)> {
    let arch = slotstream::model::ModelArch::read(model)?;
    let backend = backend.create()?;
    let costs = ModelCosts::of(&arch, backend.kv_cache_dtype())?;
    let machine = MachineMemory::detect();
    let plan = plan::plan(&costs, &machine, &memory.request())?;
    eprintln!("{}", plan.banner(&costs, &machine));
    eprintln!("  backend: {}", backend.name());
    let opts = LoadOptions { expert_slots: ExpertSlots::Count(plan.slots), mtp: plan.mtp, preload_experts: true, ..Default::default() }
        .with_env_overrides();
    let engine = Engine::load_arch(&arch, backend, &opts)?;
    Ok((engine, plan, costs))
}

/// The process's peak resident set (VmHWM), where the OS reports it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

fn doctor(args: DoctorArgs) -> Result<()> {
    let costs = if args.model == "qwen3.8-flash-next:4bit" || args.model == "qwen3.8-flash-next" {
        ModelCosts::flagship()
    } else {
        // No backend is chosen here: plan for an f32 KV cache, the largest.
        ModelCosts::from_model_dir(std::path::Path::new(&args.model), slotstream_backend::DType::F32)?
    };
    let simulated = args.sim_ram.is_some() || args.sim_available.is_some() || args.sim_working_set.is_some();
    let machine = if simulated {
        let detected = MachineMemory::detect();
        let ram = args.sim_ram.unwrap_or(detected.total_ram as f64 / 1e9);
        MachineMemory::simulated(ram, args.sim_available, args.sim_working_set)
    } else {
        MachineMemory::detect()
    };
    let plan = plan::plan(&costs, &machine, &args.memory.request())?;
    let disk_free = free_disk_bytes(std::path::Path::new(if std::path::Path::new(&args.model).exists() { args.model.as_str() } else { "." }));
    // Expected speed at several pool sizes, from the model's minimum to all experts.
    let floor = plan::FLOOR_EXPERTS_PER_LAYER.max(costs.top_k).min(costs.experts_per_layer);
    let mut sizes: Vec<usize> = [floor, 30, 60, 120, 150, 205, costs.experts_per_layer]
        .into_iter()
        .filter(|&n| n >= floor && n <= costs.experts_per_layer)
        .collect();
    sizes.dedup();
    let table: Vec<serde_json::Value> = sizes
        .iter()
        .map(|&n| {
            let slots = n * costs.moe_layers;
            serde_json::json!({
                "experts_per_layer": n,
                "pool_gb": slots as f64 * costs.expert_record_bytes as f64 / 1e9,
                "peak_gb": (costs.fixed_bytes(args.memory.plan_context) + costs.runtime_bytes() + slots as u64 * costs.expert_record_bytes) as f64 / 1e9,
                "decode_tokens_per_second_estimate": costs.estimate_decode_tokens_per_second(slots, &machine),
            })
        })
        .collect();
    if args.json {
        let v = serde_json::json!({
            "machine": machine,
            "model": costs,
            "disk_free_bytes": disk_free,
            "plan": plan,
            "expected": table,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("machine: {}", machine.describe());
    println!(
        "model:   {} ({} MoE layers x {} experts, top-{}; {:.2} GB resident, {:.2} GB routed experts, {:.2} MB per expert)",
        costs.name,
        costs.moe_layers,
        costs.experts_per_layer,
        costs.top_k,
        costs.resident_bytes as f64 / 1e9,
        costs.routed_expert_bytes() as f64 / 1e9,
        costs.expert_record_bytes as f64 / 1e6
    );
    if costs.extra_bytes > 0 || costs.mtp_bytes > 0 {
        println!(
            "         n-gram row cache {:.0} MB; MTP head {}",
            costs.extra_bytes as f64 / 1e6,
            if costs.mtp_bytes > 0 { format!("{:.2} GB", costs.mtp_bytes as f64 / 1e9) } else { "none".to_string() }
        );
    }
    if let Some(free) = disk_free {
        println!("disk:    {:.1} GB free where the model lives", free as f64 / 1e9);
    }
    println!("{}", plan.banner(&costs, &machine));
    println!("expected speed by cache size (estimates):");
    for row in &table {
        println!(
            "  {:>4} experts/layer  pool {:>6.1} GB  peak {:>6.1} GB  ~{:.1} tok/s",
            row["experts_per_layer"],
            row["pool_gb"].as_f64().unwrap_or(0.0),
            row["peak_gb"].as_f64().unwrap_or(0.0),
            row["decode_tokens_per_second_estimate"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// Free bytes on the file system holding `path`.
fn free_disk_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the struct for a valid NUL-terminated path.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
}

fn serve(args: ServeArgs) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("setting the thread count")?;
    }
    let (model_dir, default_name) = resolve_named_model(args.model.as_deref())?;
    let (engine, plan, costs) = load_planned(&model_dir, &args.memory, &args.backend)?;
    let model_name = args.name.unwrap_or(default_name);
    let options = slotstream::server::ServerOptions {
        model_name,
        max_context: args.max_context,
        prefix_cache: !args.no_prefix_cache,
        queue: args.queue,
        elastic: (plan.mode == slotstream::plan::PlanMode::Auto && !args.no_elastic).then(|| slotstream::server::Elastic {
            costs,
            request: args.memory.request(),
        }),
        plan: Some(plan),
    };
    let config = slotstream::server::ServeConfig { model_dir, host: args.host, port: args.port, options };
    slotstream::server::serve(config, engine)
}
