//! Attention over the CPU KV cache: decode and causal prefill, grouped-query
//! heads, and block-sparse key selections; AVX2 kernels where the CPU has
//! them.

use crate::for_each_piece;
use crate::kv_cache::{each_rows, simd_kernels, HeadView, KvCache, KvRowsRef};

impl KvCache {
    /// Attention of `tokens` queries (`q`, `[tokens, heads*head_dim]`, the
    /// last `tokens` positions of the cache, already appended) over the
    /// cache; `selected[t]` lists the only keys query `t` may see (block-sparse attention).
    /// Returns `[tokens, heads*head_dim]`.
    pub(crate) fn attend(&self, q: &[f32], tokens: usize, heads: usize, scale: f32, selected: Option<&[Vec<usize>]>) -> Vec<f32> {
        each_rows!(&self.rows, rows => {
            let keys: Vec<_> = rows.keys.iter().map(|k| k.view()).collect();
            let values: Vec<_> = rows.values.iter().map(|v| v.view()).collect();
            self.attend_rows(&keys, &values, q, tokens, heads, scale, selected)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn attend_rows<S: KvRowsRef>(
        &self,
        keys: &[S],
        values: &[S],
        qd: &[f32],
        tokens: usize,
        heads: usize,
        scale: f32,
        selected: Option<&[Vec<usize>]>,
    ) -> Vec<f32> {
        let (kvh, hd) = (self.kv_heads, self.head_dim);
        let past = self.len() - tokens;
        let group = heads / kvh;
        let mut out = vec![0.0f32; tokens * heads * hd];
        let fast = simd_kernels();
        let work = tokens * heads * (past + tokens) * hd * 2;
        #[cfg(target_arch = "x86_64")]
        if fast && hd % 8 == 0 {
            // Keys transposed once per call for the full-visibility kernel
            // (prefill; at decode a single query reads each key once anyway).
            // Its scores round differently, so calls of up to
            // `ROW_EXACT_TOKENS` (a verification pass of drafted tokens) take
            // the decode kernel: each query's bits as when it comes alone.
            let total = past + tokens;
            let kts: Vec<Vec<f32>> = if selected.is_none() && tokens > crate::matmul::ROW_EXACT_TOKENS {
                keys.iter().map(|k| transpose_keys(*k, total, hd)).collect()
            } else {
                Vec::new()
            };
            // One piece per (token, KV head): the group's query heads are
            // consecutive in q and in the output.
            for_each_piece(&mut out, group * hd, work, |i, o| {
                let (t, g) = (i / kvh, i % kvh);
                let ag = AttnGroup {
                    q: &qd[(t * heads + g * group) * hd..(t * heads + (g + 1) * group) * hd],
                    keys: keys[g],
                    values: values[g],
                    visible: past + t + 1,
                    only: selected.map(|s| s[t].as_slice()),
                    scale,
                    hd,
                    kt: kts.get(g).map(|v| v.as_slice()),
                };
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time).
                unsafe { ag.run(o) };
            });
            return out;
        }
        for_each_piece(&mut out, hd, work, |i, o| {
            let (t, h) = (i / heads, i % heads);
            let head = AttnHead {
                q: &qd[(t * heads + h) * hd..(t * heads + h + 1) * hd],
                keys: keys[h / group],
                values: values[h / group],
                visible: past + t + 1,
                only: selected.map(|s| s[t].as_slice()),
                scale,
            };
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                unsafe { head.run_avx2(o) };
                return;
            }
            let _ = fast;
            head.run(o);
        });
        out
    }
}

/// One query head's attention over the visible keys and values: positions
/// `0..visible`, or only those listed in `only` (block-sparse attention).
struct AttnHead<'a, S> {
    q: &'a [f32],
    /// One KV head's `[positions, hd]` keys and values.
    keys: S,
    values: S,
    visible: usize,
    only: Option<&'a [usize]>,
    scale: f32,
}

impl<S: KvRowsRef> AttnHead<'_, S> {
    #[inline(always)]
    fn run(&self, o: &mut [f32]) {
        let hd = self.q.len();
        let key = |n: usize| self.only.map_or(n, |o| o[n]);
        let count = self.only.map_or(self.visible, |o| o.len());
        let mut scores: Vec<f32> = (0..count).map(|n| self.keys.dot(self.q, key(n) * hd) * self.scale).collect();
        let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let inv = 1.0 / total;
        for (n, s) in scores.iter().enumerate() {
            self.values.add_to(s * inv, key(n) * hd, o);
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
struct AttnGroup<'a, S> {
    /// `[heads_in_group, hd]` queries.
    q: &'a [f32],
    /// The KV head's `[positions, hd]` keys and values.
    keys: S,
    values: S,
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

/// One KV head's keys (`[positions, hd]`) transposed into blocks of 8
/// positions: `[ceil(positions / 8), hd, 8]`, zero-padded.
#[cfg(target_arch = "x86_64")]
fn transpose_keys<S: KvRowsRef>(keys: S, positions: usize, hd: usize) -> Vec<f32> {
    let blocks = positions.div_ceil(8);
    let mut kt = vec![0.0f32; blocks * hd * 8];
    for p in 0..positions {
        let (b, l) = (p / 8, p % 8);
        for d in 0..hd {
            kt[(b * hd + d) * 8 + l] = keys.get(p * hd + d);
        }
    }
    kt
}

#[cfg(target_arch = "x86_64")]
impl<S: KvRowsRef> AttnGroup<'_, S> {
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

    /// `o[i] += sum_n p[i][n] * v[n]` over the keys `n0..n1` in order, for
    /// `Q` queries (`p` rows `pstride` apart, already normalised), `DV`
    /// vectors of `hd` at a time held in registers. `o` holds the sums over
    /// the keys before `n0` (zeros at the start), so splitting the keys
    /// into ranges gives the same bits as one range.
    #[inline(always)]
    unsafe fn weighted_values<const Q: usize, const DV: usize>(&self, p: &[f32], pstride: usize, n0: usize, n1: usize, o: &mut [f32]) {
        use std::arch::x86_64::*;
        let hd = self.hd;
        assert!(n0 <= n1 && p.len() >= (Q - 1) * pstride + n1 && o.len() >= Q * hd && hd % (8 * DV) == 0);
        assert!(n1 * hd <= self.values.values());
        let pp = p.as_ptr();
        let op = o.as_mut_ptr();
        let mut d0 = 0;
        while d0 < hd {
            let mut acc = [[_mm256_setzero_ps(); DV]; Q];
            for (i, a) in acc.iter_mut().enumerate() {
                for (j, aj) in a.iter_mut().enumerate() {
                    *aj = _mm256_loadu_ps(op.add(i * hd + d0 + 8 * j));
                }
            }
            for n in n0..n1 {
                let mut v = [_mm256_setzero_ps(); DV];
                for (j, vv) in v.iter_mut().enumerate() {
                    *vv = self.values.load8(n * hd + d0 + 8 * j);
                }
                for (i, a) in acc.iter_mut().enumerate() {
                    let w = _mm256_set1_ps(*pp.add(i * pstride + n));
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

    /// `o[i] = sum_n p[i][n] * v[n]` for `Q` queries over the first `count`
    /// keys (`o` zeroed), in tiles of keys small enough to stay in L1 while
    /// every query pair and slice of `hd` passes over them: the values come
    /// from memory once.
    #[inline(always)]
    unsafe fn values_tiled<const Q: usize>(&self, p: &[f32], pstride: usize, count: usize, o: &mut [f32]) {
        let hd = self.hd;
        let tile = (16384 / (hd * S::BYTES)).max(8);
        let mut n0 = 0;
        while n0 < count {
            let n1 = (n0 + tile).min(count);
            if hd % 32 == 0 {
                // Two queries x 4 vectors = 8 accumulators at a time.
                let mut i = 0;
                while i + 2 <= Q {
                    self.weighted_values::<2, 4>(&p[i * pstride..], pstride, n0, n1, &mut o[i * hd..]);
                    i += 2;
                }
                if i < Q {
                    self.weighted_values::<1, 4>(&p[i * pstride..], pstride, n0, n1, &mut o[i * hd..]);
                }
            } else {
                for i in 0..Q {
                    self.weighted_values::<1, 1>(&p[i * pstride..], pstride, n0, n1, &mut o[i * hd..]);
                }
            }
            n0 = n1;
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
        self.values_tiled::<Q>(scores, cpad, count, o);
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
        let row = |n: usize| self.only.map_or(n, |o| o[n]) * hd;
        if let Some(only) = self.only {
            assert!(only.iter().all(|&j| j < self.visible));
        }
        assert!(self.visible * hd <= self.keys.values().min(self.values.values()));
        // A key selection's rows are scattered, which the hardware
        // prefetcher cannot follow: fetch a few rows ahead.
        const AHEAD: usize = 16;
        let prefetch_row = |rows: S, n: usize| {
            if n < count {
                rows.prefetch(row(n), hd);
            }
        };
        for n in 0..count {
            prefetch_row(self.keys, n + AHEAD);
            let kr = row(n);
            let mut acc = [_mm256_setzero_ps(); Q];
            let mut d = 0;
            while d < hd {
                let kv = self.keys.load8(kr + d);
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
            self.values_tiled::<Q>(scores, count, count, o);
            return;
        }
        let op = o.as_mut_ptr();
        for n in 0..count {
            prefetch_row(self.values, n + AHEAD);
            let vr = row(n);
            let mut w = [_mm256_setzero_ps(); Q];
            for (i, wv) in w.iter_mut().enumerate() {
                *wv = _mm256_set1_ps(scores[i * count + n] * inv[i]);
            }
            let mut d = 0;
            while d < hd {
                let v = self.values.load8(vr + d);
                for (i, wv) in w.iter().enumerate() {
                    let p = op.add(i * hd + d);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(*wv, v, _mm256_loadu_ps(p)));
                }
                d += 8;
            }
        }
    }

    /// Every query of the group into `o` (`[heads_in_group, hd]`, zeroed).
    #[target_feature(enable = "avx2,fma,f16c")]
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

#[cfg(test)]
mod tests {
    use crate::{CpuBackend, CpuOptions};
    use slotstream_backend::{Backend, KvCacheType};

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_avx2_matches_expf() {
        use super::exp_avx2;
        if !crate::matmul::has_avx2_fma() {
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

    /// Attention of a prefill then decode steps on `b`'s cache.
    fn prefill_then_decode(b: &CpuBackend, [heads, kvh, hd]: [usize; 3], q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let mut c = b.new_kv_cache(kvh, hd).unwrap();
        let mut out = Vec::new();
        for (t0, t1) in [(0, 33), (33, 34), (34, 35), (35, 40)] {
            let o = b
                .attention(
                    &b.upload(&q[t0 * heads * hd..t1 * heads * hd], &[t1 - t0, heads * hd]).unwrap(),
                    &b.upload(&k[t0 * kvh * hd..t1 * kvh * hd], &[t1 - t0, kvh * hd]).unwrap(),
                    &b.upload(&v[t0 * kvh * hd..t1 * kvh * hd], &[t1 - t0, kvh * hd]).unwrap(),
                    &mut c,
                    heads,
                    0.125,
                    None,
                )
                .unwrap();
            out.extend(b.download(&o).unwrap());
        }
        out
    }

    /// Relative L2 distance of the attention of a cache of `kv` (with
    /// `mode`'s matmuls) from the exact backend's f32 cache, over a
    /// prefill of most tokens and then decode steps, on each path.
    fn cache_error(mode: crate::MatmulMode, kv: KvCacheType) -> f32 {
        let dims = [8, 2, 64];
        let (heads, kvh, hd, tokens) = (8, 2, 64, 40);
        let gen = |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| (((i + seed) * 7919) % 113) as f32 / 40.0 - 1.4).collect() };
        let (q, k, v) = (gen(tokens * heads * hd, 1), gen(tokens * kvh * hd, 2), gen(tokens * kvh * hd, 3));
        let exact = prefill_then_decode(&CpuBackend::exact(), dims, &q, &k, &v);
        let b = CpuBackend::with_options(CpuOptions { matmul: mode, kv_cache: Some(kv), ..CpuOptions::from_env() });
        let other = prefill_then_decode(&b, dims, &q, &k, &v);
        let norm = |x: &[f32]| x.iter().map(|a| a * a).sum::<f32>().sqrt();
        let diff: Vec<f32> = exact.iter().zip(&other).map(|(a, b)| a - b).collect();
        norm(&diff) / norm(&exact)
    }

    /// An f16 cache (the int8 mode's) gives the f32 cache's attention up to
    /// f16 rounding of keys and values (2^-11 relative): well inside 2e-3.
    #[test]
    fn f16_cache_matches_f32_cache() {
        let rel = cache_error(crate::MatmulMode::Int8, KvCacheType::F16);
        assert!(rel < 2e-3, "relative L2 {rel}");
        if super::simd_kernels() {
            assert!(rel > 0.0, "the int8 mode should cache f16");
        }
    }

    /// A q8 cache: within q8's error (half a step of 1/127 of a block's
    /// largest value per key and value, under 1% relative L2 of the output
    /// here), and not the f32 cache's.
    #[test]
    fn q8_cache_matches_f32_cache() {
        let rel = cache_error(crate::MatmulMode::Int8, KvCacheType::Q8);
        assert!(rel < 1e-2 && rel > 1e-4, "relative L2 {rel}");
    }
}
