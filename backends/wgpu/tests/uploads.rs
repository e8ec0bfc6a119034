//! Uploads go out a chunk at a time (`gpu/uploads.rs`): loading weights
//! and writing the expert pool submit each chunk of staged bytes instead of
//! leaving them all for the first prompt's submission, and what lands is
//! what was written.

mod common;

use common::check::{affine, matrix, up, TOL};
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, ExpertLayout, ExpertMatrix, ExpertPool, Gating, HostExpert};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};

#[test]
fn staged_uploads_go_out_a_chunk_at_a_time() {
    // Opened only where the shared test device is (SLOTSTREAM_SKIP_GPU_TESTS).
    if gpu().is_none() {
        return;
    }
    let chunk = 1 << 20;
    let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions { upload_chunk: chunk, map_primary: false, ..WgpuOptions::from_env() })
        .expect("opening the device");
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(37);
    let format = affine(4, 64);
    let (rows, cols) = (512, 1024);
    // Eight weights of 288 KiB each (values, scales and biases), 2.25 chunks.
    let weights: Vec<_> = (0..8).map(|_| matrix(&mut rng, format, 1, rows, cols)).collect();
    let before = g.upload_submissions();
    let loaded: Vec<_> = weights.iter().map(|m| g.load_weight(m).expect("load")).collect();
    let after_weights = g.upload_submissions();
    let staged = 8 * (rows * cols / 2 + 2 * 2 * rows * cols / 64) as u64;
    assert!(
        after_weights - before >= staged / chunk - 1,
        "{staged} bytes of weights went out in {} submissions of {chunk}-byte chunks",
        after_weights - before
    );
    // What landed is what was written.
    let x = rng.vec(cols, 2.0);
    for (m, w) in weights.iter().zip(&loaded) {
        let got = g.download(&g.matmul(&up(&g, &x, &[1, cols]), w).expect("product")).expect("download");
        let want = cpu.download(&cpu.matmul(&up(&cpu, &x, &[1, cols]), &cpu.load_weight(m).expect("load")).expect("product")).expect("download");
        assert!(rel_l2(&got, &want) <= TOL, "a weight uploaded in chunks differs from the CPU's product");
    }
}

/// Pool writes through staging wait for the pool's table to be mapped and
/// go out then in one submission, or once a chunk's worth (or
/// `pool_send_every`) is staged; with `pool_send_every` 0, each goes out as
/// it is written.
#[test]
fn pool_writes_go_out_at_the_tables_mapping_or_a_chunk_at_a_time() {
    if gpu().is_none() {
        return;
    }
    let chunk = 1 << 20;
    let mut rng = Rng::new(43);
    let format = affine(4, 64);
    let (rows, cols) = (512, 1024);
    // ~864 KiB per expert: under a chunk, two over it.
    let layout = ExpertLayout { hidden: cols, intermediate: rows, gate: format, up: format, down: format };
    let experts: Vec<HostExpert<'static>> = (0..3)
        .map(|_| HostExpert { gate: matrix(&mut rng, format, 1, rows, cols), up: matrix(&mut rng, format, 1, rows, cols), down: matrix(&mut rng, format, 1, cols, rows) })
        .collect();
    // (send every, submissions as each expert is written, at the first mapping)
    for (every, want, at_mapping) in [(u64::MAX, [0, 0, 1], 1), (0, [1, 1, 1], 0), (512 << 10, [1, 1, 1], 0)] {
        let options = WgpuOptions { upload_chunk: chunk, map_primary: false, pool_send_every: every, ..WgpuOptions::from_env() };
        let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("opening the device");
        let mut pool = g.new_expert_pool(&layout, 3, 3).expect("pool");
        let sends = |g: &WgpuBackend, act: &mut dyn FnMut()| {
            let before = g.upload_submissions();
            act();
            g.upload_submissions() - before
        };
        let sent: Vec<u64> = (0..3)
            .map(|slot| {
                let written = sends(&g, &mut || g.write_expert(&mut pool, slot, &experts[slot]).expect("write"));
                if slot == 0 {
                    let mapped = sends(&g, &mut || g.map_experts(&mut pool, &[(0, Some(0))]).expect("map"));
                    assert_eq!(mapped, at_mapping, "every {every}: the table's mapping sent {mapped} submissions");
                }
                written
            })
            .collect();
        assert_eq!(sent, want, "every {every}: submissions as each ~864 KiB expert was written, with a {chunk}-byte chunk");
    }
}

/// Pool writes through staging go through buffers reused from one write to
/// the next: experts written over and over into the same slots (more bytes
/// than one staging buffer holds, over many sends) land as written each
/// time (the MoE output over the slots equals the CPU backend's).
#[test]
fn pool_writes_reuse_their_staging_and_land_as_written() {
    if gpu().is_none() {
        return;
    }
    // And with each write's staging of its own (`reuse_staging: false`), with
    // a wait for earlier uploads between writes (a 1 MiB upload chunk), and
    // written whole or matrix by matrix, each sent at once or
    // (`pool_send_every` u64::MAX) all at the table's mapping, or once a chunk's
    // worth is staged (a 1 MiB chunk: each expert's 1.5 MiB).
    for (reuse_staging, upload_chunk, by_matrix, per_layer) in [
        (true, 256 << 20, false, false),
        (false, 256 << 20, false, false),
        (true, 1 << 20, false, false),
        (true, 256 << 20, true, false),
        (true, 256 << 20, true, true),
        (true, 256 << 20, false, true),
        (true, 1 << 20, true, true),
        (false, 256 << 20, true, true),
    ] {
        let pool_send_every = if per_layer { u64::MAX } else { 0 };
        let options = WgpuOptions { map_primary: false, reuse_staging, upload_chunk, pool_send_every, ..WgpuOptions::from_env() };
        let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("opening the device");
        rewrite_slots(&g, by_matrix);
    }
    // Each write's views filled on this thread alone, and in 4 KiB parts
    // side by side (the default splits the 512 KiB matrices in four).
    for pool_write_part in [0, 4 << 10] {
        let options = WgpuOptions { map_primary: false, pool_write_part, ..WgpuOptions::from_env() };
        let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("opening the device");
        rewrite_slots(&g, true);
    }
}

fn rewrite_slots(g: &WgpuBackend, by_matrix: bool) {
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(41);
    let format = affine(4, 64);
    // 1.5 MiB of 4-bit values per expert (plus scales and biases).
    let (hidden, inter, top_k) = (2048, 512, 2);
    let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
    let experts: Vec<HostExpert<'static>> = (0..4)
        .map(|_| HostExpert { gate: matrix(&mut rng, format, 1, inter, hidden), up: matrix(&mut rng, format, 1, inter, hidden), down: matrix(&mut rng, format, 1, hidden, inter) })
        .collect();
    let x = rng.vec(hidden, 2.0);
    // Token 0 routed to experts 2 and 0.
    let logits = [2.0f32, -4.0, 2.5];
    let gating = Gating { experts: 3, top_k, normalize: true };
    let mut pools = (g.new_expert_pool(&layout, 3, 3).expect("pool"), cpu.new_expert_pool(&layout, 3, 3).expect("pool"));
    assert!(!g.uses_mapped_primary_buffers(), "the pool must take the staged path here");
    // Each round writes the three slots with a different choice of experts.
    for round in 0..6 {
        let run = |b: &dyn Backend, pool: &mut ExpertPool| -> Vec<f32> {
            for slot in 0..3 {
                let e = &experts[(slot + round) % experts.len()];
                if by_matrix {
                    for which in ExpertMatrix::ALL {
                        b.write_expert_matrix(pool, slot, which, e.matrix(which)).expect("write");
                    }
                } else {
                    b.write_expert(pool, slot, e).expect("write");
                }
            }
            b.map_experts(pool, &[(0, Some(2)), (1, Some(1)), (2, Some(0))]).expect("map");
            let routes = b.route(&up(b, &logits, &[1, 3]), gating).expect("route");
            b.download(&b.moe(&up(b, &x, &[1, hidden]), pool, &routes, 0).expect("moe")).expect("download")
        };
        let (got, want) = (run(g, &mut pools.0), run(&cpu, &mut pools.1));
        assert!(rel_l2(&got, &want) <= TOL, "round {round}: experts written through reused staging differ from the CPU's: rel l2 {}", rel_l2(&got, &want));
    }
}

/// An activation asks the free list for a buffer of its size, and a free one
/// of up to twice that size serves it: a prompt's last, shorter chunk runs in
/// the buffers its full chunks used instead of creating a second set. The
/// products computed in the larger buffers are the CPU's.
#[test]
fn a_shorter_activation_reuses_a_larger_free_buffer() {
    if gpu().is_none() {
        return;
    }
    let g = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions::from_env()).expect("opening the device");
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(53);
    let (rows, cols) = (256, 512);
    let m = matrix(&mut rng, affine(4, 64), 1, rows, cols);
    let (gw, cw) = (g.load_weight(&m).expect("load"), cpu.load_weight(&m).expect("load"));
    let mut product = |tokens: usize| {
        let x = rng.vec(tokens * cols, 2.0);
        let got = g.download(&g.matmul(&up(&g, &x, &[tokens, cols]), &gw).expect("product")).expect("download");
        let want = cpu.download(&cpu.matmul(&up(&cpu, &x, &[tokens, cols]), &cw).expect("product")).expect("download");
        assert!(rel_l2(&got, &want) <= TOL, "a {tokens}-row product differs from the CPU's");
    };
    product(64);
    g.take_creations();
    // 40 rows: every activation fits in the 64-row product's freed buffers.
    product(40);
    let (created, bytes, _) = g.take_creations();
    assert_eq!((created, bytes), (0, 0), "a 40-row product after a 64-row one created {created} buffers ({bytes} bytes)");
    // 16 rows: a quarter of the size; a 64-row buffer is not held for it.
    product(16);
    assert!(g.take_creations().0 > 0, "a 16-row product took buffers four times its size");
}
