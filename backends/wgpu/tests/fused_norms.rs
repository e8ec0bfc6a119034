//! A one-token residual norm (`add_rms_norm`) taken into the op after it on
//! the GPU: the routing kernel (`moe_route_norm`) and the one-token 4-bit
//! product (`matvec_norm`), against the CPU's separate ops. Each case also
//! puts another op between the norm and its consumer, which must then see
//! the norm recorded on its own, in its place.

mod common;

use common::check::{affine, format_name, matrix, up, TOL};
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{routing, Backend, DType, Gating, MatrixFormat, Tensor};
use slotstream_cpu::CpuBackend;

/// `add_rms_norm` of one token: the sum and the normed row.
fn norm(b: &dyn Backend, [x, y, w]: [&[f32]; 3], cols: usize) -> (Tensor, Tensor) {
    b.add_rms_norm(&up(b, x, &[1, cols]), &up(b, y, &[1, cols]), &up(b, w, &[cols]), cols, 1e-6).unwrap()
}

fn close(what: &str, name: &str, a: &[f32], b: &[f32]) {
    let err = rel_l2(a, b);
    assert!(err <= TOL, "{what}: the {name} differs from the CPU's: rel L2 {err:.3e}");
}

/// A one-token residual norm routed next runs inside the routing kernel
/// (`moe_route_norm`): the routes, the sum and the normed row equal the
/// CPU's `add_rms_norm` then `route_matmul`, also when another op comes
/// between the two (the norm is then recorded on its own, in its place).
#[test]
fn routing_after_the_residual_norm() {
    let Some(g) = gpu() else { return };
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(29);
    let cases = [(affine(8, 64), 16, 1, 8, 2048), (affine(4, 64), 40, 0, 4, 256), (MatrixFormat::Dense(DType::F32), 16, 1, 2, 4096)];
    for (format, experts, extra, top_k, cols) in cases {
        let m = matrix(&mut rng, format, 1, experts + extra, cols);
        let gating = Gating { experts, top_k, normalize: true };
        let (x, y, w) = (rng.vec(cols, 2.0), rng.vec(cols, 2.0), rng.vec(cols, 1.0));
        for between in [false, true] {
            let run = |b: &dyn Backend| {
                let router = b.load_weight(&m).unwrap();
                let (h, normed) = norm(b, [&x, &y, &w], cols);
                let doubled = between.then(|| b.add(&h, &h).unwrap());
                let (routes, more) = b.route_matmul(&normed, &router, gating).unwrap();
                let logits = b.download(&b.matmul(&normed, &router).unwrap()).unwrap();
                let fetch = |t: &Tensor| b.download(t).unwrap();
                (fetch(&routes.tensor), logits, more.as_ref().map(fetch), [fetch(&h), fetch(&normed)], doubled.as_ref().map(fetch))
            };
            let (got, logits, more, rows, doubled) = run(g);
            let (want, _, want_more, want_rows, want_doubled) = run(&cpu);
            let what = format!("{}, {experts} experts, {cols} columns, an op between: {between}", format_name(format));
            let own: Vec<f32> = logits.chunks(experts + extra).flat_map(|r| r[..experts].to_vec()).collect();
            let ids = |v: &[f32]| -> Vec<u32> { v.chunks(2 * top_k).flat_map(|r| r[..top_k].iter().map(|x| x.to_bits())).collect() };
            let weights = |v: &[f32]| -> Vec<f32> { v.chunks(2 * top_k).flat_map(|r| r[top_k..].to_vec()).collect() };
            assert_eq!(ids(&got), ids(&routing::route_rows(&own, gating)), "{what}");
            assert_eq!(ids(&got), ids(&want), "{what}");
            close(&what, "routing weights", &weights(&got), &weights(&want));
            close(&what, "sum", &rows[0], &want_rows[0]);
            close(&what, "normed row", &rows[1], &want_rows[1]);
            match (more, want_more) {
                (Some(a), Some(b)) => close(&what, "extra row", &a, &b),
                (None, None) => assert_eq!(extra, 0, "{what}"),
                _ => panic!("{what}: one backend gave extra rows, the other none"),
            }
            if let (Some(a), Some(b)) = (doubled, want_doubled) {
                close(&what, "op between's input", &a, &b);
            }
        }
    }
}

/// A one-token 4-bit product of the normed row (`matvec_norm`): rows that
/// leave the last quad short, rows of 256 to 4096 columns (a partial
/// interleaved tile at 1280), bf16 and f16 scales, and 8200 rows (which the
/// plain matvec takes eight to a subgroup).
#[test]
fn product_after_the_residual_norm() {
    let Some(g) = gpu() else { return };
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(31);
    let f16 = MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::F16 };
    let cases = [(affine(4, 64), 1030, 2048), (f16, 77, 1280), (affine(4, 32), 13, 256), (affine(4, 64), 40, 4096), (affine(4, 64), 8200, 256)];
    for (format, rows, cols) in cases {
        let m = matrix(&mut rng, format, 1, rows, cols);
        let (x, y, w) = (rng.vec(cols, 2.0), rng.vec(cols, 2.0), rng.vec(cols, 1.0));
        for between in [false, true] {
            let run = |b: &dyn Backend| {
                let weight = b.load_weight(&m).unwrap();
                let (h, normed) = norm(b, [&x, &y, &w], cols);
                let doubled = between.then(|| b.add(&h, &h).unwrap());
                let product = b.matmul(&normed, &weight).unwrap();
                let fetch = |t: &Tensor| b.download(t).unwrap();
                [fetch(&product), fetch(&h), fetch(&normed), doubled.as_ref().map_or(Vec::new(), fetch)]
            };
            let (got, want) = (run(g), run(&cpu));
            let what = format!("{}, {rows} x {cols}, an op between: {between}", format_name(format));
            for (name, (a, b)) in ["product", "sum", "normed row", "op between's input"].iter().zip(got.iter().zip(&want)) {
                close(&what, name, a, b);
            }
        }
    }
}
