//! A one-token residual norm whose normed row goes to a matmul runs inside
//! the product's kernel (`matvec_norm`, interleaved 4-bit weights): the
//! product, the sum and the normed row equal the CPU's `add_rms_norm` then
//! `matmul`, for both row-group sizes and split quads, also when another op
//! comes between the two (the norm is then recorded on its own) and for rows
//! too long for the kernel (composed).

mod common;

use common::check::{affine, matrix, TOL};
use common::{rel_l2, Rng};
use slotstream_backend::{Backend, Tensor};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend};

fn up(b: &dyn Backend, v: &[f32], shape: &[usize]) -> Tensor {
    b.upload(v, shape).expect("upload")
}

#[test]
fn a_matmul_after_the_residual_norm_takes_it_in() {
    if common::gpu().is_none() {
        return;
    }
    // A backend of its own: its kernel profile counts the fused dispatches.
    let g = WgpuBackend::new(&AdapterChoice::allow_software()).expect("a wgpu device");
    g.set_profiling(true).expect("timestamp queries (the profile counts dispatches)");
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(31);
    // (rows, cols, fused): four rows per subgroup unsplit (256 columns) and
    // split in two (2048) and four (4096); eight rows per subgroup (8192 rows);
    // 4160 columns are too many for the kernel's copy of the row.
    let cases = [(40, 256, true), (100, 2048, true), (36, 4096, true), (8192, 256, true), (24, 4160, false)];
    let mut fused = 0;
    for (rows, cols, fuses) in cases {
        let m = matrix(&mut rng, affine(4, 64), 1, rows, cols);
        let (x, y, w) = (rng.vec(cols, 2.0), rng.vec(cols, 2.0), rng.vec(cols, 1.0));
        for between in [false, true] {
            let run = |b: &dyn Backend| {
                let weight = b.load_weight(&m).unwrap();
                let (h, normed) = b.add_rms_norm(&up(b, &x, &[1, cols]), &up(b, &y, &[1, cols]), &up(b, &w, &[cols]), cols, 1e-6).unwrap();
                let doubled = between.then(|| b.add(&h, &h).unwrap());
                let out = b.matmul(&normed, &weight).unwrap();
                let fetch = |t: &Tensor| b.download(t).unwrap();
                ([fetch(&out), fetch(&h), fetch(&normed)], doubled.as_ref().map(fetch))
            };
            let (got, doubled) = run(&g);
            let (want, want_doubled) = run(&cpu);
            let what = format!("{rows} rows of {cols} columns, an op between: {between}");
            for (name, (a, b)) in ["product", "sum", "normed row"].iter().zip(got.iter().zip(&want)) {
                assert!(rel_l2(a, b) <= TOL, "{what}: the {name} differs from the CPU's: rel L2 {:.3e}", rel_l2(a, b));
            }
            if let (Some(a), Some(b)) = (doubled, want_doubled) {
                assert!(rel_l2(&a, &b) <= TOL, "{what}: the op between read a wrong sum");
            }
            fused += usize::from(fuses && !between);
        }
    }
    let profile = g.kernel_profile();
    let dispatches = profile.iter().find(|(name, _)| name == "matvec_norm").map_or(0, |(_, t)| t.dispatches);
    assert_eq!(dispatches as usize, fused, "matvec_norm dispatches: {profile:?}");
}
