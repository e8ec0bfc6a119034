//! A one-token residual norm whose normed row a product reads next is formed
//! inside that product's workgroups (`matvec_norm`): the product, the sum and
//! the normed row equal the CPU's `add_rms_norm` then `matmul`, whatever the
//! weight's format, width and shards, and also when another op comes between
//! the two (the norm is then recorded on its own, in its place).

mod common;

use common::check::{affine, format_name, matrix, up, TOL};
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, DType, MatrixFormat, Tensor};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};

/// What one run gives back: the product, the sum, the normed row, a second
/// product of the normed row, and the op between (when there is one).
type Outputs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>);

fn run(b: &dyn Backend, m: &slotstream_backend::HostMatrix<'_>, inputs: [&[f32]; 3], between: bool) -> Outputs {
    let cols = m.cols;
    let w = b.load_weight(m).expect("load");
    let (h, normed) = b
        .add_rms_norm(&up(b, inputs[0], &[1, cols]), &up(b, inputs[1], &[1, cols]), &up(b, inputs[2], &[cols]), cols, 1e-6)
        .expect("norm");
    let doubled = between.then(|| b.add(&h, &h).expect("add"));
    let y = b.matmul(&normed, &w).expect("product");
    let again = b.matmul(&normed, &w).expect("second product");
    let fetch = |t: &Tensor| b.download(t).expect("download");
    (fetch(&y), fetch(&h), fetch(&normed), fetch(&again), doubled.as_ref().map(fetch))
}

#[test]
fn a_product_after_the_residual_norm_forms_the_norm_itself() {
    // Opened only where the shared test device is (SLOTSTREAM_SKIP_GPU_TESTS).
    if gpu().is_none() {
        return;
    }
    // Eight rows per subgroup from 64 rows, so small matrices reach that path too.
    let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions { q4_eight_rows_from: 64, norm_in_products: true, ..WgpuOptions::from_env() })
        .expect("opening the device");
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(31);
    let profiled = g.set_profiling(true).is_ok();
    // (format, rows, cols, shard cap in bytes or 0); 4096 columns are past
    // matvec_norm's row and take the norm's own dispatch.
    let cases = [
        (affine(4, 64), 40, 2048, 0),
        (affine(4, 64), 96, 256, 0),
        (affine(4, 32), 40, 3072, 0),
        (affine(8, 64), 24, 512, 0),
        (MatrixFormat::Dense(DType::F32), 12, 1024, 0),
        (affine(4, 64), 200, 512, 16 << 10),
        (affine(4, 64), 16, 4096, 0),
    ];
    for (format, rows, cols, cap) in cases {
        let m = matrix(&mut rng, format, 1, rows, cols);
        let (x, y, w) = (rng.vec(cols, 2.0), rng.vec(cols, 2.0), rng.vec(cols, 1.0));
        g.cap_shard_bytes(cap);
        for between in [false, true] {
            let what = format!("{}, {rows} x {cols}, shard cap {cap}, an op between: {between}", format_name(format));
            let before = g.kernel_profile();
            let got = run(&g, &m, [&x, &y, &w], between);
            let want = run(&cpu, &m, [&x, &y, &w], between);
            for (name, (a, b)) in ["product", "sum", "normed row", "second product"]
                .iter()
                .zip([(&got.0, &want.0), (&got.1, &want.1), (&got.2, &want.2), (&got.3, &want.3)])
            {
                let err = rel_l2(a, b);
                assert!(err <= TOL, "{what}: the {name} differs from the CPU's: rel L2 {err:.3e}");
            }
            if let (Some(a), Some(b)) = (&got.4, &want.4) {
                assert!(rel_l2(a, b) <= TOL, "{what}: the op between read a wrong sum");
            }
            if profiled {
                let count = |p: &[(String, slotstream_wgpu::FamilyTime)], kernel: &str| {
                    p.iter().filter(|(n, _)| n.starts_with(kernel)).map(|(_, t)| t.dispatches).sum::<u64>()
                };
                let after = g.kernel_profile();
                let fused = count(&after, "matvec_norm") - count(&before, "matvec_norm");
                let norms = count(&after, "add_rms_norm") - count(&before, "add_rms_norm");
                let expect_fused = !between && cols <= 3072;
                assert_eq!(fused, expect_fused as u64, "{what}: matvec_norm dispatches");
                assert_eq!(norms, !expect_fused as u64, "{what}: norm dispatches");
            }
        }
    }
    g.cap_shard_bytes(0);
    if !profiled {
        eprintln!("{} has no timestamp queries: the dispatches were not counted", g.name());
    }
}
