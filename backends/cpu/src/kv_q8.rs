//! A q8 KV cache (`--kv-cache q8`): each KV head's keys and values in
//! blocks of [`Q8_BLOCK`] values, llama.cpp's q8_0 format: one f16 scale
//! `d` per block (the block's largest magnitude / 127) and the values as
//! int8 `q = round(x / d)`, read back as `d * q`. 34 bytes per 32 values,
//! 53% of f16's; the error of a value is at most `d / 2` (1/254 of its
//! block's largest magnitude).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;
use slotstream_backend::Q8_BLOCK;

use crate::kv_cache::{HeadView, KvRowsRef};

/// One KV head's keys (or values): `qs[position * hd + d]`, and a scale per
/// block of [`Q8_BLOCK`] of them.
#[derive(Clone, Default)]
pub(crate) struct Q8Head {
    qs: Vec<i8>,
    d: Vec<f16>,
}

/// Quantizes one block of values into `qs` (appended), returning its scale.
pub(crate) fn quantize_block(x: &[f32], qs: &mut Vec<i8>) -> f16 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(amax / 127.0);
    let df = d.to_f32();
    let inv = if df > 0.0 { 1.0 / df } else { 0.0 };
    // Rounding the scale to f16 may put the largest value a hair past 127.
    qs.extend(x.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8));
    d
}

impl Q8Head {
    /// Appends values (a whole number of blocks).
    fn extend(&mut self, x: &[f32]) {
        for b in x.chunks_exact(Q8_BLOCK) {
            let d = quantize_block(b, &mut self.qs);
            self.d.push(d);
        }
    }

}

impl HeadView for Q8Head {
    type Ref<'a> = Q8Ref<'a>;
    fn view(&self) -> Q8Ref<'_> {
        Q8Ref { qs: &self.qs, d: &self.d }
    }
}

/// Keys and values of one layer, by KV head.
#[derive(Clone)]
pub(crate) struct Q8Rows {
    pub(crate) keys: Vec<Q8Head>,
    pub(crate) values: Vec<Q8Head>,
}

impl Q8Rows {
    /// Whether heads of `head_dim` are whole blocks.
    pub(crate) fn fits(head_dim: usize) -> bool {
        head_dim > 0 && head_dim % Q8_BLOCK == 0
    }

    pub(crate) fn new(kv_heads: usize) -> Q8Rows {
        Q8Rows { keys: vec![Q8Head::default(); kv_heads], values: vec![Q8Head::default(); kv_heads] }
    }

    fn heads(&mut self) -> impl Iterator<Item = &mut Q8Head> {
        self.keys.iter_mut().chain(self.values.iter_mut())
    }

    /// Values held per head.
    pub(crate) fn elements(&self) -> usize {
        self.keys.first().map_or(0, |h| h.qs.len())
    }

    /// Room for `n` values per head.
    pub(crate) fn reserve(&mut self, n: usize) {
        for h in self.heads() {
            h.qs.reserve_exact(n.saturating_sub(h.qs.len()));
            h.d.reserve_exact((n / Q8_BLOCK).saturating_sub(h.d.len()));
        }
    }

    /// Keeps the first `n` values per head (whole rows, so whole blocks).
    pub(crate) fn truncate(&mut self, n: usize) {
        for h in self.heads() {
            h.qs.truncate(n);
            h.d.truncate(n / Q8_BLOCK);
        }
    }

    /// Appends `[tokens, kv_heads*hd]` keys and values, split by head.
    pub(crate) fn append(&mut self, k: &[f32], v: &[f32], hd: usize) {
        let heads = self.keys.len();
        for (rows, x) in [(&mut self.keys, k), (&mut self.values, v)] {
            for (h, r) in rows.iter_mut().enumerate() {
                for t in x.chunks_exact(heads * hd) {
                    r.extend(&t[h * hd..(h + 1) * hd]);
                }
            }
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|h| h.qs.len() + 2 * h.d.len()).sum()
    }
}

/// One head's q8 rows as the attention kernels read them.
#[derive(Clone, Copy)]
pub(crate) struct Q8Ref<'a> {
    qs: &'a [i8],
    d: &'a [f16],
}

impl KvRowsRef for Q8Ref<'_> {
    const BYTES: usize = 1;

    #[inline(always)]
    fn values(&self) -> usize {
        self.qs.len()
    }

    /// `at` starts a row (so a block) and `q` is whole blocks.
    #[inline(always)]
    fn dot(&self, q: &[f32], at: usize) -> f32 {
        let qs = &self.qs[at..at + q.len()];
        let d = &self.d[at / Q8_BLOCK..];
        q.chunks_exact(Q8_BLOCK)
            .zip(qs.chunks_exact(Q8_BLOCK))
            .zip(d)
            .map(|((q, x), d)| d.to_f32() * q.iter().zip(x).map(|(a, &b)| a * b as f32).sum::<f32>())
            .sum()
    }

    #[inline(always)]
    fn add_to(&self, w: f32, at: usize, o: &mut [f32]) {
        let n = o.len();
        let qs = &self.qs[at..at + n];
        let d = &self.d[at / Q8_BLOCK..];
        for ((o, x), d) in o.chunks_exact_mut(Q8_BLOCK).zip(qs.chunks_exact(Q8_BLOCK)).zip(d) {
            let wd = w * d.to_f32();
            o.iter_mut().zip(x).for_each(|(o, &x)| *o += wd * x as f32);
        }
    }

    #[inline(always)]
    fn get(&self, at: usize) -> f32 {
        self.d[at / Q8_BLOCK].to_f32() * self.qs[at] as f32
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, at: usize) -> __m256 {
        debug_assert!(at % 8 == 0 && at + 8 <= self.qs.len());
        let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(self.qs.as_ptr().add(at) as *const __m128i)));
        let d = _mm_cvtph_ps(_mm_set1_epi16(self.d.get_unchecked(at / Q8_BLOCK).to_bits() as i16));
        _mm256_mul_ps(q, _mm256_broadcastss_ps(d))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn prefetch(&self, at: usize, n: usize) {
        let r = self.qs.as_ptr().wrapping_add(at) as *const i8;
        for line in (0..n).step_by(64) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(line)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_comes_back_within_half_a_step() {
        let x: Vec<f32> = (0..Q8_BLOCK).map(|i| ((i * 37) % 29) as f32 / 7.0 - 2.0).collect();
        let mut qs = Vec::new();
        let d = quantize_block(&x, &mut qs).to_f32();
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!((d - amax / 127.0).abs() <= amax / 127.0 * 1e-3, "scale {d}");
        assert!(qs.iter().any(|&q| q.abs() == 127));
        for (v, q) in x.iter().zip(&qs) {
            assert!((v - d * *q as f32).abs() <= d * 0.5 + 1e-6, "{v} vs {}", d * *q as f32);
        }
        // A block of zeros has scale 0 and stays zeros.
        let mut zs = Vec::new();
        assert_eq!(quantize_block(&[0.0; Q8_BLOCK], &mut zs).to_f32(), 0.0);
        assert!(zs.iter().all(|&q| q == 0));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_read_of_a_row_agrees() {
        if !crate::kv_cache::simd_kernels() {
            return;
        }
        let mut h = Q8Head::default();
        let x: Vec<f32> = (0..128).map(|i| ((i * 53) % 101) as f32 / 25.0 - 2.0).collect();
        h.extend(&x);
        let r = h.view();
        let q: Vec<f32> = (0..64).map(|i| i as f32 / 64.0 - 0.5).collect();
        let want: f32 = (0..64).map(|i| q[i] * r.get(64 + i)).sum();
        assert!((r.dot(&q, 64) - want).abs() <= 1e-4 * want.abs().max(1.0));
        let mut o = vec![1.0; 64];
        r.add_to(2.0, 64, &mut o);
        for at in (0..128).step_by(8) {
            let mut lanes = [0.0f32; 8];
            // SAFETY: AVX2 and F16C checked above; at + 8 <= 128.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), r.load8(at)) };
            for (i, l) in lanes.iter().enumerate() {
                assert_eq!(*l, r.get(at + i));
                if at >= 64 {
                    assert_eq!(o[at - 64 + i], 1.0 + 2.0 * r.get(at + i));
                }
            }
        }
    }
}
