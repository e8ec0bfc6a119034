//! Compiling the kernels: one shader module per kernel family, one
//! pipeline per entry point (or per set of override constants,
//! [`Module::pipelines`]).

use std::collections::HashMap;

use slotstream_backend::{BackendError, Result};

use super::Kernel;
use crate::kernels::{Module, Pipeline};
use crate::options::WgpuOptions;

/// Every kernel's pipeline by the name dispatches use, the directory any
/// kernel file was read from instead of the built-in one
/// ([`WgpuOptions::wgsl_dir`]), and why the driver refused the matrix-unit
/// kernels (`coop_matrix`: compiled too, where the driver takes them; its
/// cooperative matrices are an experimental wgpu feature).
#[allow(clippy::type_complexity)]
pub(super) fn compile(
    device: &wgpu::Device,
    options: &WgpuOptions,
    immediates: bool,
    bounds_checks: bool,
    wide_workgroups: bool,
    coop_matrix: bool,
) -> Result<(HashMap<&'static str, Kernel>, Option<std::path::PathBuf>, Option<String>)> {
    let mut kernels = HashMap::new();
    let mut kernels_from = None;
    let mut coop_refused = None;
    for module in Module::ALL.into_iter().filter(|m| (coop_matrix || !m.needs_coop()) && (options.flash_decode || *m != Module::FlashDecode)) {
        let scopes = module.needs_coop().then(|| {
            (device.push_error_scope(wgpu::ErrorFilter::Internal), device.push_error_scope(wgpu::ErrorFilter::Validation))
        });
        let (source, replaced) = module.compiled_source(immediates, options.wgsl_dir.as_deref()).map_err(BackendError::Device)?;
        if replaced {
            kernels_from = options.wgsl_dir.clone();
        }
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(module.name()),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        // Loops are never forced to a bounded trip count: that counter
        // keeps drivers from unrolling the kernels' fixed-length inner
        // loops, which then index their register arrays through memory
        // (the tiled prefill kernels ran 6x slower on an H200).
        let checks = wgpu::ShaderRuntimeChecks { bounds_checks, ..wgpu::ShaderRuntimeChecks::unchecked() };
        // SAFETY: every loop in wgsl/ is a `for` whose counter moves by a
        // positive step (or halves) towards a bound it reaches, which
        // `tests/shaders.rs::every_loop_terminates` checks of the sources
        // (and `compiled_source` of any file read from `wgsl_dir`);
        // with `bounds_checks` off, the caller of
        // `WgpuBackend::with_options_unchecked` also vouches that every index the
        // kernels compute stays in bounds, which the shape checks in
        // lib.rs establish for well-formed inputs.
        let shader = unsafe { device.create_shader_module_trusted(desc, checks) };
        for &entry in module.entry_points() {
            if entry.ends_with("_1024") && !wide_workgroups {
                continue; // the adapter's workgroups are smaller; callers check has_kernel
            }
            let plain = [Pipeline { name: entry, constants: &[] }];
            let pipelines = match module.pipelines(entry) {
                [] => &plain[..],
                specialised => specialised,
            };
            for spec in pipelines {
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(spec.name),
                    layout: None,
                    module: &shader,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions { constants: spec.constants, ..Default::default() },
                    cache: None,
                });
                let layout = pipeline.get_bind_group_layout(0);
                kernels.insert(spec.name, Kernel { pipeline, layout, family: spec.name, params: module.params() });
            }
        }
        if let Some((internal, validation)) = scopes {
            let refused = pollster::block_on(validation.pop()).or(pollster::block_on(internal.pop()));
            if let Some(e) = refused {
                for entry in module.entry_points() {
                    kernels.remove(entry);
                }
                coop_refused = Some(e.to_string());
            }
        }
    }
    Ok((kernels, kernels_from, coop_refused))
}
