//! Prefill alone (`--model DIR --chunks N,...`): a `--prompt`-token prompt
//! fed in chunks of each size in turn, warm: its wall time, then its kernel
//! time by kernel (timestamp queries), in the CLI's default mode for a GPU.
//! With `--depth-decode N` (N > 0), each chunk size's timed prefill is followed by
//! N greedy tokens at that depth (one forward and one read-back each, as
//! a step without decoding ahead) and their kernel times, instead of the
//! prefill's.

use std::time::Instant;

use anyhow::{Context, Result};
use slotstream::generate::Engine;
use slotstream::model::{LoadOptions, Logits, SequenceState};
use slotstream::run_report::DeviceMemoryReport;
use slotstream::sampling::argmax;
use slotstream_wgpu::{MatmulMode, WgpuBackend};

use super::{print_profile, Lcg};

pub fn bench(b: &WgpuBackend, dir: &std::path::Path, prompt_len: usize, chunks: &[usize], decode: usize) -> Result<()> {
    let gpu = b.with_matmul_mode(MatmulMode::from_env(MatmulMode::Int8));
    let handle = gpu.clone();
    let mut e = Engine::load(dir, Box::new(gpu), &LoadOptions { preload_experts: true, ..LoadOptions::default() }.with_env_overrides()?)
        .with_context(|| format!("loading {}", dir.display()))?;
    let mut rng = Lcg(7);
    let prompt: Vec<u32> = (0..prompt_len).map(|_| rng.word() % e.vocab_size() as u32).collect();
    for &chunk in chunks {
        e.prefill_chunk = chunk;
        let chunk = e.chunk_tokens();
        // The first prefill at a chunk size creates its buffers and pipelines
        // (decode at depth times the decode only: no warm-up).
        if decode == 0 {
            drop(e.prefill(&prompt, &mut e.new_state()?)?);
        }
        let mut state = e.new_state()?;
        handle.sync()?;
        let t = Instant::now();
        let logits = e.prefill(&prompt, &mut state)?;
        let secs = t.elapsed().as_secs_f64();
        let warm = if decode == 0 { "warm" } else { "cold" };
        println!("prefill of {prompt_len} tokens in chunks of {chunk}: {secs:.3} s = {:.0} tok/s ({warm})", prompt_len as f64 / secs);
        println!("  {}", DeviceMemoryReport::from(handle.memory_report()));
        // The last position's five likeliest tokens (to compare kernel variants' outputs).
        let mut top: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        println!("  top logits: {:?}", &top[..top.len().min(5)]);
        if decode > 0 {
            decode_at_depth(&e, &handle, &mut state, argmax(&logits), decode)?;
            continue;
        }
        let mut state = e.new_state()?;
        handle.set_profiling(true)?;
        drop(e.prefill(&prompt, &mut state)?);
        let prof = handle.kernel_profile();
        handle.set_profiling(false)?;
        println!("kernel time of that prefill by kernel:");
        print_profile(&prof, 1, "ms");
    }
    Ok(())
}

/// `n` greedy tokens after the prompt in `state`, timed, then eight more by kernel.
fn decode_at_depth(e: &Engine, handle: &WgpuBackend, state: &mut SequenceState, mut next: u32, n: usize) -> Result<()> {
    let b = e.backend.as_ref();
    let depth = state.position;
    let mut step = |next: &mut u32| -> Result<()> {
        let logits = e.model.forward(b, &[*next], state, Logits::Last)?;
        *next = argmax(&b.download(&logits)?);
        Ok(())
    };
    step(&mut next)?;
    let t = Instant::now();
    for _ in 0..n {
        step(&mut next)?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!("decode at depth {depth}: {n} tokens in {secs:.3} s = {:.1} tok/s", n as f64 / secs);
    handle.set_profiling(true)?;
    for _ in 0..8 {
        step(&mut next)?;
    }
    let prof = handle.kernel_profile();
    handle.set_profiling(false)?;
    println!("kernel time per decoded token by kernel (8 tokens):");
    print_profile(&prof, 8, "ms/token");
    Ok(())
}
