//! The bundled demo model: a 24M-parameter qwen3_next MoE (6 layers, 32
//! experts top-4 plus a shared expert) trained on public-domain English and
//! fine-tuned on it cut into chat turns, so that it ends its answers
//! (tools/demo/), MLX 4-bit, compiled into the binary so `run` and `serve`
//! work offline on a fresh machine. It is unpacked once into the user's cache.

use std::path::PathBuf;

use anyhow::{Context, Result};

const FILES: [(&str, &[u8]); 7] = [
    ("config.json", include_bytes!("../tools/demo/model/config.json")),
    ("generation_config.json", include_bytes!("../tools/demo/model/generation_config.json")),
    ("model.safetensors", include_bytes!("../tools/demo/model/model.safetensors")),
    ("model.safetensors.index.json", include_bytes!("../tools/demo/model/model.safetensors.index.json")),
    ("tokenizer.json", include_bytes!("../tools/demo/model/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../tools/demo/model/tokenizer_config.json")),
    ("chat_template.jinja", include_bytes!("../tools/demo/model/chat_template.jinja")),
];

/// The name clients use for the demo model (`serve`'s `model` field).
pub const NAME: &str = "slotstream-demo";

/// One line for users: what is running and how to get the real model.
pub const NOTE: &str = "note: no model installed, running the bundled 24M-parameter demo model \
(trained on public-domain English); run a qwen3_moe, qwen3_5_moe, qwen3_next or qwen4_exp checkpoint with \
--model DIR, or fetch Qwen3.8-Flash-Next with `slotstream pull qwen3.8-flash-next:4bit`";

/// A short digest of the bundled files. A retrained model has the same
/// dimensions and so the same file sizes: the cache folder is named by the
/// content, or an older binary's unpacked weights would be taken for these.
fn content_digest() -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for (name, bytes) in FILES {
        hasher.update(name.as_bytes());
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    }
    crate::hex::lower(&hasher.finalize()[..8])
}

/// The demo model's directory, unpacking it on first use. Files are written
/// under a temporary name and renamed, so an interrupted unpack is redone.
pub fn model_dir() -> Result<PathBuf> {
    let dir = crate::user_cache::dir()?.join(format!("demo-{}-{}", env!("CARGO_PKG_VERSION"), content_digest()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        if std::fs::metadata(&path).map(|m| m.len() as usize == bytes.len()).unwrap_or(false) {
            continue;
        }
        let tmp = dir.join(format!("{name}.partial"));
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} into place", tmp.display()))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_note_names_every_model_type_slotstream_loads() {
        for model_type in crate::model::Family::SUPPORTED.split(", ") {
            assert!(super::NOTE.contains(&format!("{model_type},")) || super::NOTE.contains(&format!("{model_type} ")), "{model_type}");
        }
    }
}
