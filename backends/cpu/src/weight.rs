//! How the CPU backend stores a weight: f32/f16/bf16 values or MLX affine
//! 2/4/8-bit words with their scales and biases in the stored precision, for
//! one matrix or a stack of expert matrices (the expert pool).

use half::{bf16, f16};
use rayon::prelude::*;
use slotstream_backend::{rows_per_part, shape_error, DType, HostMatrix, MatrixData, MatrixFormat, Result};

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
    pub(crate) fn at(&self, i: usize) -> f32 {
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
    /// same shape and format; a 4-bit matrix's words in parts of about
    /// `part_bytes` on the compute threads side by side (0: this thread alone).
    pub fn write_slot(&mut self, slot: usize, m: &HostMatrix<'_>, part_bytes: usize) -> Result<()> {
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
                let row_words = self.cols / per_word;
                let part = rows_per_part(self.rows, 4 * row_words, part_bytes) * row_words;
                let copy = |(o, c): (&mut [u32], &[u8])| {
                    for (o, c) in o.iter_mut().zip(c.chunks_exact(4)) {
                        *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                };
                if part >= wr.len() {
                    copy((&mut words[wr], w));
                } else {
                    words[wr].par_chunks_mut(part).zip(w.par_chunks(4 * part)).for_each(copy);
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

    pub(crate) fn group_size(&self) -> Option<usize> {
        match &self.store {
            Store::Affine { group_size, .. } => Some(*group_size),
            _ => None,
        }
    }
}

/// A seeded `[rows, cols]` affine matrix with f32 scales, for the kernel tests.
#[cfg(test)]
pub(crate) fn test_matrix(bits: u32, group: usize, rows: usize, cols: usize) -> HostMatrix<'static> {
    use std::borrow::Cow;
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

#[cfg(test)]
mod tests {
    use super::{test_matrix, CpuWeight, Store};

    /// A slot written in parts side by side holds the same words as one
    /// written on this thread, in its own slot only.
    #[test]
    fn a_slot_written_in_parts_holds_the_matrix() {
        let (rows, cols) = (37, 128);
        let m = test_matrix(4, 64, rows, cols);
        let words = |w: &CpuWeight| match &w.store {
            Store::Affine { words, .. } => words.clone(),
            _ => panic!("a 4-bit pool"),
        };
        // Three slots of other words (the seeded matrix, three times as tall).
        let fresh = || CpuWeight { experts: 3, rows, ..CpuWeight::from_host(&test_matrix(4, 64, 3 * rows, cols)) };
        let before = words(&fresh());
        let mut one = fresh();
        one.write_slot(1, &m, 0).expect("write");
        // 64 bytes a part: one row of 128 4-bit columns each.
        for part in [64, 100, 1 << 20] {
            let mut split = fresh();
            split.write_slot(1, &m, part).expect("write");
            assert_eq!(words(&split), words(&one), "{part}-byte parts");
        }
        let (w, n) = (words(&one), rows * cols / 8);
        assert_eq!(w[..n], before[..n], "slot 0 untouched");
        assert_eq!(w[2 * n..], before[2 * n..], "slot 2 untouched");
        assert_ne!(w[n..2 * n], before[n..2 * n], "slot 1 written");
    }
}
