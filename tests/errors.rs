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

/// [`load_error`], failing the test (instead of hanging it) when loading blocks.
fn load_error_within_seconds(dir: &Path) -> String {
    let (sender, receiver) = std::sync::mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let _ = sender.send(load_error(&dir));
    });
    receiver.recv_timeout(std::time::Duration::from_secs(20)).expect("loading blocked on a special file")
}

#[cfg(unix)]
fn make_fifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let c_path = std::ffi::CString::new(path.to_string_lossy().as_bytes()).expect("a path without NUL");
    // SAFETY: mkfifo reads a NUL-terminated path we own.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "making a FIFO at {}", path.display());
}

#[cfg(unix)]
#[test]
fn special_files_in_a_model_directory_are_refused_by_name() {
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"] {
        let dir = copy_fixture("qwen3_moe_mlx4");
        let path = if name == "model.safetensors" { first_shard(dir.path()) } else { dir.path().join(name) };
        let file_name = path.file_name().expect("a file name").to_string_lossy().into_owned();
        make_fifo(&path);
        let err = load_error_within_seconds(dir.path());
        assert!(err.contains(&format!("{file_name} is a FIFO")), "{name}: {err}");
    }
    let dir = copy_fixture("qwen3_moe_mlx4");
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::remove_file(&tokenizer).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &tokenizer).unwrap();
    let err = load_error_within_seconds(dir.path());
    assert!(err.contains("tokenizer.json is a device"), "{err}");
}

#[test]
fn an_oversized_config_is_refused_before_it_is_parsed() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(dir.path().join("config.json"), format!("{config}{}", " ".repeat(17 << 20))).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("config.json is over 16 MiB"), "{err}");
}

#[test]
fn generation_stops_at_the_models_context() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    edit_config(dir.path(), |v| v["max_position_embeddings"] = 12.into());
    let engine = Engine::load(dir.path(), Box::new(slotstream_cpu::CpuBackend::new()), &Default::default()).unwrap();
    let request = |prompt_ids: Vec<u32>| slotstream::generate::GenerateRequest {
        prompt_ids,
        max_tokens: 100,
        sampling: Default::default(),
        stop: Vec::new(),
        ignore_eos: true,
    };
    let out = engine.generate(&request(vec![1, 2, 3, 4]), |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_eq!(out.generated_ids.len(), 8, "4 prompt tokens leave 8 of a 12-token context");
    let err = engine.generate(&request(vec![1; 12]), |_| std::ops::ControlFlow::Continue(())).unwrap_err();
    assert!(format!("{err:#}").contains("max_position_embeddings"), "{err:#}");
}

#[test]
fn a_caller_can_cancel_at_every_step_while_text_is_held_back() {
    let engine = Engine::load(&fixture("qwen3_moe_mlx4"), Box::new(slotstream_cpu::CpuBackend::new()), &Default::default()).unwrap();
    let request = |stop: Vec<String>| slotstream::generate::GenerateRequest {
        prompt_ids: vec![1, 2, 3, 4],
        max_tokens: 12,
        sampling: slotstream::sampling::SamplingParams { temperature: 0.0, ..Default::default() },
        stop,
        ignore_eos: true,
    };
    let free = engine.generate(&request(Vec::new()), |_| std::ops::ControlFlow::Continue(())).unwrap();
    // A stop string the whole output is a prefix of: every piece is held back.
    let held = request(vec![format!("{}\u{1}never", free.text)]);
    let mut calls = 0;
    let out = engine
        .generate(&held, |_| {
            calls += 1;
            std::ops::ControlFlow::Break(())
        })
        .unwrap();
    assert_eq!((out.generated_ids.len(), calls), (1, 1), "cancelled at the first token, not after {}", out.generated_ids.len());
    assert_eq!(out.finish_reason, slotstream::generate::FinishReason::Cancelled);
}

/// Rewrites a safetensors file's JSON header with `edit`, keeping its data.
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + header_len..]);
    std::fs::write(path, out).unwrap();
}

#[test]
fn bytes_after_the_described_data_are_not_called_a_truncation() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    let shard = first_shard(dir.path());
    let mut file = std::fs::OpenOptions::new().append(true).open(&shard).unwrap();
    std::io::Write::write_all(&mut file, &[0u8; 1000]).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors has 1000 bytes after the") && !err.contains("truncated"), "{err}");
    // A header that describes more than the file holds is a truncation, with both sizes.
    let dir = copy_fixture("qwen3_moe_mlx4");
    let shard = first_shard(dir.path());
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 1000).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("truncated") && err.contains(&format!("the file has {}", len - 1000)), "{err}");
}

#[test]
fn a_header_whose_offsets_do_not_match_its_shapes_is_refused() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    let shard = first_shard(dir.path());
    edit_header(&shard, |h| h["lm_head.biases"]["data_offsets"] = serde_json::json!([0, 4096]));
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors has an invalid safetensors header"), "{err}");
}

#[test]
fn an_index_naming_a_shard_outside_the_model_folder_is_refused() {
    for outside in ["/etc/passwd", "../model.safetensors", "./model.safetensors"] {
        let dir = copy_fixture("qwen3_moe_mlx4");
        let index = dir.path().join("model.safetensors.index.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        v["weight_map"]["lm_head.weight"] = outside.into();
        std::fs::write(&index, v.to_string()).unwrap();
        let err = load_error(dir.path());
        assert!(err.contains(&format!("names the shard '{outside}', which is not a file inside the model directory")), "{err}");
    }
}

#[test]
fn a_tokenizer_with_ids_the_model_has_no_embedding_for_is_refused() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    let path = dir.path().join("tokenizer.json");
    let mut tokenizer: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = tokenizer["model"]["vocab"].as_object().unwrap().len() + tokenizer["added_tokens"].as_array().unwrap().len();
    tokenizer["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
        "id": vocab, "content": "<|extra|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true
    }));
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("tokenizer.json has the token \"<|extra|>\"") && err.contains("another model"), "{err}");
}

#[test]
fn a_chat_template_that_fails_names_its_file() {
    let message = [slotstream::tokenizer::ChatMessage { role: "user".into(), content: "Hi".into() }];
    let dir = copy_fixture("qwen3_moe_mlx4");
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}".into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let codec = slotstream::tokenizer::TextCodec::load(dir.path(), &[]).unwrap();
    let err = format!("{:#}", codec.apply_chat_template(&message, true, None).unwrap_err());
    assert!(err.contains("chat template in tokenizer_config.json") && err.contains("no_such_filter"), "{err}");
    std::fs::write(dir.path().join("chat_template.jinja"), "{% for m in messages %}").unwrap();
    let codec = slotstream::tokenizer::TextCodec::load(dir.path(), &[]).unwrap();
    let err = format!("{:#}", codec.apply_chat_template(&message, true, None).unwrap_err());
    assert!(err.contains("chat template in chat_template.jinja does not parse") && err.contains("raw"), "{err}");
}

#[test]
fn a_chat_template_of_the_wrong_type_or_a_damaged_tokenizer_is_named() {
    let dir = copy_fixture("qwen3_moe_mlx4");
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = 5.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let err = format!("{:#}", slotstream::tokenizer::TextCodec::load(dir.path(), &[]).err().expect("refused"));
    assert!(err.contains("tokenizer_config.json: chat_template is 5, not a template"), "{err}");
    let tokenizer = dir.path().join("tokenizer.json");
    let bytes = std::fs::read(&tokenizer).unwrap();
    std::fs::write(&tokenizer, &bytes[..bytes.len() / 2]).unwrap();
    let err = format!("{:#}", slotstream::tokenizer::TextCodec::load(dir.path(), &[]).err().expect("refused"));
    assert!(err.contains("tokenizer.json") && err.contains("re-download"), "{err}");
}

#[test]
fn one_tensor_stored_under_two_of_a_vision_language_checkpoints_names_is_refused() {
    let dir = copy_fixture("qwen3_5_moe_mlx4");
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    // transformers' name for the final norm, beside mlx-lm's in the model file.
    let mut header = br#"{"model.language_model.norm.weight":{"dtype":"BF16","shape":[128],"data_offsets":[0,256]}}"#.to_vec();
    header.resize(header.len().div_ceil(8) * 8, b' ');
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend([0u8; 256]);
    std::fs::write(dir.path().join("zz-extra.safetensors"), file).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("'language_model.model.norm.weight' and 'model.language_model.norm.weight'") && err.contains("stored twice"), "{err}");
}
