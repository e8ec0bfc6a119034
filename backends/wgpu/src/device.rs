//! Choosing an adapter and opening a device on it.

use std::str::FromStr;

use slotstream_backend::{BackendError, Result};

/// Which adapter [`crate::WgpuBackend::new`] opens.
///
/// `auto` takes the best real GPU (discrete, then integrated, then virtual) and
/// refuses software rasterizers (lavapipe, llvmpipe: `DeviceType::Cpu`), which
/// are far slower than the CPU backend; tests and CI opt into them with
/// `allow_software`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterChoice {
    /// Case-insensitive part of the adapter's name; `None` picks the best one.
    pub name_contains: Option<String>,
    /// Accept a software rasterizer.
    pub allow_software: bool,
}

impl AdapterChoice {
    pub fn auto() -> Self {
        AdapterChoice::default()
    }

    /// Any adapter, software rasterizers included (for tests and CI).
    pub fn allow_software() -> Self {
        AdapterChoice { name_contains: None, allow_software: true }
    }
}

impl FromStr for AdapterChoice {
    type Err = BackendError;

    /// `auto`, `software` (any adapter, software included) or part of an adapter's name.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "" | "auto" => Ok(AdapterChoice::auto()),
            "software" => Ok(AdapterChoice::allow_software()),
            name => Ok(AdapterChoice { name_contains: Some(name.to_lowercase()), allow_software: false }),
        }
    }
}

fn rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

fn describe(info: &wgpu::AdapterInfo) -> String {
    format!("{} ({:?}, {:?})", info.name, info.device_type, info.backend)
}

/// Native APIs the backend is built for on this platform.
fn native_backends() -> wgpu::Backends {
    if cfg!(any(target_os = "macos", target_os = "ios")) {
        wgpu::Backends::METAL
    } else {
        wgpu::Backends::VULKAN
    }
}

/// The adapter `choice` selects, or an error listing what was found and why
/// each candidate was passed over.
pub fn select_adapter(choice: &AdapterChoice) -> Result<wgpu::Adapter> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    desc.backends = native_backends();
    let instance = wgpu::Instance::new(desc);
    let adapters = pollster::block_on(instance.enumerate_adapters(native_backends()));
    let mut passed_over = Vec::new();
    let mut candidates = Vec::new();
    for a in adapters {
        let info = a.get_info();
        if let Some(want) = &choice.name_contains {
            if !info.name.to_lowercase().contains(want.as_str()) {
                passed_over.push(format!("{}: name does not contain '{want}'", describe(&info)));
                continue;
            }
        }
        if info.device_type == wgpu::DeviceType::Cpu && !choice.allow_software {
            passed_over.push(format!("{}: software rasterizer (the adapter choice `software` accepts it)", describe(&info)));
            continue;
        }
        if !a.features().contains(wgpu::Features::SUBGROUP) {
            passed_over.push(format!("{}: no subgroup operations, which the kernels need", describe(&info)));
            continue;
        }
        candidates.push(a);
    }
    candidates.sort_by_key(|a| rank(a.get_info().device_type));
    candidates.into_iter().next().ok_or_else(|| {
        let found = if passed_over.is_empty() {
            "no Vulkan or Metal adapter was found (is a Vulkan driver installed? \
             on Linux: mesa-vulkan-drivers for lavapipe, or the GPU vendor's driver)"
                .to_string()
        } else {
            format!("adapters passed over: {}", passed_over.join("; "))
        };
        BackendError::Device(format!("no usable GPU adapter for the wgpu backend: {found}"))
    })
}
