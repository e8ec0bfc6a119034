//! The loader accepts Qwen3.8-Flash-Next exactly as published, tensor by
//! tensor, without its 104 GB of weights.
//!
//! From ../shared/reference/qwen3.8-flash-next (the real config.json, the shard
//! index and every tensor's name, shape and dtype) this test writes the 11
//! shards as sparse files: real safetensors headers, holes where the weights
//! would be, and the three small integer tensors of the n-gram hash filled in
//! with the values the reference model derives from the config. The real
//! loader then builds the model on a backend that only checks shapes and keeps
//! no bytes, and must use every text tensor and skip the vision tower.

use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};
use slotstream::model::qwen4_exp::hyper::HyperResidual;
use slotstream::model::{self, ExpertSlots, LoadOptions};
use slotstream_backend::{
    Backend, BackendError, ExpertLayout, ExpertMatrix, ExpertPool, GateAct, Gating, HostMatrix, KeySelection, Routes,
    Result, State, Tensor, Weight,
};

fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/reference/qwen3.8-flash-next")
}

/// A backend that validates what it is given and stores nothing.
struct ShapeOnly;

fn no(op: &str) -> BackendError {
    BackendError::Unsupported(format!("{op}: the shape-only backend does not compute"))
}

impl Backend for ShapeOnly {
    fn name(&self) -> String {
        "shape-only".into()
    }
    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<Tensor> {
        assert_eq!(data.len(), shape.iter().product::<usize>(), "upload of {shape:?}");
        Ok(Tensor::from_buffer(Arc::new(()), shape.to_vec()))
    }
    fn download(&self, _: &Tensor) -> Result<Vec<f32>> {
        Err(no("download"))
    }
    fn load_weight(&self, m: &HostMatrix<'_>) -> Result<Weight> {
        m.validate()?;
        Ok(Weight::from_buffer(Arc::new(()), m.experts, m.rows, m.cols, 0))
    }
    fn slice_cols(&self, _: &Tensor, _: usize, _: usize) -> Result<Tensor> {
        Err(no("slice_cols"))
    }
    fn slice_rows(&self, _: &Tensor, _: usize, _: usize) -> Result<Tensor> {
        Err(no("slice_rows"))
    }
    fn concat_rows(&self, _: &[&Tensor]) -> Result<Tensor> {
        Err(no("concat_rows"))
    }
    fn add(&self, _: &Tensor, _: &Tensor) -> Result<Tensor> {
        Err(no("add"))
    }
    fn sigmoid_mul(&self, _: &Tensor, _: &Tensor) -> Result<Tensor> {
        Err(no("sigmoid_mul"))
    }
    fn silu_mul(&self, _: &Tensor, _: &Tensor) -> Result<Tensor> {
        Err(no("silu_mul"))
    }
    fn silu(&self, _: &Tensor) -> Result<Tensor> {
        Err(no("silu"))
    }
    fn add_sigmoid_mul(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<Tensor> {
        Err(no("add_sigmoid_mul"))
    }
    fn scale(&self, _: &Tensor, _: f32) -> Result<Tensor> {
        Err(no("scale"))
    }
    fn repeat_cols(&self, _: &Tensor, _: usize) -> Result<Tensor> {
        Err(no("repeat_cols"))
    }
    fn sigmoid_weighted_stream_mean(&self, _: &Tensor, _: &Tensor, _: usize) -> Result<Tensor> {
        Err(no("sigmoid_weighted_stream_mean"))
    }
    fn add_gated_to_streams(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: f32) -> Result<Tensor> {
        Err(no("add_gated_to_streams"))
    }
    fn stream_dot_gate(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: usize) -> Result<Tensor> {
        Err(no("stream_dot_gate"))
    }
    fn embed(&self, _: &Weight, _: &[u32]) -> Result<Tensor> {
        Err(no("embed"))
    }
    fn matmul(&self, _: &Tensor, _: &Weight) -> Result<Tensor> {
        Err(no("matmul"))
    }
    fn rms_norm(&self, _: &Tensor, _: Option<&Tensor>, _: usize, _: f32) -> Result<Tensor> {
        Err(no("rms_norm"))
    }
    fn rms_norm_gated(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: usize, _: f32, _: GateAct) -> Result<Tensor> {
        Err(no("rms_norm_gated"))
    }
    fn l2_normalize(&self, _: &Tensor, _: usize, _: f32, _: f32) -> Result<Tensor> {
        Err(no("l2_normalize"))
    }
    fn rope(&self, _: &Tensor, _: usize, _: usize, _: slotstream_backend::Rope, _: usize) -> Result<Tensor> {
        Err(no("rope"))
    }
    fn new_kv_cache(&self, _: usize, _: usize) -> Result<State> {
        Err(no("new_kv_cache"))
    }
    fn kv_cache_type(&self) -> slotstream_backend::KvCacheType {
        slotstream_backend::KvCacheType::F32
    }
    fn kv_len(&self, _: &State) -> Result<usize> {
        Err(no("kv_len"))
    }
    fn kv_truncate(&self, _: &mut State, _: usize) -> Result<()> {
        Err(no("kv_truncate"))
    }
    fn attention(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: &mut State, _: usize, _: f32, _: Option<&KeySelection>) -> Result<Tensor> {
        Err(no("attention"))
    }
    fn new_conv_state(&self, _: usize, _: usize, _: usize) -> Result<State> {
        Err(no("new_conv_state"))
    }
    fn causal_conv1d(&self, _: &Tensor, _: &Tensor, _: &mut State) -> Result<Tensor> {
        Err(no("causal_conv1d"))
    }
    fn causal_conv1d_silu(&self, _: &Tensor, _: &Tensor, _: &mut State) -> Result<Tensor> {
        Err(no("causal_conv1d_silu"))
    }
    fn new_recurrent_state(&self, _: usize, _: usize, _: usize) -> Result<State> {
        Err(no("new_recurrent_state"))
    }
    fn delta_gates(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<(Tensor, Tensor)> {
        Err(no("delta_gates"))
    }
    fn gated_delta(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: &Tensor, _: &Tensor, _: usize, _: &mut State) -> Result<Tensor> {
        Err(no("gated_delta"))
    }
    fn route(&self, _: &Tensor, _: Gating) -> Result<Routes> {
        Err(no("route"))
    }
    fn new_expert_pool(&self, layout: &ExpertLayout, slots: usize, keys: usize) -> Result<ExpertPool> {
        Ok(ExpertPool::new(Box::new(()), *layout, slots, keys, 0))
    }
    fn map_experts(&self, _: &mut ExpertPool, _: &[(u32, Option<u32>)]) -> Result<()> {
        Err(no("map_experts"))
    }
    fn write_expert_matrix(&self, _: &mut ExpertPool, _: usize, _: ExpertMatrix, _: &HostMatrix<'_>) -> Result<()> {
        Err(no("write_expert_matrix"))
    }
    fn moe_expert_outputs(&self, _: &Tensor, _: &ExpertPool, _: &Routes, _: usize) -> Result<Tensor> {
        Err(no("moe_expert_outputs"))
    }
    fn moe_combine(&self, _: &Tensor, _: &Routes) -> Result<Tensor> {
        Err(no("moe_combine"))
    }
    fn clone_state(&self, _: &State) -> Result<State> {
        Err(no("clone_state"))
    }
}

// ---- the n-gram hash constants, as the reference model derives them ----

fn splitmix64(v: u64) -> u64 {
    let mut v = v.wrapping_add(0x9E37_79B9_7F4A_7C15);
    v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    v ^ (v >> 31)
}

fn is_prime(v: u64) -> bool {
    v >= 2 && (v == 2 || v % 2 == 1) && (3..).step_by(2).take_while(|d| d * d <= v).all(|d| v % d != 0)
}

/// (multipliers, per-head table sizes, offsets) for PLE layer index 0.
fn ngram_constants(t: &Value) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    let n = t["ngram_size"].as_u64().unwrap();
    let heads = (n - 1) * t["heads_per_ngram"].as_u64().unwrap();
    let vocab = t["vocab_size"].as_u64().unwrap();
    let base = t["ngram_vocab_size_base"].as_u64().unwrap();
    let (mut sizes, mut offsets, mut p, mut total) = (vec![], vec![], base - 1, 0i64);
    for _ in 0..heads {
        p += 1;
        while !is_prime(p) {
            p += 1;
        }
        sizes.push(p as i64);
        offsets.push(total);
        total += p as i64;
    }
    let half = ((i64::MAX as u64 / vocab) / 2).max(1);
    let seed = 1234u64; // + 10007 * ple_layer_index (0)
    let mults = (0..n)
        .map(|i| (2 * (splitmix64(seed.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i + 1))) % half) + 1) as i64)
        .collect();
    (mults, sizes, offsets)
}

/// Writes the published shards as sparse files with real headers.
fn write_sparse_checkpoint(dir: &Path) {
    let reference = reference_dir();
    let shapes: BTreeMap<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(reference.join("tensor_shapes.json")).unwrap()).unwrap();
    let index: Value = serde_json::from_str(&std::fs::read_to_string(reference.join("model.safetensors.index.json")).unwrap()).unwrap();
    let config: Value = serde_json::from_str(&std::fs::read_to_string(reference.join("config.json")).unwrap()).unwrap();
    std::fs::copy(reference.join("config.json"), dir.join("config.json")).unwrap();
    std::fs::copy(reference.join("model.safetensors.index.json"), dir.join("model.safetensors.index.json")).unwrap();
    let (mults, sizes, offsets) = ngram_constants(&config["text_config"]);
    let ints: BTreeMap<&str, &Vec<i64>> =
        [("layer_multipliers", &mults), ("ngram_heads_vocab_sizes", &sizes), ("ngram_heads_offsets", &offsets)].into();
    let mut by_file: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
    for (name, file) in index["weight_map"].as_object().unwrap() {
        by_file.entry(file.as_str().unwrap()).or_default().push(name);
    }
    let elem = |d: &str| match d {
        "BF16" | "F16" => 2,
        "U32" | "F32" | "I32" => 4,
        "I64" => 8,
        other => panic!("dtype {other}"),
    };
    let mut total = 0u64;
    for (file, mut names) in by_file {
        names.sort();
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut at = 0u64;
        let mut fill = vec![];
        for name in names {
            let t = shapes.get(name).unwrap_or_else(|| panic!("{name} is in the index but not in tensor_shapes.json"));
            let n: u64 = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product();
            let bytes = n * elem(t["dtype"].as_str().unwrap());
            header.insert(name.clone(), json!({"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [at, at + bytes]}));
            if let Some((_, v)) = ints.iter().find(|(k, _)| name.ends_with(*k)) {
                fill.push((at, v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()));
            }
            at += bytes;
        }
        let mut text = serde_json::to_string(&header).unwrap().into_bytes();
        while text.len() % 8 != 0 {
            text.push(b' ');
        }
        let mut f = std::fs::File::create(dir.join(file)).unwrap();
        f.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
        f.write_all(&text).unwrap();
        let data_start = 8 + text.len() as u64;
        for (off, bytes) in fill {
            f.seek(SeekFrom::Start(data_start + off)).unwrap();
            f.write_all(&bytes).unwrap();
        }
        f.set_len(data_start + at).unwrap();
        total += at;
    }
    // The index's total_size also counts the shards' headers.
    let published = index["metadata"]["total_size"].as_u64().unwrap();
    assert!(total <= published && published - total < 1 << 20, "tensor bytes {total} vs the index's total_size {published}");
    assert_eq!(index["weight_map"].as_object().unwrap().len(), shapes.len(), "the index and the tensor table list the same tensors");
}

#[test]
fn loader_accepts_the_published_flagship_tensor_by_tensor() {
    if !reference_dir().join("tensor_shapes.json").exists() {
        eprintln!("skipped: {} is not on this machine", reference_dir().display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_sparse_checkpoint(dir.path());
    let opts = LoadOptions { expert_slots: ExpertSlots::Count(10), ..Default::default() };
    let m = model::ModelArch::read(dir.path())
        .and_then(|arch| model::load(&arch, &ShapeOnly, &opts))
        .unwrap_or_else(|e| panic!("the loader rejected the flagship: {e:#}"));
    assert_eq!(m.arch.text.model_type, "qwen4_exp_text");
    assert_eq!(m.layers.len(), 48);
    assert_eq!(m.streams, 4);
    assert_eq!(m.unused_tensors, Vec::<String>::new(), "checkpoint tensors the loader never used");
    // The resident trunk: everything but routed experts, n-gram shards and the vision tower.
    assert_eq!(m.resident_bytes, 2_924_005_400);
    let experts = m.experts.lock().unwrap();
    assert_eq!(experts.store().record_bytes, 2_764_800, "one expert record");
    drop(experts);
    let ple: Vec<_> = m
        .layers
        .iter()
        .enumerate()
        .filter_map(|(i, l)| l.residual.as_any().downcast_ref::<HyperResidual>()?.ple.as_ref().map(|p| (i, p)))
        .collect();
    assert_eq!(ple.len(), 1);
    assert_eq!(ple[0].0, 1, "PLE sits at layer index 1");
    assert_eq!(ple[0].1.store.row_disk_bytes(), 100, "one n-gram row on disk");
    let attention = m.layers.iter().filter(|l| matches!(l.mixer, model::Mixer::Attention(_))).count();
    assert_eq!(attention, 12);
}

/// `doctor` plans the flagship from its known sizes, without any weights:
/// expert records, the resident trunk, the n-gram row cache and the MTP head.
#[test]
fn doctor_plans_the_flagship_without_its_weights() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args(["doctor", "--model", "qwen3.8-flash-next:4bit", "--sim-ram", "48", "--sim-available", "40", "--json"])
        .output()
        .expect("running slotstream doctor");
    assert!(out.status.success(), "doctor failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json prints JSON");
    let m = &v["model"];
    assert_eq!(m["expert_record_bytes"], 2_764_800);
    assert_eq!(m["resident_bytes"], 2_924_005_400u64);
    assert_eq!(m["moe_layers"], 48);
    assert_eq!(m["experts_per_layer"], 512);
    assert_eq!(m["extra_bytes"], (model::DEFAULT_NGRAM_CACHE_BYTES as u64));
    assert_eq!(m["mtp_bytes"], 1_470_955_171u64);
    let plan = &v["plan"];
    assert_eq!(plan["mtp"], true, "48 GB has room for the MTP head: {plan}");
    assert!(plan["peak_bytes"].as_u64().unwrap() < 48_000_000_000 * 7 / 10);
}
