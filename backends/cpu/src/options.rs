//! The CPU backend's settings: one value built in code or, once, from the
//! `SLOTSTREAM_CPU_*` environment variables (for measurements and the CLI);
//! nothing below the backend's constructor reads the environment.

use slotstream_backend::{KvCacheType, POOL_WRITE_PART};

use crate::matmul::MatmulMode;

/// Which int8 kernel 4-bit matmuls use in [`MatmulMode::Int8`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Kernel {
    /// AVX-512 VNNI where the CPU has it, else AVX2.
    Best,
    /// AVX2 `maddubs` even where VNNI is available (for comparing the two).
    Avx2,
}

/// Settings of a [`crate::CpuBackend`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuOptions {
    /// How 4-bit affine weights meet the activations (`SLOTSTREAM_CPU_MATMUL=exact`
    /// selects [`MatmulMode::Exact`]).
    pub matmul: MatmulMode,
    /// `SLOTSTREAM_CPU_INT8_KERNEL=avx2` selects [`Int8Kernel::Avx2`].
    pub int8_kernel: Int8Kernel,
    /// Int8 matmuls of fewer weight bytes (times tokens) than this run on the
    /// calling thread (`SLOTSTREAM_CPU_SERIAL_KB`, in KiB).
    pub serial_bytes: usize,
    /// A streamed expert's matrix is copied into its pool slot by the
    /// compute threads in parts of about this many bytes, side by side (the
    /// threads wait on the expert reads meanwhile); 0 copies on the calling
    /// thread alone (`SLOTSTREAM_CPU_POOL_WRITE_KB`, in KiB, for measurements).
    pub pool_write_part: usize,
    /// How KV caches store keys and values (`--kv-cache`); `None`: f16 with
    /// int8 matmuls, f32 in the exact mode.
    pub kv_cache: Option<KvCacheType>,
}

/// Measured on the 2-core dev VM (BENCHMARKS.md, CPU section): at 32 KB the
/// demo model's decode ran at 620-800 tok/s on 2 threads against 1230 on one;
/// at 256 KB, 1200-1240, with no loss on the 432M-parameter models.
const SERIAL_BYTES: usize = 256 << 10;

impl Default for CpuOptions {
    /// The fast backend: int8 activations for 4-bit weights, the best int8
    /// kernel, the measured serial threshold.
    fn default() -> Self {
        CpuOptions { matmul: MatmulMode::Int8, int8_kernel: Int8Kernel::Best, serial_bytes: SERIAL_BYTES, pool_write_part: POOL_WRITE_PART, kv_cache: None }
    }
}

impl CpuOptions {
    /// The defaults, overridden by whichever `SLOTSTREAM_CPU_*` variables are
    /// set: the one place the CPU backend reads the environment.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let defaults = CpuOptions::default();
        CpuOptions {
            matmul: match var("SLOTSTREAM_CPU_MATMUL").as_deref() {
                Some("exact") => MatmulMode::Exact,
                _ => defaults.matmul,
            },
            int8_kernel: match var("SLOTSTREAM_CPU_INT8_KERNEL").as_deref() {
                Some("avx2") => Int8Kernel::Avx2,
                _ => defaults.int8_kernel,
            },
            serial_bytes: var("SLOTSTREAM_CPU_SERIAL_KB")
                .and_then(|kb| kb.parse::<usize>().ok())
                .map_or(defaults.serial_bytes, |kb| kb << 10),
            pool_write_part: var("SLOTSTREAM_CPU_POOL_WRITE_KB")
                .and_then(|kb| kb.parse::<usize>().ok())
                .map_or(defaults.pool_write_part, |kb| kb << 10),
            kv_cache: defaults.kv_cache,
        }
    }
}
