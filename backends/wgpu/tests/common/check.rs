//! The kernel tests' comparison with the CPU backend and their snapshots
//! (see `kernels.rs`), and seeded weights in every format.

use std::borrow::Cow;

use half::{bf16, f16};
use slotstream_backend::{Backend, DType, HostMatrix, MatrixData, MatrixFormat, Tensor};
use slotstream_cpu::CpuBackend;

use super::{gpu, rel_l2, Rng};

pub const TOL: f64 = 1e-5;

/// `v` rounded to `digits` significant digits.
pub fn significant(v: f64, digits: i32) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let scale = 10f64.powi(digits - 1 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

pub fn snapshot(name: &str, values: &[f32]) {
    let rounded: Vec<f64> = values.iter().take(24).map(|v| significant(*v as f64, 4)).collect();
    let l2: f64 = values.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
    // Keys in alphabetical order: the same text whether or not serde_json
    // keeps insertion order (the workspace turns `preserve_order` on).
    let summary = serde_json::json!({ "first": rounded, "l2": (l2 * 1e3).round() / 1e3, "len": values.len() });
    insta::with_settings!({ snapshot_path => "../../../../snapshots", prepend_module_to_snapshot => false }, {
        insta::assert_json_snapshot!(format!("wgpu_{name}"), summary);
    });
}

/// Runs `op` on both backends, checks agreement within `tol` and snapshots the GPU output.
pub fn check(name: &str, tol: f64, op: impl Fn(&dyn Backend) -> Tensor) {
    let Some(g) = gpu() else { return };
    let cpu = CpuBackend::exact();
    let want = cpu.download(&op(&cpu)).expect("cpu download");
    let got = g.download(&op(g)).expect("gpu download");
    let err = rel_l2(&got, &want);
    assert!(err <= tol, "{name}: GPU differs from CPU, rel L2 {err:.3e} > {tol:e}");
    snapshot(name, &got);
}

pub fn up(b: &dyn Backend, v: &[f32], shape: &[usize]) -> Tensor {
    b.upload(v, shape).expect("upload")
}

/// A random `[experts, rows, cols]` matrix in `format`.
pub fn matrix(rng: &mut Rng, format: MatrixFormat, experts: usize, rows: usize, cols: usize) -> HostMatrix<'static> {
    let n = experts * rows * cols;
    let data = match format {
        MatrixFormat::Dense(DType::F32) => MatrixData::Dense { dtype: DType::F32, bytes: Cow::Owned(bytemuck::cast_slice(&rng.vec(n, 1.0)).to_vec()) },
        MatrixFormat::Dense(DType::F16) => MatrixData::Dense {
            dtype: DType::F16,
            bytes: Cow::Owned(rng.vec(n, 1.0).iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()),
        },
        MatrixFormat::Dense(DType::BF16) => MatrixData::Dense {
            dtype: DType::BF16,
            bytes: Cow::Owned(rng.vec(n, 1.0).iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()),
        },
        MatrixFormat::Affine { bits, group_size, scale_dtype } => {
            let groups = n / group_size;
            let words: Vec<u8> = (0..n * bits as usize / 32).flat_map(|_| rng.bits().to_le_bytes()).collect();
            let scales: Vec<f32> = rng.vec(groups, 0.02);
            let biases: Vec<f32> = rng.vec(groups, 0.2);
            let enc = |v: &[f32]| -> Vec<u8> {
                match scale_dtype {
                    DType::F32 => bytemuck::cast_slice(v).to_vec(),
                    DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
                    DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
                }
            };
            MatrixData::Affine {
                bits,
                group_size,
                words: Cow::Owned(words),
                scale_dtype,
                scales: Cow::Owned(enc(&scales)),
                biases: Cow::Owned(enc(&biases)),
            }
        }
    };
    HostMatrix { experts, rows, cols, data }
}

pub fn affine(bits: u32, group_size: usize) -> MatrixFormat {
    MatrixFormat::Affine { bits, group_size, scale_dtype: DType::BF16 }
}

pub fn format_name(f: MatrixFormat) -> String {
    match f {
        MatrixFormat::Dense(d) => format!("{d:?}").to_lowercase(),
        MatrixFormat::Affine { bits, group_size, scale_dtype } => format!("q{bits}g{group_size}_{}", format!("{scale_dtype:?}").to_lowercase()),
    }
}
