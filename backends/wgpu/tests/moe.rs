//! The MoE kernels against the CPU backend: routing, the slot table and the
//! expert FFN over it (see `kernels.rs` for the tolerance and snapshots).

mod common;

use common::check::{affine, check, format_name, matrix, up, TOL};
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{routing, Backend, DType, ExpertLayout, ExpertPool, Gating, HostExpert, MatrixFormat, Routes, Tensor};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};

/// Router logits that pick, for token `t`, the experts `picks[t]` in that
/// order (the rest far below), with a spread of weights.
fn logits_picking(experts: usize, picks: &[&[u32]]) -> Vec<f32> {
    let mut v = vec![-4.0f32; experts * picks.len()];
    for (t, ids) in picks.iter().enumerate() {
        for (rank, &e) in ids.iter().enumerate() {
            v[t * experts + e as usize] = 2.0 - 0.5 * rank as f32 + 0.1 * t as f32;
        }
    }
    v
}

/// A pool of 3 slots and a slot table of 2 layers x 4 experts, with layer 1
/// (keys 4..8) mapped as expert 0 -> slot 2, 1 -> 0, 2 -> 1, 3 -> none.
fn layer1_pool(b: &dyn Backend, layout: &ExpertLayout, experts: &[HostExpert<'static>]) -> ExpertPool {
    let mut pool = b.new_expert_pool(layout, 3, 8).unwrap();
    for (slot, e) in experts.iter().enumerate() {
        let e = HostExpert { gate: e.gate.clone(), up: e.up.clone(), down: e.down.clone() };
        b.write_expert(&mut pool, slot, &e).unwrap();
    }
    // Layer 0's entries point at slots too: they must not leak into layer 1.
    let entries = [(0, Some(0)), (1, Some(1)), (4, Some(2)), (5, Some(0)), (6, Some(1)), (7, None)];
    b.map_experts(&mut pool, &entries).unwrap();
    pool
}

fn random_experts(rng: &mut Rng, format: MatrixFormat, hidden: usize, inter: usize, n: usize) -> Vec<HostExpert<'static>> {
    (0..n)
        .map(|_| HostExpert {
            gate: matrix(rng, format, 1, inter, hidden),
            up: matrix(rng, format, 1, inter, hidden),
            down: matrix(rng, format, 1, hidden, inter),
        })
        .collect()
}

#[test]
fn routing_kernel_matches_the_host_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(17);
    for (experts, top_k, normalize) in [(40, 3, true), (512, 10, true), (16, 8, false), (300, 1, true), (1100, 4, true)] {
        let tokens = 5;
        let mut logits = rng.vec(tokens * experts, 3.0);
        // Exact ties: the lower id must win on both sides.
        logits[7] = logits[3];
        logits[experts + 1] = 9.0;
        logits[experts + 2] = 9.0;
        let gating = Gating { experts, top_k, normalize };
        let want = routing::route_rows(&logits, gating);
        let routes = g.route(&up(g, &logits, &[tokens, experts]), gating).unwrap();
        assert_eq!(routes.tensor.shape(), [tokens, 2 * top_k]);
        let got = g.download(&routes.tensor).unwrap();
        let ids = |v: &[f32]| -> Vec<u32> { v.chunks(2 * top_k).flat_map(|r| r[..top_k].iter().map(|x| x.to_bits())).collect() };
        let weights = |v: &[f32]| -> Vec<f32> { v.chunks(2 * top_k).flat_map(|r| r[top_k..].to_vec()).collect() };
        assert_eq!(ids(&got), ids(&want), "experts {experts}, top {top_k}");
        assert_eq!(g.routed_experts(&routes).unwrap(), ids(&want));
        let err = rel_l2(&weights(&got), &weights(&want));
        assert!(err <= TOL, "routing weights differ: rel L2 {err:.3e}");
    }
}

/// The router's product fused into the routing (`moe_route_matmul`, up to
/// eight tokens; more take the separate product), with a shared expert's
/// gate row after the router's: the ids equal the host reference's on the
/// GPU's own product, the weights and the extra column match the CPU's. A
/// backend that routes routers of up to 1024 rows in one workgroup runs the
/// cases the default routes as a matmul (128 rows) through that kernel too.
#[test]
fn routing_with_the_router_product() {
    let Some(shared) = gpu() else { return };
    let options = WgpuOptions { route_rows: 1024, ..WgpuOptions::from_env() };
    let wide = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("GPU adapter");
    for g in [shared, &wide] {
        routing_with_the_router_product_on(g);
    }
}

fn routing_with_the_router_product_on(g: &WgpuBackend) {
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(23);
    let cols = 256;
    for (format, experts, extra, top_k) in [(affine(4, 64), 16, 1, 8), (affine(8, 64), 40, 1, 3), (MatrixFormat::Dense(DType::F32), 128, 0, 10)] {
        let m = matrix(&mut rng, format, 1, experts + extra, cols);
        let gating = Gating { experts, top_k, normalize: true };
        for tokens in [1usize, 3, 12] {
            let x = rng.vec(tokens * cols, 2.0);
            let run = |b: &dyn Backend| {
                let w = b.load_weight(&m).unwrap();
                let xt = up(b, &x, &[tokens, cols]);
                let (routes, more) = b.route_matmul(&xt, &w, gating).unwrap();
                let logits = b.download(&b.matmul(&xt, &w).unwrap()).unwrap();
                let more = more.map(|t| b.download(&t).unwrap());
                (b.download(&routes.tensor).unwrap(), logits, more)
            };
            let (got, logits, more) = run(g);
            let (want, _, want_more) = run(&cpu);
            let own: Vec<f32> = logits.chunks(experts + extra).flat_map(|r| r[..experts].to_vec()).collect();
            let reference = routing::route_rows(&own, gating);
            let ids = |v: &[f32]| -> Vec<u32> { v.chunks(2 * top_k).flat_map(|r| r[..top_k].iter().map(|x| x.to_bits())).collect() };
            let weights = |v: &[f32]| -> Vec<f32> { v.chunks(2 * top_k).flat_map(|r| r[top_k..].to_vec()).collect() };
            let what = format!("{}, {experts} experts, {tokens} tokens", format_name(format));
            assert_eq!(ids(&got), ids(&reference), "{what}");
            let err = rel_l2(&weights(&got), &weights(&want));
            assert!(err <= TOL, "{what}: routing weights differ from the CPU's: rel L2 {err:.3e}");
            match (more, want_more) {
                (Some(a), Some(b)) => {
                    let own_extra: Vec<f32> = logits.chunks(experts + extra).flat_map(|r| r[experts..].to_vec()).collect();
                    assert_eq!(a.len(), tokens * extra, "{what}");
                    assert!(rel_l2(&a, &b) <= TOL && rel_l2(&a, &own_extra) <= TOL, "{what}: the extra rows differ");
                }
                (None, None) => assert_eq!(extra, 0, "{what}"),
                _ => panic!("{what}: one backend gave extra rows, the other none"),
            }
        }
    }
}

/// A router of at most a subgroup's width of experts is routed in one
/// subgroup (`route_token_lanes`): the same routes, bit for bit, as the
/// workgroup's routing on this device, with ties and several tokens.
#[test]
fn routing_in_one_subgroup_matches_the_workgroup() {
    if gpu().is_none() {
        return;
    }
    let open = |route_lanes| {
        let options = WgpuOptions { route_lanes, ..WgpuOptions::from_env() };
        WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("GPU adapter")
    };
    let (lanes, whole) = (open(true), open(false));
    let (smallest, _) = lanes.subgroup_sizes();
    let mut rng = Rng::new(31);
    let cols = 256;
    let mut ran = 0;
    for (experts, top_k) in [(4usize, 2usize), (8, 8), (16, 8), (16, 10), (32, 4)] {
        if experts > smallest as usize {
            continue;
        }
        ran += 1;
        let mut m = matrix(&mut rng, affine(8, 64), 1, experts + 1, cols);
        if experts >= 8 {
            // Rows 2 and 5 alike: their logits tie.
            m = m.permute_rows(&(0..=experts).map(|r| if r == 5 { 2 } else { r }).collect::<Vec<_>>()).unwrap();
        }
        let gating = Gating { experts, top_k, normalize: experts != 8 };
        for tokens in [1usize, 3] {
            let x = rng.vec(tokens * cols, 2.0);
            let run = |b: &dyn Backend| {
                let (routes, _) = b.route_matmul(&up(b, &x, &[tokens, cols]), &b.load_weight(&m).unwrap(), gating).unwrap();
                b.download(&routes.tensor).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            assert_eq!(run(&lanes), run(&whole), "{experts} experts, top {top_k}, {tokens} tokens");
        }
    }
    assert!(ran > 0, "no case fits a subgroup of {smallest} lanes");
}

/// A one-token residual norm routed next runs inside the routing kernel
/// (`moe_route_norm`; `moe_route_norm_q8` for an 8-bit router of at most a
/// subgroup's width of experts; or over several workgroups,
/// `moe_route_norm_wide`, for an 8-bit router of 128 rows or, a shared
/// expert's gate after them, 513):
/// the routes, the sum and the normed row equal the CPU's `add_rms_norm`
/// then `route_matmul`, also when another op comes between the two (the norm
/// is then recorded on its own, in its place). A backend that takes every
/// 8-bit router over several workgroups runs the small ones that way too: four
/// such dispatches one after another (a count left non-zero by one would
/// leave the next unrouted).
#[test]
fn routing_after_the_residual_norm() {
    if gpu().is_none() {
        return;
    }
    let options = WgpuOptions { route_rows: 0, route_wide_rows: 1, ..WgpuOptions::from_env() };
    let wide = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("GPU adapter");
    let plain = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions::from_env()).expect("GPU adapter");
    let profiled = plain.set_profiling(true).is_ok();
    routing_after_the_residual_norm_on(&plain);
    let env = WgpuOptions::from_env();
    if profiled && env.route_lanes && env.fuse_norms && env.route_rows >= 17 {
        // The 8-expert case (and on subgroups of 16 lanes or more the
        // 16-expert one), each with no op between.
        let ran = plain.kernel_profile().iter().find(|(k, _)| k == "moe_route_norm_q8").map_or(0, |(_, t)| t.dispatches);
        let fits = [8, 16].iter().filter(|&&e| e <= plain.subgroup_sizes().0).count() as u64;
        assert_eq!(ran, fits, "moe_route_norm_q8 ran {ran} times");
    }
    let profiled = wide.set_profiling(true).is_ok();
    routing_after_the_residual_norm_on(&wide);
    if profiled && wide.orders_across_workgroups() {
        let ran = wide.kernel_profile().iter().find(|(k, _)| k == "moe_route_norm_wide").map_or(0, |(_, t)| t.dispatches);
        // Once per 8-bit case (with an op between, the norm runs apart).
        assert_eq!(ran, 4, "moe_route_norm_wide ran {ran} times");
    }
}

fn routing_after_the_residual_norm_on(g: &WgpuBackend) {
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(29);
    let cases = [
        (affine(8, 64), 16, 1, 8, 2048),
        (affine(8, 64), 8, 1, 4, 2048),
        (affine(4, 64), 40, 0, 4, 256),
        (MatrixFormat::Dense(DType::F32), 16, 1, 2, 4096),
        (affine(8, 64), 128, 0, 8, 2048),
        (affine(8, 64), 512, 1, 10, 1024),
    ];
    for (format, experts, extra, top_k, cols) in cases {
        let m = matrix(&mut rng, format, 1, experts + extra, cols);
        let gating = Gating { experts, top_k, normalize: true };
        let (x, y, w) = (rng.vec(cols, 2.0), rng.vec(cols, 2.0), rng.vec(cols, 1.0));
        for between in [false, true] {
            let run = |b: &dyn Backend| {
                let router = b.load_weight(&m).unwrap();
                let (h, normed) = b.add_rms_norm(&up(b, &x, &[1, cols]), &up(b, &y, &[1, cols]), &up(b, &w, &[cols]), cols, 1e-6).unwrap();
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
            assert!(rel_l2(&weights(&got), &weights(&want)) <= TOL, "{what}: routing weights differ from the CPU's");
            for (name, (a, b)) in ["sum", "normed row"].iter().zip(rows.iter().zip(&want_rows)) {
                assert!(rel_l2(a, b) <= TOL, "{what}: the {name} differs from the CPU's: rel L2 {:.3e}", rel_l2(a, b));
            }
            match (more, want_more) {
                (Some(a), Some(b)) => assert!(rel_l2(&a, &b) <= TOL, "{what}: the extra row differs"),
                (None, None) => assert_eq!(extra, 0, "{what}"),
                _ => panic!("{what}: one backend gave extra rows, the other none"),
            }
            if let (Some(a), Some(b)) = (doubled, want_doubled) {
                assert!(rel_l2(&a, &b) <= TOL, "{what}: the op between read a wrong sum");
            }
        }
    }
}

#[test]
fn expert_ffn_over_the_slot_table() {
    let (hidden, inter, top_k, tokens) = (128, 64, 2, 3);
    for format in [affine(4, 64), affine(8, 64), MatrixFormat::Dense(DType::BF16)] {
        let mut rng = Rng::new(21);
        let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
        let experts = random_experts(&mut rng, format, hidden, inter, 3);
        let x = rng.vec(tokens * hidden, 2.0);
        // Token 1's rank-1 expert (3) has no slot: its row must stay zero.
        let logits = logits_picking(4, &[&[0, 1], &[2, 3], &[1, 0]]);
        let gating = Gating { experts: 4, top_k, normalize: true };
        let routes = |b: &dyn Backend| -> Routes { b.route(&up(b, &logits, &[tokens, 4]), gating).unwrap() };
        check(&format!("moe_expert_outputs_{}", format_name(format)), TOL, |b| {
            let pool = layer1_pool(b, &layout, &experts);
            b.moe_expert_outputs(&up(b, &x, &[tokens, hidden]), &pool, &routes(b), 4).unwrap()
        });
        check(&format!("moe_combine_{}", format_name(format)), TOL, |b| {
            let pool = layer1_pool(b, &layout, &experts);
            let r = routes(b);
            let outs = b.moe_expert_outputs(&up(b, &x, &[tokens, hidden]), &pool, &r, 4).unwrap();
            b.moe_combine(&outs, &r).unwrap()
        });
        check(&format!("moe_{}", format_name(format)), TOL, |b| {
            let pool = layer1_pool(b, &layout, &experts);
            b.moe(&up(b, &x, &[tokens, hidden]), &pool, &routes(b), 4).unwrap()
        });
    }
}

/// Rows of 2048 columns: `moe_gate_up` shares each quad's gate rows and up
/// rows among several subgroups (two to four on 8- to 32-lane subgroups),
/// and must give the CPU's activations all the same.
#[test]
fn expert_ffn_with_rows_split_over_subgroups() {
    let Some(g) = gpu() else {
        return;
    };
    let (hidden, inter, top_k, tokens) = (2048, 64, 2, 2);
    let cpu = CpuBackend::exact();
    for format in [affine(4, 64), MatrixFormat::Affine { bits: 4, group_size: 32, scale_dtype: DType::F16 }] {
        let mut rng = Rng::new(23);
        let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
        let experts = random_experts(&mut rng, format, hidden, inter, 3);
        let x = rng.vec(tokens * hidden, 2.0);
        let logits = logits_picking(4, &[&[2, 0], &[1, 2]]);
        let gating = Gating { experts: 4, top_k, normalize: true };
        let run = |b: &dyn Backend| {
            let pool = layer1_pool(b, &layout, &experts);
            let routes = b.route(&up(b, &logits, &[tokens, 4]), gating).unwrap();
            b.download(&b.moe_expert_outputs(&up(b, &x, &[tokens, hidden]), &pool, &routes, 4).unwrap()).unwrap()
        };
        let err = rel_l2(&run(g), &run(&cpu));
        assert!(err <= TOL, "{}: split gate/up rows differ from the CPU's, rel L2 {err:.3e}", format_name(format));
    }
}

/// A table update lands in op order: a MoE call recorded before it sees the
/// old slots, one recorded after sees the new.
#[test]
fn slot_table_updates_are_ordered_with_moe_calls() {
    let Some(g) = gpu() else { return };
    let (hidden, inter) = (128, 64);
    let format = affine(4, 64);
    let mut rng = Rng::new(5);
    let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
    let experts = random_experts(&mut rng, format, hidden, inter, 3);
    let x = rng.vec(hidden, 2.0);
    let logits = logits_picking(4, &[&[1]]);
    let gating = Gating { experts: 4, top_k: 1, normalize: true };
    let mut pool = layer1_pool(g, &layout, &experts);
    let xt = up(g, &x, &[1, hidden]);
    let routes = g.route(&up(g, &logits, &[1, 4]), gating).unwrap();
    let before = g.moe(&xt, &pool, &routes, 4).unwrap();
    g.map_experts(&mut pool, &[(5, Some(1))]).unwrap();
    let after = g.moe(&xt, &pool, &routes, 4).unwrap();
    g.map_experts(&mut pool, &[(5, None)]).unwrap();
    let missing = g.moe(&xt, &pool, &routes, 4).unwrap();
    let (before, after, missing) = (g.download(&before).unwrap(), g.download(&after).unwrap(), g.download(&missing).unwrap());
    let cpu = CpuBackend::exact();
    let want = |slot: usize| -> Vec<f32> {
        let mut pool = cpu.new_expert_pool(&layout, 3, 8).unwrap();
        let e = &experts[slot];
        cpu.write_expert(&mut pool, 0, &HostExpert { gate: e.gate.clone(), up: e.up.clone(), down: e.down.clone() }).unwrap();
        cpu.map_experts(&mut pool, &[(5, Some(0))]).unwrap();
        let r = cpu.route(&up(&cpu, &logits, &[1, 4]), gating).unwrap();
        cpu.download(&cpu.moe(&up(&cpu, &x, &[1, hidden]), &pool, &r, 4).unwrap()).unwrap()
    };
    assert!(rel_l2(&before, &want(0)) <= TOL, "the call before the update must use slot 0");
    assert!(rel_l2(&after, &want(1)) <= TOL, "the call after the update must use slot 1");
    assert!(missing.iter().all(|v| *v == 0.0), "an expert with no slot must contribute nothing");
    assert!(g.map_experts(&mut pool, &[(8, Some(0))]).is_err(), "a key past the table must be refused");
    assert!(g.map_experts(&mut pool, &[(0, Some(3))]).is_err(), "a slot past the pool must be refused");
}

/// Weights and expert pools larger than one storage binding are split into
/// shards (here forced small): results must not change.
#[test]
fn sharded_weights_and_pool_match_cpu() {
    if gpu().is_none() {
        return;
    }
    // A backend of its own: the shard cap must not reach the other tests.
    let g = &WgpuBackend::new(&AdapterChoice::allow_software()).expect("GPU adapter");
    let cpu = CpuBackend::exact();
    let mut rng = Rng::new(31);
    let (rows, cols) = (100, 256);
    let m = matrix(&mut rng, affine(4, 64), 1, rows, cols);
    let x = rng.vec(2 * cols, 2.0);
    let (hidden, inter) = (128, 64);
    let format = affine(4, 64);
    let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
    let experts = random_experts(&mut rng, format, hidden, inter, 5);
    let xe = rng.vec(2 * hidden, 2.0);
    // Token 0 uses experts 4 and 1, token 1 experts 0 and 3 (expert e in slot e).
    let logits = logits_picking(5, &[&[4, 1], &[0, 3]]);
    let gating = Gating { experts: 5, top_k: 2, normalize: true };
    let run = |b: &dyn Backend| -> Vec<f32> {
        let w = b.load_weight(&m).unwrap();
        let mut out = b.download(&b.matmul(&up(b, &x[..cols], &[1, cols]), &w).unwrap()).unwrap();
        out.extend(b.download(&b.matmul(&up(b, &x, &[2, cols]), &w).unwrap()).unwrap());
        out.extend(b.download(&b.embed(&w, &[99, 0, 57]).unwrap()).unwrap());
        let mut pool = b.new_expert_pool(&layout, 5, 5).unwrap();
        for (slot, e) in experts.iter().enumerate() {
            let e = HostExpert { gate: e.gate.clone(), up: e.up.clone(), down: e.down.clone() };
            b.write_expert(&mut pool, slot, &e).unwrap();
        }
        b.map_experts(&mut pool, &(0..5).map(|e| (e, Some(e))).collect::<Vec<_>>()).unwrap();
        let routes = b.route(&up(b, &logits, &[2, 5]), gating).unwrap();
        let xt = up(b, &xe, &[2, hidden]);
        out.extend(b.download(&b.moe_expert_outputs(&xt, &pool, &routes, 0).unwrap()).unwrap());
        out.extend(b.download(&b.moe(&xt, &pool, &routes, 0).unwrap()).unwrap());
        out
    };
    let want = run(&cpu);
    // 10 KiB shards: 70 rows of 144 bytes per weight shard (2 shards), one
    // expert's 9.2 KB gate-and-up matrix per pool shard (5 shards).
    g.cap_shard_bytes(10 * 1024);
    let got = run(g);
    let err = rel_l2(&got, &want);
    assert!(err <= TOL, "sharded weights differ from the CPU backend: rel L2 {err:.3e}");
}

/// Prefill-sized calls take the tiled kernels (pairs grouped by expert, 64 to
/// a tile, or with 300 tokens 128 to a tile, `moe_*_wide`;
/// `wgsl/matmul_tiled.wgsl`): many pairs per expert, tiles cut short, an
/// expert with no slot, every pool format, and a pool in several shards.
#[test]
fn tiled_expert_ffn_for_many_tokens() {
    if gpu().is_none() {
        return;
    }
    let (hidden, inter) = (192, 128);
    let gating = Gating { experts: 4, top_k: 2, normalize: true };
    let cases = [affine(4, 64), affine(8, 64), MatrixFormat::Dense(DType::BF16)].into_iter().flat_map(|f| [(f, 100), (f, 300)]);
    for (format, tokens) in cases {
        let mut rng = Rng::new(41);
        let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
        let experts = random_experts(&mut rng, format, hidden, inter, 3);
        let x = rng.vec(tokens * hidden, 2.0);
        let logits = rng.vec(tokens * 4, 3.0);
        let run = |b: &dyn Backend| -> Vec<f32> {
            let pool = layer1_pool(b, &layout, &experts);
            let routes = b.route(&up(b, &logits, &[tokens, 4]), gating).unwrap();
            let xt = up(b, &x, &[tokens, hidden]);
            let mut out = b.download(&b.moe_expert_outputs(&xt, &pool, &routes, 4).unwrap()).unwrap();
            out.extend(b.download(&b.moe(&xt, &pool, &routes, 4).unwrap()).unwrap());
            out
        };
        let want = run(&CpuBackend::exact());
        let name = format!("{}, {tokens} tokens", format_name(format));
        let got = run(gpu().unwrap());
        let err = rel_l2(&got, &want);
        assert!(err <= TOL, "{name}: tiled MoE differs from the CPU backend: rel L2 {err:.3e}");
        // Expert 3 (no slot) leaves its pairs' rows zero.
        assert!(got.iter().take(tokens * 2 * hidden).any(|v| *v == 0.0), "{name}: rows of the unmapped expert must stay zero");
        // A backend of its own with one slot per pool shard.
        let sharded = WgpuBackend::new(&AdapterChoice::allow_software()).expect("GPU adapter");
        let bits = match format {
            MatrixFormat::Affine { bits, .. } => bits as usize,
            _ => 16,
        };
        // One gate-and-up matrix (plus its scales) per shard.
        sharded.cap_shard_bytes((2 * inter * hidden * bits / 8 * 6 / 5) as u64);
        let got = run(&sharded);
        let err = rel_l2(&got, &want);
        assert!(err <= TOL, "{name}: tiled MoE over a sharded pool differs from the CPU backend: rel L2 {err:.3e}");
    }
}

/// A pool that holds every expert keeps 4-bit slots interleaved (fmt 4, as
/// standalone weights): decode-sized and prefill-sized calls over it, with
/// bf16 and f16 scales, against the CPU backend.
#[test]
fn resident_pool_of_interleaved_slots() {
    if gpu().is_none() {
        return;
    }
    let (hidden, inter, experts) = (2048, 64, 4);
    let gating = Gating { experts, top_k: 2, normalize: true };
    let formats = [affine(4, 64), MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::F16 }];
    for format in formats {
        let mut rng = Rng::new(43);
        let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
        let weights = random_experts(&mut rng, format, hidden, inter, experts);
        for tokens in [1usize, 3, 20] {
            let x = rng.vec(tokens * hidden, 2.0);
            let logits = rng.vec(tokens * experts, 3.0);
            check(&format!("moe_resident_{}_t{tokens}", format_name(format)), TOL, |b| {
                let mut pool = b.new_expert_pool(&layout, experts, experts).unwrap();
                for (slot, e) in weights.iter().enumerate() {
                    b.write_expert(&mut pool, slot, &HostExpert { gate: e.gate.clone(), up: e.up.clone(), down: e.down.clone() }).unwrap();
                }
                b.map_experts(&mut pool, &(0..experts as u32).map(|e| (e, Some(e))).collect::<Vec<_>>()).unwrap();
                let routes = b.route(&up(b, &logits, &[tokens, experts]), gating).unwrap();
                b.moe(&up(b, &x, &[tokens, hidden]), &pool, &routes, 0).unwrap()
            });
        }
    }
}

/// A pool that holds every expert in several shards, each layer's experts in
/// consecutive slots (as a pool read in full at load keeps them): a
/// decode-sized call for a layer within one shard takes the fused kernels on
/// that shard alone, one for a layer across two shards the per-shard kernels
/// on those two; the outputs are the CPU backend's.
#[test]
fn a_sharded_resident_pool_runs_each_layer_on_its_own_shards() {
    if gpu().is_none() {
        return;
    }
    let (hidden, inter, experts, layers) = (128, 64, 4, 3);
    let keys = experts * layers;
    let gating = Gating { experts, top_k: 2, normalize: true };
    let format = affine(4, 64);
    let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
    let mut rng = Rng::new(47);
    let weights = random_experts(&mut rng, format, hidden, inter, keys);
    let (x, logits) = (rng.vec(hidden, 2.0), rng.vec(experts, 3.0));
    let run = |b: &dyn Backend| -> Vec<f32> {
        let mut pool = b.new_expert_pool(&layout, keys, keys).unwrap();
        for (slot, e) in weights.iter().enumerate() {
            b.write_expert(&mut pool, slot, &HostExpert { gate: e.gate.clone(), up: e.up.clone(), down: e.down.clone() }).unwrap();
        }
        b.map_experts(&mut pool, &(0..keys as u32).map(|k| (k, Some(k))).collect::<Vec<_>>()).unwrap();
        let routes = b.route(&up(b, &logits, &[1, experts]), gating).unwrap();
        let xt = up(b, &x, &[1, hidden]);
        (0..layers).flat_map(|l| b.download(&b.moe(&xt, &pool, &routes, l * experts).unwrap()).unwrap()).collect()
    };
    let want = run(&CpuBackend::exact());
    // A backend of its own, shards of six slots: layer 0 in shard 0, layer 1
    // across shards 0 and 1, layer 2 in shard 1.
    let sharded = WgpuBackend::new(&AdapterChoice::allow_software()).expect("GPU adapter");
    let probe = sharded.new_expert_pool(&layout, keys, keys).unwrap();
    let slot_bytes = sharded.expert_pool_slot_bytes(&probe).expect("a pool of this backend");
    sharded.cap_shard_bytes((64 + 6 * slot_bytes) as u64);
    sharded.set_profiling(true).expect("timestamp queries (the profile counts dispatches)");
    let got = run(&sharded);
    let err = rel_l2(&got, &want);
    assert!(err <= TOL, "a sharded resident pool differs from the CPU backend: rel L2 {err:.3e}");
    let profile = sharded.kernel_profile();
    let dispatches = |name: &str| profile.iter().find(|(n, _)| n == name).map_or(0, |(_, t)| t.dispatches);
    assert_eq!(dispatches("moe_down_combine"), 2, "layers 0 and 2, one shard each: {profile:?}");
    assert_eq!(dispatches("moe_down"), 2, "layer 1, on its two shards: {profile:?}");
    assert_eq!(dispatches("moe_gate_up"), 4, "{profile:?}");
}

/// A prefill's MoE call in parts (`WgpuOptions::moe_rows`) gives the whole
/// call's bits, with less scratch: each part runs the kernels the whole call
/// takes (wide tiles here, narrow ones for 100 tokens), and each pair's
/// output and each token's weighted sum depend on that pair and token alone.
#[test]
fn moe_in_parts_gives_the_whole_calls_bits() {
    if gpu().is_none() {
        return;
    }
    let (hidden, inter) = (192, 128);
    let gating = Gating { experts: 4, top_k: 2, normalize: true };
    let format = affine(4, 64);
    // 1,100 tokens in parts of 384, 384 and 332 (each wide: 2 ranks x 332 >= 128 x 4), 100 in 64 and 36.
    for (tokens, rows) in [(1100, 512), (100, 48)] {
        let mut rng = Rng::new(43);
        let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
        let experts = random_experts(&mut rng, format, hidden, inter, 3);
        let x = rng.vec(tokens * hidden, 2.0);
        let logits = rng.vec(tokens * 4, 3.0);
        let run = |moe_rows: usize| -> (Vec<f32>, u64) {
            let options = WgpuOptions { moe_rows, ..WgpuOptions::from_env() };
            let b = WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("GPU adapter");
            let pool = layer1_pool(&b, &layout, &experts);
            let routes = b.route(&up(&b, &logits, &[tokens, 4]), gating).unwrap();
            let out = b.download(&b.moe(&up(&b, &x, &[tokens, hidden]), &pool, &routes, 4).unwrap()).unwrap();
            (out, b.memory_report().scratch_peak_bytes)
        };
        let (whole, whole_scratch) = run(0);
        let (parts, parts_scratch) = run(rows);
        assert!(whole == parts, "{tokens} tokens in parts of about {rows}: the output differs from the whole call's");
        assert!(parts_scratch < whole_scratch, "{tokens} tokens: scratch {parts_scratch} in parts, {whole_scratch} whole");
    }
}
