//! A call's expert pieces read in as few reads as the file layout allows.
//!
//! mlx-lm stacks each projection's values, scales and biases over the
//! experts, each in its own tensor: one expert's nine pieces lie in nine
//! tensors, whole tensors apart (26 MB between an expert's scales and its
//! biases in the flagship), and no read can join them. Within one tensor the
//! experts sit in id order, so the same piece of two experts of a call whose
//! slices are adjacent, or a small gap apart, joins into one read: the gap's
//! bytes are read and dropped, which costs less than a read of its own
//! (each O_DIRECT read pays the disk's latency; [`JOIN_GAP`]). A decode's few
//! misses of 512 experts seldom neighbour each other; a prefill chunk's,
//! which miss most of a layer, join into runs of [`MAX_READ`] bytes.
//!
//! The pieces of a joined read are views of its one buffer, which goes back
//! to the store's kept buffers once the last of them is dropped.

use std::sync::Arc;

use crate::direct_io::RangeBuf;

/// One contiguous byte range of one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub file: u32,
    pub offset: u64,
    pub len: u64,
}

/// Largest gap between two pieces of one file that a read spans to join
/// them: 64 KiB, ~40 us at 1.5 GB/s, less than a read's own latency on the
/// disks measured (BENCHMARKS.md, the flagship section). Two experts' scales
/// (51,200 bytes each in the flagship) join across one expert between them.
pub const JOIN_GAP: u64 = 64 << 10;

/// Largest joined read: a few records' worth, so that a prefill's misses
/// still spread over the read threads and a buffer is not held for long.
pub const MAX_READ: u64 = 8 << 20;

/// One read of a plan: the span it reads and, per piece it covers, the
/// piece's index in the list planned and where it starts in the span.
#[derive(Clone, Debug, PartialEq)]
pub struct Read {
    pub span: Piece,
    pub parts: Vec<(usize, usize)>,
}

/// The reads that cover `pieces`: pieces of one file at most `gap` bytes
/// apart join while the span stays within `max` bytes. Reads come in the
/// order of their first piece in `pieces`, so a caller that lists pieces
/// record by record gets its first records' reads first.
pub fn plan(pieces: &[&Piece], gap: u64, max: u64) -> Vec<Read> {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&n| (pieces[n].file, pieces[n].offset, n));
    let mut reads: Vec<Read> = Vec::new();
    for n in order {
        let p = pieces[n];
        if let Some(r) = reads.last_mut() {
            let end = r.span.offset + r.span.len;
            let joined_end = end.max(p.offset + p.len);
            if r.span.file == p.file && p.offset.saturating_sub(end) <= gap && joined_end - r.span.offset <= max {
                r.parts.push((n, (p.offset - r.span.offset) as usize));
                r.span.len = joined_end - r.span.offset;
                continue;
            }
        }
        reads.push(Read { span: *p, parts: vec![(n, 0)] });
    }
    reads.sort_by_key(|r| r.parts.iter().map(|&(n, _)| n).min());
    reads
}

/// One piece's bytes: a view of the read that brought it.
pub struct PieceBuf {
    read: Arc<RangeBuf>,
    at: usize,
    len: usize,
}

impl PieceBuf {
    pub fn bytes(&self) -> &[u8] {
        &self.read.bytes()[self.at..self.at + self.len]
    }
}

/// The views of a landed read's pieces: (index in the list planned, bytes),
/// each piece's length from `pieces`.
pub fn split(read: RangeBuf, plan: &Read, pieces: &[&Piece]) -> Vec<(usize, PieceBuf)> {
    let read = Arc::new(read);
    plan.parts.iter().map(|&(n, at)| (n, PieceBuf { read: Arc::clone(&read), at, len: pieces[n].len as usize })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(file: u32, offset: u64, len: u64) -> Piece {
        Piece { file, offset, len }
    }

    fn spans(reads: &[Read]) -> Vec<(u32, u64, u64)> {
        reads.iter().map(|r| (r.span.file, r.span.offset, r.span.len)).collect()
    }

    #[test]
    fn adjacent_and_near_pieces_join_far_ones_and_other_files_do_not() {
        let list = [
            piece(0, 1000, 100), // 0
            piece(0, 0, 100),    // 1: 900 bytes before 0
            piece(0, 100, 50),   // 2: adjacent to 1
            piece(1, 150, 10),   // 3: another file
            piece(0, 5000, 10),  // 4: far from the rest
        ];
        let refs: Vec<&Piece> = list.iter().collect();
        let joined = plan(&refs, 1000, 1 << 20);
        // 1, 2 and 0 join (gap 850), in the order of their first piece (0).
        assert_eq!(spans(&joined), vec![(0, 0, 1100), (1, 150, 10), (0, 5000, 10)]);
        assert_eq!(joined[0].parts, vec![(1, 0), (2, 100), (0, 1000)]);
        // With no gap allowed only the adjacent pair joins.
        let tight = plan(&refs, 0, 1 << 20);
        assert_eq!(spans(&tight), vec![(0, 1000, 100), (0, 0, 150), (1, 150, 10), (0, 5000, 10)]);
        // The span bound splits a run.
        let short = plan(&refs, 1000, 150);
        assert_eq!(spans(&short), vec![(0, 1000, 100), (0, 0, 150), (1, 150, 10), (0, 5000, 10)]);
    }

    #[test]
    fn every_piece_is_covered_once_at_its_place() {
        // Stacked tensors of 8 experts: pieces of 3 tensors for experts 1, 2, 5.
        let (tensors, per) = ([0u64, 10_000, 20_000], 1000u64);
        let list: Vec<Piece> =
            [1u64, 2, 5].iter().flat_map(|&e| tensors.iter().map(move |&t| piece(0, t + e * per, per))).collect();
        let refs: Vec<&Piece> = list.iter().collect();
        let reads = plan(&refs, 0, u64::MAX);
        assert_eq!(reads.len(), 6, "experts 1 and 2 join in each tensor, 5 stands alone");
        let mut seen = vec![0; list.len()];
        for r in &reads {
            for &(n, at) in &r.parts {
                seen[n] += 1;
                assert_eq!(r.span.offset + at as u64, list[n].offset);
                assert!(at as u64 + list[n].len <= r.span.len);
            }
        }
        assert!(seen.iter().all(|&s| s == 1));
    }
}
