//! `x @ W^T` over every weight format of [`crate::weight`]: f32 accumulation,
//! rows split across threads, AVX2 unpack-and-multiply loops where the CPU
//! has them; 4-bit weights in int8 mode go to `q8.rs` instead.

use rayon::prelude::*;

use crate::options::{CpuOptions, Int8Kernel};
#[cfg(target_arch = "x86_64")]
use crate::weight::Scales;
use crate::weight::{CpuWeight, Store};

impl CpuWeight {
    /// Dot product of global row `row` with one input vector. `xsums` holds the
    /// sum of `x` over each quantization group (only read for affine weights).
    #[inline(always)]
    fn dot_row<const AVX2: bool>(&self, row: usize, x: &[f32], xsums: &[f32], scratch: &mut [f32]) -> f32 {
        match &self.store {
            Store::Affine { bits: 4, group_size, words, scales, biases } => {
                let k = self.cols;
                let groups = k / group_size;
                let wrow = &words[row * k / 8..(row + 1) * k / 8];
                #[cfg(target_arch = "x86_64")]
                if AVX2 && group_size % 32 == 0 {
                    assert!(x.len() >= k && xsums.len() >= groups);
                    // SAFETY: AVX2 is only true inside `run_avx2` (features
                    // checked at run time); lengths asserted above.
                    return unsafe { dot_row_q4_avx2(wrow, x, scales, biases, row * groups, *group_size, xsums) };
                }
                let mut acc = 0.0f32;
                for g in 0..groups {
                    let gw = &wrow[g * group_size / 8..(g + 1) * group_size / 8];
                    let gx = &x[g * group_size..(g + 1) * group_size];
                    let q = dot_q4::<AVX2>(gw, gx);
                    acc += scales.at(row * groups + g) * q + biases.at(row * groups + g) * xsums[g];
                }
                acc
            }
            Store::Affine { bits: 8, group_size, words, scales, biases } => {
                let k = self.cols;
                let groups = k / group_size;
                let wrow = &words[row * k / 4..(row + 1) * k / 4];
                let mut acc = 0.0f32;
                for g in 0..groups {
                    let gw = &wrow[g * group_size / 4..(g + 1) * group_size / 4];
                    let gx = &x[g * group_size..(g + 1) * group_size];
                    let q = dot_q8(gw, gx);
                    acc += scales.at(row * groups + g) * q + biases.at(row * groups + g) * xsums[g];
                }
                acc
            }
            Store::F32(v) => dot(&v[row * self.cols..(row + 1) * self.cols], x),
            _ => {
                self.dequant_row(row, scratch);
                dot(scratch, x)
            }
        }
    }
}


#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn dot_q4<const AVX2: bool>(words: &[u32], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        assert!(x.len() >= words.len() * 8);
        // SAFETY: AVX2 is only true inside `run_avx2` (features checked at run
        // time); lengths asserted above.
        return unsafe { dot_q4_avx2(words, x) };
    }
    dot_q4_portable(words, x)
}

/// One 4-bit row in f32: per group, four independent accumulators (so the
/// FMAs are not one serial chain) scaled into a vector sum, one horizontal sum
/// per row. `group_size` is a multiple of 32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_row_q4_avx2(wrow: &[u32], x: &[f32], scales: &Scales, biases: &Scales, g0: usize, gs: usize, xsums: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let m = _mm256_set1_epi32(15);
    let (wp, xp) = (wrow.as_ptr(), x.as_ptr());
    let groups = wrow.len() * 8 / gs;
    let mut racc = _mm256_setzero_ps();
    let mut bias = 0.0f32;
    for g in 0..groups {
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = g * gs / 8;
        while i < (g + 1) * gs / 8 {
            for (u, acc) in a.iter_mut().enumerate() {
                let w = _mm256_set1_epi32(*wp.add(i + u) as i32);
                let q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), m));
                *acc = _mm256_fmadd_ps(q, _mm256_loadu_ps(xp.add(8 * (i + u))), *acc);
            }
            i += 4;
        }
        let p = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        racc = _mm256_fmadd_ps(p, _mm256_set1_ps(scales.at(g0 + g)), racc);
        bias += biases.at(g0 + g) * xsums[g];
    }
    let s = _mm_add_ps(_mm256_castps256_ps128(racc), _mm256_extractf128_ps(racc, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s) + bias
}

/// Four independent accumulators, so the FMAs are not one serial chain.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_q4_avx2(words: &[u32], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let m = _mm256_set1_epi32(15);
    let mut a = [_mm256_setzero_ps(); 4];
    let (n, wp, xp) = (words.len(), words.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i + 4 <= n {
        for (u, acc) in a.iter_mut().enumerate() {
            let w = _mm256_set1_epi32(*wp.add(i + u) as i32);
            let q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), m));
            *acc = _mm256_fmadd_ps(q, _mm256_loadu_ps(xp.add(8 * (i + u))), *acc);
        }
        i += 4;
    }
    while i < n {
        let w = _mm256_set1_epi32(*wp.add(i) as i32);
        let q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), m));
        a[0] = _mm256_fmadd_ps(q, _mm256_loadu_ps(xp.add(8 * i)), a[0]);
        i += 1;
    }
    let v = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline(always)]
fn dot_q4_portable(words: &[u32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, xs) in words.iter().zip(x.chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += ((w >> (4 * j)) & 15) as f32 * xs[j];
        }
    }
    acc.iter().sum()
}

/// Asks for the cache lines of global row `row` of an affine or dense weight
/// (a few rows ahead of the one being computed: the hardware prefetcher does
/// not follow short rows far enough).
#[inline(always)]
fn prefetch_row(w: &CpuWeight, row: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (ptr, bytes) = match &w.store {
            Store::Affine { bits, words, .. } => {
                let rb = w.cols * *bits as usize / 8;
                ((words.as_ptr() as *const u8).wrapping_add(row * rb), rb)
            }
            Store::F32(v) => ((v.as_ptr() as *const u8).wrapping_add(row * w.cols * 4), w.cols * 4),
            Store::F16(v) => ((v.as_ptr() as *const u8).wrapping_add(row * w.cols * 2), w.cols * 2),
            Store::BF16(v) => ((v.as_ptr() as *const u8).wrapping_add(row * w.cols * 2), w.cols * 2),
        };
        let mut off = 0;
        while off < bytes {
            // SAFETY: prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(off) as *const i8) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (w, row);
}

#[inline(always)]
fn dot_q8(words: &[u32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, xs) in words.chunks_exact(2).zip(x.chunks_exact(8)) {
        for j in 0..4 {
            acc[j] += ((w[0] >> (8 * j)) & 255) as f32 * xs[j];
            acc[4 + j] += ((w[1] >> (8 * j)) & 255) as f32 * xs[4 + j];
        }
    }
    acc.iter().sum()
}

const PREFETCH_ROWS: usize = 4;

/// Calls of up to this many tokens compute each output as a one-token call
/// does (`dot_row` per token), so a decode step over a batch of sequences
/// gives every sequence the row its decode alone would get (concurrency
/// changes speed, never output). Longer calls (prefill) dequantize each
/// weight row once for all their tokens. Attention keeps the same bound
/// (`attention.rs`: its many-query kernel only above it).
pub(crate) const ROW_EXACT_TOKENS: usize = 16;

/// One parallel task's share of a matmul: a run of consecutive output rows.
struct RowTask<'a> {
    w: &'a CpuWeight,
    x: &'a [f32],
    xsums: &'a [f32],
    tokens: usize,
    k: usize,
    groups: usize,
    fused: bool,
    base: usize,
    chunk: usize,
}

impl RowTask<'_> {
    #[inline(always)]
    fn run<const AVX2: bool>(&self, c: usize, out: &mut [f32]) {
        let (k, groups) = (self.k, self.groups);
        let mut scratch = vec![0.0f32; k];
        let rows = out.len() / self.tokens.max(1);
        for (i, orow) in out.chunks_exact_mut(self.tokens).enumerate() {
            let row = self.base + c * self.chunk + i;
            if i + PREFETCH_ROWS < rows {
                prefetch_row(self.w, row + PREFETCH_ROWS);
            }
            if self.fused {
                for (t, o) in orow.iter_mut().enumerate() {
                    let xs = &self.xsums[if groups > 0 { t * groups..(t + 1) * groups } else { 0..0 }];
                    *o = self.w.dot_row::<AVX2>(row, &self.x[t * k..(t + 1) * k], xs, &mut scratch);
                }
            } else {
                self.w.dequant_row(row, &mut scratch);
                for (t, o) in orow.iter_mut().enumerate() {
                    *o = dot(&scratch, &self.x[t * k..(t + 1) * k]);
                }
            }
        }
    }

    /// The same loop compiled with AVX2 and FMA, so the unpack-and-multiply
    /// loops vectorise eight lanes wide.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, c: usize, out: &mut [f32]) {
        self.run::<true>(c, out)
    }
}

pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows handled by one parallel task: enough work to amortise scheduling.
fn rows_per_task(cols: usize, tokens: usize) -> usize {
    let work_per_row = cols * tokens.max(1);
    (65536 / work_per_row.max(1)).clamp(1, 256)
}

/// How the CPU backend multiplies by quantized weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulMode {
    /// f32 activations and accumulation for every weight format: the reference
    /// the parity tests hold to 1e-4 of the oracle.
    Exact,
    /// 4-bit affine weights take int8 activations (per 32-block scales) and
    /// integer dot products; everything else as `Exact`. Relative error of a
    /// matmul output ~1e-3 (rounding x to 8 bits).
    Int8,
}

/// How the backend runs its matmuls, fixed when it is built from [`CpuOptions`].
#[derive(Clone, Copy, Debug)]
// Only x86 has int8 kernels; elsewhere every matmul takes the f32 path.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct MatmulPlan {
    /// The int8 kernel 4-bit weights use (`Some(true)`: VNNI, `Some(false)`:
    /// AVX2), `None` for the f32 path: in exact mode, or where this CPU has no
    /// int8 kernel.
    pub int8_vnni: Option<bool>,
    /// Int8 matmuls below this many weight bytes (times tokens) run on the
    /// calling thread.
    pub serial_bytes: usize,
}

impl MatmulPlan {
    pub(crate) fn new(options: &CpuOptions) -> MatmulPlan {
        #[cfg(target_arch = "x86_64")]
        let int8_vnni = (options.matmul == MatmulMode::Int8 && crate::q8::available())
            .then(|| options.int8_kernel == Int8Kernel::Best && crate::q8::has_vnni());
        #[cfg(not(target_arch = "x86_64"))]
        let int8_vnni = {
            let _ = (options.matmul, Int8Kernel::Best);
            None
        };
        MatmulPlan { int8_vnni, serial_bytes: options.serial_bytes }
    }
}

fn transpose_out(out_nt: Vec<f32>, n: usize, tokens: usize) -> Vec<f32> {
    if tokens == 1 {
        return out_nt;
    }
    // 16 x 16 tiles: both sides touch whole cache lines.
    const B: usize = 16;
    let mut out = vec![0.0f32; tokens * n];
    for r0 in (0..n).step_by(B) {
        for t0 in (0..tokens).step_by(B) {
            for r in r0..(r0 + B).min(n) {
                for t in t0..(t0 + B).min(tokens) {
                    out[t * n + r] = out_nt[r * tokens + t];
                }
            }
        }
    }
    out
}

/// `x @ W_e^T` for expert `expert` of `w`: `x` is `[tokens, cols]`, the result
/// `[tokens, rows]`. `parallel`: split the rows across the thread pool (when
/// the matrix is large enough to be worth it).
pub(crate) fn matmul(x: &[f32], tokens: usize, w: &CpuWeight, expert: usize, plan: &MatmulPlan, parallel: bool) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if let Some(out) = plan.int8_vnni.and_then(|vnni| crate::q8::matmul_q8(x, tokens, w, expert, vnni, plan.serial_bytes, parallel)) {
        return out;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = plan;
    let (n, k) = (w.rows, w.cols);
    let base = expert * n;
    // Per-token group sums let affine kernels apply the bias once per group.
    let xsums: Vec<f32> = match w.group_size() {
        Some(g) => x.chunks_exact(g).map(|c| c.iter().sum()).collect(),
        None => Vec::new(),
    };
    let groups = w.group_size().map(|g| k / g).unwrap_or(0);
    let mut out_nt = vec![0.0f32; n * tokens];
    let chunk = rows_per_task(k, tokens);
    let fused = tokens <= ROW_EXACT_TOKENS || matches!(w.store, Store::F32(_));
    let task = RowTask { w, x, xsums: &xsums, tokens, k, groups, fused, base, chunk };
    let avx2 = has_avx2_fma();
    let run = |c: usize, out: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
            unsafe { task.run_avx2(c, out) };
            return;
        }
        let _ = avx2;
        task.run::<false>(c, out);
    };
    if parallel {
        out_nt.par_chunks_mut(chunk * tokens).enumerate().for_each(|(c, out)| run(c, out));
    } else {
        out_nt.chunks_mut(chunk * tokens).enumerate().for_each(|(c, out)| run(c, out));
    }
    transpose_out(out_nt, n, tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight::test_matrix as quantized;

    /// The int8 path against the exact one. Its only approximation is rounding
    /// x to 8 bits per block of 32 (step d = max|x|/127 of the block), so each
    /// output may differ from the exact dot product by at most
    /// sum_i |s_g q_i| * d_blk(i) / 2 (plus f32 rounding): that bound is checked
    /// per output. The outputs' relative L2 error is also held under 3e-2 on
    /// this deliberately hard input (every 97th x is 8x larger, widening its
    /// block's step; smooth inputs give ~1e-3). This is why the parity tests,
    /// which hold logits to 1e-4 of the oracle, run on `CpuBackend::exact()`;
    /// tests/demo.rs holds the int8 path to the 0.5% perplexity bar.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn int8_matches_exact_within_tolerance() {
        if !crate::q8::available() {
            return;
        }
        let mut kernels = vec![false];
        if crate::q8::has_vnni() {
            kernels.push(true);
        }
        for group in [32, 64, 128] {
            let (rows, cols) = (37, 512);
            let host = quantized(4, group, rows, cols);
            let w = CpuWeight::from_host(&host);
            let Store::Affine { scales, .. } = &w.store else { unreachable!() };
            for tokens in [1, 3, 9] {
                let x: Vec<f32> = (0..tokens * cols)
                    .map(|i| (((i * 7919) % 113) as f32 / 113.0 - 0.5) * if i % 97 == 0 { 8.0 } else { 1.0 })
                    .collect();
                let exact = matmul(&x, tokens, &w, 0, &exact(), true);
                for &vnni in &kernels {
                    let got = crate::q8::matmul_q8(&x, tokens, &w, 0, vnni, 0, true).unwrap();
                    let (mut num, mut den) = (0.0f64, 0.0f64);
                    for t in 0..tokens {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let d: Vec<f32> =
                            xt.chunks(32).map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0).collect();
                        for r in 0..rows {
                            let mut bound = 0.0f32;
                            for c in 0..cols {
                                let s = scales.at((r * cols + c) / group);
                                let q = ((words_of(&w)[(r * cols + c) / 8] >> (4 * (c % 8))) & 15) as f32;
                                bound += (s * q).abs() * d[c / 32] / 2.0;
                            }
                            let (e, g) = (exact[t * rows + r], got[t * rows + r]);
                            assert!(
                                (e - g).abs() <= bound * 1.01 + 1e-5 * (1.0 + e.abs()),
                                "group {group} tokens {tokens} vnni {vnni} row {r}: {g} vs {e} (bound {bound})"
                            );
                            num += ((e - g) as f64).powi(2);
                            den += (e as f64).powi(2);
                        }
                    }
                    let rel = (num / den).sqrt();
                    assert!(rel <= 3e-2, "group {group} tokens {tokens} vnni {vnni}: relative L2 {rel}");
                }
            }
        }
    }

    /// A token's int8 result must not depend on the other tokens of the call
    /// (the kernels tile tokens; each (row, token) must be computed the same way).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn int8_rows_independent_of_token_count() {
        if !crate::q8::available() {
            return;
        }
        let mut kernels = vec![false];
        if crate::q8::has_vnni() {
            kernels.push(true);
        }
        for group in [32, 64] {
            let (rows, cols) = (37, 512);
            let w = CpuWeight::from_host(&quantized(4, group, rows, cols));
            let tokens = 70;
            let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
            for &vnni in &kernels {
                let all = crate::q8::matmul_q8(&x, tokens, &w, 0, vnni, 0, true).unwrap();
                let one = |t: usize| crate::q8::matmul_q8(&x[t * cols..(t + 1) * cols], 1, &w, 0, vnni, 0, true).unwrap();
                for t in [0, 1, 5, 63, 64, 69] {
                    assert_eq!(&all[t * rows..(t + 1) * rows], &one(t)[..], "group {group} vnni {vnni} token {t}");
                }
                // Every tile shape: a batched step's 2 to 7 rows.
                for n in 2..8 {
                    let some = crate::q8::matmul_q8(&x[..n * cols], n, &w, 0, vnni, 0, true).unwrap();
                    for t in 0..n {
                        assert_eq!(&some[t * rows..(t + 1) * rows], &one(t)[..], "group {group} vnni {vnni} {n} tokens, token {t}");
                    }
                }
            }
        }
    }

    /// Up to [`ROW_EXACT_TOKENS`] tokens, every token's outputs are bit
    /// for bit those of a call with that token alone, in every weight format.
    #[test]
    fn exact_rows_independent_of_batch() {
        for (bits, group) in [(4, 32), (4, 64), (8, 64), (2, 64)] {
            let (rows, cols) = (37, 256);
            let w = CpuWeight::from_host(&quantized(bits, group, rows, cols));
            for tokens in [2, 4, ROW_EXACT_TOKENS] {
                let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
                let all = matmul(&x, tokens, &w, 0, &exact(), true);
                for t in 0..tokens {
                    let one = matmul(&x[t * cols..(t + 1) * cols], 1, &w, 0, &exact(), true);
                    assert_eq!(&all[t * rows..(t + 1) * rows], &one[..], "bits {bits} group {group} tokens {tokens} token {t}");
                }
            }
        }
    }

    fn exact() -> MatmulPlan {
        MatmulPlan::new(&CpuOptions { matmul: MatmulMode::Exact, ..CpuOptions::default() })
    }

    #[cfg(target_arch = "x86_64")]
    fn words_of(w: &CpuWeight) -> &[u32] {
        match &w.store {
            Store::Affine { words, .. } => words,
            _ => unreachable!(),
        }
    }

    #[test]
    fn quantized_matmul_matches_dequantized_reference() {
        for (bits, group) in [(4, 32), (4, 64), (4, 128), (8, 64), (2, 64)] {
            let (rows, cols) = (37, 256);
            let host = quantized(bits, group, rows, cols);
            host.validate().unwrap();
            let dense = host.to_f32();
            let w = CpuWeight::from_host(&host);
            for tokens in [1, 3] {
                let x: Vec<f32> =
                    (0..tokens * cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
                let got = matmul(&x, tokens, &w, 0, &exact(), true);
                for t in 0..tokens {
                    for r in 0..rows {
                        let want: f32 = (0..cols)
                            .map(|c| dense[r * cols + c] * x[t * cols + c])
                            .sum();
                        let have = got[t * rows + r];
                        assert!(
                            (want - have).abs() <= 1e-4 * (1.0 + want.abs()),
                            "bits {bits} group {group} tokens {tokens} row {r}: {have} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
