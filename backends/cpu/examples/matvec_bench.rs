//! Decode-shaped matmul timing for the CPU backend (issue 8):
//!
//!   cargo run --release -p slotstream-cpu --example matvec_bench [tokens]
//!
//! MLX 4-bit g64 bf16 weights of the shapes one token of the moe-a peer model
//! multiplies (8 layers: q/o 1024x1024, k/v 256x1024, 4 experts of gate/up
//! 512x1024 and down 1024x512; lm_head 4096x1024), ~45 MB in all, so the
//! weights come from DRAM as in real decode. Prints ms per "token" for the
//! exact and int8 modes.
use std::borrow::Cow;
use std::time::Instant;

use slotstream_backend::{Backend, DType, HostMatrix, MatrixData};
use slotstream_cpu::{CpuBackend, MatmulMode};

fn q4(rows: usize, cols: usize, seed: u32) -> HostMatrix<'static> {
    let mut state = seed;
    let mut words = Vec::with_capacity(rows * cols / 2);
    for _ in 0..rows * cols / 8 {
        state = state.wrapping_mul(1664525).wrapping_add(1013904223);
        words.extend_from_slice(&state.to_le_bytes());
    }
    let groups = rows * cols / 64;
    let scales: Vec<u8> = (0..groups).flat_map(|i| half::bf16::from_f32(0.01 * (1 + i % 7) as f32).to_le_bytes()).collect();
    let biases: Vec<u8> = (0..groups).flat_map(|i| half::bf16::from_f32(-0.08 + 0.01 * (i % 5) as f32).to_le_bytes()).collect();
    HostMatrix {
        experts: 1,
        rows,
        cols,
        data: MatrixData::Affine {
            bits: 4,
            group_size: 64,
            words: Cow::Owned(words),
            scale_dtype: DType::BF16,
            scales: Cow::Owned(scales),
            biases: Cow::Owned(biases),
        },
    }
}

fn main() {
    let tokens: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(1);
    let mut shapes = Vec::new();
    for _ in 0..8 {
        shapes.extend([(1024, 1024), (256, 1024), (256, 1024), (1024, 1024)]);
        for _ in 0..4 {
            shapes.extend([(512, 1024), (512, 1024), (1024, 512)]);
        }
    }
    shapes.push((4096, 1024));
    for mode in [MatmulMode::Exact, MatmulMode::Int8] {
        let b = CpuBackend::with_mode(mode);
        let ws: Vec<_> = shapes.iter().enumerate().map(|(i, &(r, c))| b.load_weight(&q4(r, c, i as u32 + 1)).unwrap()).collect();
        let xs: Vec<_> = [1024usize, 512]
            .iter()
            .map(|&c| b.upload(&(0..tokens * c).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect::<Vec<_>>(), &[tokens, c]).unwrap())
            .collect();
        let bytes: usize = shapes.iter().map(|(r, c)| r * c / 2 + r * c / 64 * 4).sum();
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            let reps = 20;
            for _ in 0..reps {
                for (w, &(_, c)) in ws.iter().zip(&shapes) {
                    let x = if c == 1024 { &xs[0] } else { &xs[1] };
                    std::hint::black_box(b.matmul(x, w).unwrap());
                }
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        println!(
            "{mode:?}: {} matmuls, {:.1} MB, tokens {tokens}: {:.3} ms per pass, {:.1} GB/s, {:.0} passes/s",
            shapes.len(),
            bytes as f64 / 1e6,
            best * 1e3,
            bytes as f64 / best / 1e9,
            1.0 / best
        );
    }
}
