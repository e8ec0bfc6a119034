//! Every kernel module parses and validates with naga and translates to MSL
//! (the Metal path) with a per-entry-point binding map, without a device.

use std::collections::BTreeMap;

use naga::back::msl;
use slotstream_wgpu::kernels::{check_loops, Module, Pipeline};

fn parse_and_validate(module: Module) -> (naga::Module, naga::valid::ModuleInfo) {
    let source = module.source();
    let parsed = naga::front::wgsl::parse_str(&source)
        .unwrap_or_else(|e| panic!("{}.wgsl does not parse:\n{}", module.name(), e.emit_to_string(&source)));
    // The matrix-unit kernels need f16 and cooperative matrices (on Vulkan).
    let coop = naga::valid::Capabilities::SHADER_FLOAT16 | naga::valid::Capabilities::COOPERATIVE_MATRIX;
    let capabilities = if module.needs_coop() { msl::supported_capabilities() | coop } else { msl::supported_capabilities() };
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities)
        .validate(&parsed)
        .unwrap_or_else(|e| panic!("{}.wgsl does not validate:\n{}", module.name(), e.emit_to_string(&source)));
    (parsed, info)
}

#[test]
fn every_module_validates_and_translates_to_msl() {
    for module in Module::ALL {
        let (parsed, info) = parse_and_validate(module);
        let declared: Vec<&str> = parsed.entry_points.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(declared, module.entry_points(), "{}: entry points in the WGSL vs. the Rust list", module.name());
        if module.needs_coop() {
            // 16 x 16 matrices have no Metal form (simdgroup matrices are
            // 8 x 8): a Mac never compiles this module (gpu/coop.rs).
            continue;
        }
        // Metal buffer slot = WGSL binding index; writable where the WGSL says read_write.
        let mut resources = msl::BindingMap::new();
        for (_, var) in parsed.global_variables.iter() {
            if let Some(binding) = &var.binding {
                let mutable = matches!(var.space, naga::AddressSpace::Storage { access } if access.contains(naga::StorageAccess::STORE));
                let slot = u8::try_from(binding.binding).expect("binding index fits a Metal slot");
                resources.insert(*binding, msl::BindTarget { buffer: Some(slot), mutable, ..Default::default() });
            }
        }
        let per_entry_point_map: BTreeMap<String, msl::EntryPointResources> = module
            .entry_points()
            .iter()
            .map(|e| (e.to_string(), msl::EntryPointResources { resources: resources.clone(), immediates_buffer: None, sizes_buffer: Some(30) }))
            .collect();
        let options = msl::Options { lang_version: (2, 4), per_entry_point_map, fake_missing_bindings: false, ..Default::default() };
        for &entry in module.entry_points() {
            let pipeline = msl::PipelineOptions { entry_point: Some((naga::ShaderStage::Compute, entry.to_string())), ..Default::default() };
            // Each specialisation's override constants applied, as wgpu does
            // before translating (or none: the defaults).
            let plain = [Pipeline { name: entry, constants: &[] }];
            let specs = match module.pipelines(entry) {
                [] => &plain[..],
                specs => specs,
            };
            for spec in specs {
                let mut constants = naga::back::PipelineConstants::default();
                for &(name, value) in spec.constants {
                    constants.insert(name.to_string(), value);
                }
                let (parsed, info) = naga::back::pipeline_constants::process_overrides(&parsed, &info, None, &constants)
                    .unwrap_or_else(|e| panic!("{}: the constants of {}: {e}", module.name(), spec.name));
                let (msl_source, _) = msl::write_string(&parsed, &info, &options, &pipeline)
                    .unwrap_or_else(|e| panic!("{}.wgsl entry '{entry}' ({}) does not translate to MSL: {e}", module.name(), spec.name));
                assert!(msl_source.contains(&format!("kernel void {entry}")), "{}: no MSL kernel named {entry}", module.name());
            }
        }
    }
}

#[test]
fn every_wgsl_file_is_used_and_documented() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../wgsl");
    let sources: Vec<String> = Module::ALL.iter().map(|m| m.source()).collect();
    for entry in std::fs::read_dir(&dir).expect("reading wgsl/") {
        let path = entry.expect("listing wgsl/").path();
        if path.extension().and_then(|e| e.to_str()) != Some("wgsl") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("reading a kernel file");
        assert!(text.starts_with("// "), "{} must open with a header comment (bindings and shapes)", path.display());
        assert!(sources.iter().any(|s| s.contains(&text)), "{} is not part of any kernel module", path.display());
    }
}

/// The members of the struct named `name` in a parsed module, and its size in bytes.
fn wgsl_struct(module: &naga::Module, name: &str) -> Option<(Vec<String>, u32)> {
    module.types.iter().find_map(|(_, ty)| match &ty.inner {
        naga::TypeInner::Struct { members, span } if ty.name.as_deref() == Some(name) => {
            Some((members.iter().map(|m| m.name.clone().unwrap_or_default()).collect(), *span))
        }
        _ => None,
    })
}

#[test]
fn every_params_struct_matches_its_rust_mirror() {
    let weight_desc = slotstream_wgpu::kernels::weight_desc_layout();
    for module in Module::ALL {
        let (parsed, _) = parse_and_validate(module);
        let rust = module.params();
        let (fields, bytes) =
            wgsl_struct(&parsed, "Params").unwrap_or_else(|| panic!("{}.wgsl declares no `Params` struct", module.name()));
        assert_eq!(fields, rust.fields, "{}.wgsl: `Params` fields vs. the Rust parameter struct", module.name());
        assert_eq!(bytes as usize, rust.bytes, "{}.wgsl: `Params` size vs. the Rust parameter struct", module.name());
        if let Some((fields, bytes)) = wgsl_struct(&parsed, "WeightDesc") {
            assert_eq!(fields, weight_desc.fields, "{}: `WeightDesc` fields vs. the Rust struct", module.name());
            assert_eq!(bytes as usize, weight_desc.bytes, "{}: `WeightDesc` size vs. the Rust struct", module.name());
        }
    }
}

/// The kernels are compiled without forced loop bounding (see
/// `Gpu::open`), which is sound only if every loop ends by itself: each is a
/// `for` whose counter rises by a positive step to an upper bound, or halves
/// down to zero; no `loop` or `while`. The steps are the subgroup size,
/// workgroup counts and sizes, and positive constants.
#[test]
fn every_loop_terminates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../wgsl");
    let mut loops = 0;
    for entry in std::fs::read_dir(&dir).expect("reading wgsl/") {
        let path = entry.expect("listing wgsl/").path();
        if path.extension().and_then(|e| e.to_str()) != Some("wgsl") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("reading a kernel file");
        loops += check_loops(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    assert!(loops > 50, "found only {loops} loops: the scan is broken");
    for bad in ["for (var i = 0u; i < n; i--) {}", "for (var i = 0u; i != n; i++) {}", "loop { break; }", "while (x) {}", "for (;;) {}", "for (var i = 0u; i < n"] {
        assert!(check_loops(bad).is_err(), "{bad:?} passed the check");
    }
}

#[test]
fn kernel_files_in_a_directory_replace_the_built_in_ones() {
    let dir = std::env::temp_dir().join(format!("slotstream-wgsl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating a directory");
    let marker = "// a variant of route.wgsl\n";
    std::fs::write(dir.join("route.wgsl"), marker).expect("writing a kernel file");
    let (route, replaced) = Module::Route.compiled_source(false, Some(&dir)).expect("reading the directory");
    assert!(replaced && route.contains(marker) && route.contains("fn reduce_sum"), "route.wgsl is read from the directory, the files it joins stay");
    let (norm, replaced) = Module::Norm.compiled_source(false, Some(&dir)).expect("reading the directory");
    assert!(!replaced && norm == Module::Norm.source(), "a module without a file there is the built-in one");
    let (built_in, replaced) = Module::Route.compiled_source(true, None).expect("the built-in sources");
    assert!(!replaced && built_in.contains("var<immediate> p: Params;") && !built_in.contains(marker));
    std::fs::write(dir.join("route.wgsl"), "fn f() { loop { break; } }\n").expect("writing a kernel file");
    let err = Module::Route.compiled_source(false, Some(&dir)).expect_err("a loop not known to end");
    assert!(err.contains("route.wgsl") && err.contains("loop"), "the error names the file and the loop: {err}");
    std::fs::remove_file(dir.join("route.wgsl")).expect("removing the kernel file");
    std::fs::create_dir(dir.join("route.wgsl")).expect("a directory where a file is looked for");
    let err = Module::Route.compiled_source(false, Some(&dir)).expect_err("a kernel path that cannot be read");
    assert!(err.contains("route.wgsl"), "the error names the file: {err}");
    std::fs::remove_dir_all(&dir).expect("cleaning up");
    let err = Module::Route.compiled_source(false, Some(&dir)).expect_err("a directory that is not there");
    assert!(err.contains("not a directory"), "{err}");
}
