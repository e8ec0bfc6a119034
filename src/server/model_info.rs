//! What the server says about its model: identity and details read once at
//! start, and the live memory report (`/api/show`, `/api/ps`).

use std::io::Read;
use std::path::Path;
use std::time::SystemTime;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::experts::CacheStats;
use crate::model::ModelArch;

use crate::generate::PrefixCacheStats;

/// Ollama's `details` object.
#[derive(Clone, Debug, Serialize)]
pub struct ModelDetails {
    pub parent_model: String,
    pub format: String,
    pub family: String,
    pub families: Vec<String>,
    pub parameter_size: String,
    pub quantization_level: String,
}

/// The served model, described once at start.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The name clients use (`model` in requests).
    pub name: String,
    pub details: ModelDetails,
    pub parameter_count: u64,
    /// Bytes of the checkpoint files on disk.
    pub file_bytes: u64,
    /// sha256 over what defines the model: each weight file's header and a
    /// sample of its data, the config, the tokenizer and the chat template
    /// (see [`definition_digest`]).
    pub digest: String,
    pub modified_at: SystemTime,
    pub config: serde_json::Value,
    pub context_length: Option<u64>,
    /// `/api/show`'s `model_info`: `general.*` and `<family>.*` keys as
    /// Ollama names them (context length, layers, heads, experts).
    pub model_info: serde_json::Map<String, serde_json::Value>,
}

impl ModelInfo {
    /// From the model's description and the safetensors headers of its
    /// directory; never fails on odd files (details it cannot read stay empty).
    pub fn describe(arch: &ModelArch, name: String) -> ModelInfo {
        let dir = arch.dir.as_path();
        let config = arch.raw.clone();
        let family = arch.text.model_type.clone();
        let bits = arch.quant_bits().map(u64::from);
        let (format, quantization_level) = match bits {
            Some(b) => ("mlx".to_string(), format!("{b}bit")),
            None => ("safetensors".to_string(), arch.torch_dtype().unwrap_or("unknown").to_uppercase()),
        };
        let mut parameter_count = 0u64;
        let mut file_bytes = 0u64;
        let mut modified_at = SystemTime::UNIX_EPOCH;
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        for path in files.iter().filter(|p| p.extension().is_some_and(|x| x == "safetensors")) {
            if let Ok(meta) = std::fs::metadata(path) {
                file_bytes += meta.len();
                modified_at = modified_at.max(meta.modified().unwrap_or(SystemTime::UNIX_EPOCH));
            }
            if let Some(header) = read_safetensors_header(path) {
                parameter_count += count_parameters(&header, bits);
            }
        }
        let digest = definition_digest(dir, &files, &config);
        let t = &arch.text;
        let mut model_info = serde_json::Map::new();
        model_info.insert("general.architecture".into(), family.clone().into());
        model_info.insert("general.parameter_count".into(), parameter_count.into());
        let mut put = |key: &str, value: Option<u64>| {
            if let Some(v) = value {
                model_info.insert(format!("{family}.{key}"), v.into());
            }
        };
        put("context_length", arch.context_length());
        put("embedding_length", Some(t.hidden_size as u64));
        put("block_count", Some(t.num_hidden_layers as u64));
        put("attention.head_count", Some(t.num_attention_heads as u64));
        put("attention.head_count_kv", t.num_key_value_heads.map(|n| n as u64));
        put("attention.key_length", t.head_dim.map(|n| n as u64));
        put("expert_count", Some(t.num_experts as u64));
        put("expert_used_count", Some(t.num_experts_per_tok as u64));
        put("expert_feed_forward_length", Some(t.moe_intermediate_size as u64));
        put("vocab_size", Some(t.vocab_size as u64));
        ModelInfo {
            name,
            details: ModelDetails {
                parent_model: String::new(),
                format,
                family: family.clone(),
                families: vec![family],
                parameter_size: human_count(parameter_count),
                quantization_level,
            },
            parameter_count,
            file_bytes,
            digest,
            modified_at,
            context_length: arch.context_length(),
            model_info,
            config,
        }
    }

    /// Whether a request's `model` names this model (`name` or `name:latest`).
    pub fn answers_to(&self, requested: &str) -> bool {
        let requested = requested.trim();
        requested == self.name || requested.strip_suffix(":latest") == Some(self.name.as_str())
    }
}

/// Files besides the weights that change what a model answers: its
/// configuration, tokenizer and chat template.
const DEFINITION_FILES: [&str; 10] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
];

/// Bytes read from each end of a weight file's data for the digest.
const WEIGHT_SAMPLE_BYTES: u64 = 64 << 10;

/// Bytes of one definition file the digest reads at most.
const DEFINITION_FILE_LIMIT: u64 = 256 << 20;

/// sha256 (hex) over what defines the model in `dir`: each weight file's
/// name, size, header and the first and last [`WEIGHT_SAMPLE_BYTES`] of its
/// data (hashing every weight would read the whole checkpoint at start;
/// fine-tunes of one shape differ in the sample), its `config` (as
/// `ModelArch` read it), then each of [`DEFINITION_FILES`] that is there, by
/// name and content. Two models that
/// differ only in their chat template get different digests; clients (the
/// `llm-ollama` plugin) fold models with one digest into one. Files that
/// cannot be read count as absent; the digest never fails.
pub fn definition_digest(dir: &Path, files: &[std::path::PathBuf], config: &serde_json::Value) -> String {
    let mut hasher = Sha256::new();
    let mut tagged = |tag: &str, name: &str, bytes: &[u8]| {
        hasher.update(format!("{tag} {name} {}\n", bytes.len()).as_bytes());
        hasher.update(bytes);
    };
    for path in files.iter().filter(|p| p.extension().is_some_and(|x| x == "safetensors")) {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        tagged("weights", &name, &weight_sample(path).unwrap_or_default());
    }
    tagged("config", "config.json", config.to_string().as_bytes());
    for name in DEFINITION_FILES {
        let Ok(mut f) = crate::model_files::open_regular(&dir.join(name)) else { continue };
        let mut bytes = Vec::new();
        if (&mut f).take(DEFINITION_FILE_LIMIT).read_to_end(&mut bytes).is_ok() {
            tagged("file", name, &bytes);
        }
    }
    crate::hex::lower(&hasher.finalize())
}

/// A weight file's size, header and the two ends of its data.
fn weight_sample(path: &Path) -> Option<Vec<u8>> {
    use std::io::{Seek, SeekFrom};
    let mut f = crate::model_files::open_regular(path).ok()?;
    let size = f.metadata().ok()?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let header_len = u64::from_le_bytes(len).min(100 << 20).min(size.saturating_sub(8));
    let mut out = size.to_le_bytes().to_vec();
    (&mut f).take(header_len).read_to_end(&mut out).ok()?;
    let data_start = 8 + header_len;
    let head = WEIGHT_SAMPLE_BYTES.min(size - data_start);
    (&mut f).take(head).read_to_end(&mut out).ok()?;
    let tail_start = size.saturating_sub(WEIGHT_SAMPLE_BYTES).max(data_start + head);
    f.seek(SeekFrom::Start(tail_start)).ok()?;
    f.take(size - tail_start).read_to_end(&mut out).ok()?;
    Some(out)
}

fn read_safetensors_header(path: &Path) -> Option<serde_json::Value> {
    // A special file named *.safetensors must not block the server's start.
    let mut f = crate::model_files::open_regular(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return None;
    }
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).ok()?;
    serde_json::from_slice(&buf).ok()
}

/// Parameters in one header; packed quantized weights count `32 / bits`
/// values per stored u32, and quantization scales and biases do not count.
fn count_parameters(header: &serde_json::Value, bits: Option<u64>) -> u64 {
    let Some(map) = header.as_object() else { return 0 };
    let mut total = 0u64;
    for (name, t) in map {
        if name == "__metadata__" || name.ends_with(".scales") || name.ends_with(".biases") {
            continue;
        }
        let numel: u64 = t
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|s| s.iter().filter_map(|d| d.as_u64()).product())
            .unwrap_or(0);
        let packed = t.get("dtype").and_then(|d| d.as_str()) == Some("U32");
        total += match (packed, bits) {
            (true, Some(b)) if b > 0 => numel * (32 / b),
            _ => numel,
        };
    }
    total
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// Where the server's memory goes, as far as it is known today. Grows with
/// the memory planner.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryReport {
    /// Weights kept resident (everything but the routed experts).
    pub resident_weight_bytes: u64,
    /// The routed-expert slot pool.
    pub expert_pool_bytes: u64,
    pub expert_slots: usize,
    /// KV and recurrent state held by the prefix cache.
    pub prefix_cache_state_bytes: u64,
    /// Everything above.
    pub total_bytes: u64,
    pub prefix_cache: PrefixCacheStats,
    pub expert_cache: CacheStats,
    /// The memory plan in force (the governor may have resized it).
    pub plan: Option<crate::plan::Plan>,
}

/// `2026-11-30T13:00:27.123456789Z`, as Ollama writes `created_at`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_covers_the_chat_template_tokenizer_and_weights() {
        let dir = tempfile::tempdir().expect("a scratch folder");
        let write = |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).expect("writing");
        let mut weights = 8u64.to_le_bytes().to_vec();
        weights.extend(b"{}      ");
        weights.extend(vec![1u8; 300 << 10]);
        write("model.safetensors", &weights);
        let files = vec![dir.path().join("model.safetensors")];
        let digest = || definition_digest(dir.path(), &files, &serde_json::json!({}));
        let first = digest();
        assert_eq!(first.len(), 64, "sha256 in hex: {first}");
        assert_eq!(digest(), first, "stable");
        assert_ne!(definition_digest(dir.path(), &files, &serde_json::json!({"n": 1})), first, "the config counts");
        write("chat_template.jinja", b"{{ messages }}");
        let templated = digest();
        assert_ne!(templated, first, "a chat template changes the digest");
        write("chat_template.jinja", b"{{ messages[0] }}");
        assert_ne!(digest(), templated, "another chat template changes it again");
        write("tokenizer.json", b"{}");
        let tokenized = digest();
        assert_ne!(tokenized, templated, "the tokenizer counts");
        // The last bytes of the weights' data (a fine-tune of the same shape).
        let last = weights.len() - 1;
        weights[last] = 2;
        write("model.safetensors", &weights);
        assert_ne!(digest(), tokenized, "the weights' data counts");
    }

    #[test]
    fn timestamps_are_rfc3339() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.000000000Z");
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
    }
}
