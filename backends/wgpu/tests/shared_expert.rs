//! A MoE block's shared expert held in the expert pool: `moe_shared` runs it
//! as one more rank of the fused MoE kernels (no dispatch of its own) and
//! gives the CPU backend's composed output; without a pool copy (no key, or
//! a key the table does not map) it composes.

mod common;

use common::check::{affine, format_name, matrix, up, TOL};
use common::{gpu, rel_l2, Rng};
use slotstream_backend::{Backend, DType, ExpertLayout, Gating, HostExpert, HostMatrix, MatrixFormat, SharedExpert};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend};

/// Each layer's output of `moe_shared` over a pool of every routed expert
/// of `layers` layers (keys and slots `0..layers * experts`) and each
/// layer's shared expert after them (key and slot `layers * experts + l`,
/// mapped when `mapped`), its key passed to the op when `keyed`.
fn run(b: &dyn Backend, format: MatrixFormat, tokens: usize, keyed: bool, mapped: bool) -> Vec<f32> {
    let (hidden, inter, experts, layers) = (2048, 64, 4, 2);
    let routed = experts * layers;
    let mut rng = Rng::new(53);
    let expert = |rng: &mut Rng| HostExpert {
        gate: matrix(rng, format, 1, inter, hidden),
        up: matrix(rng, format, 1, inter, hidden),
        down: matrix(rng, format, 1, hidden, inter),
    };
    let all: Vec<HostExpert<'static>> = (0..routed + layers).map(|_| expert(&mut rng)).collect();
    let layout = ExpertLayout { hidden, intermediate: inter, gate: format, up: format, down: format };
    let mut pool = b.new_expert_pool(&layout, routed + layers, routed + layers).unwrap();
    for (slot, e) in all.iter().enumerate() {
        b.write_expert(&mut pool, slot, e).unwrap();
    }
    let keys = if mapped { routed + layers } else { routed };
    b.map_experts(&mut pool, &(0..keys as u32).map(|k| (k, Some(k))).collect::<Vec<_>>()).unwrap();
    let x = up(b, &rng.vec(tokens * hidden, 2.0), &[tokens, hidden]);
    let gating = Gating { experts, top_k: 2, normalize: true };
    let mut out = Vec::new();
    for l in 0..layers {
        let routes = b.route(&up(b, &rng.vec(tokens * experts, 3.0), &[tokens, experts]), gating).unwrap();
        let gate = up(b, &rng.vec(tokens, 4.0), &[tokens, 1]);
        let s = &all[routed + l];
        let gate_up = b.load_weight(&HostMatrix::concat_rows(&[&s.gate, &s.up]).unwrap()).unwrap();
        let down = b.load_weight(&s.down).unwrap();
        let shared = SharedExpert { gate_up: &gate_up, down: &down, gate: &gate, key: keyed.then_some(routed + l) };
        out.extend(b.download(&b.moe_shared(&x, &pool, &routes, l * experts, &shared).unwrap()).unwrap());
    }
    out
}

#[test]
fn a_shared_expert_in_the_pool_runs_with_the_routed_experts() {
    if gpu().is_none() {
        return;
    }
    // A backend of its own: the test counts its dispatches.
    let g = WgpuBackend::new(&AdapterChoice::allow_software()).expect("GPU adapter");
    let cpu = CpuBackend::exact();
    for format in [affine(4, 64), MatrixFormat::Dense(DType::BF16)] {
        for tokens in [1, 3] {
            let want = run(&cpu, format, tokens, true, true);
            for (keyed, mapped) in [(true, true), (false, true), (true, false)] {
                g.set_profiling(true).expect("timestamp queries (the profile counts dispatches)");
                let got = run(&g, format, tokens, keyed, mapped);
                let profile = g.kernel_profile();
                g.set_profiling(false).expect("profiling off");
                let name = format!("{} for {tokens} tokens, key given {keyed}, mapped {mapped}", format_name(format));
                let err = rel_l2(&got, &want);
                assert!(err <= TOL, "{name}: differs from the CPU backend's composed shared expert, rel L2 {err:.3e}");
                let dispatches = |k: &str| profile.iter().find(|(n, _)| n == k).map_or(0, |(_, t)| t.dispatches);
                assert_eq!(dispatches("moe_down_combine"), 2, "{name}: {profile:?}");
                // The shared expert's own products (SwiGLU, then the gated
                // add; separate ops for several tokens) only without a pool copy.
                let own = dispatches("matvec_epilogue") + dispatches("matvec") + dispatches("matvec_q4") + dispatches("matvec_q4_tokens");
                assert_eq!(own, if keyed && mapped { 0 } else { 4 }, "{name}: {profile:?}");
            }
        }
    }
}
