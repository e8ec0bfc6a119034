//! One decode step of N sequences: N one-token passes against one batched
//! pass (`DecoderModel::forward_batch`), on the same states, greedy.
//!
//!     cargo run --release --example bench_batch_step -- MODEL_DIR [STEPS] [cpu|cpu:exact] [SIZES]
//!
//! SIZES: the batch sizes, comma-separated (default `1,2,4`).
//!
//! Prints one JSON line per batch size: milliseconds per step of all N
//! sequences alone and batched, and their ratio. Fails if a batched row's
//! greedy token differs from its pass alone.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use slotstream::generate::Engine;
use slotstream::model::{LoadOptions, Logits, SequenceState};
use slotstream::sampling::argmax;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).context("usage: bench_batch_step MODEL_DIR [STEPS] [cpu|cpu:exact]")?);
    let steps: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(32);
    let backend: Box<dyn slotstream_backend::Backend> = match args.get(3).map(String::as_str).unwrap_or("cpu") {
        "cpu" => Box::new(slotstream_cpu::CpuBackend::new()),
        "cpu:exact" => Box::new(slotstream_cpu::CpuBackend::exact()),
        other => bail!("backend {other}: expected cpu or cpu:exact"),
    };
    let e = Engine::load(&dir, backend, &LoadOptions::default())?;
    let b = e.backend.as_ref();
    let texts = ["The sea was calm, and the ship", "A river of stone ran", "In the lantern's light the map", "Copper signals drift over"];
    let sizes: Vec<usize> = match args.get(4) {
        Some(list) => list.split(',').map(|n| n.parse().with_context(|| format!("batch size {n:?}"))).collect::<Result<_>>()?,
        None => vec![1, 2, 4],
    };
    for n in sizes {
        if n == 0 || n > texts.len() {
            bail!("batch size {n}: give 1 to {}", texts.len());
        }
        let mut alone: Vec<SequenceState> = Vec::new();
        let mut together: Vec<SequenceState> = Vec::new();
        let mut next = Vec::new();
        for t in &texts[..n] {
            let ids = e.codec.encode(t, false)?;
            let mut s = e.new_state()?;
            next.push(argmax(&e.prefill(&ids, &mut s)?));
            together.push(e.clone_state(&s)?);
            alone.push(s);
        }
        // Each way from copies of the same states, the whole run one way
        // and then the other (taking turns step by step would hand the second
        // the first's caches); a few warm-up steps first.
        let copies = |from: &[SequenceState]| from.iter().map(|s| e.clone_state(s)).collect::<Result<Vec<_>>>();
        let run_alone = |states: &mut [SequenceState], steps: usize| -> Result<(f64, Vec<Vec<u32>>)> {
            let (mut t, mut tokens) = (next.clone(), vec![Vec::new(); n]);
            let start = Instant::now();
            for _ in 0..steps {
                for (i, s) in states.iter_mut().enumerate() {
                    t[i] = argmax(&b.download(&e.model.forward(b, &[t[i]], s, Logits::Last)?)?);
                    tokens[i].push(t[i]);
                }
            }
            Ok((start.elapsed().as_secs_f64(), tokens))
        };
        let run_batched = |states: &mut [SequenceState], steps: usize| -> Result<(f64, Vec<Vec<u32>>)> {
            let (mut t, mut tokens) = (next.clone(), vec![Vec::new(); n]);
            let start = Instant::now();
            for _ in 0..steps {
                let mut refs: Vec<&mut SequenceState> = states.iter_mut().collect();
                let logits = b.download(&e.model.forward_batch(b, &t, &mut refs)?)?;
                t = logits.chunks_exact(logits.len() / n).map(argmax).collect();
                for (i, &id) in t.iter().enumerate() {
                    tokens[i].push(id);
                }
            }
            Ok((start.elapsed().as_secs_f64(), tokens))
        };
        run_alone(&mut copies(&alone)?, 4)?;
        run_batched(&mut copies(&together)?, 4)?;
        let (t_alone, tokens_alone) = run_alone(&mut alone, steps)?;
        let (t_batch, tokens_batched) = run_batched(&mut together, steps)?;
        if tokens_alone != tokens_batched {
            bail!("batch of {n}: batched tokens {tokens_batched:?} differ from alone {tokens_alone:?}");
        }
        let per = |t: f64| t * 1e3 / steps as f64;
        println!(
            "{}",
            serde_json::json!({
                "sequences": n,
                "backend": b.name(),
                "ms_per_step_alone": per(t_alone),
                "ms_per_step_batched": per(t_batch),
                "speedup": t_alone / t_batch,
            })
        );
    }
    Ok(())
}
