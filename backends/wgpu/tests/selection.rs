//! Adapter selection: `auto` refuses software rasterizers unless allowed.

mod common;

use slotstream_wgpu::{AdapterChoice, WgpuBackend};

#[test]
fn choices_parse() {
    assert_eq!("auto".parse::<AdapterChoice>().unwrap(), AdapterChoice::auto());
    assert_eq!("software".parse::<AdapterChoice>().unwrap(), AdapterChoice::allow_software());
    let named: AdapterChoice = "H200".parse().unwrap();
    assert_eq!(named.name_contains.as_deref(), Some("h200"));
    assert!(!named.allow_software);
}

#[test]
fn auto_refuses_a_software_rasterizer() {
    let Some(any) = common::gpu() else { return };
    if any.device_type() != slotstream_wgpu::wgpu::DeviceType::Cpu {
        // A real GPU is present and preferred; nothing to refuse.
        return;
    }
    let err = match WgpuBackend::new(&AdapterChoice::auto()) {
        Ok(b) => panic!("auto picked {} although it is a software rasterizer", slotstream_backend::Backend::name(&b)),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("software rasterizer"), "unexpected refusal message: {err}");
}
