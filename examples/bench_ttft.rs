//! Time to first token of a short request while long prompts are fed, on
//! one engine as `serve --parallel N` runs it (`Engine::run_turn` on a
//! thread per request, no prefix cache): the short request alone, then the
//! same request started `DELAY_MS` after `LONG` long prompts. The time to
//! first token runs from the short turn's start to its first `on_text` call
//! (made for every token, shown or held back).
//!
//!     cargo run --release --example bench_ttft -- MODEL_DIR [ROUNDS] [LONG_WORDS] [cpu|cpu:exact]
//!
//! Settings from the environment: `LONG` (3), `PARALLEL` (4), `DELAY_MS`
//! (300). Prints a Markdown table row per round and the median ratio.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use slotstream::generate::{Engine, GenerateRequest, TurnEnd};
use slotstream::model::LoadOptions;
use slotstream::sampling::SamplingParams;

const WORDS: [&str; 10] = ["river", "stone", "lantern", "orbit", "cedar", "harbor", "signal", "meadow", "copper", "drift"];

fn text(seed: usize, words: usize) -> String {
    (0..words).map(|j| WORDS[(seed * 3 + j * 7) % WORDS.len()]).collect::<Vec<_>>().join(" ")
}

fn env(name: &str, default: usize) -> Result<usize> {
    std::env::var(name).ok().map_or(Ok(default), |v| v.parse().with_context(|| format!("{name}={v:?}")))
}

/// Runs one turn of `ids` generating `tokens`; returns the seconds to its first token.
fn turn(e: &Engine, ids: &[u32], tokens: usize) -> Result<f64> {
    let req = GenerateRequest {
        prompt_ids: ids.to_vec(),
        max_tokens: tokens,
        sampling: SamplingParams { temperature: 0.0, ..Default::default() },
        stop: Vec::new(),
        ignore_eos: true,
    };
    let start = Instant::now();
    let first = Mutex::new(None);
    let end = e.run_turn(None, &req, None, || false, |_| {
        first.lock().expect("first").get_or_insert(start.elapsed());
        ControlFlow::Continue(())
    })?;
    if !matches!(end, TurnEnd::Done(_)) {
        bail!("the turn did not finish");
    }
    let first = first.into_inner().expect("first");
    Ok(first.context("no token came")?.as_secs_f64())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).context("usage: bench_ttft MODEL_DIR [ROUNDS] [LONG_WORDS] [cpu|cpu:exact]")?);
    let rounds: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(3);
    let long_words: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(400);
    let backend: Box<dyn slotstream_backend::Backend> = match args.get(4).map(String::as_str).unwrap_or("cpu") {
        "cpu" => Box::new(slotstream_cpu::CpuBackend::new()),
        "cpu:exact" => Box::new(slotstream_cpu::CpuBackend::exact()),
        other => bail!("backend {other}: expected cpu or cpu:exact"),
    };
    let (long, parallel, delay) = (env("LONG", 3)?, env("PARALLEL", 4)?, env("DELAY_MS", 300)?);
    let mut e = Engine::load(&dir, backend, &LoadOptions::default())?;
    e.set_parallel(parallel)?;
    let short = e.codec.encode(&text(7, 8), false)?;
    turn(&e, &short, 2)?; // warm-up
    println!("| round | short alone (s) | short with {long} long prompts (s) | ratio | long prompts done (s) |");
    println!("|---:|---:|---:|---:|---:|");
    let mut ratios = Vec::new();
    for r in 0..rounds {
        let alone = turn(&e, &short, 2)?;
        let longs = (0..long).map(|i| e.codec.encode(&text(r * 5 + i + 1, long_words), false)).collect::<Result<Vec<_>>>()?;
        let start = Instant::now();
        let (busy, done) = std::thread::scope(|s| -> Result<(f64, f64)> {
            let handles: Vec<_> = longs.iter().map(|ids| s.spawn(|| turn(&e, ids, 4))).collect();
            std::thread::sleep(Duration::from_millis(delay as u64));
            let busy = turn(&e, &short, 2)?;
            for h in handles {
                h.join().map_err(|_| anyhow::anyhow!("a long prompt's thread panicked"))??;
            }
            Ok((busy, start.elapsed().as_secs_f64()))
        })?;
        ratios.push(busy / alone);
        println!("| {} | {alone:.3} | {busy:.3} | {:.2}x | {done:.2} |", r + 1, busy / alone);
    }
    ratios.sort_by(f64::total_cmp);
    println!("\nmedian ratio {:.2}x over {rounds} rounds; long prompts of {} tokens", ratios[ratios.len() / 2], {
        e.codec.encode(&text(1, long_words), false)?.len()
    });
    Ok(())
}
