//! Host time of one sampled token over a Qwen-sized vocabulary (151936
//! logits, seeded), for Ollama's default settings (temperature 0.8, top-k
//! 40, top-p 0.9), temperature alone (the OpenAI API's default) and greedy,
//! over flat logits (uniform in [-10, 10]: the longest draws), then
//! temperature alone over Zipf-like logits (probability ~ rank^-1.1, closer
//! to a trained model's). The sum of the picked ids shows whether two builds
//! pick the same tokens.
//!
//!   cargo run --release --example bench_sampler

use slotstream::sampling::{Sampler, SamplingParams};

fn main() {
    let n = 151_936;
    let mut x = 1u64;
    let logits: Vec<f32> = (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((x >> 40) as f32 / 16_777_216.0) * 20.0 - 10.0
        })
        .collect();
    let settings = [
        ("Ollama's defaults", SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.9, seed: Some(1), ..Default::default() }),
        ("temperature alone", SamplingParams { temperature: 0.8, seed: Some(1), ..Default::default() }),
        ("greedy", SamplingParams::default()),
    ];
    // Zipf-like: logit -1.1 ln(rank), ranks shuffled over the ids.
    let mut ranks: Vec<usize> = (1..=n).collect();
    for i in (1..n).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        ranks.swap(i, (x >> 33) as usize % (i + 1));
    }
    let zipf: Vec<f32> = ranks.iter().map(|&r| -1.1 * (r as f32).ln()).collect();
    let tokens = 50;
    let zipf_alone = ("temperature alone, Zipf-like logits", SamplingParams { temperature: 1.0, seed: Some(1), ..Default::default() });
    for (name, params, logits) in settings.into_iter().map(|(n, p)| (n, p, &logits)).chain([(zipf_alone.0, zipf_alone.1, &zipf)]) {
        let mut s = Sampler::new(params);
        let t = std::time::Instant::now();
        let picked: u64 = (0..tokens).map(|_| u64::from(s.sample(logits, &[1, 2, 3]))).sum();
        println!("{name}: {:.2} ms per token (sum of picked ids {picked})", t.elapsed().as_secs_f64() * 1e3 / tokens as f64);
    }
}
