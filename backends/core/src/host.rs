//! Weights as they arrive from a checkpoint, before a backend takes them over.

use std::borrow::Cow;

use crate::{shape_error, BackendError, Result};

/// Floating-point element types found in checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Converts little-endian bytes of this type to f32.
    pub fn to_f32(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }
}

/// The bytes of a matrix in one of the supported storage formats.
#[derive(Clone, Debug)]
pub enum MatrixData<'a> {
    /// Plain floats, `[experts, rows, cols]`.
    Dense { dtype: DType, bytes: Cow<'a, [u8]> },
    /// MLX affine quantization: each row packs `cols` values of `bits` bits into
    /// little-endian u32 words (value `i` of a word at bits `bits*i..`), and each
    /// group of `group_size` values has a scale and a bias: `w = scale * q + bias`.
    Affine {
        bits: u32,
        group_size: usize,
        words: Cow<'a, [u8]>,
        scale_dtype: DType,
        scales: Cow<'a, [u8]>,
        biases: Cow<'a, [u8]>,
    },
}

/// A weight matrix (or a stack of per-expert matrices) in host memory.
#[derive(Clone, Debug)]
pub struct HostMatrix<'a> {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData<'a>,
}

impl<'a> HostMatrix<'a> {
    /// Bytes per row of each stored piece: (values, scales, biases).
    fn row_bytes(&self) -> (usize, usize, usize) {
        match &self.data {
            MatrixData::Dense { dtype, .. } => (self.cols * dtype.size(), 0, 0),
            MatrixData::Affine { bits, group_size, scale_dtype, .. } => {
                let values = self.cols * *bits as usize / 8;
                let groups = self.cols / group_size;
                (values, groups * scale_dtype.size(), groups * scale_dtype.size())
            }
        }
    }

    /// Checks that the byte lengths agree with the declared shape.
    pub fn validate(&self) -> Result<()> {
        let total_rows = self.experts * self.rows;
        let (v, s, b) = self.row_bytes();
        let check = |what: &str, have: usize, per_row: usize| -> Result<()> {
            if have != per_row * total_rows {
                return Err(shape_error(
                    "load_weight",
                    format!(
                        "{what}: {have} bytes, expected {} for [{} x {} x {}]",
                        per_row * total_rows,
                        self.experts,
                        self.rows,
                        self.cols
                    ),
                ));
            }
            Ok(())
        };
        match &self.data {
            MatrixData::Dense { bytes, .. } => check("values", bytes.len(), v),
            MatrixData::Affine { bits, group_size, words, scales, biases, .. } => {
                if !matches!(bits, 2 | 4 | 8) {
                    return Err(BackendError::Unsupported(format!(
                        "{bits}-bit affine quantization is not supported yet (supported: 2, 4 and 8 bits)"
                    )));
                }
                if *group_size == 0 || self.cols % group_size != 0 {
                    return Err(shape_error(
                        "load_weight",
                        format!("{} columns are not a multiple of group size {group_size}", self.cols),
                    ));
                }
                if (self.cols * *bits as usize) % 32 != 0 {
                    return Err(shape_error(
                        "load_weight",
                        format!("{} columns of {bits} bits do not fill whole u32 words", self.cols),
                    ));
                }
                check("packed weights", words.len(), v)?;
                check("scales", scales.len(), s)?;
                check("biases", biases.len(), b)
            }
        }
    }

    /// Reorders rows within every expert: output row `i` is input row `order[i]`.
    /// Used to turn interleaved fused projections into contiguous blocks.
    pub fn permute_rows(&self, order: &[usize]) -> Result<HostMatrix<'static>> {
        if order.len() != self.rows || order.iter().any(|&r| r >= self.rows) {
            return Err(shape_error("permute_rows", "order is not a permutation of the rows"));
        }
        let (v, s, b) = self.row_bytes();
        let gather = |bytes: &[u8], per_row: usize| -> Vec<u8> {
            let mut out = Vec::with_capacity(bytes.len());
            for e in 0..self.experts {
                let base = e * self.rows * per_row;
                for &r in order {
                    out.extend_from_slice(&bytes[base + r * per_row..base + (r + 1) * per_row]);
                }
            }
            out
        };
        let data = match &self.data {
            MatrixData::Dense { dtype, bytes } => {
                MatrixData::Dense { dtype: *dtype, bytes: Cow::Owned(gather(bytes, v)) }
            }
            MatrixData::Affine { bits, group_size, words, scale_dtype, scales, biases } => {
                MatrixData::Affine {
                    bits: *bits,
                    group_size: *group_size,
                    words: Cow::Owned(gather(words, v)),
                    scale_dtype: *scale_dtype,
                    scales: Cow::Owned(gather(scales, s)),
                    biases: Cow::Owned(gather(biases, b)),
                }
            }
        };
        Ok(HostMatrix { experts: self.experts, rows: self.rows, cols: self.cols, data })
    }

    /// Stacks single matrices of one format into `[parts.len(), rows, cols]`.
    pub fn stack(parts: &[HostMatrix<'_>]) -> Result<HostMatrix<'static>> {
        let first = parts.first().ok_or_else(|| shape_error("stack", "nothing to stack"))?;
        if let Some(p) = parts.iter().find(|p| (p.rows, p.cols) != (first.rows, first.cols)) {
            return Err(shape_error("stack", format!("[{} x {}] vs [{} x {}]", p.rows, p.cols, first.rows, first.cols)));
        }
        let refs: Vec<&HostMatrix<'_>> = parts.iter().collect();
        let data = concat_bytes("stack", &refs)?;
        let experts = parts.iter().map(|p| p.experts).sum();
        let m = HostMatrix { experts, rows: first.rows, cols: first.cols, data };
        m.validate()?;
        Ok(m)
    }

    /// The rows of single matrices of one format (same columns) one after
    /// another: `[sum of rows, cols]` (several projections fused into one weight).
    pub fn concat_rows(parts: &[&HostMatrix<'_>]) -> Result<HostMatrix<'static>> {
        let first = parts.first().ok_or_else(|| shape_error("concat_rows", "nothing to concatenate"))?;
        if let Some(p) = parts.iter().find(|p| p.experts != 1 || p.cols != first.cols) {
            return Err(shape_error(
                "concat_rows",
                format!("[{} x {} x {}] vs {} columns of single matrices", p.experts, p.rows, p.cols, first.cols),
            ));
        }
        let data = concat_bytes("concat_rows", parts)?;
        let m = HostMatrix { experts: 1, rows: parts.iter().map(|p| p.rows).sum(), cols: first.cols, data };
        m.validate()?;
        Ok(m)
    }

    /// Dequantizes or converts everything to f32 `[experts*rows*cols]`. For tests
    /// and small tensors; backends use their own kernels.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            MatrixData::Dense { dtype, bytes } => dtype.to_f32(bytes),
            MatrixData::Affine { bits, group_size, words, scale_dtype, scales, biases } => {
                let scales = scale_dtype.to_f32(scales);
                let biases = scale_dtype.to_f32(biases);
                let words: Vec<u32> = words
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let n = self.experts * self.rows * self.cols;
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    let q = unpack(&words, *bits, i);
                    let g = i / group_size;
                    out.push(scales[g] * q as f32 + biases[g]);
                }
                out
            }
        }
    }
}

/// The stored bytes of `parts` one after another, in the first part's format
/// (every part must share it).
fn concat_bytes(op: &'static str, parts: &[&HostMatrix<'_>]) -> Result<MatrixData<'static>> {
    let first = parts.first().ok_or_else(|| shape_error(op, "no parts"))?;
    let mut out = match &first.data {
        MatrixData::Dense { dtype, .. } => MatrixData::Dense { dtype: *dtype, bytes: Cow::Owned(Vec::new()) },
        MatrixData::Affine { bits, group_size, scale_dtype, .. } => MatrixData::Affine {
            bits: *bits,
            group_size: *group_size,
            words: Cow::Owned(Vec::new()),
            scale_dtype: *scale_dtype,
            scales: Cow::Owned(Vec::new()),
            biases: Cow::Owned(Vec::new()),
        },
    };
    for p in parts {
        match (&mut out, &p.data) {
            (MatrixData::Dense { dtype, bytes }, MatrixData::Dense { dtype: d, bytes: b }) if dtype == d => {
                bytes.to_mut().extend_from_slice(b)
            }
            (
                MatrixData::Affine { bits, group_size, words, scale_dtype, scales, biases },
                MatrixData::Affine { bits: pb, group_size: pg, words: pw, scale_dtype: psd, scales: ps, biases: pbi },
            ) if (*bits, *group_size, *scale_dtype) == (*pb, *pg, *psd) => {
                words.to_mut().extend_from_slice(pw);
                scales.to_mut().extend_from_slice(ps);
                biases.to_mut().extend_from_slice(pbi);
            }
            _ => return Err(shape_error(op, "parts are stored in different formats")),
        }
    }
    Ok(out)
}

/// Value `i` of a packed little-endian bit stream of `bits`-bit values.
pub fn unpack(words: &[u32], bits: u32, i: usize) -> u32 {
    let bit = i * bits as usize;
    let (w, off) = (bit / 32, (bit % 32) as u32);
    let mask = (1u64 << bits) - 1;
    let lo = words[w] as u64 >> off;
    let v = if off + bits > 32 { lo | ((words[w + 1] as u64) << (32 - off)) } else { lo };
    (v & mask) as u32
}
