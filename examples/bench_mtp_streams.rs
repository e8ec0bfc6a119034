//! MTP beside other decoding sequences: N concurrent greedy streams on one
//! engine with `set_parallel(4)` (a thread per stream running
//! `Engine::generate_from`, as the server runs a request), three ways:
//! without the draft head (`plain`), the head drafting for every sequence
//! (`MtpBeside::Draft`), and the head paused while other sequences decode
//! (`MtpBeside::Pause`); and, first, the same streams one after another
//! without the head (`in_a_row`). A model without `mtp.safetensors` runs
//! `in_a_row` and `plain` only (a model that batches: continuous batching's
//! gain inside the engine, without the server).
//!
//!     cargo run --release --example bench_mtp_streams -- MODEL_DIR [TOKENS] [STREAMS] [ROUNDS] [cpu|cpu:exact|cpu:f32-kv]
//!
//! STREAMS: comma-separated stream counts (default `1,2,4`); TOKENS per
//! stream (default 128); ROUNDS (default 3) repeat every configuration, the
//! three taking turns. Each stream feeds its prompt but the last token, then
//! all start decoding together; aggregate = generated tokens / wall time
//! from that start until the last stream ends; CPU seconds are the
//! process's over the same time (Linux). Prints one JSON line per (round,
//! streams, configuration), with whether every stream's tokens equal its
//! tokens without the head; on `cpu:exact` a difference fails the run.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use slotstream::generate::{Engine, GenerateOutput, GenerateRequest, MtpBeside};
use slotstream::model::LoadOptions;
use slotstream::sampling::SamplingParams;

const TEXTS: [&str; 4] = ["The sea was calm, and the ship", "A river of stone ran", "In the lantern's light the map", "Copper signals drift over"];

/// The process's user and system CPU seconds so far (`None` off Linux).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

struct Round {
    outs: Vec<GenerateOutput>,
    wall: f64,
    cpu: Option<f64>,
}

/// The first `streams` prompts generated at once, `tokens` each.
fn run(e: &Engine, prompts: &[Vec<u32>], tokens: usize) -> Result<Round> {
    let ready = Barrier::new(prompts.len() + 1);
    let (outs, wall, cpu) = std::thread::scope(|scope| -> Result<_> {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let ready = &ready;
                scope.spawn(move || -> Result<GenerateOutput> {
                    let mut state = e.new_state()?;
                    e.prefill_until(p, p.len() - 1, &mut state, || false)?;
                    ready.wait();
                    let req = GenerateRequest {
                        prompt_ids: p.clone(),
                        max_tokens: tokens,
                        sampling: SamplingParams { temperature: 0.0, ..Default::default() },
                        stop: Vec::new(),
                        ignore_eos: true,
                    };
                    e.generate_from(&mut state, &req, |_| ControlFlow::Continue(()))
                })
            })
            .collect();
        ready.wait();
        let (start, cpu_start) = (Instant::now(), cpu_seconds());
        let outs = handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("a stream panicked"))?).collect::<Result<Vec<_>>>()?;
        let cpu = cpu_seconds().zip(cpu_start).map(|(b, a)| b - a);
        Ok((outs, start.elapsed().as_secs_f64(), cpu))
    })?;
    Ok(Round { outs, wall, cpu })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: bench_mtp_streams MODEL_DIR [TOKENS] [STREAMS] [ROUNDS] [cpu|cpu:exact|cpu:f32-kv]";
    let dir = PathBuf::from(args.get(1).context(usage)?);
    let tokens: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(128);
    let streams: Vec<usize> = match args.get(3) {
        Some(list) => list.split(',').map(|n| n.parse().with_context(|| format!("stream count {n:?}"))).collect::<Result<_>>()?,
        None => vec![1, 2, 4],
    };
    let rounds: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(3);
    let kind = args.get(5).map(String::as_str).unwrap_or("cpu").to_string();
    if let Some(n) = streams.iter().find(|&&n| n == 0 || n > TEXTS.len()) {
        bail!("{n} streams: give 1 to {}", TEXTS.len());
    }
    let load = |mtp: bool| -> Result<Engine> {
        let backend: Box<dyn slotstream_backend::Backend> = match kind.as_str() {
            "cpu" => Box::new(slotstream_cpu::CpuBackend::new()),
            "cpu:exact" => Box::new(slotstream_cpu::CpuBackend::exact()),
            // The int8 matmuls over an f32 KV cache (the fast mode's is f16).
            "cpu:f32-kv" => Box::new(slotstream_cpu::CpuBackend::with_options(slotstream_cpu::CpuOptions {
                kv_cache: Some(slotstream_backend::KvCacheType::F32),
                ..slotstream_cpu::CpuOptions::from_env()
            })),
            other => bail!("backend {other}: expected cpu, cpu:exact or cpu:f32-kv"),
        };
        let mut e = Engine::load(&dir, backend, &LoadOptions { mtp, ..Default::default() })?;
        e.set_parallel(4)?;
        Ok(e)
    };
    let plain = load(false)?;
    let mut spec = load(true)?;
    let configs: &[&str] = if spec.model.draft.is_some() { &["in_a_row", "plain", "draft", "pause"] } else { &["in_a_row", "plain"] };
    let prompts: Vec<Vec<u32>> = TEXTS.iter().map(|t| plain.codec.encode(t, false)).collect::<Result<_>>()?;
    // Warm-up (allocations, the pool's first reads), and each stream's tokens alone without the head.
    run(&plain, &prompts, 8)?;
    run(&spec, &prompts, 8)?;
    let want: Vec<Vec<u32>> =
        prompts.iter().map(|p| Ok(run(&plain, std::slice::from_ref(p), tokens)?.outs.remove(0).generated_ids)).collect::<Result<_>>()?;
    for round in 1..=rounds {
        for &n in &streams {
            for &config in configs {
                let e = match config {
                    "plain" | "in_a_row" => &plain,
                    _ => {
                        spec.mtp_beside_others = if config == "draft" { MtpBeside::Draft } else { MtpBeside::Pause };
                        &spec
                    }
                };
                let r = match config {
                    "in_a_row" => {
                        let mut all = Round { outs: Vec::new(), wall: 0.0, cpu: Some(0.0) };
                        for p in &prompts[..n] {
                            let one = run(e, std::slice::from_ref(p), tokens)?;
                            all.outs.extend(one.outs);
                            all.wall += one.wall;
                            all.cpu = all.cpu.zip(one.cpu).map(|(a, b)| a + b);
                        }
                        all
                    }
                    _ => run(e, &prompts[..n], tokens)?,
                };
                let same = r.outs.iter().zip(&want).all(|(out, want)| &out.generated_ids == want);
                if !same && kind == "cpu:exact" {
                    bail!("{config}, {n} streams: a stream's tokens differ from its tokens without the head");
                }
                let generated: usize = r.outs.iter().map(|o| o.generated_ids.len()).sum();
                let sum = |f: fn(&slotstream::generate::MtpStats) -> usize| r.outs.iter().filter_map(|o| o.stats.mtp.as_ref()).map(f).sum::<usize>();
                let (drafted, accepted, passes, beside) = (sum(|m| m.drafted), sum(|m| m.accepted), sum(|m| m.forward_passes), sum(|m| m.passes_beside_others));
                println!(
                    "{}",
                    serde_json::json!({
                        "round": round,
                        "streams": n,
                        "config": config,
                        "backend": e.backend.name(),
                        "aggregate_tokens_per_second": generated as f64 / r.wall,
                        "wall_seconds": r.wall,
                        "cpu_seconds": r.cpu,
                        "drafted": drafted,
                        "accepted": accepted,
                        "acceptance": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
                        "decode_passes": matches!(config, "draft" | "pause").then_some(passes),
                        "passes_beside_others": beside,
                        "same_tokens": same,
                    })
                );
            }
        }
    }
    Ok(())
}
