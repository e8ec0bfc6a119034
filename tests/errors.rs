//! Broken model directories give errors that name the file, the tensor and what
//! was expected, never a panic or garbage output.

use std::path::{Path, PathBuf};

use slotstream::generate::Engine;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A writable copy of a fixture.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> String {
    match Engine::load(dir, Box::new(slotstream_cpu::CpuBackend::new()), &Default::default()) {
        Ok(_) => panic!("loading {} should have failed", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn first_shard(dir: &Path) -> PathBuf {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    shards.remove(0)
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    let shard = first_shard(dir.path());
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 1000).unwrap();
    let err = load_error(dir.path());
    let name = shard.file_name().unwrap().to_string_lossy().to_string();
    assert!(err.contains(&name) && err.contains("truncated"), "{err}");
}

#[test]
fn missing_shard_listed_by_the_index_is_named() {
    let dir = copy_fixture("qwen3_next_hf");
    assert!(dir.path().join("model.safetensors.index.json").exists(), "fixture should be sharded with an index");
    let shard = first_shard(dir.path());
    std::fs::remove_file(&shard).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains(&*shard.file_name().unwrap().to_string_lossy()), "{err}");
}

#[test]
fn unknown_model_type_is_refused() {
    let dir = copy_fixture("qwen3_moe_hf");
    edit_config(dir.path(), |v| v["model_type"] = "llama4_moe".into());
    let err = load_error(dir.path());
    assert!(err.contains("llama4_moe") && err.contains("not supported"), "{err}");
}

#[test]
fn shape_mismatch_names_tensor_and_expected_shape() {
    let dir = copy_fixture("qwen3_moe_hf");
    edit_config(dir.path(), |v| {
        let m = v["moe_intermediate_size"].as_u64().unwrap();
        v["moe_intermediate_size"] = (m * 2).into();
    });
    let err = load_error(dir.path());
    assert!(err.contains("experts.0.gate_proj.weight") && err.contains("expected"), "{err}");
}

#[test]
fn unsupported_quantization_mode_is_refused() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    edit_config(dir.path(), |v| v["quantization"]["mode"] = "mxfp4".into());
    let err = load_error(dir.path());
    assert!(err.contains("mxfp4") && err.contains("not supported yet"), "{err}");
}

#[test]
fn wrong_quantization_bits_name_the_tensor() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    edit_config(dir.path(), |v| {
        v["quantization"]["bits"] = 8.into();
        if let Some(q) = v.get_mut("quantization_config") {
            q["bits"] = 8.into();
        }
    });
    let err = load_error(dir.path());
    assert!(err.contains("quantized tensor") && err.contains("expected"), "{err}");
}

#[test]
fn missing_tokenizer_is_named() {
    let dir = copy_fixture("qwen3_moe_hf");
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn not_a_model_directory() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn garbage_safetensors_header() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    let shard = first_shard(dir.path());
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[8] = b'#';
    std::fs::write(&shard, bytes).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("header"), "{err}");
}

#[test]
fn qwen4_exp_without_text_config_says_so() {
    let dir = copy_fixture("qwen4_exp_tiny");
    edit_config(dir.path(), |v| {
        v.as_object_mut().unwrap().remove("text_config");
    });
    let err = load_error(dir.path());
    assert!(err.contains("text_config"), "{err}");
}

#[test]
fn qwen4_exp_inconsistent_indexer_settings_are_named() {
    let dir = copy_fixture("qwen4_exp_tiny");
    edit_config(dir.path(), |v| v["text_config"]["indexer_budget"] = 30.into());
    let err = load_error(dir.path());
    assert!(err.contains("indexer_budget 30") && err.contains("indexer_compress_ratio"), "{err}");
}

#[test]
fn truncated_mtp_head_names_the_file_when_mtp_is_on() {
    let dir = copy_fixture("qwen4_exp_tiny");
    let mtp = dir.path().join("mtp.safetensors");
    let len = std::fs::metadata(&mtp).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&mtp).unwrap().set_len(len / 2).unwrap();
    let opts = slotstream::model::LoadOptions { mtp: true, ..Default::default() };
    let err = match Engine::load(dir.path(), Box::new(slotstream_cpu::CpuBackend::new()), &opts) {
        Ok(_) => panic!("a truncated mtp.safetensors should fail to load with MTP on"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("mtp.safetensors") && err.contains("truncated"), "{err}");
    // Without MTP the head is never opened and the model loads.
    assert!(Engine::load(dir.path(), Box::new(slotstream_cpu::CpuBackend::new()), &Default::default()).is_ok());
}
