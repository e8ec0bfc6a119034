//! The GPU's matrix units (cooperative matrices, `wgsl/matmul_coop.wgsl`):
//! whether an adapter has what those kernels need.

/// The device features the kernels use: f16 values and cooperative matrices.
pub(super) const FEATURES: wgpu::Features = wgpu::Features::SHADER_F16.union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);

/// Workgroup memory of `matmul_coop.wgsl`'s kernels: two staged slices of
/// 128 rows of 40 f16, the accumulators' 128 tokens of 36 f32, and
/// `tile_of`'s word.
const SHARED_BYTES: u32 = 2 * 128 * 40 * 2 + 128 * 36 * 4 + 16;

/// Whether `adapter` multiplies 16 x 16 f16 matrices into f32 ones in
/// subgroups of 32 (every subgroup: the kernels number eight of them per
/// workgroup of 256) with enough workgroup memory. NVIDIA's Vulkan driver
/// does; Metal's simdgroup matrices are 8 x 8 and Mesa's lavapipe has none,
/// so those keep `matmul_wide`.
pub(super) fn usable(adapter: &wgpu::Adapter, info: &wgpu::AdapterInfo, limits: &wgpu::Limits) -> bool {
    use wgpu::CooperativeScalarType::{F16, F32};
    adapter.features().contains(FEATURES)
        && info.subgroup_min_size == 32
        && info.subgroup_max_size == 32
        && limits.max_compute_workgroup_storage_size >= SHARED_BYTES
        && adapter.cooperative_matrix_properties().iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16) && p.ab_type == F16 && p.cr_type == F32
        })
}
