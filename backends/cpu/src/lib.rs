//! The CPU backend: every op of [`slotstream_backend::Backend`] in plain Rust,
//! f32 activations and accumulation, threads from rayon. It is the reference the
//! GPU backend is checked against and the fallback on machines without a GPU.
//!
//! By default ([`CpuBackend::new`]) 4-bit affine weights are multiplied by
//! int8-quantized activations (integer dot products, `q8.rs`; ~1e-3 relative
//! error); [`CpuBackend::exact`] or `SLOTSTREAM_CPU_MATMUL=exact` keeps f32
//! activations everywhere, which the oracle parity tests use.

mod delta;
mod matmul;
mod q8;

use std::sync::Arc;

use rayon::prelude::*;
use slotstream_backend::{
    shape_error, Backend, BackendError, ExpertAssignment, ExpertLayout, ExpertPool, GateAct, HostExpert,
    HostMatrix, KeySelection, Result, State, Tensor, Weight,
};

pub use matmul::{CpuWeight, MatmulMode, Store};

/// Multi-threaded CPU implementation of the backend trait.
pub struct CpuBackend {
    mode: MatmulMode,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The fast backend: 4-bit affine weights use int8 activations
    /// ([`MatmulMode::Int8`]). `SLOTSTREAM_CPU_MATMUL=exact` in the environment
    /// selects [`CpuBackend::exact`] instead.
    pub fn new() -> Self {
        match std::env::var("SLOTSTREAM_CPU_MATMUL").as_deref() {
            Ok("exact") => CpuBackend::exact(),
            _ => CpuBackend::with_mode(MatmulMode::Int8),
        }
    }

    /// f32 activations everywhere: the reference the parity tests compare with
    /// the oracle at 1e-4 relative L2.
    pub fn exact() -> Self {
        CpuBackend::with_mode(MatmulMode::Exact)
    }

    pub fn with_mode(mode: MatmulMode) -> Self {
        CpuBackend { mode }
    }

    pub fn mode(&self) -> MatmulMode {
        self.mode
    }
}

type Buf = Vec<f32>;

/// Work (about one multiply-add per unit) below which an op runs on the
/// calling thread: a round trip through the thread pool costs ~10-20 µs, more
/// than a decode step's norms or short-context attention take.
const PAR_WORK: usize = 1 << 16;

/// `f(index, piece)` over `size`-long pieces of `out`, on the thread pool only
/// when `work` is large enough to pay for it.
fn for_each_piece(out: &mut [f32], size: usize, work: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if work < PAR_WORK || rayon::current_num_threads() == 1 {
        out.chunks_mut(size).enumerate().for_each(|(i, c)| f(i, c));
    } else {
        out.par_chunks_mut(size).enumerate().for_each(|(i, c)| f(i, c));
    }
}

fn data(t: &Tensor) -> Result<&[f32]> {
    t.buffer::<Buf>()
        .map(|v| v.as_slice())
        .ok_or_else(|| BackendError::Device("tensor does not belong to the CPU backend".into()))
}

fn weight(w: &Weight) -> Result<&CpuWeight> {
    w.buffer::<CpuWeight>()
        .ok_or_else(|| BackendError::Device("weight does not belong to the CPU backend".into()))
}

fn tensor(v: Vec<f32>, shape: Vec<usize>) -> Tensor {
    Tensor::from_buffer(Arc::new(v), shape)
}

fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(shape_error(op, format!("{:?} vs {:?}", a.shape(), b.shape())));
    }
    Ok(())
}

fn groups_of(op: &'static str, x: &Tensor, dim: usize) -> Result<()> {
    if dim == 0 || x.numel() % dim != 0 {
        return Err(shape_error(op, format!("{:?} is not a whole number of groups of {dim}", x.shape())));
    }
    Ok(())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

fn softplus(x: f32) -> f32 {
    // log(1 + e^x) without overflow for large x.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Keys and values of one attention layer, `[positions, kv_heads*head_dim]`.
pub struct KvCache {
    kv_heads: usize,
    head_dim: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl KvCache {
    fn len(&self) -> usize {
        self.keys.len() / (self.kv_heads * self.head_dim)
    }
}

/// One query head's attention over the visible keys and values: positions
/// `0..visible`, or only those listed in `only` (QSA).
struct AttnHead<'a> {
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    stride: usize,
    offset: usize,
    visible: usize,
    only: Option<&'a [usize]>,
    scale: f32,
}

impl AttnHead<'_> {
    #[inline(always)]
    fn run(&self, o: &mut [f32]) {
        let hd = self.q.len();
        let at = |m: &[f32], j: usize| -> std::ops::Range<usize> {
            let _ = m;
            j * self.stride + self.offset..j * self.stride + self.offset + hd
        };
        let key = |n: usize| self.only.map_or(n, |o| o[n]);
        let count = self.only.map_or(self.visible, |o| o.len());
        let mut scores: Vec<f32> =
            (0..count).map(|n| matmul::dot(self.q, &self.keys[at(self.keys, key(n))]) * self.scale).collect();
        let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let inv = 1.0 / total;
        for (n, s) in scores.iter().enumerate() {
            let w = s * inv;
            let vv = &self.values[at(self.values, key(n))];
            o.iter_mut().zip(vv).for_each(|(o, v)| *o += w * v);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, o: &mut [f32]) {
        self.run(o)
    }
}

/// The query heads that share one KV head, at one token: they see the same
/// keys, so each key and value row is loaded once for all of them. Per query
/// the arithmetic is the same however many are batched together.
#[cfg(target_arch = "x86_64")]
struct AttnGroup<'a> {
    /// `[heads_in_group, hd]` queries.
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    stride: usize,
    offset: usize,
    visible: usize,
    only: Option<&'a [usize]>,
    scale: f32,
    hd: usize,
    /// This KV head's keys transposed in blocks of 8 positions,
    /// `[blocks, hd, 8]` (zero-padded), when every visible key is used.
    kt: Option<&'a [f32]>,
}

/// `e^x` for eight lanes (Cephes' `expf`: range reduction by ln 2 in two
/// parts, degree-5 polynomial; relative error ~1e-7). Inputs below -87.3
/// give ~1e-38 instead of underflowing to 0.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.3));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4), r);
    let mut y = _mm256_set1_ps(1.9875691500e-4);
    for c in [1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    let p = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(y, _mm256_castsi256_ps(p))
}

/// In-place softmax of one query's scores, eight lanes at a time.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn softmax_avx2(sc: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = sc.len();
    let p = sc.as_mut_ptr();
    let full = n / 8 * 8;
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < full {
        mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
    let max = lanes.iter().chain(&sc[full..]).cloned().fold(f32::NEG_INFINITY, f32::max);
    let m = _mm256_set1_ps(max);
    let mut tv = _mm256_setzero_ps();
    let mut i = 0;
    while i < full {
        let e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
        _mm256_storeu_ps(p.add(i), e);
        tv = _mm256_add_ps(tv, e);
        i += 8;
    }
    let mut tail = [max; 8];
    tail[..n - full].copy_from_slice(&sc[full..]);
    let e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), m));
    _mm256_storeu_ps(tail.as_mut_ptr(), e);
    sc[full..].copy_from_slice(&tail[..n - full]);
    _mm256_storeu_ps(lanes.as_mut_ptr(), tv);
    let total: f32 = lanes.iter().sum::<f32>() + tail[..n - full].iter().sum::<f32>();
    let inv = _mm256_set1_ps(1.0 / total);
    let mut i = 0;
    while i < full {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
        i += 8;
    }
    let inv = 1.0 / total;
    for s in &mut sc[full..] {
        *s *= inv;
    }
}

/// Keys of KV head `g` (`[positions, stride]` at `offset`) transposed into
/// blocks of 8 positions: `[ceil(positions / 8), hd, 8]`, zero-padded.
#[cfg(target_arch = "x86_64")]
fn transpose_keys(keys: &[f32], positions: usize, stride: usize, offset: usize, hd: usize) -> Vec<f32> {
    let blocks = positions.div_ceil(8);
    let mut kt = vec![0.0f32; blocks * hd * 8];
    for p in 0..positions {
        let (b, l) = (p / 8, p % 8);
        let row = &keys[p * stride + offset..p * stride + offset + hd];
        for (d, v) in row.iter().enumerate() {
            kt[(b * hd + d) * 8 + l] = *v;
        }
    }
    kt
}

#[cfg(target_arch = "x86_64")]
impl AttnGroup<'_> {
    /// Scores of queries `q0..q0 + Q` against every visible key from the
    /// transposed keys: each lane (key) is one FMA chain over `d`, the same
    /// whatever `Q` or the block pairing. `scores` is `[Q, blocks * 8]`.
    #[inline(always)]
    unsafe fn scores_t<const Q: usize>(&self, kt: &[f32], q0: usize, count: usize, scores: &mut [f32]) {
        use std::arch::x86_64::*;
        let hd = self.hd;
        let blocks = count.div_ceil(8);
        let cpad = blocks * 8;
        assert!(kt.len() >= blocks * hd * 8 && scores.len() >= Q * cpad && self.q.len() >= (q0 + Q) * hd);
        let qp = self.q.as_ptr().add(q0 * hd);
        let kp = kt.as_ptr();
        let sp = scores.as_mut_ptr();
        let scale = _mm256_set1_ps(self.scale);
        let mut b = 0;
        while b + 2 <= blocks {
            let mut acc = [[_mm256_setzero_ps(); 2]; Q];
            let (k0p, k1p) = (kp.add(b * hd * 8), kp.add((b + 1) * hd * 8));
            for d in 0..hd {
                let k0 = _mm256_loadu_ps(k0p.add(d * 8));
                let k1 = _mm256_loadu_ps(k1p.add(d * 8));
                for (i, a) in acc.iter_mut().enumerate() {
                    let qb = _mm256_set1_ps(*qp.add(i * hd + d));
                    a[0] = _mm256_fmadd_ps(qb, k0, a[0]);
                    a[1] = _mm256_fmadd_ps(qb, k1, a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(sp.add(i * cpad + b * 8), _mm256_mul_ps(a[0], scale));
                _mm256_storeu_ps(sp.add(i * cpad + b * 8 + 8), _mm256_mul_ps(a[1], scale));
            }
            b += 2;
        }
        if b < blocks {
            let mut acc = [_mm256_setzero_ps(); Q];
            let k0p = kp.add(b * hd * 8);
            for d in 0..hd {
                let k0 = _mm256_loadu_ps(k0p.add(d * 8));
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(*qp.add(i * hd + d)), k0, *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(sp.add(i * cpad + b * 8), _mm256_mul_ps(*a, scale));
            }
        }
    }

    /// `o[i] = sum_n p[i][n] * v[n]` for `Q` queries (`p` rows `cpad` apart,
    /// already normalised), `DV` vectors of `hd` at a time held in registers.
    #[inline(always)]
    unsafe fn weighted_values<const Q: usize, const DV: usize>(&self, p: &[f32], cpad: usize, count: usize, o: &mut [f32]) {
        use std::arch::x86_64::*;
        let hd = self.hd;
        assert!(p.len() >= (Q - 1) * cpad + count && o.len() >= Q * hd && hd % (8 * DV) == 0);
        assert!(count == 0 || (count - 1) * self.stride + self.offset + hd <= self.values.len());
        let vp = self.values.as_ptr().add(self.offset);
        let pp = p.as_ptr();
        let op = o.as_mut_ptr();
        let mut d0 = 0;
        while d0 < hd {
            let mut acc = [[_mm256_setzero_ps(); DV]; Q];
            for n in 0..count {
                let vr = vp.add(n * self.stride + d0);
                // Rows `stride` apart: fetch ahead (a prefetch never faults).
                let ahead = vr.wrapping_add(16 * self.stride) as *const i8;
                for line in (0..DV * 32).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
                }
                let mut v = [_mm256_setzero_ps(); DV];
                for (j, vv) in v.iter_mut().enumerate() {
                    *vv = _mm256_loadu_ps(vr.add(8 * j));
                }
                for (i, a) in acc.iter_mut().enumerate() {
                    let w = _mm256_set1_ps(*pp.add(i * cpad + n));
                    for j in 0..DV {
                        a[j] = _mm256_fmadd_ps(w, v[j], a[j]);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                for j in 0..DV {
                    _mm256_storeu_ps(op.add(i * hd + d0 + 8 * j), a[j]);
                }
            }
            d0 += 8 * DV;
        }
    }

    /// Queries `q0..q0 + Q` over all visible keys via the transposed keys.
    #[inline(always)]
    unsafe fn run_t<const Q: usize>(&self, kt: &[f32], q0: usize, o: &mut [f32], scores: &mut Vec<f32>) {
        let count = self.visible;
        let cpad = count.div_ceil(8) * 8;
        scores.clear();
        scores.resize(Q * cpad, 0.0);
        self.scores_t::<Q>(kt, q0, count, scores);
        for sc in scores.chunks_exact_mut(cpad) {
            softmax_avx2(&mut sc[..count]);
        }
        if self.hd % 32 == 0 {
            // Two queries x 4 vectors = 8 accumulators at a time.
            let mut i = 0;
            while i + 2 <= Q {
                self.weighted_values::<2, 4>(&scores[i * cpad..], cpad, count, &mut o[i * self.hd..]);
                i += 2;
            }
            if i < Q {
                self.weighted_values::<1, 4>(&scores[i * cpad..], cpad, count, &mut o[i * self.hd..]);
            }
        } else {
            for i in 0..Q {
                self.weighted_values::<1, 1>(&scores[i * cpad..], cpad, count, &mut o[i * self.hd..]);
            }
        }
    }

    /// Queries `q0..q0 + Q` of the group into `o` (`[Q, hd]`, zeroed);
    /// `scores` is scratch.
    #[inline(always)]
    unsafe fn run_q<const Q: usize>(&self, q0: usize, o: &mut [f32], scores: &mut Vec<f32>) {
        use std::arch::x86_64::*;
        let hd = self.hd;
        let count = self.only.map_or(self.visible, |o| o.len());
        debug_assert!(hd % 8 == 0 && o.len() == Q * hd);
        assert!(self.q.len() >= (q0 + Q) * hd);
        scores.clear();
        scores.resize(Q * count, 0.0);
        let qp = self.q.as_ptr().add(q0 * hd);
        let row = |n: usize| self.only.map_or(n, |o| o[n]) * self.stride + self.offset;
        if let Some(only) = self.only {
            assert!(only.iter().all(|&j| j < self.visible));
        }
        assert!((self.visible - 1) * self.stride + self.offset + hd <= self.keys.len().min(self.values.len()));
        let kp = self.keys.as_ptr();
        // Rows are `stride` floats apart (KV heads interleaved), which the
        // hardware prefetcher follows poorly: fetch a few rows ahead.
        const AHEAD: usize = 16;
        let prefetch_row = |base: *const f32, n: usize| {
            if n < count {
                let r = base.wrapping_add(row(n)) as *const i8;
                for line in (0..hd * 4).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(line));
                }
            }
        };
        for n in 0..count {
            prefetch_row(kp, n + AHEAD);
            let kr = kp.add(row(n));
            let mut acc = [_mm256_setzero_ps(); Q];
            let mut d = 0;
            while d < hd {
                let kv = _mm256_loadu_ps(kr.add(d));
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i * hd + d)), kv, *a);
                }
                d += 8;
            }
            for (i, a) in acc.iter().enumerate() {
                let s = _mm_add_ps(_mm256_castps256_ps128(*a), _mm256_extractf128_ps(*a, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                scores[i * count + n] = _mm_cvtss_f32(s) * self.scale;
            }
        }
        let mut inv = [0.0f32; Q];
        for (i, sc) in scores.chunks_exact_mut(count).enumerate() {
            softmax_avx2(sc);
            inv[i] = 1.0;
        }
        if self.only.is_none() && hd % 32 == 0 {
            // Accumulators in registers: two queries x 32 dimensions at a time.
            let vp = self.values.as_ptr();
            for n in 0..AHEAD.min(count) {
                prefetch_row(vp, n);
            }
            let mut i = 0;
            while i + 2 <= Q {
                self.weighted_values::<2, 4>(&scores[i * count..], count, count, &mut o[i * hd..]);
                i += 2;
            }
            if i < Q {
                self.weighted_values::<1, 4>(&scores[i * count..], count, count, &mut o[i * hd..]);
            }
            return;
        }
        let vp = self.values.as_ptr();
        let op = o.as_mut_ptr();
        for n in 0..count {
            prefetch_row(vp, n + AHEAD);
            let vr = vp.add(row(n));
            let mut w = [_mm256_setzero_ps(); Q];
            for (i, wv) in w.iter_mut().enumerate() {
                *wv = _mm256_set1_ps(scores[i * count + n] * inv[i]);
            }
            let mut d = 0;
            while d < hd {
                let v = _mm256_loadu_ps(vr.add(d));
                for (i, wv) in w.iter().enumerate() {
                    let p = op.add(i * hd + d);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(*wv, v, _mm256_loadu_ps(p)));
                }
                d += 8;
            }
        }
    }

    /// Every query of the group into `o` (`[heads_in_group, hd]`, zeroed).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run(&self, o: &mut [f32]) {
        if self.only.map_or(self.visible, |keys| keys.len()) == 0 {
            // A query a key selection leaves with no keys attends to nothing.
            return;
        }
        let hd = self.hd;
        let n = self.q.len() / hd;
        let mut scores = Vec::new();
        let mut i = 0;
        if let Some(kt) = self.kt {
            while i + 4 <= n {
                self.run_t::<4>(kt, i, &mut o[i * hd..(i + 4) * hd], &mut scores);
                i += 4;
            }
            while i < n {
                self.run_t::<1>(kt, i, &mut o[i * hd..(i + 1) * hd], &mut scores);
                i += 1;
            }
            return;
        }
        while i + 4 <= n {
            self.run_q::<4>(i, &mut o[i * hd..(i + 4) * hd], &mut scores);
            i += 4;
        }
        while i < n {
            self.run_q::<1>(i, &mut o[i * hd..(i + 1) * hd], &mut scores);
            i += 1;
        }
    }
}

/// The last `(kernel-1)*dilation` inputs of a causal convolution, `[.., channels]`.
pub struct ConvState {
    channels: usize,
    kernel: usize,
    dilation: usize,
    window: Vec<f32>,
}

/// The CPU's expert slot pool: three stacked weights with one matrix per slot.
pub struct CpuExpertPool {
    gate: CpuWeight,
    up: CpuWeight,
    down: CpuWeight,
}

/// Gated DeltaNet matrix state, `[heads, value_dim, key_dim]`.
pub struct RecurrentState {
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    s: Vec<f32>,
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        let m = match self.mode {
            MatmulMode::Exact => "",
            MatmulMode::Int8 => ", int8 activations for 4-bit",
        };
        format!("cpu ({} threads{m})", rayon::current_num_threads())
    }

    fn upload(&self, values: &[f32], shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != values.len() {
            return Err(shape_error("upload", format!("{} values for shape {shape:?}", values.len())));
        }
        Ok(tensor(values.to_vec(), shape.to_vec()))
    }

    fn download(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(data(t)?.to_vec())
    }

    fn load_weight(&self, m: &HostMatrix<'_>) -> Result<Weight> {
        m.validate()?;
        let w = CpuWeight::from_host(m);
        let bytes = w.bytes();
        Ok(Weight::from_buffer(Arc::new(w), m.experts, m.rows, m.cols, bytes))
    }

    fn slice_cols(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let (rows, cols) = (x.rows(), x.cols());
        if start + len > cols {
            return Err(shape_error("slice_cols", format!("[{start}, {}) of {cols} columns", start + len)));
        }
        let src = data(x)?;
        let mut out = Vec::with_capacity(rows * len);
        for r in 0..rows {
            out.extend_from_slice(&src[r * cols + start..r * cols + start + len]);
        }
        Ok(tensor(out, vec![rows, len]))
    }

    fn slice_rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let (rows, cols) = (x.rows(), x.cols());
        if start + len > rows {
            return Err(shape_error("slice_rows", format!("[{start}, {}) of {rows} rows", start + len)));
        }
        Ok(tensor(data(x)?[start * cols..(start + len) * cols].to_vec(), vec![len, cols]))
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Result<Tensor> {
        let cols = parts.first().map(|t| t.cols()).unwrap_or(0);
        let mut out = Vec::new();
        for p in parts {
            if p.cols() != cols {
                return Err(shape_error("concat_rows", format!("{} vs {} columns", p.cols(), cols)));
            }
            out.extend_from_slice(data(p)?);
        }
        let rows = out.len() / cols.max(1);
        Ok(tensor(out, vec![rows, cols]))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        same_shape("add", a, b)?;
        let out = data(a)?.iter().zip(data(b)?).map(|(x, y)| x + y).collect();
        Ok(tensor(out, a.shape().to_vec()))
    }

    fn sigmoid_mul(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let (xs, gs) = (data(x)?, data(gate)?);
        let out = if gs.len() == xs.len() {
            xs.iter().zip(gs).map(|(v, g)| v * sigmoid(*g)).collect()
        } else if gs.len() == x.rows() {
            let cols = x.cols();
            xs.iter().enumerate().map(|(i, v)| v * sigmoid(gs[i / cols])).collect()
        } else {
            return Err(shape_error("sigmoid_mul", format!("x {:?}, gate {:?}", x.shape(), gate.shape())));
        };
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape("silu_mul", gate, up)?;
        let out = data(gate)?.iter().zip(data(up)?).map(|(g, u)| silu(*g) * u).collect();
        Ok(tensor(out, gate.shape().to_vec()))
    }

    fn add_sigmoid_mul(&self, y: &Tensor, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let gated = self.sigmoid_mul(x, gate)?;
        self.add(y, &gated)
    }

    fn silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(tensor(data(x)?.iter().map(|v| silu(*v)).collect(), x.shape().to_vec()))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        Ok(tensor(data(x)?.iter().map(|v| v * s).collect(), x.shape().to_vec()))
    }

    fn repeat_cols(&self, x: &Tensor, n: usize) -> Result<Tensor> {
        let d = x.cols();
        let out: Vec<f32> = data(x)?.chunks_exact(d.max(1)).flat_map(|row| (0..n).flat_map(move |_| row.iter().copied())).collect();
        Ok(tensor(out, vec![x.rows(), n * d]))
    }

    fn hc_mix(&self, normed: &Tensor, mix: &Tensor, streams: usize) -> Result<Tensor> {
        same_shape("hc_mix", normed, mix)?;
        if streams == 0 || normed.cols() % streams != 0 {
            return Err(shape_error("hc_mix", format!("{:?} is not {streams} streams", normed.shape())));
        }
        let (rows, d) = (normed.rows(), normed.cols() / streams);
        let (nd, md) = (data(normed)?, data(mix)?);
        let mut out = vec![0.0f32; rows * d];
        out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            for s in 0..streams {
                let base = r * streams * d + s * d;
                for (j, o) in o.iter_mut().enumerate() {
                    *o += sigmoid(md[base + j]) * nd[base + j];
                }
            }
            o.iter_mut().for_each(|v| *v /= streams as f32);
        });
        Ok(tensor(out, vec![rows, d]))
    }

    fn hc_inject(&self, h: &Tensor, x: &Tensor, logits: &Tensor, logit_scale: f32) -> Result<Tensor> {
        let (rows, streams, d) = (h.rows(), logits.cols(), x.cols());
        if x.rows() != rows || logits.rows() != rows || h.cols() != streams * d {
            return Err(shape_error("hc_inject", format!("h {:?}, x {:?}, logits {:?}", h.shape(), x.shape(), logits.shape())));
        }
        let (xd, ld) = (data(x)?, data(logits)?);
        let mut out = data(h)?.to_vec();
        out.par_chunks_mut(streams * d).enumerate().for_each(|(r, o)| {
            for (s, chunk) in o.chunks_exact_mut(d).enumerate() {
                let w = 2.0 * sigmoid(logit_scale * ld[r * streams + s]);
                chunk.iter_mut().zip(&xd[r * d..(r + 1) * d]).for_each(|(o, x)| *o += w * x);
            }
        });
        Ok(tensor(out, h.shape().to_vec()))
    }

    fn ple_gate(&self, key: &Tensor, query: &Tensor, value: &Tensor, streams: usize) -> Result<Tensor> {
        same_shape("ple_gate", key, query)?;
        let (rows, d) = (value.rows(), value.cols());
        if key.rows() != rows || key.cols() != streams * d {
            return Err(shape_error("ple_gate", format!("key {:?}, value {:?}, {streams} streams", key.shape(), value.shape())));
        }
        let (kd, qd, vd) = (data(key)?, data(query)?, data(value)?);
        let inv_sqrt_d = 1.0 / (d as f32).sqrt();
        let mut out = vec![0.0f32; rows * streams * d];
        out.par_chunks_mut(streams * d).enumerate().for_each(|(r, o)| {
            for (s, chunk) in o.chunks_exact_mut(d).enumerate() {
                let base = r * streams * d + s * d;
                let g = kd[base..base + d].iter().zip(&qd[base..base + d]).map(|(k, q)| k * q).sum::<f32>() * inv_sqrt_d;
                // sign(0) = 0, as in the reference (Rust's signum would give 1).
                let sign = if g > 0.0 { 1.0 } else if g < 0.0 { -1.0 } else { 0.0 };
                let g = sign * g.abs().max(1e-6).sqrt();
                let w = sigmoid(g);
                chunk.iter_mut().zip(&vd[r * d..(r + 1) * d]).for_each(|(o, v)| *o = w * v);
            }
        });
        Ok(tensor(out, vec![rows, streams * d]))
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        let w = weight(table)?;
        let mut out = vec![0.0f32; ids.len() * w.cols];
        for (row, &id) in out.chunks_exact_mut(w.cols).zip(ids) {
            if id as usize >= w.rows {
                return Err(shape_error("embed", format!("token id {id} >= vocabulary size {}", w.rows)));
            }
            w.dequant_row(id as usize, row);
        }
        Ok(tensor(out, vec![ids.len(), w.cols]))
    }

    fn matmul(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let cw = weight(w)?;
        if x.cols() != cw.cols || cw.experts != 1 {
            return Err(shape_error(
                "matmul",
                format!("x {:?} @ W[{} x {} x {}]^T", x.shape(), cw.experts, cw.rows, cw.cols),
            ));
        }
        let tokens = x.rows();
        Ok(tensor(matmul::matmul(data(x)?, tokens, cw, 0, self.mode, true), vec![tokens, cw.rows]))
    }

    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, dim: usize, eps: f32) -> Result<Tensor> {
        groups_of("rms_norm", x, dim)?;
        let wv = match w {
            Some(w) if w.numel() == dim || (w.numel() % dim == 0 && w.numel() == x.cols()) => Some(data(w)?),
            Some(w) => return Err(shape_error("rms_norm", format!("weight {:?} for groups of {dim} in rows of {}", w.shape(), x.cols()))),
            None => None,
        };
        let wlen = wv.map_or(dim, |w| w.len());
        let mut out = data(x)?.to_vec();
        let work = out.len();
        for_each_piece(&mut out, dim, work, |i, g| {
            let ms = g.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let r = 1.0 / (ms + eps).sqrt();
            match wv {
                Some(wv) => {
                    let start = (i * dim) % wlen;
                    g.iter_mut().zip(&wv[start..start + dim]).for_each(|(v, w)| *v = *v * r * w)
                }
                None => g.iter_mut().for_each(|v| *v *= r),
            }
        });
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn rms_norm_gated(&self, x: &Tensor, z: &Tensor, w: &Tensor, dim: usize, eps: f32, act: GateAct) -> Result<Tensor> {
        same_shape("rms_norm_gated", x, z)?;
        if w.numel() != dim {
            return Err(shape_error("rms_norm_gated", format!("weight {:?} for groups of {dim}", w.shape())));
        }
        let normed = self.rms_norm(x, Some(w), dim, eps)?;
        let gate = match act {
            GateAct::Silu => silu,
            GateAct::Sigmoid => sigmoid,
        };
        let out = data(&normed)?.iter().zip(data(z)?).map(|(n, z)| gate(*z) * n).collect();
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn l2_normalize(&self, x: &Tensor, dim: usize, eps: f32, scale: f32) -> Result<Tensor> {
        groups_of("l2_normalize", x, dim)?;
        let mut out = data(x)?.to_vec();
        let work = out.len();
        for_each_piece(&mut out, dim, work, |_, g| {
            let r = scale / (g.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
            g.iter_mut().for_each(|v| *v *= r);
        });
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn rope(&self, x: &Tensor, head_dim: usize, rotary_dim: usize, theta: f32, start_pos: usize) -> Result<Tensor> {
        groups_of("rope", x, head_dim)?;
        if rotary_dim > head_dim || rotary_dim % 2 != 0 {
            return Err(shape_error("rope", format!("rotary dim {rotary_dim} for head dim {head_dim}")));
        }
        let tokens = x.shape().first().copied().unwrap_or(0);
        let heads_per_token = x.numel() / head_dim / tokens.max(1);
        let half = rotary_dim / 2;
        let inv_freq: Vec<f64> =
            (0..half).map(|i| (theta as f64).powf(-((2 * i) as f64) / rotary_dim as f64)).collect();
        let mut out = data(x)?.to_vec();
        for (t, tok) in out.chunks_exact_mut(heads_per_token * head_dim).enumerate() {
            let pos = (start_pos + t) as f64;
            let cs: Vec<(f32, f32)> =
                inv_freq.iter().map(|f| ((pos * f).cos() as f32, (pos * f).sin() as f32)).collect();
            for head in tok.chunks_exact_mut(head_dim) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
        }
        Ok(tensor(out, x.shape().to_vec()))
    }

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize) -> Result<State> {
        Ok(State::new(Box::new(KvCache { kv_heads, head_dim, keys: Vec::new(), values: Vec::new() })))
    }

    fn kv_len(&self, cache: &State) -> Result<usize> {
        cache.get::<KvCache>().map(|c| c.len()).ok_or_else(|| BackendError::Device("not a CPU KV cache".into()))
    }

    fn kv_truncate(&self, cache: &mut State, len: usize) -> Result<()> {
        let c = cache.get_mut::<KvCache>().ok_or_else(|| BackendError::Device("not a CPU KV cache".into()))?;
        if len > c.len() {
            return Err(shape_error("kv_truncate", format!("to {len} positions of {}", c.len())));
        }
        let row = c.kv_heads * c.head_dim;
        c.keys.truncate(len * row);
        c.values.truncate(len * row);
        Ok(())
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut State, heads: usize, scale: f32, selection: Option<&KeySelection>) -> Result<Tensor> {
        let c = cache.get_mut::<KvCache>().ok_or_else(|| BackendError::Device("not a CPU KV cache".into()))?;
        let (kvh, hd) = (c.kv_heads, c.head_dim);
        let tokens = q.rows();
        if q.cols() != heads * hd || k.cols() != kvh * hd || v.cols() != kvh * hd || k.rows() != tokens || heads % kvh != 0 {
            return Err(shape_error(
                "attention",
                format!("q {:?} k {:?} v {:?} for {heads} heads, {kvh} kv heads of {hd}", q.shape(), k.shape(), v.shape()),
            ));
        }
        if let Some(sel) = selection {
            if sel.block == 0 || sel.per_query == 0 || sel.blocks.len() != tokens * sel.per_query {
                return Err(shape_error("attention", format!("key selection of {} entries ({} per query) for {tokens} queries", sel.blocks.len(), sel.per_query)));
            }
        }
        let past = c.len();
        // The keys each query may see, once per query (not per head).
        let selected: Option<Vec<Vec<usize>>> = selection.map(|sel| (0..tokens).map(|t| sel.keys_of(t, past + t)).collect());
        c.keys.extend_from_slice(data(k)?);
        c.values.extend_from_slice(data(v)?);
        let (keys, values) = (&c.keys, &c.values);
        let qd = data(q)?;
        let group = heads / kvh;
        let mut out = vec![0.0f32; tokens * heads * hd];
        let avx2 = matmul::has_avx2_fma();
        let work = tokens * heads * (past + tokens) * hd * 2;
        #[cfg(target_arch = "x86_64")]
        if avx2 && hd % 8 == 0 {
            // Keys transposed once per call for the full-visibility kernel
            // (prefill; at decode a single query reads each key once anyway).
            let total = past + tokens;
            let kts: Vec<Vec<f32>> = if selected.is_none() && tokens > 1 {
                (0..kvh).map(|g| transpose_keys(keys, total, kvh * hd, g * hd, hd)).collect()
            } else {
                Vec::new()
            };
            // One piece per (token, KV head): the group's query heads are
            // consecutive in q and in the output.
            for_each_piece(&mut out, group * hd, work, |i, o| {
                let (t, g) = (i / kvh, i % kvh);
                let ag = AttnGroup {
                    q: &qd[(t * heads + g * group) * hd..(t * heads + (g + 1) * group) * hd],
                    keys,
                    values,
                    stride: kvh * hd,
                    offset: g * hd,
                    visible: past + t + 1,
                    only: selected.as_ref().map(|s| s[t].as_slice()),
                    scale,
                    hd,
                    kt: kts.get(g).map(|v| v.as_slice()),
                };
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                unsafe { ag.run(o) };
            });
            return Ok(tensor(out, vec![tokens, heads * hd]));
        }
        for_each_piece(&mut out, hd, work, |i, o| {
            let (t, h) = (i / heads, i % heads);
            let head = AttnHead {
                q: &qd[(t * heads + h) * hd..(t * heads + h + 1) * hd],
                keys,
                values,
                stride: kvh * hd,
                offset: (h / group) * hd,
                visible: past + t + 1,
                only: selected.as_ref().map(|s| s[t].as_slice()),
                scale,
            };
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                unsafe { head.run_avx2(o) };
                return;
            }
            let _ = avx2;
            head.run(o);
        });
        Ok(tensor(out, vec![tokens, heads * hd]))
    }

    fn new_conv_state(&self, channels: usize, kernel: usize, dilation: usize) -> Result<State> {
        if kernel == 0 || dilation == 0 {
            return Err(shape_error("new_conv_state", format!("kernel size {kernel}, dilation {dilation}")));
        }
        let window = vec![0.0; (kernel - 1) * dilation * channels];
        Ok(State::new(Box::new(ConvState { channels, kernel, dilation, window })))
    }

    fn causal_conv1d_silu(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        let conv = self.causal_conv1d(x, w, state)?;
        self.silu(&conv)
    }

    fn causal_conv1d(&self, x: &Tensor, w: &Tensor, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<ConvState>().ok_or_else(|| BackendError::Device("not a CPU conv state".into()))?;
        let (c, kk, dil) = (st.channels, st.kernel, st.dilation);
        if x.cols() != c || w.numel() != c * kk {
            return Err(shape_error("causal_conv1d", format!("x {:?}, weight {:?}, {c} channels x {kk}", x.shape(), w.shape())));
        }
        let tokens = x.rows();
        let wd = data(w)?;
        // The window followed by the new inputs: [(kernel-1)*dilation+tokens, channels].
        let mut seq = st.window.clone();
        seq.extend_from_slice(data(x)?);
        let mut out = vec![0.0f32; tokens * c];
        for_each_piece(&mut out, c, tokens * c * kk, |t, o| {
            for (ch, o) in o.iter_mut().enumerate() {
                let mut acc = 0.0;
                for j in 0..kk {
                    acc += wd[ch * kk + j] * seq[(t + j * dil) * c + ch];
                }
                *o = acc;
            }
        });
        st.window = seq[tokens * c..].to_vec();
        Ok(tensor(out, vec![tokens, c]))
    }

    fn new_recurrent_state(&self, heads: usize, key_dim: usize, value_dim: usize) -> Result<State> {
        Ok(State::new(Box::new(RecurrentState { heads, key_dim, value_dim, s: vec![0.0; heads * key_dim * value_dim] })))
    }

    fn delta_gates(&self, a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor) -> Result<(Tensor, Tensor)> {
        same_shape("delta_gates", a, b)?;
        let heads = a.cols();
        if a_log.numel() != heads || dt_bias.numel() != heads {
            return Err(shape_error("delta_gates", format!("{heads} heads, A_log {:?}, dt_bias {:?}", a_log.shape(), dt_bias.shape())));
        }
        let (al, dt) = (data(a_log)?, data(dt_bias)?);
        let g = data(a)?
            .iter()
            .enumerate()
            .map(|(i, a)| (-al[i % heads].exp() * softplus(a + dt[i % heads])).exp())
            .collect();
        let beta = data(b)?.iter().map(|b| sigmoid(*b)).collect();
        Ok((tensor(g, a.shape().to_vec()), tensor(beta, b.shape().to_vec())))
    }

    fn gated_delta(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, key_heads: usize, state: &mut State) -> Result<Tensor> {
        let st = state.get_mut::<RecurrentState>().ok_or_else(|| BackendError::Device("not a CPU recurrent state".into()))?;
        let (h, dk, dv) = (st.heads, st.key_dim, st.value_dim);
        let tokens = q.rows();
        if key_heads == 0 || h % key_heads != 0 || q.cols() != key_heads * dk || k.cols() != key_heads * dk
            || v.cols() != h * dv || g.cols() != h || beta.cols() != h || k.rows() != tokens || v.rows() != tokens
        {
            return Err(shape_error(
                "gated_delta",
                format!("q {:?} k {:?} v {:?} g {:?} for {h} heads ({key_heads} key heads) of {dk}/{dv}", q.shape(), k.shape(), v.shape(), g.shape()),
            ));
        }
        let inputs = delta::DeltaInputs {
            q: data(q)?, k: data(k)?, v: data(v)?, g: data(g)?, beta: data(beta)?,
            tokens, heads: h, key_heads, key_dim: dk, value_dim: dv,
        };
        let out = delta::gated_delta(&inputs, &mut st.s);
        Ok(tensor(out, vec![tokens, h * dv]))
    }

    fn new_expert_pool(&self, layout: &ExpertLayout, slots: usize) -> Result<ExpertPool> {
        let (h, i) = (layout.hidden, layout.intermediate);
        let pool = CpuExpertPool {
            gate: CpuWeight::zeros(slots, i, h, layout.gate),
            up: CpuWeight::zeros(slots, i, h, layout.up),
            down: CpuWeight::zeros(slots, h, i, layout.down),
        };
        let bytes = pool.gate.bytes() + pool.up.bytes() + pool.down.bytes();
        Ok(ExpertPool::new(Box::new(pool), *layout, slots, bytes))
    }

    fn write_expert(&self, pool: &mut ExpertPool, slot: usize, e: &HostExpert<'_>) -> Result<()> {
        let p = pool.get_mut::<CpuExpertPool>().ok_or_else(|| BackendError::Device("not a CPU expert pool".into()))?;
        p.gate.write_slot(slot, &e.gate)?;
        p.up.write_slot(slot, &e.up)?;
        p.down.write_slot(slot, &e.down)
    }

    fn moe_expert_outputs(&self, x: &Tensor, pool: &ExpertPool, assignments: &[ExpertAssignment], top_k: usize) -> Result<Tensor> {
        let p = pool.get::<CpuExpertPool>().ok_or_else(|| BackendError::Device("not a CPU expert pool".into()))?;
        let (tokens, hidden) = (x.rows(), x.cols());
        if hidden != p.gate.cols {
            return Err(shape_error("moe_expert_outputs", format!("x {:?} for experts of hidden size {}", x.shape(), p.gate.cols)));
        }
        let xd = data(x)?;
        // Group assignments by slot so each expert's weights are read once per call.
        let mut by_slot: std::collections::BTreeMap<u32, Vec<ExpertAssignment>> = Default::default();
        for a in assignments {
            if a.slot as usize >= pool.slots || a.token as usize >= tokens || a.rank as usize >= top_k {
                return Err(shape_error("moe_expert_outputs", format!("{a:?} with {} slots, {tokens} tokens, top {top_k}", pool.slots)));
            }
            by_slot.entry(a.slot).or_default().push(*a);
        }
        let groups: Vec<(u32, Vec<ExpertAssignment>)> = by_slot.into_iter().collect();
        let run = |(slot, users): &(u32, Vec<ExpertAssignment>), parallel: bool| {
            let s = *slot as usize;
            let xs: Vec<f32> =
                users.iter().flat_map(|a| xd[a.token as usize * hidden..(a.token as usize + 1) * hidden].iter().copied()).collect();
            let n = users.len();
            let g = matmul::matmul(&xs, n, &p.gate, s, self.mode, parallel);
            let u = matmul::matmul(&xs, n, &p.up, s, self.mode, parallel);
            let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
            matmul::matmul(&act, n, &p.down, s, self.mode, parallel)
        };
        // At decode each expert's matrices are small (a few hundred KB): one
        // parallel region over the experts, each computed by one thread, costs
        // far less than three thread-pool round trips per expert.
        let results: Vec<Vec<f32>> = if groups.len() > 1 && rayon::current_num_threads() > 1 {
            groups.par_iter().map(|g| run(g, false)).collect()
        } else {
            groups.iter().map(|g| run(g, true)).collect()
        };
        let mut out = vec![0.0f32; tokens * top_k * hidden];
        for ((_, users), y) in groups.iter().zip(&results) {
            for (i, a) in users.iter().enumerate() {
                let row = a.token as usize * top_k + a.rank as usize;
                out[row * hidden..(row + 1) * hidden].copy_from_slice(&y[i * hidden..(i + 1) * hidden]);
            }
        }
        Ok(tensor(out, vec![tokens, top_k, hidden]))
    }

    fn moe_combine(&self, outputs: &Tensor, weights: &[f32], top_k: usize) -> Result<Tensor> {
        let hidden = outputs.cols();
        let tokens = outputs.rows() / top_k.max(1);
        if weights.len() != tokens * top_k || outputs.rows() != tokens * top_k {
            return Err(shape_error("moe_combine", format!("outputs {:?}, {} weights, top {top_k}", outputs.shape(), weights.len())));
        }
        let od = data(outputs)?;
        let mut out = vec![0.0f32; tokens * hidden];
        for_each_piece(&mut out, hidden, tokens * top_k * hidden, |t, o| {
            for r in 0..top_k {
                let w = weights[t * top_k + r];
                let row = &od[(t * top_k + r) * hidden..(t * top_k + r + 1) * hidden];
                o.iter_mut().zip(row).for_each(|(o, y)| *o += w * y);
            }
        });
        Ok(tensor(out, vec![tokens, hidden]))
    }

    fn clone_state(&self, state: &State) -> Result<State> {
        if let Some(c) = state.get::<KvCache>() {
            return Ok(State::new(Box::new(KvCache { kv_heads: c.kv_heads, head_dim: c.head_dim, keys: c.keys.clone(), values: c.values.clone() })));
        }
        if let Some(c) = state.get::<ConvState>() {
            return Ok(State::new(Box::new(ConvState { channels: c.channels, kernel: c.kernel, dilation: c.dilation, window: c.window.clone() })));
        }
        if let Some(r) = state.get::<RecurrentState>() {
            return Ok(State::new(Box::new(RecurrentState { heads: r.heads, key_dim: r.key_dim, value_dim: r.value_dim, s: r.s.clone() })));
        }
        Err(BackendError::Device("state does not belong to the CPU backend".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_avx2_matches_expf() {
        if !matmul::has_avx2_fma() {
            return;
        }
        for i in 0..20000 {
            let x = -87.0 + i as f32 * 0.0044;
            let mut out = [0.0f32; 8];
            // SAFETY: AVX2 and FMA checked above.
            unsafe {
                use std::arch::x86_64::*;
                _mm256_storeu_ps(out.as_mut_ptr(), exp_avx2(_mm256_set1_ps(x)));
            }
            let want = x.exp();
            assert!((out[0] - want).abs() <= 4e-7 * want, "exp({x}) = {} vs {want}", out[0]);
        }
    }

    /// A prefill call's attention (many queries, transposed-key kernel) must
    /// match feeding the same tokens one at a time, up to float rounding.
    #[test]
    fn attention_prefill_matches_token_by_token() {
        let b = CpuBackend::new();
        let (heads, kvh, hd, tokens) = (8, 2, 64, 21);
        let gen = |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| (((i + seed) * 7919) % 113) as f32 / 113.0 - 0.5).collect() };
        let q = gen(tokens * heads * hd, 1);
        let k = gen(tokens * kvh * hd, 2);
        let v = gen(tokens * kvh * hd, 3);
        let mut c1 = b.new_kv_cache(kvh, hd).unwrap();
        let all = b
            .attention(
                &b.upload(&q, &[tokens, heads * hd]).unwrap(),
                &b.upload(&k, &[tokens, kvh * hd]).unwrap(),
                &b.upload(&v, &[tokens, kvh * hd]).unwrap(),
                &mut c1,
                heads,
                0.125,
                None,
            )
            .unwrap();
        let all = b.download(&all).unwrap();
        let mut c2 = b.new_kv_cache(kvh, hd).unwrap();
        for t in 0..tokens {
            let one = b
                .attention(
                    &b.upload(&q[t * heads * hd..(t + 1) * heads * hd], &[1, heads * hd]).unwrap(),
                    &b.upload(&k[t * kvh * hd..(t + 1) * kvh * hd], &[1, kvh * hd]).unwrap(),
                    &b.upload(&v[t * kvh * hd..(t + 1) * kvh * hd], &[1, kvh * hd]).unwrap(),
                    &mut c2,
                    heads,
                    0.125,
                    None,
                )
                .unwrap();
            let one = b.download(&one).unwrap();
            for (i, (a, o)) in all[t * heads * hd..(t + 1) * heads * hd].iter().zip(&one).enumerate() {
                assert!((a - o).abs() <= 1e-5 * (1.0 + o.abs()), "token {t} element {i}: {a} vs {o}");
            }
        }
    }
}
