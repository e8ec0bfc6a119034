//! Typed calls of `wgsl/elementwise.wgsl`: one thread per output value.

use slotstream_backend::Result;

use crate::gpu::{Bind, Gpu};
use crate::params::ElementwiseParams;

// Bindings.
const A: u32 = 2;
const OUT: u32 = 3;
const B: u32 = 4;
const C: u32 = 5;
const D: u32 = 6;
const OUT2: u32 = 7;

fn run(gpu: &Gpu, entry: &str, params: ElementwiseParams, binds: &[(u32, Bind<'_>)]) -> Result<()> {
    gpu.dispatch(entry, &params, binds, Gpu::grid((params.n as u64).div_ceil(256)))
}

fn n(values: usize) -> ElementwiseParams {
    ElementwiseParams { n: values as u32, ..Default::default() }
}

/// `out = a + b` over `values` values.
pub(crate) fn add(gpu: &Gpu, a: Bind<'_>, b: Bind<'_>, out: Bind<'_>, values: usize) -> Result<()> {
    run(gpu, "add", n(values), &[(A, a), (B, b), (OUT, out)])
}

/// `out = x * sigmoid(gate)`, `gate` elementwise or (`per_row`) one per row of `cols`.
pub(crate) fn sigmoid_mul(gpu: &Gpu, x: Bind<'_>, gate: Bind<'_>, out: Bind<'_>, values: usize, cols: usize, per_row: bool) -> Result<()> {
    let params = ElementwiseParams { cols: cols as u32, b_per_row: per_row as u32, ..n(values) };
    run(gpu, "sigmoid_mul", params, &[(A, x), (B, gate), (OUT, out)])
}

/// `out = y + x * sigmoid(gate)`, `gate` as in [`sigmoid_mul`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_sigmoid_mul(
    gpu: &Gpu,
    y: Bind<'_>,
    x: Bind<'_>,
    gate: Bind<'_>,
    out: Bind<'_>,
    values: usize,
    cols: usize,
    per_row: bool,
) -> Result<()> {
    let params = ElementwiseParams { cols: cols as u32, b_per_row: per_row as u32, ..n(values) };
    run(gpu, "add_sigmoid_mul", params, &[(A, x), (B, gate), (C, y), (OUT, out)])
}

/// `out = silu(gate) * up`.
pub(crate) fn silu_mul(gpu: &Gpu, gate: Bind<'_>, up: Bind<'_>, out: Bind<'_>, values: usize) -> Result<()> {
    run(gpu, "silu_mul", n(values), &[(A, gate), (B, up), (OUT, out)])
}

/// `out = silu(x)`.
pub(crate) fn silu(gpu: &Gpu, x: Bind<'_>, out: Bind<'_>, values: usize) -> Result<()> {
    run(gpu, "silu_only", n(values), &[(A, x), (OUT, out)])
}

/// `out = x * factor`.
pub(crate) fn scale(gpu: &Gpu, x: Bind<'_>, factor: f32, out: Bind<'_>, values: usize) -> Result<()> {
    run(gpu, "scale", ElementwiseParams { factor, ..n(values) }, &[(A, x), (OUT, out)])
}

/// `out[r, c] = x[r, start + c]` for `c < cols` of rows of `src_cols`.
pub(crate) fn copy_cols(gpu: &Gpu, x: Bind<'_>, out: Bind<'_>, rows: usize, cols: usize, src_cols: usize, start: usize) -> Result<()> {
    let params = ElementwiseParams { cols: cols as u32, src_cols: src_cols as u32, start: start as u32, ..n(rows * cols) };
    run(gpu, "copy_cols", params, &[(A, x), (OUT, out)])
}

/// The delta rule's gates over `[tokens, heads]`: `g = exp(-exp(a_log) *
/// softplus(a + dt_bias))`, `beta = sigmoid(b)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn delta_gates(
    gpu: &Gpu,
    a: Bind<'_>,
    b: Bind<'_>,
    a_log: Bind<'_>,
    dt_bias: Bind<'_>,
    g: Bind<'_>,
    beta: Bind<'_>,
    values: usize,
    heads: usize,
) -> Result<()> {
    let params = ElementwiseParams { cols: heads as u32, ..n(values) };
    run(gpu, "delta_gates", params, &[(A, a), (B, b), (C, a_log), (D, dt_bias), (OUT, g), (OUT2, beta)])
}
