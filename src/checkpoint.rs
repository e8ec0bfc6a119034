//! Opening a checkpoint's safetensors files without reading them: headers are
//! parsed (through a memory map that only ever touches the header pages), and
//! a tensor's bytes are read with positioned reads only when it is loaded, so
//! loading never leaves file pages counted in the process's memory.
//!
//! Also owns the MLX quantization settings, because whether a module is
//! quantized, and how, is a property of the files.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use slotstream_backend::{DType, HostMatrix, MatrixData, MatrixFormat};

use crate::model_files;

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range inside the file.
    pub start: usize,
    pub end: usize,
}

/// How a quantized module is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantParams {
    pub bits: u32,
    pub group_size: usize,
}

/// The `quantization` block of an MLX config: defaults plus per-module overrides.
#[derive(Clone, Debug, Default)]
pub struct QuantConfig {
    pub default: Option<QuantParams>,
    /// Module path (e.g. `model.layers.0.mlp.gate`) -> its own settings, or
    /// `None` when the module is explicitly left unquantized.
    pub overrides: HashMap<String, Option<QuantParams>>,
}

impl QuantConfig {
    /// Reads `quantization` (or `quantization_config`) from a config.json value.
    pub fn from_config(config: &serde_json::Value) -> Result<QuantConfig> {
        let Some(q) = config.get("quantization").or_else(|| config.get("quantization_config")) else {
            return Ok(QuantConfig::default());
        };
        if let Some(method) = q.get("quant_method").and_then(|m| m.as_str()) {
            bail!(
                "quantization method '{method}' is not supported yet; slotstream reads unquantized \
                 (f32/f16/bf16) checkpoints and MLX affine-quantized ones"
            );
        }
        let mode = q.get("mode").and_then(|m| m.as_str()).unwrap_or("affine");
        if mode != "affine" {
            bail!(
                "quantization mode '{mode}' is not supported yet; slotstream reads MLX 'affine' \
                 quantization (use an affine 4- or 8-bit conversion of this model)"
            );
        }
        let params = |v: &serde_json::Value, what: &str| -> Result<QuantParams> {
            let bits = v.get("bits").and_then(|b| b.as_u64()).ok_or_else(|| anyhow!("{what}: missing 'bits'"))?;
            let group = v
                .get("group_size")
                .and_then(|g| g.as_u64())
                .ok_or_else(|| anyhow!("{what}: missing 'group_size'"))?;
            if !matches!(bits, 2 | 4 | 8) {
                bail!("{what}: {bits}-bit quantization is not supported yet (supported: 2, 4, 8)");
            }
            if !matches!(group, 32 | 64 | 128) {
                bail!("{what}: group size {group} is not supported (supported: 32, 64, 128)");
            }
            Ok(QuantParams { bits: bits as u32, group_size: group as usize })
        };
        let mut out = QuantConfig { default: Some(params(q, "config.json quantization")?), ..Default::default() };
        if let Some(obj) = q.as_object() {
            for (k, v) in obj {
                match v {
                    serde_json::Value::Object(_) => {
                        if let Some(m) = v.get("mode").and_then(|m| m.as_str()) {
                            if m != "affine" {
                                bail!("quantization of '{k}': mode '{m}' is not supported yet");
                            }
                        }
                        out.overrides.insert(k.clone(), Some(params(v, &format!("quantization of '{k}'"))?));
                    }
                    serde_json::Value::Bool(false) => {
                        out.overrides.insert(k.clone(), None);
                    }
                    _ => {}
                }
            }
        }
        Ok(out)
    }

    /// Settings for a module path, honouring overrides.
    pub fn for_module(&self, module: &str) -> Option<QuantParams> {
        match self.overrides.get(module) {
            Some(p) => *p,
            None => self.default,
        }
    }
}

/// How a matrix is stored and which tensors hold it (weight, then scales and
/// biases if quantized).
#[derive(Clone, Debug, PartialEq)]
pub struct MatrixLayout {
    pub format: MatrixFormat,
    pub tensors: Vec<String>,
}

/// All safetensors files of a model directory, indexed by tensor name.
pub struct Checkpoint {
    pub dir: PathBuf,
    files: Vec<(PathBuf, File)>,
    tensors: BTreeMap<String, TensorEntry>,
    pub quant: QuantConfig,
    /// Names a loader has looked up, to find tensors no loader uses.
    used: std::sync::Mutex<std::collections::HashSet<String>>,
}

fn dtype_of(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// Whether an index's shard name is a path below the model directory (no
/// root, no `..`, no `.`), so one file has one name and none lies outside.
fn is_inside_the_folder(name: &str) -> bool {
    !name.is_empty() && Path::new(name).components().all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// The size a safetensors file's header says the whole file has (the header
/// plus the end of its last tensor), when the header parses.
fn described_len(file: &[u8]) -> Option<usize> {
    let header_len = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header: serde_json::Value = serde_json::from_slice(file.get(8..8usize.checked_add(header_len)?)?).ok()?;
    let data_end = header
        .as_object()?
        .values()
        .filter_map(|tensor| tensor.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    (8 + header_len).checked_add(usize::try_from(data_end).ok()?)
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string())
}

impl Checkpoint {
    /// Opens the shards named by `model.safetensors.index.json`, or every
    /// `*.safetensors` file in `dir` when there is no index.
    pub fn open(dir: &Path, quant: QuantConfig) -> Result<Checkpoint> {
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text = model_files::read_text(&index_path, model_files::INDEX_MAX_BYTES)?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| anyhow!("{} has no 'weight_map' object", index_path.display()))?;
            let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
            names.sort();
            names.dedup();
            if let Some(outside) = names.iter().find(|name| !is_inside_the_folder(name)) {
                bail!(
                    "{} names the shard '{outside}', which is not a file inside the model directory: the index is \
                     corrupt (re-download the model)",
                    index_path.display()
                );
            }
            names
        } else {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .with_context(|| format!("listing model directory {}", dir.display()))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            names.sort();
            names
        };
        if shard_names.is_empty() {
            bail!("no .safetensors files in {} (is this a model directory?)", dir.display());
        }
        let mut ck = Checkpoint { dir: dir.to_path_buf(), files: Vec::new(), tensors: BTreeMap::new(), quant, used: Default::default() };
        for name in shard_names {
            ck.add_file(&dir.join(&name))?;
        }
        Ok(ck)
    }

    /// Opens one safetensors file on its own (an `mtp.safetensors` head).
    pub fn open_file(path: &Path, quant: QuantConfig) -> Result<Checkpoint> {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let mut ck = Checkpoint { dir, files: Vec::new(), tensors: BTreeMap::new(), quant, used: Default::default() };
        ck.add_file(path)?;
        Ok(ck)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = model_files::open_regular(path).with_context(|| {
            format!("opening {} (listed by the checkpoint but missing or unreadable; re-download the model)", path.display())
        })?;
        // SAFETY: the map is read-only; a checkpoint changed underneath a running
        // process is outside what we can defend against, as for any mmap reader.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            let what = match e {
                SafeTensorError::MetadataIncompleteBuffer => match described_len(&map) {
                    Some(described) if described < map.len() => format!(
                        "has {} bytes after the {described} bytes its header describes (a corrupt or mixed-up \
                         download; re-download it)",
                        map.len() - described
                    ),
                    described => format!(
                        "is truncated: its header describes {} bytes of data but the file has {} (re-download it)",
                        described.map_or_else(|| "more".to_string(), |d| d.to_string()),
                        map.len()
                    ),
                },
                SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => {
                    "is too short to be a safetensors file (truncated or not a safetensors file)".to_string()
                }
                other => format!("has an invalid safetensors header: {other}"),
            };
            anyhow!("{} {what}", path.display())
        })?;
        let idx = self.files.len();
        let data_start = 8 + header_len;
        for (name, info) in meta.tensors() {
            let entry = TensorEntry {
                file: idx,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + info.data_offsets.0,
                end: data_start + info.data_offsets.1,
            };
            if let Some(prev) = self.tensors.insert(name.clone(), entry) {
                bail!(
                    "tensor '{name}' appears in both {} and {}",
                    file_name(&self.files[prev.file].0),
                    file_name(path)
                );
            }
        }
        drop(map);
        self.files.push((path.to_path_buf(), file));
        Ok(())
    }

    /// For multimodal checkpoints (qwen4_exp, qwen3_5_moe): keeps the language
    /// model's tensors under the names a text-only checkpoint gives them
    /// (mlx-lm's `language_model.model.X` and transformers'
    /// `model.language_model.X` become `model.X`, `language_model.lm_head`
    /// becomes `lm_head`), renames config.json's quantization overrides to
    /// match, and drops the vision tower and any multi-token-prediction head,
    /// which slotstream does not run. Returns how many tensors were dropped.
    pub fn keep_language_model(&mut self) -> Result<usize> {
        let before = self.tensors.len();
        let mut kept = BTreeMap::new();
        for (name, e) in std::mem::take(&mut self.tensors) {
            let renamed = if let Some(rest) = name.strip_prefix("language_model.") {
                rest.to_string()
            } else if let Some(rest) = name.strip_prefix("model.language_model.") {
                format!("model.{rest}")
            } else if name.starts_with("vision_tower.") || name.starts_with("model.visual.") || name.starts_with("mtp.") {
                continue;
            } else {
                name.clone()
            };
            // Two spellings of one tensor: a mixed-up download, whichever
            // were kept.
            if let Some(other) = kept.insert(renamed.clone(), (name.clone(), e)) {
                bail!(
                    "the tensors '{}' and '{name}' in {} are the same tensor of the language model, stored twice \
                     (files of two downloads mixed in one folder?): keep one checkpoint's files",
                    other.0,
                    self.dir.display()
                );
            }
        }
        self.tensors = kept.into_iter().map(|(name, (_, e))| (name, e)).collect();
        let mut overrides = HashMap::new();
        for (module, q) in std::mem::take(&mut self.quant.overrides) {
            let renamed = module.strip_prefix("language_model.").map_or(module.clone(), str::to_string);
            if overrides.insert(renamed, q).is_some_and(|other| other != q) {
                bail!("config.json's quantization names '{module}' twice, with different settings");
            }
        }
        self.quant.overrides = overrides;
        Ok(before - self.tensors.len())
    }

    /// Renames every tensor `{prefix}X` to `X` and drops the others (the
    /// `mtp.` head file).
    pub fn strip_prefix(&mut self, prefix: &str) {
        let tensors = std::mem::take(&mut self.tensors);
        self.tensors =
            tensors.into_iter().filter_map(|(name, e)| name.strip_prefix(prefix).map(|r| (r.to_string(), e))).collect();
    }

    /// An integer tensor (`I64`) of exactly `shape`.
    pub fn i64_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>> {
        let e = self.expect_shape(name, shape)?;
        if e.dtype != Dtype::I64 {
            bail!("tensor '{name}' in {} has dtype {:?}, expected I64", self.file_of(e), e.dtype);
        }
        Ok(self.read_bytes(name)?.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
    }

    /// Tensors never looked up since the checkpoint was opened, sorted.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.lock().map(|u| u.clone()).unwrap_or_default();
        self.tensors.keys().filter(|n| !used.contains(*n)).cloned().collect()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        if let Ok(mut used) = self.used.lock() {
            used.insert(name.to_string());
        }
        self.tensors.get(name).ok_or_else(|| {
            anyhow!("tensor '{name}' is missing from the checkpoint in {} (wrong model_type or incomplete download?)", self.dir.display())
        })
    }

    /// Path of the file holding a tensor.
    pub fn path_of(&self, e: &TensorEntry) -> &Path {
        &self.files[e.file].0
    }

    /// Name of the file holding a tensor, for error messages.
    pub fn file_of(&self, e: &TensorEntry) -> String {
        file_name(&self.files[e.file].0)
    }

    /// Reads a tensor's bytes from disk.
    pub fn read_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let e = self.entry(name)?;
        let (path, file) = &self.files[e.file];
        let mut buf = vec![0u8; e.end - e.start];
        file.read_exact_at(&mut buf, e.start as u64)
            .with_context(|| format!("reading tensor '{name}' from {}", path.display()))?;
        Ok(buf)
    }

    fn expect_shape(&self, name: &str, want: &[usize]) -> Result<&TensorEntry> {
        let e = self.entry(name)?;
        if e.shape != want {
            bail!("tensor '{name}' in {} has shape {:?}, expected {:?}", self.file_of(e), e.shape, want);
        }
        Ok(e)
    }

    /// A float tensor of exactly `shape`, converted to f32.
    pub fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.expect_shape(name, shape)?;
        let dt = dtype_of(e.dtype).ok_or_else(|| {
            anyhow!("tensor '{name}' in {} has dtype {:?}; expected f32, f16 or bf16", self.file_of(e), e.dtype)
        })?;
        Ok(dt.to_f32(&self.read_bytes(name)?))
    }

    /// Checks a weight matrix `{prefix}.weight` of logical shape
    /// `lead ++ [rows, cols]`, quantized (with `.scales`/`.biases`) or plain,
    /// without reading it: its storage format and the tensors that hold it.
    /// `lead` is `[]` for a linear layer and `[experts]` for stacked experts.
    pub fn matrix_layout(&self, prefix: &str, lead: &[usize], rows: usize, cols: usize) -> Result<MatrixLayout> {
        let wname = format!("{prefix}.weight");
        let sname = format!("{prefix}.scales");
        let with = |last: usize| -> Vec<usize> { lead.iter().copied().chain([rows, last]).collect() };
        if !self.has(&sname) {
            return self.dense_layout(&wname, &with(cols));
        }
        let QuantParams { bits, group_size } = self.quant.for_module(prefix).ok_or_else(|| {
            anyhow!("'{prefix}' is stored quantized ('{sname}' exists) but config.json has no quantization settings for it")
        })?;
        let we = self.entry(&wname)?;
        if we.dtype != Dtype::U32 {
            bail!("quantized tensor '{wname}' in {} has dtype {:?}, expected U32", self.file_of(we), we.dtype);
        }
        if cols % group_size != 0 || (cols * bits as usize) % 32 != 0 {
            bail!("'{prefix}': {cols} input columns do not fit {bits}-bit groups of {group_size}");
        }
        let want_w = with(cols * bits as usize / 32);
        if we.shape != want_w {
            bail!(
                "quantized tensor '{wname}' in {} has shape {:?}, expected {:?} ({rows} x {cols} at {bits} bits; \
                 check the 'quantization' bits/group_size in config.json)",
                self.file_of(we), we.shape, want_w
            );
        }
        let bname = format!("{prefix}.biases");
        let se = self.expect_shape(&sname, &with(cols / group_size))?;
        let be = self.expect_shape(&bname, &with(cols / group_size))?;
        if se.dtype != be.dtype {
            bail!("'{sname}' and '{bname}' have different dtypes");
        }
        let scale_dtype = dtype_of(se.dtype)
            .ok_or_else(|| anyhow!("'{sname}' has dtype {:?}; expected f32, f16 or bf16", se.dtype))?;
        Ok(MatrixLayout { format: MatrixFormat::Affine { bits, group_size, scale_dtype }, tensors: vec![wname, sname, bname] })
    }

    /// An unquantized tensor `name` of the given shape (f32, f16 or bf16).
    pub fn dense_layout(&self, name: &str, shape: &[usize]) -> Result<MatrixLayout> {
        let e = self.expect_shape(name, shape)?;
        let dtype = dtype_of(e.dtype).ok_or_else(|| {
            anyhow!("tensor '{name}' in {} has dtype {:?}: expected f32/f16/bf16, or MLX quantized with scales", self.file_of(e), e.dtype)
        })?;
        Ok(MatrixLayout { format: MatrixFormat::Dense(dtype), tensors: vec![name.to_string()] })
    }

    /// Reads a weight matrix (see [`Checkpoint::matrix_layout`]).
    pub fn matrix(&self, prefix: &str, lead: &[usize], rows: usize, cols: usize) -> Result<HostMatrix<'static>> {
        let layout = self.matrix_layout(prefix, lead, rows, cols)?;
        let experts: usize = lead.iter().product();
        let mut parts = layout.tensors.iter().map(|t| self.read_bytes(t).map(Cow::Owned));
        let mut next = || parts.next().unwrap_or_else(|| Err(anyhow!("internal: missing piece of '{prefix}'")));
        let data = match layout.format {
            MatrixFormat::Dense(dtype) => MatrixData::Dense { dtype, bytes: next()? },
            MatrixFormat::Affine { bits, group_size, scale_dtype } => {
                MatrixData::Affine { bits, group_size, words: next()?, scale_dtype, scales: next()?, biases: next()? }
            }
        };
        Ok(HostMatrix { experts, rows, cols, data })
    }

    /// Total bytes of all tensors whose name satisfies `pred`.
    pub fn bytes_where(&self, pred: impl Fn(&str) -> bool) -> u64 {
        self.tensors.iter().filter(|(n, _)| pred(n)).map(|(_, e)| (e.end - e.start) as u64).sum()
    }
}
