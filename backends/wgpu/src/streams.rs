//! Typed calls of `wgsl/streams.wgsl`: multi-stream residual ops over rows
//! of `streams` streams of `d` values side by side.

use slotstream_backend::Result;

use crate::gpu::{Bind, Gpu};
use crate::params::StreamParams;

// Bindings.
const A: u32 = 2;
const OUT: u32 = 3;
const B: u32 = 4;
const C: u32 = 5;

fn elementwise(gpu: &Gpu, entry: &str, params: StreamParams, binds: &[(u32, Bind<'_>)]) -> Result<()> {
    gpu.dispatch(entry, &params, binds, Gpu::grid((params.n as u64).div_ceil(256)))
}

/// `[rows, d]` -> `[rows, streams*d]`, each row repeated side by side.
pub(crate) fn repeat_cols(gpu: &Gpu, x: Bind<'_>, out: Bind<'_>, rows: usize, d: usize, streams: usize) -> Result<()> {
    let params = StreamParams { n: (rows * streams * d) as u32, d: d as u32, streams: streams as u32, ..Default::default() };
    elementwise(gpu, "repeat_cols", params, &[(A, x), (OUT, out)])
}

/// `out[r] = (1/streams) sum_s sigmoid(w[r, s]) * x[r, s]`: `[rows, d]`.
pub(crate) fn stream_mean(gpu: &Gpu, x: Bind<'_>, w: Bind<'_>, out: Bind<'_>, rows: usize, d: usize, streams: usize) -> Result<()> {
    let params = StreamParams { n: (rows * d) as u32, d: d as u32, streams: streams as u32, ..Default::default() };
    elementwise(gpu, "stream_mean", params, &[(A, x), (B, w), (OUT, out)])
}

/// `out[r, s] = h[r, s] + 2*sigmoid(logit_scale * logits[r, s]) * x[r]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_gated_to_streams(
    gpu: &Gpu,
    h: Bind<'_>,
    x: Bind<'_>,
    logits: Bind<'_>,
    logit_scale: f32,
    out: Bind<'_>,
    values: usize,
    d: usize,
    streams: usize,
) -> Result<()> {
    let params =
        StreamParams { n: values as u32, d: d as u32, streams: streams as u32, factor: logit_scale, ..Default::default() };
    elementwise(gpu, "add_gated_to_streams", params, &[(A, h), (B, x), (C, logits), (OUT, out)])
}

/// Per (row, stream): `sigmoid(signed_sqrt(key . query / sqrt(d))) * value[row]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn stream_dot_gate(
    gpu: &Gpu,
    key: Bind<'_>,
    query: Bind<'_>,
    value: Bind<'_>,
    out: Bind<'_>,
    rows: usize,
    d: usize,
    streams: usize,
) -> Result<()> {
    let groups = rows * streams;
    let params = StreamParams {
        d: d as u32,
        streams: streams as u32,
        groups: groups as u32,
        factor: 1.0 / (d as f32).sqrt(),
        ..Default::default()
    };
    let binds = [(A, key), (B, query), (C, value), (OUT, out)];
    gpu.dispatch("stream_dot_gate", &params, &binds, [gpu.subgroup_grid(groups, 64), 1, 1])
}
