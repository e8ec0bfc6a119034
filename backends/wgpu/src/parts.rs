//! Pool writes filled on several threads. A streamed expert's matrix goes
//! into staging (or, on unified memory, the mapped pool) through one
//! `WriteOnly` view; one thread filling every view of a streamed token (~750
//! MB on A's 64-expert trunk, 4-bit values interleaved on the way) took 72 of
//! its ~100 ms on a fast file system. The view is split into parts of whole
//! rows, filled side by side on rayon's threads, idle while the host waits
//! on the expert reads (BENCHMARKS.md, "pool writes side by side").

use rayon::prelude::*;
use slotstream_backend::rows_per_part;
use wgpu::WriteOnly;

/// One part of a view, filled on another thread.
struct Part<'a>(WriteOnly<'a, [u8]>);

// SAFETY: a `WriteOnly<'_, [u8]>` is an exclusive, write-only reference to
// bytes, like `&mut [u8]`, which is `Send`; wgpu-types implements `Send` only
// for sized `T` (`WriteOnly<'_, T>` with `T: Send`), not for slices.
unsafe impl Send for Part<'_> {}

/// Fills `dst` from `src`, rows of `src_row` bytes becoming rows of
/// `dst_row` bytes, `fill(src_rows, dst_rows)` on whole rows, in parts of
/// about `part_bytes` (of `dst`) side by side; on this thread alone where
/// `part_bytes` is 0 or `dst` is smaller than two parts.
pub(crate) fn fill_rows(
    src: &[u8],
    src_row: usize,
    dst: &mut WriteOnly<'_, [u8]>,
    dst_row: usize,
    part_bytes: usize,
    fill: impl Fn(&[u8], &mut WriteOnly<'_, [u8]>) + Sync,
) {
    let rows = src.len() / src_row.max(1);
    let per = rows_per_part(rows, dst_row, part_bytes);
    if per >= rows || src_row == 0 || dst_row == 0 {
        return fill(src, dst);
    }
    let mut parts = Vec::with_capacity(rows.div_ceil(per));
    let mut rest = dst.slice(..);
    for s in src.chunks(per * src_row) {
        let (head, tail) = rest.split_at(s.len() / src_row * dst_row);
        parts.push((s, Part(head)));
        rest = tail;
    }
    parts.into_par_iter().for_each(|(s, mut d)| fill(s, &mut d.0));
}

#[cfg(test)]
mod tests {
    use super::fill_rows;
    use wgpu::WriteOnly;

    /// Split or not, every destination row is its source row transformed,
    /// and nothing past the rows is written.
    #[test]
    fn parts_fill_every_row_once() {
        let src: Vec<u8> = (0..37 * 12).map(|i| (i * 7 + 3) as u8).collect();
        for part in [0, 1, 24, 48, 100, 1 << 20] {
            let mut out = vec![0xAAu8; 37 * 24 + 5];
            let mut view = WriteOnly::from(&mut out[..37 * 24]);
            // Each source row of 12 bytes becomes 24: each byte twice.
            fill_rows(&src, 12, &mut view, 24, part, |s, d| {
                let doubled: Vec<u8> = s.iter().flat_map(|&b| [b, b]).collect();
                d.slice(..doubled.len()).copy_from_slice(&doubled);
            });
            let want: Vec<u8> = src.iter().flat_map(|&b| [b, b]).collect();
            assert_eq!(&out[..37 * 24], &want[..], "part {part}");
            assert!(out[37 * 24..].iter().all(|&b| b == 0xAA), "part {part}");
        }
    }
}
