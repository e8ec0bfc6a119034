//! Weight storage and `x @ W^T` kernels: f32/f16/bf16 and MLX affine 2/4/8-bit,
//! f32 accumulation, rows split across threads.

use half::{bf16, f16};
use rayon::prelude::*;
use slotstream_backend::{shape_error, DType, HostMatrix, MatrixData, MatrixFormat, Result};

/// How a weight's values are stored on the CPU.
pub enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    Affine { bits: u32, group_size: usize, words: Vec<u32>, scales: Scales, biases: Scales },
}

/// Quantization scales or biases, kept in their stored precision (halving the
/// memory of f32 copies) and widened one group at a time.
pub enum Scales {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Scales {
    fn from_bytes(dtype: DType, bytes: &[u8]) -> Scales {
        match dtype {
            DType::F32 => Scales::F32(DType::F32.to_f32(bytes)),
            DType::F16 => Scales::F16(bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect()),
            DType::BF16 => Scales::BF16(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()),
        }
    }

    fn zeros(dtype: DType, n: usize) -> Scales {
        match dtype {
            DType::F32 => Scales::F32(vec![0.0; n]),
            DType::F16 => Scales::F16(vec![f16::ZERO; n]),
            DType::BF16 => Scales::BF16(vec![bf16::ZERO; n]),
        }
    }

    #[inline(always)]
    fn at(&self, i: usize) -> f32 {
        match self {
            Scales::F32(v) => v[i],
            Scales::F16(v) => v[i].to_f32(),
            Scales::BF16(v) => v[i].to_f32(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Scales::F32(v) => v.len() * 4,
            Scales::F16(v) => v.len() * 2,
            Scales::BF16(v) => v.len() * 2,
        }
    }

    /// Overwrites `[start, start + n)` from stored bytes of the same dtype.
    fn write(&mut self, start: usize, dtype: DType, bytes: &[u8]) -> Result<()> {
        match (self, dtype) {
            (Scales::F32(v), DType::F32) => v[start..start + bytes.len() / 4].copy_from_slice(&DType::F32.to_f32(bytes)),
            (Scales::F16(v), DType::F16) => {
                for (o, c) in v[start..].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]);
                }
            }
            (Scales::BF16(v), DType::BF16) => {
                for (o, c) in v[start..].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]);
                }
            }
            _ => return Err(shape_error("write_expert", "scale dtype differs from the pool's")),
        }
        Ok(())
    }
}

/// A `[experts, rows, cols]` weight owned by the CPU backend.
pub struct CpuWeight {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub store: Store,
}

fn le_u32(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

impl CpuWeight {
    pub fn from_host(m: &HostMatrix<'_>) -> CpuWeight {
        let store = match &m.data {
            MatrixData::Dense { dtype: DType::F32, bytes } => Store::F32(DType::F32.to_f32(bytes)),
            MatrixData::Dense { dtype: DType::F16, bytes } => Store::F16(
                bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect(),
            ),
            MatrixData::Dense { dtype: DType::BF16, bytes } => Store::BF16(
                bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect(),
            ),
            MatrixData::Affine { bits, group_size, words, scale_dtype, scales, biases } => {
                Store::Affine {
                    bits: *bits,
                    group_size: *group_size,
                    words: le_u32(words),
                    scales: Scales::from_bytes(*scale_dtype, scales),
                    biases: Scales::from_bytes(*scale_dtype, biases),
                }
            }
        };
        CpuWeight { experts: m.experts, rows: m.rows, cols: m.cols, store }
    }

    /// An all-zero stack of `experts` matrices in `format` (an expert pool).
    pub fn zeros(experts: usize, rows: usize, cols: usize, format: MatrixFormat) -> CpuWeight {
        let n = experts * rows * cols;
        let store = match format {
            MatrixFormat::Dense(DType::F32) => Store::F32(vec![0.0; n]),
            MatrixFormat::Dense(DType::F16) => Store::F16(vec![f16::ZERO; n]),
            MatrixFormat::Dense(DType::BF16) => Store::BF16(vec![bf16::ZERO; n]),
            MatrixFormat::Affine { bits, group_size, scale_dtype } => Store::Affine {
                bits,
                group_size,
                words: vec![0; n * bits as usize / 32],
                scales: Scales::zeros(scale_dtype, n / group_size),
                biases: Scales::zeros(scale_dtype, n / group_size),
            },
        };
        CpuWeight { experts, rows, cols, store }
    }

    /// Overwrites matrix `slot` of the stack with a single host matrix of the
    /// same shape and format.
    pub fn write_slot(&mut self, slot: usize, m: &HostMatrix<'_>) -> Result<()> {
        m.validate()?;
        if slot >= self.experts || m.experts != 1 || m.rows != self.rows || m.cols != self.cols {
            return Err(shape_error(
                "write_expert",
                format!("[{} x {}] into slot {slot} of [{} x {} x {}]", m.rows, m.cols, self.experts, self.rows, self.cols),
            ));
        }
        let n = self.rows * self.cols;
        let range = slot * n..(slot + 1) * n;
        match (&mut self.store, &m.data) {
            (Store::F32(v), MatrixData::Dense { dtype: DType::F32, bytes }) => {
                v[range].copy_from_slice(&DType::F32.to_f32(bytes))
            }
            (Store::F16(v), MatrixData::Dense { dtype: DType::F16, bytes }) => {
                for (o, c) in v[range].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]);
                }
            }
            (Store::BF16(v), MatrixData::Dense { dtype: DType::BF16, bytes }) => {
                for (o, c) in v[range].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]);
                }
            }
            (
                Store::Affine { bits, group_size, words, scales, biases },
                MatrixData::Affine { bits: b, group_size: g, words: w, scale_dtype, scales: s, biases: bi },
            ) if (*bits, *group_size) == (*b, *g) => {
                let per_word = 32 / *bits as usize;
                let wr = slot * n / per_word..(slot + 1) * n / per_word;
                for (o, c) in words[wr].iter_mut().zip(w.chunks_exact(4)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
                let gr = slot * n / *group_size..(slot + 1) * n / *group_size;
                scales.write(gr.start, *scale_dtype, s)?;
                biases.write(gr.start, *scale_dtype, bi)?;
            }
            _ => return Err(shape_error("write_expert", "the expert's storage format differs from the pool's")),
        }
        Ok(())
    }

    pub fn bytes(&self) -> usize {
        match &self.store {
            Store::F32(v) => v.len() * 4,
            Store::F16(v) => v.len() * 2,
            Store::BF16(v) => v.len() * 2,
            Store::Affine { words, scales, biases, .. } => {
                words.len() * 4 + scales.bytes() + biases.bytes()
            }
        }
    }

    /// Writes global row `row` (counting across experts) as f32 into `out`.
    #[inline(always)]
    pub fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let k = self.cols;
        let range = row * k..(row + 1) * k;
        match &self.store {
            Store::F32(v) => out.copy_from_slice(&v[range]),
            Store::F16(v) => {
                for (o, w) in out.iter_mut().zip(&v[range]) {
                    *o = w.to_f32();
                }
            }
            Store::BF16(v) => {
                for (o, w) in out.iter_mut().zip(&v[range]) {
                    *o = w.to_f32();
                }
            }
            Store::Affine { bits, group_size, words, scales, biases } => {
                let per_word = (32 / bits) as usize;
                let mask = (1u32 << bits) - 1;
                let wrow = &words[row * k / per_word..(row + 1) * k / per_word];
                let groups = k / group_size;
                for g in 0..groups {
                    let (s, b) = (scales.at(row * groups + g), biases.at(row * groups + g));
                    let seg = &mut out[g * group_size..(g + 1) * group_size];
                    let gw = &wrow[g * group_size / per_word..(g + 1) * group_size / per_word];
                    for (chunk, w) in seg.chunks_exact_mut(per_word).zip(gw) {
                        for (j, o) in chunk.iter_mut().enumerate() {
                            *o = s * ((w >> (bits * j as u32)) & mask) as f32 + b;
                        }
                    }
                }
            }
        }
    }

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

    fn group_size(&self) -> Option<usize> {
        match &self.store {
            Store::Affine { group_size, .. } => Some(*group_size),
            _ => None,
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

/// Splits `n` rows into tasks of whole multiples of `align` rows and runs
/// `f(row0, rows)` on each, in parallel when the matrix is large enough to pay
/// for waking the thread pool.
#[cfg(target_arch = "x86_64")] // used by the int8 path only
fn par_row_ranges(n: usize, tokens: usize, row_bytes: usize, align: usize, parallel: bool, f: impl Fn(usize, usize) + Sync) {
    let threads = rayon::current_num_threads().max(1);
    let total = n * row_bytes * tokens.max(1);
    if !parallel || threads == 1 || total < serial_bytes() {
        f(0, n);
        return;
    }
    let tasks = threads * TASKS_PER_THREAD;
    let chunk = (n.div_ceil(tasks)).max(MIN_TASK_BYTES.div_ceil(row_bytes * tokens.max(1))).div_ceil(align) * align;
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let r0 = c * chunk;
        f(r0, chunk.min(n - r0))
    });
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used for writes to disjoint elements (one row range per task).
#[cfg(target_arch = "x86_64")]
unsafe impl Send for OutPtr {}
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for OutPtr {}

/// Matrices below this many weight bytes (times tokens) run on the calling
/// thread. `SLOTSTREAM_CPU_SERIAL_KB` overrides it (for measurements).
#[cfg(target_arch = "x86_64")]
fn serial_bytes() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("SLOTSTREAM_CPU_SERIAL_KB").ok().and_then(|v| v.parse::<usize>().ok()).map(|kb| kb << 10).unwrap_or(SERIAL_BYTES)
    })
}

/// Measured on the 2-core dev VM (BENCHMARKS.md, CPU section): at 32 KB the
/// demo model's decode ran at 620-800 tok/s on 2 threads against 1230 on one;
/// at 256 KB, 1200-1240, with no loss on the 432M-parameter models.
#[cfg(target_arch = "x86_64")]
const SERIAL_BYTES: usize = 256 << 10;
#[cfg(target_arch = "x86_64")]
const TASKS_PER_THREAD: usize = 4;
#[cfg(target_arch = "x86_64")]
const MIN_TASK_BYTES: usize = 16 << 10;

/// The int8-activation path for 4-bit affine weights, when it applies.
#[cfg(target_arch = "x86_64")]
fn matmul_q8(x: &[f32], tokens: usize, w: &CpuWeight, expert: usize, vnni: bool, parallel: bool) -> Option<Vec<f32>> {
    use crate::q8::{quantize, Q4Job, ScaleRead};
    let Store::Affine { bits: 4, group_size, words, scales, biases } = &w.store else { return None };
    let (n, k, gs) = (w.rows, w.cols, *group_size);
    if k % 64 != 0 || gs % 32 != 0 {
        return None;
    }
    let qx = quantize(x, tokens, k);
    let xsums: Vec<f32> = x.chunks_exact(gs).map(|c| c.iter().sum()).collect();
    let mut out = vec![0.0f32; tokens * n];
    let ptr = OutPtr(out.as_mut_ptr());
    fn go<S: ScaleRead + ?Sized>(job: Q4Job<'_, S>, base: usize, n: usize, out: OutPtr, vnni: bool, parallel: bool) {
        par_row_ranges(n, job.tokens, job.k / 2, 4, parallel, |r0, rows| {
            let o = out;
            // SAFETY: `out` is `[tokens, n]`; each task writes only columns
            // `r0..r0 + rows`, disjoint from every other task's.
            unsafe { job.rows_into(base + r0, rows, o.0, n, r0, vnni) }
        });
    }
    let base = expert * n;
    macro_rules! job {
        ($s:expr, $b:expr) => {
            go(Q4Job { words, scales: $s, biases: $b, k, group_size: gs, tokens, x: &qx, xsums: &xsums }, base, n, ptr, vnni, parallel)
        };
    }
    match (scales, biases) {
        (Scales::BF16(s), Scales::BF16(b)) => job!(s.as_slice(), b.as_slice()),
        (Scales::F16(s), Scales::F16(b)) => job!(s.as_slice(), b.as_slice()),
        (Scales::F32(s), Scales::F32(b)) => job!(s.as_slice(), b.as_slice()),
        _ => return None,
    }
    Some(out)
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
pub fn matmul(x: &[f32], tokens: usize, w: &CpuWeight, expert: usize, mode: MatmulMode, parallel: bool) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if mode == MatmulMode::Int8 {
        if let Some(out) = crate::q8::kernel().and_then(|vnni| matmul_q8(x, tokens, w, expert, vnni, parallel)) {
            return out;
        }
    }
    let _ = mode;
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
    let fused = tokens == 1 || matches!(w.store, Store::F32(_));
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
    use std::borrow::Cow;

    fn quantized(bits: u32, group: usize, rows: usize, cols: usize) -> HostMatrix<'static> {
        let per_word = 32 / bits as usize;
        let mut words = Vec::new();
        let mut state = 12345u32;
        for _ in 0..rows * cols / per_word {
            state = state.wrapping_mul(1664525).wrapping_add(1013904223);
            words.extend_from_slice(&state.to_le_bytes());
        }
        let groups = rows * cols / group;
        let scales: Vec<u8> =
            (0..groups).flat_map(|i| (0.01f32 * (1 + i % 7) as f32).to_le_bytes()).collect();
        let biases: Vec<u8> =
            (0..groups).flat_map(|i| (-0.05f32 + 0.01 * (i % 5) as f32).to_le_bytes()).collect();
        HostMatrix {
            experts: 1,
            rows,
            cols,
            data: MatrixData::Affine {
                bits,
                group_size: group,
                words: Cow::Owned(words),
                scale_dtype: DType::F32,
                scales: Cow::Owned(scales),
                biases: Cow::Owned(biases),
            },
        }
    }

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
        if crate::q8::kernel().is_none() {
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
                let exact = matmul(&x, tokens, &w, 0, MatmulMode::Exact, true);
                for &vnni in &kernels {
                    let got = matmul_q8(&x, tokens, &w, 0, vnni, true).unwrap();
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
        if crate::q8::kernel().is_none() {
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
                let all = matmul_q8(&x, tokens, &w, 0, vnni, true).unwrap();
                for t in [0, 1, 5, 63, 64, 69] {
                    let one = matmul_q8(&x[t * cols..(t + 1) * cols], 1, &w, 0, vnni, true).unwrap();
                    assert_eq!(&all[t * rows..(t + 1) * rows], &one[..], "group {group} vnni {vnni} token {t}");
                }
            }
        }
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
                let got = matmul(&x, tokens, &w, 0, MatmulMode::Exact, true);
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
