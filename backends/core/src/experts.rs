//! Experts in the backend's pool: how routing chooses them ([`Gating`],
//! [`Routes`]), how one is stored ([`ExpertLayout`]), the pool with its slot
//! table ([`ExpertPool`]), and a block's shared expert ([`SharedExpert`]).

use std::any::Any;

use crate::{Backend, DType, HostMatrix, MatrixData, Result, Tensor, Weight};

/// How a MoE router's logits choose each token's experts: a softmax over all
/// `experts` logits, of which the `top_k` largest are kept (highest logit
/// first, ties to the lower id), their probabilities renormalised to sum to
/// one when `normalize`. [`routing::route_row`] is the host reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gating {
    pub experts: usize,
    pub top_k: usize,
    pub normalize: bool,
}

/// The routing of a MoE call, kept on the device that computed it:
/// `tensor` is `[tokens, 2 * top_k]`, each row the token's expert ids (u32
/// bit patterns, best first) and then their weights. Only a streaming pool
/// reads the ids back ([`Backend::routed_experts`]).
#[derive(Clone)]
pub struct Routes {
    pub tensor: Tensor,
    pub gating: Gating,
}

impl Routes {
    pub fn tokens(&self) -> usize {
        self.tensor.rows()
    }

    /// Every token's expert ids (best first) from the rows of `tensor` read
    /// back: each row holds `top_k` ids (u32 bits), then `top_k` weights.
    pub fn ids_of_rows(&self, rows: &[f32]) -> Vec<u32> {
        let k = self.gating.top_k;
        rows.chunks_exact(2 * k).flat_map(|r| r[..k].iter().map(|v| v.to_bits())).collect()
    }
}

/// Bytes of a pool write (a streamed expert's matrix copied into its slot)
/// each thread takes by default: backends split larger writes into parts of
/// about this size, whole rows each, and write them side by side. One thread
/// copying a streamed token's experts (~750 MB on A's 64-expert trunk) took
/// 72-114 ms of its 100-175 ms on a fast file system (BENCHMARKS.md, "pool
/// writes side by side").
pub const POOL_WRITE_PART: usize = 128 << 10;

/// Rows in each part when `rows` rows of `row_bytes` bytes are written in
/// parts of about `part_bytes` ([`POOL_WRITE_PART`]): all of them (one part,
/// the calling thread) where `part_bytes` is 0 or the write is smaller than
/// two parts, else at least one.
pub fn rows_per_part(rows: usize, row_bytes: usize, part_bytes: usize) -> usize {
    if part_bytes == 0 || rows.saturating_mul(row_bytes) < part_bytes.saturating_mul(2) {
        return rows.max(1);
    }
    (part_bytes / row_bytes.max(1)).max(1)
}

/// How one matrix of an expert record is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatrixFormat {
    Dense(DType),
    Affine { bits: u32, group_size: usize, scale_dtype: DType },
}

impl MatrixFormat {
    pub fn of(m: &HostMatrix<'_>) -> MatrixFormat {
        match &m.data {
            MatrixData::Dense { dtype, .. } => MatrixFormat::Dense(*dtype),
            MatrixData::Affine { bits, group_size, scale_dtype, .. } => {
                MatrixFormat::Affine { bits: *bits, group_size: *group_size, scale_dtype: *scale_dtype }
            }
        }
    }
}

/// Shape and format of one routed expert (gate, up, down projections); every
/// slot of a pool holds one record of this layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    pub hidden: usize,
    pub intermediate: usize,
    pub gate: MatrixFormat,
    pub up: MatrixFormat,
    pub down: MatrixFormat,
}

/// An expert's three matrices in host memory, as read from disk.
pub struct HostExpert<'a> {
    pub gate: HostMatrix<'a>,
    pub up: HostMatrix<'a>,
    pub down: HostMatrix<'a>,
}

/// One of an expert's three matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertMatrix {
    Gate,
    Up,
    Down,
}

impl ExpertMatrix {
    /// In record order.
    pub const ALL: [ExpertMatrix; 3] = [ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down];
}

impl<'a> HostExpert<'a> {
    pub fn matrix(&self, which: ExpertMatrix) -> &HostMatrix<'a> {
        match which {
            ExpertMatrix::Gate => &self.gate,
            ExpertMatrix::Up => &self.up,
            ExpertMatrix::Down => &self.down,
        }
    }
}

/// A fixed pool of expert slots owned by a backend, shared by all layers,
/// with its slot table: for each of `keys` experts (key `layer * experts +
/// expert`; a pool that also holds shared experts keys them after those,
/// `layers * experts + layer`), the slot that holds it or none. The table lives on the device
/// ([`Backend::map_experts`] keeps it in step with the slots), so MoE calls
/// find their experts without the host.
pub struct ExpertPool {
    inner: Box<dyn Any + Send + Sync>,
    pub layout: ExpertLayout,
    pub slots: usize,
    pub keys: usize,
    /// Bytes the pool occupies in the backend.
    pub bytes: usize,
}

impl ExpertPool {
    pub fn new(inner: Box<dyn Any + Send + Sync>, layout: ExpertLayout, slots: usize, keys: usize, bytes: usize) -> Self {
        ExpertPool { inner, layout, slots, keys, bytes }
    }
    pub fn get<T: 'static>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }
    pub fn get_mut<T: 'static>(&mut self) -> Option<&mut T> {
        self.inner.downcast_mut::<T>()
    }
}

/// A MoE block's shared expert for [`Backend::moe_shared`]: its fused gate
/// and up rows, its down projection, the gate's logit per token (`[tokens,
/// 1]`, as [`Backend::route_matmul`] returns it) and, where the pool holds a
/// copy of it, its slot table key.
pub struct SharedExpert<'a> {
    pub gate_up: &'a Weight,
    pub down: &'a Weight,
    pub gate: &'a Tensor,
    pub key: Option<usize>,
}

/// [`Backend::moe_shared`] from `moe`, `matmul_swiglu` and `matmul_gated_add`.
pub fn moe_shared_composed<B: Backend + ?Sized>(
    b: &B,
    x: &Tensor,
    pool: &ExpertPool,
    routes: &Routes,
    key_base: usize,
    shared: &SharedExpert<'_>,
) -> Result<Tensor> {
    add_shared_expert(b, &b.moe(x, pool, routes, key_base)?, x, shared)
}

/// `y + sigmoid(gate) * down(silu(gate x) * up x)` of `shared` on its own
/// weights: a shared expert's output added to the routed experts' `y`.
pub fn add_shared_expert<B: Backend + ?Sized>(b: &B, y: &Tensor, x: &Tensor, shared: &SharedExpert<'_>) -> Result<Tensor> {
    let act = b.matmul_swiglu(x, shared.gate_up)?;
    b.matmul_gated_add(y, &act, shared.down, shared.gate)
}

#[cfg(test)]
mod tests {
    use super::rows_per_part;

    #[test]
    fn a_write_splits_in_whole_rows_only_when_two_parts_fit() {
        // 0: one part; under two parts' bytes: one part.
        assert_eq!(rows_per_part(512, 1024, 0), 512);
        assert_eq!(rows_per_part(100, 1024, 64 << 10), 100);
        // 512 KiB in 128 KiB parts: 128 rows each.
        assert_eq!(rows_per_part(512, 1024, 128 << 10), 128);
        // Rows larger than a part: one row each.
        assert_eq!(rows_per_part(8, 4096, 1024), 1);
        assert_eq!(rows_per_part(0, 1024, 1024), 1);
    }
}
