//! The VNNI kernel's register tile in 512-bit registers.

use std::arch::x86_64::*;

use super::{prefetch, Q4Job, ScaleRead, TileAt};

/// Eight floats at `p`, twice over.
#[inline(always)]
unsafe fn twice(p: *const f32) -> __m512 {
    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(p as *const f64)))
}

impl<S: ScaleRead + ?Sized> Q4Job<'_, S> {
    /// [`Q4Job::tile`] in 512-bit registers (AVX-512 VNNI): a chunk's 32
    /// weight bytes become one register of their 32 low nibbles then their
    /// 32 high ones, against the chunk's 64 quantized inputs as stored (evens
    /// then odds), so one `vpdpbusd` computes a (row, token, chunk). Its i32
    /// lanes 0-3 and 8-11 hold block 0, 4-7 and 12-15 block 1: the chunk's
    /// eight block scales twice over scale them. Four instructions per (row,
    /// token, chunk) against five in 256-bit registers; the arithmetic for
    /// one (row, token) is the same whatever `T` is.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile512<const R: usize, const T: usize, const PRE: bool>(
        &self,
        row0: usize,
        t0: usize,
        bf: &[f32],
        sv8: &[f32],
        out: *mut f32,
        ld: usize,
        col0: usize,
    ) {
        let TileAt { k, chunks, row_bytes, wb, qx, d8 } = self.tile_at::<R, T, PRE>(row0, t0, bf, sv8);
        let mask = _mm512_set1_epi8(0x0F);
        // The low half of the broadcast weights as they are, the high half shifted to the high nibbles.
        let shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let svp = sv8.as_ptr();
        for c in 0..chunks {
            prefetch(wb, R * row_bytes, c);
            let mut w = [_mm512_setzero_si512(); R];
            let mut sv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let wv = _mm512_broadcast_i64x4(_mm256_loadu_si256(wb.add(r * row_bytes + 32 * c) as *const __m256i));
                w[r] = _mm512_and_si512(_mm512_srlv_epi64(wv, shift), mask);
                sv[r] = if PRE {
                    twice(svp.add((r * chunks + c) * 8))
                } else {
                    let (s0, s1) = self.chunk_scales(row0 + r, c);
                    if self.group_size % 64 == 0 {
                        _mm512_set1_ps(s0)
                    } else {
                        _mm512_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1, s0, s0, s0, s0, s1, s1, s1, s1)
                    }
                };
            }
            for j in 0..T {
                let xv = _mm512_loadu_si512(qx.add(j * k + 64 * c) as *const _);
                let dx = twice(d8.add(j * k / 8 + 8 * c));
                for r in 0..R {
                    let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xv);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), dx), sv[r], acc[r][j]);
                }
            }
        }
        self.tile_store::<R, T>(t0, bf, out, ld, col0, |r, j| _mm512_reduce_add_ps(acc[r][j]));
    }
}
