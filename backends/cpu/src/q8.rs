//! Int8 activations for 4-bit MLX-affine weights (the default CPU matmul for
//! 4-bit weights; `MatmulMode::Exact` (`CpuBackend::exact()`) keeps the f32
//! path).
//!
//! MLX affine 4-bit stores, per row and group of G inputs, nibbles q in 0..15
//! (element i of a u32 word at bits 4i) and a scale s and bias b: w = s*q + b.
//! So `dot(w, x) = sum_g s_g * sum_{i in g} q_i x_i + b_g * sum_{i in g} x_i`.
//! The bias term uses exact f32 group sums of x. For the first term, x is
//! quantized per block of 32 to int8 (x_i ≈ d_blk * xq_i, d_blk = max|x|/127,
//! as llama.cpp's Q8_0), and `sum q_i xq_i` is an integer dot product of
//! unsigned nibbles with signed bytes: `vpdpbusd` (AVX-512 VNNI) or
//! `vpmaddubsw` + `vpmaddwd` (AVX2).
//!
//! Layout trick: 32 bytes of weights are 64 elements, byte m holding element
//! 2m (low nibble) and 2m+1 (high nibble). Instead of interleaving the nibbles
//! we store each 64-element chunk of quantized x as [x_0, x_2, .., x_62,
//! x_1, x_3, .., x_63], so `low nibbles · first half + high nibbles · second
//! half` is the chunk's dot product, and i32 lanes 0-3 hold block 0 (elements
//! 0..32), lanes 4-7 block 1 (elements 32..64): one f32 multiply by
//! [d0 x4, d1 x4] applies the block scales.
//!
//! The error is that of rounding x to 8 bits per block: relative error of a
//! dot product ~1e-3 (see the `int8_matches_exact_within_tolerance` test).

#![cfg(target_arch = "x86_64")]

use half::{bf16, f16};
use rayon::prelude::*;
use std::arch::x86_64::*;

use crate::weight::{CpuWeight, Scales, Store};

mod wide;

/// `tokens` activation rows quantized to int8 in the chunk order above.
pub struct QuantizedX {
    /// `[tokens, k]`, each 64-element chunk as evens then odds.
    pub q: Vec<i8>,
    /// `[tokens, k/64, 8]`: per chunk, the scale of block 0 four times, then block 1's.
    pub d8: Vec<f32>,
}

/// Whether the int8 kernels can run here (AVX2 at least).
pub fn available() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

pub fn has_vnni() -> bool {
    std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512f")
}

#[cfg(test)]
fn quantize_into(x: &[f32], q: &mut [i8], d8: &mut [f32]) {
    for ((xc, qc), dc) in x.chunks_exact(64).zip(q.chunks_exact_mut(64)).zip(d8.chunks_exact_mut(8)) {
        let mut inv = [0.0f32; 2];
        for b in 0..2 {
            let amax = xc[32 * b..32 * b + 32].iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            inv[b] = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            dc[4 * b..4 * b + 4].fill(d);
        }
        let (qe, qo) = qc.split_at_mut(32);
        for j in 0..32 {
            let s = inv[j / 16];
            qe[j] = (xc[2 * j] * s).round_ties_even() as i8;
            qo[j] = (xc[2 * j + 1] * s).round_ties_even() as i8;
        }
    }
}

/// Even (`EVEN`) or odd elements of the 16 i32s `a, b`, in order.
#[inline(always)]
unsafe fn pick<const EVEN: bool>(a: __m256i, b: __m256i) -> __m256i {
    let (a, b) = (_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
    // Per 128-bit lane: [a0, a2, b0, b2] (or odds); then quads reordered.
    let s = if EVEN { _mm256_shuffle_ps::<0b10_00_10_00>(a, b) } else { _mm256_shuffle_ps::<0b11_01_11_01>(a, b) };
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_castps_si256(s))
}

/// 16 i32s (`a` then `b`, each within i8 range) as 16 bytes, in order.
#[inline(always)]
unsafe fn narrow(a: __m256i, b: __m256i) -> __m128i {
    let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
    _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w))
}

/// `quantize_into` with AVX2: the same values (max is exact; `cvtps` rounds
/// to nearest even like `round_ties_even`; packing saturates like `as i8`).
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(x: &[f32], q: &mut [i8], d8: &mut [f32]) {
    assert!(x.len() % 64 == 0 && q.len() >= x.len() && d8.len() >= x.len() / 8);
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for c in 0..x.len() / 64 {
        let xp = x.as_ptr().add(64 * c);
        let qp = q.as_mut_ptr().add(64 * c);
        for b in 0..2 {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xp.add(32 * b + 8 * i)));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            d8[8 * c + 4 * b..8 * c + 4 * b + 4].fill(d);
            let s = _mm256_set1_ps(inv);
            let i: [__m256i; 4] = std::array::from_fn(|j| _mm256_cvtps_epi32(_mm256_mul_ps(v[j], s)));
            let e = narrow(pick::<true>(i[0], i[1]), pick::<true>(i[2], i[3]));
            let o = narrow(pick::<false>(i[0], i[1]), pick::<false>(i[2], i[3]));
            _mm_storeu_si128(qp.add(16 * b) as *mut __m128i, e);
            _mm_storeu_si128(qp.add(32 + 16 * b) as *mut __m128i, o);
        }
    }
}

/// Quantizes `[tokens, k]` activations (`k` a multiple of 64).
pub fn quantize(x: &[f32], tokens: usize, k: usize) -> QuantizedX {
    debug_assert!(k % 64 == 0 && x.len() == tokens * k);
    let mut q = vec![0i8; tokens * k];
    let mut d8 = vec![0.0f32; tokens * k / 8];
    // SAFETY: callers only reach here when `available()` holds.
    unsafe { quantize_avx2(x, &mut q, &mut d8) };
    QuantizedX { q, d8 }
}

/// Group scales or biases widened to f32 one at a time.
pub trait ScaleRead: Sync {
    fn get(&self, i: usize) -> f32;
}

impl ScaleRead for [f32] {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self[i]
    }
}

impl ScaleRead for [bf16] {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        f32::from_bits((self[i].to_bits() as u32) << 16)
    }
}

impl ScaleRead for [f16] {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self[i].to_f32()
    }
}

/// Integer dot product of 32 low and 32 high nibbles with 64 int8s: i32 lane L
/// sums bytes 4L..4L+4 of both halves.
trait IDot {
    /// The kernel takes 512-bit registers ([`Q4Job::tile512`]) instead.
    const WIDE: bool = false;
    unsafe fn dot(lo: __m256i, hi: __m256i, xe: __m256i, xo: __m256i) -> __m256i;
}

struct Vnni;
impl IDot for Vnni {
    const WIDE: bool = true;
    #[inline(always)]
    unsafe fn dot(lo: __m256i, hi: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo)
    }
}

struct Avx2;
impl IDot for Avx2 {
    #[inline(always)]
    unsafe fn dot(lo: __m256i, hi: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
        // |15*127*2| * 2 = 7620 fits i16: no saturation.
        let s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
        _mm256_madd_epi16(s16, _mm256_set1_epi16(1))
    }
}

/// One 4-bit matmul: rows of `words` (global row indices) against quantized x.
pub struct Q4Job<'a, S: ScaleRead + ?Sized> {
    pub words: &'a [u32],
    pub scales: &'a S,
    pub biases: &'a S,
    pub k: usize,
    pub group_size: usize,
    pub tokens: usize,
    pub x: &'a QuantizedX,
    /// `[tokens, k / group_size]` exact f32 sums of x per group.
    pub xsums: &'a [f32],
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Prefetches the weights `PF_BLOCKS` row blocks ahead: a block of `block`
/// bytes is read in `block / 128` chunk steps, two cache lines per step.
#[inline(always)]
unsafe fn prefetch(wb: *const u8, block: usize, c: usize) {
    let p = wb.wrapping_add(PF_BLOCKS * block + 128 * c);
    _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64) as *const i8);
}

const PF_BLOCKS: usize = 2;

/// Where a register tile's weights and inputs start ([`Q4Job::tile_at`]).
struct TileAt {
    k: usize,
    chunks: usize,
    row_bytes: usize,
    wb: *const u8,
    qx: *const i8,
    d8: *const f32,
}

/// Tokens per outer block: their int8 activations (`TOKEN_BLOCK * k` bytes)
/// stay in L2 while every row block of the task streams past them.
const TOKEN_BLOCK: usize = 64;

/// `sum_g b[g] * xs[g]`, eight lanes at a time (fixed order: the result for a
/// token never depends on which tile or call it was computed in).
#[inline(always)]
unsafe fn bias_dot(b: *const f32, xs: *const f32, groups: usize) -> f32 {
    let mut v = _mm256_setzero_ps();
    let mut g = 0;
    while g + 8 <= groups {
        v = _mm256_fmadd_ps(_mm256_loadu_ps(b.add(g)), _mm256_loadu_ps(xs.add(g)), v);
        g += 8;
    }
    let mut s = hsum(v);
    while g < groups {
        s += *b.add(g) * *xs.add(g);
        g += 1;
    }
    s
}

impl<S: ScaleRead + ?Sized> Q4Job<'_, S> {
    /// A register tile: `R` consecutive rows from `row0` against `T` tokens
    /// from `t0`. Each 64-element weight chunk is loaded and unpacked once
    /// and used for all `T` tokens. `bf` holds the `R` rows' biases as f32
    /// (`[R, groups]`). Output (row `i`, token `t`) goes to
    /// `out[t * ld + col0 + i]`. The arithmetic for one (row, token) is the
    /// same whatever `T` is. A wide kernel runs [`Q4Job::tile512`] instead.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const T: usize, const PRE: bool, D: IDot>(
        &self,
        row0: usize,
        t0: usize,
        bf: &[f32],
        sv8: &[f32],
        out: *mut f32,
        ld: usize,
        col0: usize,
    ) {
        if D::WIDE {
            return self.tile512::<R, T, PRE>(row0, t0, bf, sv8, out, ld, col0);
        }
        let TileAt { k, chunks, row_bytes, wb, qx, d8 } = self.tile_at::<R, T, PRE>(row0, t0, bf, sv8);
        let mask = _mm256_set1_epi8(0x0F);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let svp = sv8.as_ptr();
        for c in 0..chunks {
            prefetch(wb, R * row_bytes, c);
            let mut lo = [_mm256_setzero_si256(); R];
            let mut hi = [_mm256_setzero_si256(); R];
            let mut sv = [_mm256_setzero_ps(); R];
            for r in 0..R {
                let wv = _mm256_loadu_si256(wb.add(r * row_bytes + 32 * c) as *const __m256i);
                lo[r] = _mm256_and_si256(wv, mask);
                hi[r] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
                sv[r] = if PRE {
                    _mm256_loadu_ps(svp.add((r * chunks + c) * 8))
                } else {
                    let (s0, s1) = self.chunk_scales(row0 + r, c);
                    if self.group_size % 64 == 0 {
                        _mm256_set1_ps(s0)
                    } else {
                        _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0))
                    }
                };
            }
            for j in 0..T {
                let xe = _mm256_loadu_si256(qx.add(j * k + 64 * c) as *const __m256i);
                let xo = _mm256_loadu_si256(qx.add(j * k + 64 * c + 32) as *const __m256i);
                let dx = _mm256_loadu_ps(d8.add(j * k / 8 + 8 * c));
                for r in 0..R {
                    let isum = D::dot(lo[r], hi[r], xe, xo);
                    acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), dx), sv[r], acc[r][j]);
                }
            }
        }
        self.tile_store::<R, T>(t0, bf, out, ld, col0, |r, j| hsum(acc[r][j]));
    }

    /// Where a tile's weights and inputs start (bounds checked in debug builds).
    #[inline(always)]
    unsafe fn tile_at<const R: usize, const T: usize, const PRE: bool>(&self, row0: usize, t0: usize, bf: &[f32], sv8: &[f32]) -> TileAt {
        let k = self.k;
        let row_bytes = k / 2;
        debug_assert!((row0 + R) * k / 8 <= self.words.len());
        debug_assert!(t0 + T <= self.tokens);
        debug_assert!((!PRE || sv8.len() >= R * k / 8) && bf.len() >= R * (k / self.group_size));
        TileAt {
            k,
            chunks: k / 64,
            row_bytes,
            wb: (self.words.as_ptr() as *const u8).add(row0 * row_bytes),
            qx: self.x.q.as_ptr().add(t0 * k),
            d8: self.x.d8.as_ptr().add(t0 * k / 8),
        }
    }

    /// The scales of chunk `c`'s two 32-blocks in global row `row`.
    #[inline(always)]
    fn chunk_scales(&self, row: usize, c: usize) -> (f32, f32) {
        let gs = self.group_size;
        let gi = row * (self.k / gs);
        if gs % 64 == 0 {
            // Both 32-blocks of the chunk in one group (no division: group
            // sizes are powers of two).
            let g = if gs.is_power_of_two() { (64 * c) >> gs.trailing_zeros() } else { 64 * c / gs };
            let s = self.scales.get(gi + g);
            (s, s)
        } else {
            (self.scales.get(gi + 64 * c / gs), self.scales.get(gi + (64 * c + 32) / gs))
        }
    }

    /// Writes a tile's outputs: `sum(r, j)` (row `r`, token `t0 + j`) plus
    /// the row's biases times the token's group sums.
    #[inline(always)]
    unsafe fn tile_store<const R: usize, const T: usize>(&self, t0: usize, bf: &[f32], out: *mut f32, ld: usize, col0: usize, sum: impl Fn(usize, usize) -> f32) {
        let groups = self.k / self.group_size;
        for r in 0..R {
            for j in 0..T {
                let xs = self.xsums.as_ptr().add((t0 + j) * groups);
                let b = bias_dot(bf.as_ptr().add(r * groups), xs, groups);
                *out.add((t0 + j) * ld + col0 + r) = sum(r, j) + b;
            }
        }
    }

    /// Rows `row0 .. row0 + R` against tokens `tb..te`, `T` at a time.
    #[inline(always)]
    unsafe fn row_block<const R: usize, const T: usize, D: IDot>(
        &self,
        row0: usize,
        tb: usize,
        te: usize,
        bf: &mut [f32],
        sv8: &mut [f32],
        out: *mut f32,
        ld: usize,
        col0: usize,
    ) {
        let (k, gs) = (self.k, self.group_size);
        let groups = k / gs;
        let chunks = k / 64;
        let pre = te - tb >= 2;
        assert!((!pre || sv8.len() >= R * chunks * 8) && bf.len() >= R * groups);
        for r in 0..R {
            for g in 0..groups {
                bf[r * groups + g] = self.biases.get((row0 + r) * groups + g);
            }
            // Per 64-element chunk the scales of its two 32-blocks, 4 lanes each.
            // With several tokens, each chunk's scale vector is built once
            // here rather than once per token tile.
            if pre {
                let gi = (row0 + r) * groups;
                for c in 0..chunks {
                    let (s0, s1) = (self.scales.get(gi + 64 * c / gs), self.scales.get(gi + (64 * c + 32) / gs));
                    let v = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
                    _mm256_storeu_ps(sv8.as_mut_ptr().add((r * chunks + c) * 8), v);
                }
            }
        }
        let mut t = tb;
        if !pre {
            while t < te {
                self.tile::<R, 1, false, D>(row0, t, bf, sv8, out, ld, col0);
                t += 1;
            }
            return;
        }
        while t + T <= te {
            self.tile::<R, T, true, D>(row0, t, bf, sv8, out, ld, col0);
            t += T;
        }
        // The rest in one tile where it can be (a batched decode step's
        // expert often has 2 or 3 rows): its weights unpacked once for all.
        match te - t {
            3 if T > 3 => self.tile::<R, 3, true, D>(row0, t, bf, sv8, out, ld, col0),
            2 if T > 2 => self.tile::<R, 2, true, D>(row0, t, bf, sv8, out, ld, col0),
            _ => {
                while t < te {
                    self.tile::<R, 1, true, D>(row0, t, bf, sv8, out, ld, col0);
                    t += 1;
                }
            }
        }
    }

    /// Rows `row0..row0 + n` against every token; output (row `row0 + i`,
    /// token `t`) goes to `out[t * ld + col0 + i]`.
    #[inline(always)]
    unsafe fn run<const T: usize, D: IDot>(&self, row0: usize, n: usize, out: *mut f32, ld: usize, col0: usize) {
        const R: usize = 4;
        let tokens = self.tokens;
        let groups = self.k / self.group_size;
        let mut bf = vec![0.0f32; R * groups];
        let mut sv8 = vec![0.0f32; R * self.k / 8];
        let mut tb = 0;
        while tb < tokens {
            let te = (tb + TOKEN_BLOCK).min(tokens);
            let mut i = 0;
            while i + R <= n {
                self.row_block::<R, T, D>(row0 + i, tb, te, &mut bf, &mut sv8, out, ld, col0 + i);
                i += R;
            }
            while i < n {
                self.row_block::<1, T, D>(row0 + i, tb, te, &mut bf, &mut sv8, out, ld, col0 + i);
                i += 1;
            }
            tb = te;
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    unsafe fn run_vnni(&self, row0: usize, n: usize, out: *mut f32, ld: usize, col0: usize) {
        self.run::<4, Vnni>(row0, n, out, ld, col0)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, row0: usize, n: usize, out: *mut f32, ld: usize, col0: usize) {
        self.run::<2, Avx2>(row0, n, out, ld, col0)
    }

    /// Rows `row0..row0 + n` (global indices) against every token, with the
    /// best kernel this CPU has. Output (row `row0 + i`, token `t`) goes to
    /// `out[t * ld + col0 + i]`.
    ///
    /// # Safety
    /// `out` must be valid for writes at every such index, and no other
    /// thread may write those elements meanwhile.
    pub unsafe fn rows_into(&self, row0: usize, n: usize, out: *mut f32, ld: usize, col0: usize, vnni: bool) {
        assert!(self.k % 64 == 0 && self.group_size % 32 == 0);
        assert!((row0 + n) * self.k / 8 <= self.words.len());
        assert!(self.x.q.len() >= self.tokens * self.k && self.xsums.len() >= self.tokens * (self.k / self.group_size));
        assert!(col0 + n <= ld);
        // SAFETY: features checked when the backend was built (`MatmulPlan::new`:
        // `available()`, and `has_vnni()` for VNNI); bounds asserted above.
        if vnni {
            self.run_vnni(row0, n, out, ld, col0)
        } else {
            self.run_avx2(row0, n, out, ld, col0)
        }
    }
}

/// Splits `n` rows into tasks of whole multiples of `align` rows and runs
/// `f(row0, rows)` on each, in parallel when the matrix is large enough to pay
/// for waking the thread pool.
fn par_row_ranges(n: usize, tokens: usize, row_bytes: usize, align: usize, serial_bytes: usize, parallel: bool, f: impl Fn(usize, usize) + Sync) {
    let threads = rayon::current_num_threads().max(1);
    let total = n * row_bytes * tokens.max(1);
    if !parallel || threads == 1 || total < serial_bytes {
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
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used for writes to disjoint elements (one row range per task).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

const TASKS_PER_THREAD: usize = 4;
const MIN_TASK_BYTES: usize = 16 << 10;

/// The int8-activation path for 4-bit affine weights, when it applies.
///
/// `vnni` picks the kernel; matrices below `serial_bytes` weight bytes (times
/// tokens) run on the calling thread.
pub(crate) fn matmul_q8(
    x: &[f32],
    tokens: usize,
    w: &CpuWeight,
    expert: usize,
    vnni: bool,
    serial_bytes: usize,
    parallel: bool,
) -> Option<Vec<f32>> {
    let Store::Affine { bits: 4, group_size, words, scales, biases } = &w.store else { return None };
    let (n, k, gs) = (w.rows, w.cols, *group_size);
    if k % 64 != 0 || gs % 32 != 0 {
        return None;
    }
    let qx = quantize(x, tokens, k);
    let xsums: Vec<f32> = x.chunks_exact(gs).map(|c| c.iter().sum()).collect();
    let mut out = vec![0.0f32; tokens * n];
    let ptr = OutPtr(out.as_mut_ptr());
    fn go<S: ScaleRead + ?Sized>(job: Q4Job<'_, S>, base: usize, n: usize, out: OutPtr, vnni: bool, serial: usize, parallel: bool) {
        par_row_ranges(n, job.tokens, job.k / 2, 4, serial, parallel, |r0, rows| {
            let o = out;
            // SAFETY: `out` is `[tokens, n]`; each task writes only columns
            // `r0..r0 + rows`, disjoint from every other task's.
            unsafe { job.rows_into(base + r0, rows, o.0, n, r0, vnni) }
        });
    }
    let base = expert * n;
    macro_rules! job {
        ($s:expr, $b:expr) => {
            go(Q4Job { words, scales: $s, biases: $b, k, group_size: gs, tokens, x: &qx, xsums: &xsums }, base, n, ptr, vnni, serial_bytes, parallel)
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

#[cfg(test)]
mod tests {
    #[test]
    fn quantize_avx2_matches_scalar() {
        if !super::available() {
            return;
        }
        let k = 256;
        let x: Vec<f32> = (0..3 * k).map(|i| (((i * 7919) % 113) as f32 / 113.0 - 0.5) * if i % 97 == 0 { 8.0 } else { 1.0 }).collect();
        let mut x = x;
        x[64..96].fill(0.0);
        let (mut q1, mut d1) = (vec![0i8; x.len()], vec![0.0f32; x.len() / 8]);
        let (mut q2, mut d2) = (q1.clone(), d1.clone());
        super::quantize_into(&x, &mut q1, &mut d1);
        unsafe { super::quantize_avx2(&x, &mut q2, &mut d2) };
        assert_eq!(q1, q2);
        assert_eq!(d1, d2);
    }
}
