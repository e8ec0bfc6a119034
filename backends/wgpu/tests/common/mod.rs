//! Shared by the wgpu backend's tests: opening a device (lavapipe is fine),
//! seeded inputs and comparisons.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

pub mod check;

use slotstream_wgpu::{AdapterChoice, WgpuBackend};

/// The backend under test (opened once per test binary), or `None` when
/// `SLOTSTREAM_SKIP_GPU_TESTS=1`. Without that variable a missing Vulkan
/// device fails the test loudly.
pub fn gpu() -> Option<&'static WgpuBackend> {
    static GPU: std::sync::OnceLock<Option<WgpuBackend>> = std::sync::OnceLock::new();
    GPU.get_or_init(open).as_ref()
}

fn open() -> Option<WgpuBackend> {
    if std::env::var("SLOTSTREAM_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("SLOTSTREAM_SKIP_GPU_TESTS=1: skipping a test that needs a Vulkan or Metal device");
        return None;
    }
    match WgpuBackend::new(&AdapterChoice::allow_software()) {
        Ok(b) => Some(b),
        Err(e) => panic!(
            "no GPU adapter for the wgpu tests: {e}\n\
             On Linux install a Vulkan driver (apt-get install -y mesa-vulkan-drivers for lavapipe) and set \
             VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json XDG_RUNTIME_DIR=/tmp, \
             or set SLOTSTREAM_SKIP_GPU_TESTS=1 to skip these tests."
        ),
    }
}

/// Deterministic values in [-0.5, 0.5).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }

    pub fn bits(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 32) as u32
    }
}

/// `||a - b|| / ||b||`.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "output lengths differ");
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}
