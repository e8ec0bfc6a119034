//! What a JSON-schema constraint costs per generated token: the same greedy
//! generation with and without `format`, timing the grammar's mask and commit
//! apart from the model's forward passes.
//!
//!     cargo run --release --example bench_constraint -- [MODEL_DIR] [TOKENS] [RUNS]
//!
//! Defaults: the demo model (`tools/demo/model`), 128 tokens, 3 runs (the
//! median is reported). The CPU backend runs the model.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;
use slotstream::constrain::{ConstraintSpec, Grammars};
use slotstream::generate::{Engine, GenerateRequest, TokenConstraint};
use slotstream::sampling::SamplingParams;

/// A constraint that times its inner one.
struct Timed<C> {
    inner: C,
    spent: Duration,
}

impl<C: TokenConstraint> TokenConstraint for Timed<C> {
    fn mask(&mut self, logits: &mut [f32]) -> Result<bool> {
        let t = Instant::now();
        let r = self.inner.mask(logits);
        self.spent += t.elapsed();
        r
    }

    fn commit(&mut self, token: u32) -> Result<bool> {
        let t = Instant::now();
        let r = self.inner.commit(token);
        self.spent += t.elapsed();
        r
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.first().map(String::as_str).unwrap_or("tools/demo/model"));
    let tokens: usize = args.get(1).map(|s| s.parse()).transpose().context("TOKENS must be a number")?.unwrap_or(128);
    let runs: usize = args.get(2).map(|s| s.parse()).transpose().context("RUNS must be a number")?.unwrap_or(3);
    let engine = Engine::load(&dir, Box::new(slotstream_cpu::CpuBackend::new()), &slotstream::model::LoadOptions::default())?;
    let grammars = Grammars::load(&dir, engine.vocab_size(), &engine.codec.eos_ids)?;
    let schema = json!({"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]});
    let spec = ConstraintSpec::JsonSchema(schema);
    let prompt_ids = engine.codec.encode("Write a story as JSON: ", false)?;
    let req = GenerateRequest {
        prompt_ids,
        max_tokens: tokens,
        sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
        stop: Vec::new(),
        ignore_eos: true,
    };
    let (mut free, mut constrained, mut grammar) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let out = engine.generate(&req, |_| ControlFlow::Continue(()))?;
        free.push(out.stats.decode_seconds / out.stats.generated_tokens.max(1) as f64);
        let mut timed = Timed { inner: grammars.constraint(&spec)?, spent: Duration::ZERO };
        let mut state = engine.new_state()?;
        let out = engine.generate_constrained(&mut state, &req, Some(&mut timed), |_| ControlFlow::Continue(()))?;
        let n = out.stats.generated_tokens.max(1) as f64;
        serde_json::from_str::<serde_json::Value>(&out.text)
            .or_else(|_| serde_json::from_str::<serde_json::Value>(&format!("{}\"}}", out.text)))
            .with_context(|| format!("the constrained output is not JSON (even closed): {:?}", out.text))?;
        constrained.push(out.stats.decode_seconds / n);
        grammar.push(timed.spent.as_secs_f64() / n);
    }
    let (free, constrained, grammar) = (median(free), median(constrained), median(grammar));
    println!("model {} | {tokens} tokens, median of {runs} runs, CPU backend", dir.display());
    println!("decode without constraint: {:.3} ms/token", free * 1e3);
    println!("decode with a JSON schema: {:.3} ms/token", constrained * 1e3);
    println!("grammar mask + commit:     {:.1} us/token ({:.1}% of the unconstrained decode time)", grammar * 1e6, 100.0 * grammar / free);
    Ok(())
}
