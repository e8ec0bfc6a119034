//! The CPU backend's KV cache: keys and values of one attention layer, as f32,
//! or as f16 with the fast (int8) matmuls, as llama.cpp's default cache:
//! decode reads the whole cache every token, and f16 halves those bytes
//! (rounding a key or value to f16 is a relative error of at most 2^-11,
//! below the int8 activations' ~1e-3); or as q8 blocks (`kv_q8.rs`,
//! `--kv-cache q8`), about half of f16's bytes again.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;
use slotstream_backend::{DeviceState, KvCacheType, Result};

use crate::kv_q8::Q8Rows;
use crate::matmul;

/// An element type of the KV cache.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// `sum q[i] * row[i]`.
    fn dot(q: &[f32], row: &[Self]) -> f32;
    /// Eight consecutive elements as f32 (needs AVX2 and F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn dot(q: &[f32], row: &[f32]) -> f32 {
        matmul::dot(q, row)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn dot(q: &[f32], row: &[f16]) -> f32 {
        q.iter().zip(row).map(|(a, b)| a * b.to_f32()).sum()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// One KV head's `[positions, hd]` keys (or values) as the attention
/// kernels read them: `at` is a value's index (`position * hd + d`).
pub(crate) trait KvRowsRef: Copy + Send + Sync {
    /// Bytes per value, about (key tiles are sized by it).
    // Read by the x86-64 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const BYTES: usize;
    /// Values held.
    // Read by the x86-64 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn values(&self) -> usize;
    /// `sum q[i] * x[at + i]`.
    fn dot(&self, q: &[f32], at: usize) -> f32;
    /// `o[i] += w * x[at + i]`.
    fn add_to(&self, w: f32, at: usize, o: &mut [f32]);
    /// Value `at` as f32.
    // Read by the x86-64 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn get(&self, at: usize) -> f32;
    /// Values `at..at + 8` as f32 (`at` a multiple of 8, `at + 8 <=
    /// values()`; needs AVX2 and F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(&self, at: usize) -> __m256;
    /// Fetches the `n` values from `at` into L1 ahead of their use (a hint;
    /// any `at` is allowed).
    #[cfg(target_arch = "x86_64")]
    fn prefetch(&self, at: usize, n: usize);
}

impl<E: KvElem> KvRowsRef for &[E] {
    const BYTES: usize = std::mem::size_of::<E>();
    #[inline(always)]
    fn values(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn dot(&self, q: &[f32], at: usize) -> f32 {
        E::dot(q, &self[at..at + q.len()])
    }
    #[inline(always)]
    fn add_to(&self, w: f32, at: usize, o: &mut [f32]) {
        let n = o.len();
        o.iter_mut().zip(&self[at..at + n]).for_each(|(o, v)| *o += w * v.to_f32());
    }
    #[inline(always)]
    fn get(&self, at: usize) -> f32 {
        self[at].to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, at: usize) -> __m256 {
        debug_assert!(at + 8 <= self.len());
        E::load8(self.as_ptr().add(at))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn prefetch(&self, at: usize, n: usize) {
        let r = self.as_ptr().wrapping_add(at) as *const i8;
        for line in (0..n * Self::BYTES).step_by(64) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(line)) };
        }
    }
}

/// One KV head's stored rows, viewed as the kernels read them.
pub(crate) trait HeadView {
    type Ref<'a>: KvRowsRef
    where
        Self: 'a;
    fn view(&self) -> Self::Ref<'_>;
}

impl<E: KvElem> HeadView for Vec<E> {
    type Ref<'a> = &'a [E];
    fn view(&self) -> &[E] {
        self
    }
}

/// Cached keys and values of one layer, each KV head's in its own
/// `[positions, head_dim]` rows: a decode step reads one head's keys (then
/// values) as one sequential stream, which the hardware prefetcher follows.
pub(crate) struct HeadRows<E> {
    pub(crate) keys: Vec<Vec<E>>,
    pub(crate) values: Vec<Vec<E>>,
}

impl<E: KvElem> HeadRows<E> {
    fn new(kv_heads: usize) -> Self {
        HeadRows { keys: vec![Vec::new(); kv_heads], values: vec![Vec::new(); kv_heads] }
    }

    /// Elements held per head.
    fn elements(&self) -> usize {
        self.keys.first().map_or(0, Vec::len)
    }

    /// Room for `n` elements per head.
    fn reserve(&mut self, n: usize) {
        self.keys.iter_mut().chain(self.values.iter_mut()).for_each(|r| r.reserve_exact(n.saturating_sub(r.len())));
    }

    fn truncate(&mut self, n: usize) {
        self.keys.iter_mut().chain(self.values.iter_mut()).for_each(|r| r.truncate(n));
    }

    /// Appends `[tokens, kv_heads*hd]` keys and values, split by head.
    fn append(&mut self, k: &[f32], v: &[f32], hd: usize) {
        let heads = self.keys.len();
        for (rows, x) in [(&mut self.keys, k), (&mut self.values, v)] {
            for (h, r) in rows.iter_mut().enumerate() {
                r.reserve(x.len() / heads);
                for t in x.chunks_exact(heads * hd) {
                    r.extend(t[h * hd..(h + 1) * hd].iter().map(|&x| E::from_f32(x)));
                }
            }
        }
    }

    fn duplicate(&self) -> Self {
        HeadRows { keys: self.keys.clone(), values: self.values.clone() }
    }

    fn bytes(&self) -> usize {
        2 * self.keys.len() * self.elements() * std::mem::size_of::<E>()
    }
}

/// The cache's rows in its element type.
pub(crate) enum Rows {
    F32(HeadRows<f32>),
    F16(HeadRows<f16>),
    Q8(Q8Rows),
}

/// `$body` with `$r` bound to the rows, whichever their type.
macro_rules! each_rows {
    ($rows:expr, $r:ident => $body:expr) => {
        match $rows {
            $crate::kv_cache::Rows::F32($r) => $body,
            $crate::kv_cache::Rows::F16($r) => $body,
            $crate::kv_cache::Rows::Q8($r) => $body,
        }
    };
}
pub(crate) use each_rows;

/// Keys and values of one attention layer.
pub struct KvCache {
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rows: Rows,
}

impl KvCache {
    /// The type a cache asked to store `asked` holds: f16 only where this
    /// CPU converts it in hardware (else f32); q8 where the head dim is
    /// whole blocks (else f16, as above).
    pub(crate) fn resolve(asked: KvCacheType, head_dim: usize) -> KvCacheType {
        match asked {
            KvCacheType::Q8 if Q8Rows::fits(head_dim) => KvCacheType::Q8,
            KvCacheType::F16 | KvCacheType::Q8 if simd_kernels() => KvCacheType::F16,
            _ => KvCacheType::F32,
        }
    }

    /// An empty cache of the type [`KvCache::resolve`] gives `asked`.
    pub(crate) fn new(kv_heads: usize, head_dim: usize, asked: KvCacheType) -> KvCache {
        let rows = match KvCache::resolve(asked, head_dim) {
            KvCacheType::F32 => Rows::F32(HeadRows::new(kv_heads)),
            KvCacheType::F16 => Rows::F16(HeadRows::new(kv_heads)),
            KvCacheType::Q8 => Rows::Q8(Q8Rows::new(kv_heads)),
        };
        KvCache { kv_heads, head_dim, rows }
    }

    pub(crate) fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    pub(crate) fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub(crate) fn len(&self) -> usize {
        each_rows!(&self.rows, r => r.elements()) / self.head_dim
    }

    /// Room for `positions` positions in all (a hint: appends still grow
    /// the cache as they need).
    pub(crate) fn reserve(&mut self, positions: usize) {
        let n = positions.saturating_mul(self.head_dim);
        each_rows!(&mut self.rows, r => r.reserve(n))
    }

    /// Keeps the first `len` positions (`len <= self.len()`).
    pub(crate) fn truncate(&mut self, len: usize) {
        let n = len * self.head_dim;
        each_rows!(&mut self.rows, r => r.truncate(n))
    }

    /// Appends rows of keys and values (`[tokens, kv_heads*head_dim]` each).
    pub(crate) fn append(&mut self, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        each_rows!(&mut self.rows, r => r.append(k, v, hd))
    }
}

/// Whether the SIMD kernels (AVX2, FMA, F16C) run here; f16 caches need them.
pub(crate) fn simd_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matmul::has_avx2_fma() && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl DeviceState for KvCache {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        let rows = match &self.rows {
            Rows::F32(r) => Rows::F32(r.duplicate()),
            Rows::F16(r) => Rows::F16(r.duplicate()),
            Rows::Q8(r) => Rows::Q8(r.clone()),
        };
        Ok(Box::new(KvCache { kv_heads: self.kv_heads, head_dim: self.head_dim, rows }))
    }

    fn bytes(&self) -> usize {
        each_rows!(&self.rows, r => r.bytes())
    }
}
