//! MTP speculative decoding: decode speed and acceptance with the model's own
//! head, against plain decoding, plus the verification machinery's ceiling with
//! scripted drafts (always right, right 3 times in 5).
//!
//!     cargo run --release --example bench_mtp -- MODEL_DIR [TOKENS] [cpu|wgpu]
//!
//! Prints one JSON line per configuration. Greedy output must be identical in
//! every configuration; the program fails otherwise.

use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use slotstream::generate::{Engine, GenerateOutput, GenerateRequest};
use slotstream::model::LoadOptions;
use slotstream::sampling::SamplingParams;

fn backend(kind: &str) -> Result<Box<dyn slotstream_backend::Backend>> {
    Ok(match kind {
        "cpu" => Box::new(slotstream_cpu::CpuBackend::new()),
        "wgpu" => Box::new(slotstream_wgpu::WgpuBackend::new(&slotstream_wgpu::AdapterChoice::auto())?),
        other => bail!("backend {other}: expected cpu or wgpu"),
    })
}

fn generate(e: &Engine, prompt: &[u32], tokens: usize) -> Result<GenerateOutput> {
    let req = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens: tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        ignore_eos: true,
    };
    e.generate(&req, |_| ControlFlow::Continue(()))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).context("usage: bench_mtp MODEL_DIR [TOKENS] [cpu|wgpu]")?);
    let tokens: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(256);
    let kind = args.get(3).map(String::as_str).unwrap_or("cpu");
    let load = |mtp: bool| Engine::load(&dir, backend(kind)?, &LoadOptions { mtp, ..Default::default() });
    let plain = load(false)?;
    let prompt = plain.codec.encode("The sea was calm, and the ship", false)?;
    // Warm-up (expert reads, allocations), then the measured plain run.
    generate(&plain, &prompt, 8)?;
    let base = generate(&plain, &prompt, tokens)?;
    let report = |name: &str, out: &GenerateOutput| {
        let m = out.stats.mtp;
        println!(
            "{}",
            serde_json::json!({
                "config": name,
                "backend": plain.backend.name(),
                "tokens": out.generated_ids.len(),
                "decode_tokens_per_second": out.stats.decode_tokens_per_second,
                "speedup": out.stats.decode_tokens_per_second / base.stats.decode_tokens_per_second,
                "mtp": m,
                "acceptance": m.map(|m| m.acceptance()),
            })
        );
    };
    report("plain", &base);
    let runs: [(&str, Option<usize>); 3] = [("mtp head", None), ("scripted: always right", Some(1)), ("scripted: right 3 in 5", Some(5))];
    for (name, script) in runs {
        let mut e = load(true)?;
        if e.model.draft.is_none() {
            bail!("{} has no mtp.safetensors", dir.display());
        }
        if let Some(period) = script {
            let want = base.generated_ids.clone();
            let n = prompt.len();
            e.drafter = Some(Box::new(move |history: &[u32]| {
                let i = history.len() - n;
                let right = want.get(i).copied().unwrap_or(0);
                if period == 1 || i % period < 3 { right } else { right.wrapping_add(1) % 64 }
            }));
        }
        generate(&e, &prompt, 8)?;
        let out = generate(&e, &prompt, tokens)?;
        if out.generated_ids != base.generated_ids {
            bail!("{name}: greedy output differs from plain decoding");
        }
        report(name, &out);
    }
    Ok(())
}
