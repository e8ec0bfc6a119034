//! Typed calls of `wgsl/norm.wgsl`: normalisation over groups of `dim`
//! values, one subgroup per group (one workgroup for long groups).

use slotstream_backend::{checks, shape_error, GateAct, Result, Tensor};

use crate::gpu::{whole, Bind, Gpu};
use crate::params::NormParams;
use crate::tensors::{buf, new_tensor};

// Bindings.
const X: u32 = 2;
const OUT: u32 = 3;
const WEIGHT: u32 = 4;
const Z: u32 = 5;
const SUM: u32 = 6;
const ANGLES: u32 = 7;
const WEIGHT2: u32 = 8;

/// Groups at least this long are normalised by a whole workgroup each.
const WIDE_NORM_DIM: usize = 1024;

/// Workgroups of 64 giving each of `groups` groups one subgroup.
fn subgroup_grid(gpu: &Gpu, groups: usize) -> [u32; 3] {
    [gpu.subgroup_grid(groups, 64), 1, 1]
}

/// `out = x / rms(x) * weight` per group of `dim` (without a weight: `x`
/// itself binds as the unused weight).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm(
    gpu: &Gpu,
    x: Bind<'_>,
    weight: Option<Bind<'_>>,
    out: Bind<'_>,
    groups: usize,
    dim: usize,
    weight_len: usize,
    eps: f32,
) -> Result<()> {
    let params = NormParams {
        groups: groups as u32,
        dim: dim as u32,
        has_weight: weight.is_some() as u32,
        weight_len: weight_len as u32,
        eps,
        scale: 1.0,
        ..Default::default()
    };
    let binds = [(X, x), (OUT, out), (WEIGHT, weight.unwrap_or(x))];
    if dim >= WIDE_NORM_DIM {
        gpu.dispatch("rms_norm_wide", &params, &binds, Gpu::grid(groups as u64))
    } else {
        gpu.dispatch("rms_norm", &params, &binds, subgroup_grid(gpu, groups))
    }
}

/// Rows at least this long take `add_rms_norm_1024`.
const WIDE_FROM: usize = 2048;

/// `sum = x + y`, `out = sum / rms(sum) * weight` per group of `dim`, one
/// workgroup per group; with `held`, held back for the next op to take in.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_rms_norm(
    gpu: &Gpu,
    x: Bind<'_>,
    y: Bind<'_>,
    weight: Bind<'_>,
    sum: Bind<'_>,
    out: Bind<'_>,
    groups: usize,
    dim: usize,
    weight_len: usize,
    eps: f32,
    held: Option<HeldNorm>,
) -> Result<()> {
    let params = NormParams {
        groups: groups as u32,
        dim: dim as u32,
        has_weight: 1,
        weight_len: weight_len as u32,
        eps,
        scale: 1.0,
        ..Default::default()
    };
    let binds = [(X, x), (Z, y), (WEIGHT, weight), (SUM, sum), (OUT, out)];
    // Long rows take four times as many threads where the adapter has them:
    // the loads of a row come in a quarter as many steps per thread.
    let entry = if dim >= WIDE_FROM && gpu.has_kernel("add_rms_norm_1024") { "add_rms_norm_1024" } else { "add_rms_norm" };
    match held {
        Some(h) => gpu.hold(entry, &params, &binds, Gpu::grid(groups as u64), Box::new(h)),
        None => gpu.dispatch(entry, &params, &binds, Gpu::grid(groups as u64)),
    }
}

/// A decode step's `add_rms_norm` (one token or a batched few) held back (`Gpu::hold`) for a routing kernel
/// to take in (`moe::route_norm`): its tensors and epsilon.
pub(crate) struct HeldNorm {
    pub x: Tensor,
    pub y: Tensor,
    pub weight: Tensor,
    pub sum: Tensor,
    pub out: Tensor,
    pub eps: f32,
}

/// Per-head RMSNorm of `x: [tokens, heads, dim]` with `weight` (`dim`
/// values), then the rotary embedding of `angles` (see
/// `attention::rope_angles`) on the first `rotary_dim` values of each head.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_rope(
    gpu: &Gpu,
    x: Bind<'_>,
    weight: Bind<'_>,
    angles: Bind<'_>,
    out: Bind<'_>,
    [tokens, heads, dim]: [usize; 3],
    eps: f32,
    rotary_dim: usize,
) -> Result<()> {
    let one = NormRope { x, weight, out, heads, eps };
    rms_norm_rope_sets(gpu, one, None, angles, tokens, dim, rotary_dim)
}

/// One set of heads for [`rms_norm_rope_sets`].
#[derive(Clone, Copy)]
pub(crate) struct NormRope<'a> {
    pub x: Bind<'a>,
    pub weight: Bind<'a>,
    pub out: Bind<'a>,
    pub heads: usize,
    pub eps: f32,
}

/// `rms_norm_rope` of one or two sets of heads (queries and keys) of the
/// same tokens, in one dispatch.
pub(crate) fn rms_norm_rope_sets(
    gpu: &Gpu,
    first: NormRope<'_>,
    second: Option<NormRope<'_>>,
    angles: Bind<'_>,
    tokens: usize,
    dim: usize,
    rotary_dim: usize,
) -> Result<()> {
    let (groups2, heads2, eps2) = second.as_ref().map_or((0, 0, 0.0), |s| (tokens * s.heads, s.heads, s.eps));
    let params = NormParams {
        groups: (tokens * first.heads) as u32,
        dim: dim as u32,
        has_weight: 1,
        weight_len: dim as u32,
        eps: first.eps,
        scale: 1.0,
        half: (rotary_dim / 2) as u32,
        heads: first.heads as u32,
        groups2: groups2 as u32,
        heads2: heads2 as u32,
        eps2,
        ..Default::default()
    };
    // Without a second set its bindings repeat the first's (nothing reads them).
    let s = second.unwrap_or(first);
    let binds = [(X, first.x), (WEIGHT, first.weight), (OUT, first.out), (Z, s.x), (WEIGHT2, s.weight), (SUM, s.out), (ANGLES, angles)];
    gpu.dispatch("rms_norm_rope", &params, &binds, subgroup_grid(gpu, tokens * first.heads + groups2))
}

/// `out = act(z) * (x / rms(x) * weight)` per group of `dim`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_gated(
    gpu: &Gpu,
    x: Bind<'_>,
    z: Bind<'_>,
    weight: Bind<'_>,
    out: Bind<'_>,
    groups: usize,
    dim: usize,
    eps: f32,
    act: GateAct,
) -> Result<()> {
    let gate_act = match act {
        GateAct::Silu => 0,
        GateAct::Sigmoid => 1,
    };
    let params = NormParams {
        groups: groups as u32,
        dim: dim as u32,
        has_weight: 1,
        weight_len: dim as u32,
        eps,
        scale: 1.0,
        gate_act,
        ..Default::default()
    };
    let binds = [(X, x), (OUT, out), (WEIGHT, weight), (Z, z)];
    gpu.dispatch("rms_norm_gated", &params, &binds, subgroup_grid(gpu, groups))
}

/// `out = x * scale / sqrt(sum x^2 + eps)` per group of `dim`.
pub(crate) fn l2_normalize(gpu: &Gpu, x: Bind<'_>, out: Bind<'_>, groups: usize, dim: usize, eps: f32, scale: f32) -> Result<()> {
    let params = NormParams { groups: groups as u32, dim: dim as u32, weight_len: dim as u32, eps, scale, ..Default::default() };
    gpu.dispatch("l2_normalize", &params, &[(X, x), (OUT, out)], subgroup_grid(gpu, groups))
}

/// [`slotstream_backend::Backend::rms_norm_rope_pair`]: both sets in one
/// `rms_norm_rope` dispatch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_rope_pair(
    gpu: &Gpu,
    [q, k]: [&Tensor; 2],
    weights: [&Tensor; 2],
    head_dim: usize,
    eps: [f32; 2],
    rotary_dim: usize,
    rope: slotstream_backend::Rope,
    start_pos: usize,
) -> Result<(Tensor, Tensor)> {
    let mut sets = Vec::with_capacity(2);
    for (x, w) in [(q, weights[0]), (k, weights[1])] {
        checks::rms_norm_weight(x, Some(w), head_dim)?;
        let heads = checks::groups_of("rms_norm_rope_pair", x, head_dim)? / x.rows().max(1);
        let shaped = x.reshape(&[x.rows(), heads, head_dim])?;
        checks::rope(&shaped, head_dim, rotary_dim)?;
        if w.numel() != head_dim {
            return Err(shape_error("rms_norm_rope_pair", format!("a weight of {} values for heads of {head_dim}", w.numel())));
        }
        sets.push((shaped, heads));
    }
    let tokens = q.rows();
    if k.rows() != tokens {
        return Err(shape_error("rms_norm_rope_pair", format!("{tokens} query rows and {} key rows", k.rows())));
    }
    let (qo, qb) = new_tensor(gpu, tokens * sets[0].1 * head_dim, vec![tokens, sets[0].1, head_dim])?;
    let (ko, kb) = new_tensor(gpu, tokens * sets[1].1 * head_dim, vec![tokens, sets[1].1, head_dim])?;
    let angles = crate::attention::rope_angles(gpu, tokens, rotary_dim, rope, start_pos)?;
    let first = NormRope { x: buf(&sets[0].0)?, weight: buf(weights[0])?, out: qb.bind(), heads: sets[0].1, eps: eps[0] };
    let second = NormRope { x: buf(&sets[1].0)?, weight: buf(weights[1])?, out: kb.bind(), heads: sets[1].1, eps: eps[1] };
    rms_norm_rope_sets(gpu, first, Some(second), whole(&angles), tokens, head_dim, rotary_dim)?;
    Ok((qo, ko))
}
