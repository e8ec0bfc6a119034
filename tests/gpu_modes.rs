//! `--backend` picks the wgpu backend's matmul mode: a software rasterizer
//! defaults to exact (f32) activations, `SLOTSTREAM_WGPU_MATMUL=int8` selects
//! int8 and a `:exact` suffix overrides that. The JSON's `backend` field is
//! the backend's name, which says when int8 activations are on.
//!
//! Needs a Vulkan (or Metal) device; lavapipe is enough. Without one these
//! tests fail, unless SLOTSTREAM_SKIP_GPU_TESTS=1.

mod common;

use common::{case, fixture};

/// The `backend` field of `slotstream run --json` on a fixture's short case.
fn backend_name(backend: &str, env: Option<&str>) -> String {
    let case = case("qwen3_moe_hf", "short");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"));
    cmd.env_remove("SLOTSTREAM_WGPU_MATMUL");
    if let Some(mode) = env {
        cmd.env("SLOTSTREAM_WGPU_MATMUL", mode);
    }
    let out = cmd
        .args(["run", "--backend", backend, "--raw", "--json", "--ignore-eos", "--max-tokens", "2", "--model"])
        .arg(fixture("qwen3_moe_hf"))
        .arg("--prompt")
        .arg(&case.prompt_text)
        .output()
        .expect("running slotstream");
    assert!(out.status.success(), "--backend {backend}: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json prints one JSON object");
    v["backend"].as_str().unwrap_or("").to_string()
}

#[test]
fn backend_spec_selects_the_matmul_mode() {
    if std::env::var("SLOTSTREAM_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        return;
    }
    let plain = backend_name("wgpu:software", None);
    assert!(plain.starts_with("wgpu") && !plain.contains("int8"), "{plain}");
    let int8 = backend_name("wgpu:software", Some("int8"));
    assert!(int8.contains("int8 activations"), "{int8}");
    let exact = backend_name("wgpu:software:exact", Some("int8"));
    assert!(exact.starts_with("wgpu") && !exact.contains("int8"), "{exact}");
}
