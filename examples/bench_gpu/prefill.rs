//! Prefill alone (`--model DIR --chunks N,...`): a `--prompt`-token prompt
//! fed in chunks of each size in turn, warm: its wall time, then its kernel
//! time by kernel (timestamp queries), in the CLI's default mode for a GPU.

use std::time::Instant;

use anyhow::{Context, Result};
use slotstream::generate::Engine;
use slotstream::model::LoadOptions;
use slotstream_wgpu::{MatmulMode, WgpuBackend};

use super::{print_profile, Lcg};

pub fn bench(b: &WgpuBackend, dir: &std::path::Path, prompt_len: usize, chunks: &[usize]) -> Result<()> {
    let gpu = b.with_matmul_mode(MatmulMode::from_env(MatmulMode::Int8));
    let handle = gpu.clone();
    let mut e = Engine::load(dir, Box::new(gpu), &LoadOptions { preload_experts: true, ..LoadOptions::default() }.with_env_overrides()?)
        .with_context(|| format!("loading {}", dir.display()))?;
    let mut rng = Lcg(7);
    let prompt: Vec<u32> = (0..prompt_len).map(|_| rng.word() % e.vocab_size() as u32).collect();
    for &chunk in chunks {
        e.prefill_chunk = chunk;
        // The first prefill at a chunk size creates its buffers and pipelines.
        drop(e.prefill(&prompt, &mut e.new_state()?)?);
        let mut state = e.new_state()?;
        handle.sync()?;
        let t = Instant::now();
        drop(e.prefill(&prompt, &mut state)?);
        let secs = t.elapsed().as_secs_f64();
        println!("prefill of {prompt_len} tokens in chunks of {chunk}: {secs:.3} s = {:.0} tok/s (warm)", prompt_len as f64 / secs);
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
