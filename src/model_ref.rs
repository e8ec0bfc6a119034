//! `--model` for `run`, `serve` and `perplexity`: the directory a model name
//! stands for (a directory, a known model or `hf:ORG/NAME[@REV]` in the
//! Hugging Face cache, or with no name the default model, else the bundled
//! demo), and the name clients use for it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::{demo, pull};

/// A model found on disk, ready to plan and load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedModel {
    pub dir: PathBuf,
    /// The name clients put in `model`: the directory's name, the known
    /// model's name, `ORG/NAME` for `hf:` models, or [`demo::NAME`].
    pub name: String,
    /// Nothing was named and the default model is not installed, so the
    /// bundled demo runs (callers tell the user, see [`demo::NOTE`]).
    pub is_demo: bool,
}

impl ResolvedModel {
    /// Resolves a `--model` value. A known or `hf:` model must be complete and
    /// verified in the cache; otherwise the error says what is missing and
    /// the `slotstream pull` command that completes it.
    pub fn resolve(spec: Option<&str>) -> Result<ResolvedModel> {
        resolve_with(spec, pull::locate_model, demo::model_dir)
    }
}

/// [`ResolvedModel::resolve`] with the cache lookup and the demo's unpacking
/// passed in, so tests need neither the user's cache nor the demo's files.
fn resolve_with(
    spec: Option<&str>,
    locate: impl Fn(&str) -> Result<PathBuf>,
    demo_dir: impl FnOnce() -> Result<PathBuf>,
) -> Result<ResolvedModel> {
    let found = |dir: PathBuf, name: &str| ResolvedModel { dir, name: name.to_string(), is_demo: false };
    match spec {
        Some(dir) if Path::new(dir).is_dir() => Ok(found(PathBuf::from(dir), &directory_name(Path::new(dir)))),
        // The name `serve` lists the bundled demo under.
        Some(demo::NAME) => Ok(ResolvedModel { dir: demo_dir()?, name: demo::NAME.to_string(), is_demo: true }),
        Some(spec) if looks_like_a_repo(spec) && !Path::new(spec).exists() => {
            bail!("--model {spec}: no such directory (for a Hugging Face repo, write hf:{spec} and pull it first)")
        }
        Some(spec) if spec.contains('/') && !spec.starts_with("hf:") => {
            if Path::new(spec).is_file() {
                bail!("{}", a_file(spec));
            }
            bail!("--model {spec}: no such directory (give the folder that holds the model's config.json)")
        }
        Some(spec) => {
            let repo = spec.strip_prefix("hf:").unwrap_or(spec);
            let name = repo.split_once('@').map_or(repo, |(name, _revision)| name);
            match locate(spec) {
                Ok(dir) => Ok(found(dir, name)),
                // A known name or repo comes first; a file of that name is named as one.
                Err(_) if Path::new(spec).is_file() => bail!("{}", a_file(spec)),
                // Neither a folder nor a name `pull` knows: most likely a mistyped path.
                Err(e) if !Path::new(spec).exists() && pull::check_spec(spec).is_err() => bail!(
                    "--model {spec}: no such directory, nor a model name ({e:#}); `--model {}` runs the bundled demo",
                    demo::NAME
                ),
                Err(e) => Err(e),
            }
        }
        // Any failure to find the default model (not downloaded, no cache at
        // all) means "not installed": the demo keeps a fresh machine working.
        None => match locate(pull::DEFAULT_MODEL) {
            Ok(dir) => Ok(found(dir, pull::DEFAULT_MODEL)),
            Err(_) => Ok(ResolvedModel { dir: demo_dir()?, name: demo::NAME.to_string(), is_demo: true }),
        },
    }
}

/// What `--model` says of a file given as the model.
fn a_file(spec: &str) -> String {
    format!("--model {spec}: a file, not a model directory (give the folder that holds the model's config.json and weights)")
}

/// `ORG/NAME` as Hugging Face spells a repository: two plain names, not a path.
fn looks_like_a_repo(spec: &str) -> bool {
    let mut parts = spec.split('/');
    let plain = |p: Option<&str>| {
        p.is_some_and(|p| !p.is_empty() && !p.starts_with('.') && !p.starts_with('~') && !p.contains('@'))
    };
    !spec.starts_with("hf:") && plain(parts.next()) && plain(parts.next()) && parts.next().is_none()
}

/// Folder names that say nothing about which model is inside; such a folder
/// is named after its parent (`tools/demo/model` is `demo`).
const GENERIC_DIRECTORY_NAMES: [&str; 4] = ["model", "models", "weights", "checkpoint"];

/// A model directory's own name (of its canonical path, so `.` works), its
/// parent's when its own is generic, or `model` where it has none.
fn directory_name(dir: &Path) -> String {
    let Ok(path) = dir.canonicalize() else { return "model".to_string() };
    let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    match name(&path) {
        Some(own) if GENERIC_DIRECTORY_NAMES.contains(&own.to_lowercase().as_str()) => {
            path.parent().and_then(name).unwrap_or(own)
        }
        Some(own) => own,
        None => "model".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::anyhow;

    fn not_installed(spec: &str) -> Result<PathBuf> {
        Err(anyhow!("{spec} is not downloaded"))
    }

    fn in_cache(spec: &str) -> Result<PathBuf> {
        Ok(PathBuf::from("/cache").join(spec))
    }

    fn no_demo() -> Result<PathBuf> {
        panic!("the demo model should not be used here")
    }

    #[test]
    fn a_directory_is_named_after_itself() {
        let parent = tempfile::tempdir().expect("creating a scratch folder");
        let dir = parent.path().join("my-model");
        std::fs::create_dir(&dir).expect("creating the model folder");
        let model = resolve_with(dir.to_str(), not_installed, no_demo).expect("a directory resolves");
        assert_eq!(model, ResolvedModel { dir: dir.clone(), name: "my-model".into(), is_demo: false });
    }

    #[test]
    fn a_name_that_is_neither_a_folder_nor_a_model_says_so_and_names_the_demo() {
        let error = resolve_with(Some("nonexistent"), not_installed, no_demo).expect_err("no such model");
        let text = format!("{error:#}");
        assert!(text.starts_with("--model nonexistent: no such directory") && text.contains("slotstream-demo"), "{text}");
        // A known name that is not downloaded keeps its own advice.
        let error = resolve_with(Some("qwen3.8-flash-next:4bit"), not_installed, no_demo).expect_err("not downloaded");
        assert!(format!("{error:#}").contains("is not downloaded"), "{error:#}");
    }

    #[test]
    fn a_path_that_is_not_a_directory_suggests_the_hf_form() {
        let error = resolve_with(Some("org/missing"), in_cache, no_demo).expect_err("no such directory");
        assert!(format!("{error:#}").contains("write hf:org/missing"), "{error:#}");
    }

    #[test]
    fn a_file_is_named_as_one() {
        let parent = tempfile::tempdir().expect("creating a scratch folder");
        let file = parent.path().join("model.safetensors");
        std::fs::write(&file, b"not a folder").expect("writing a file");
        let error = resolve_with(file.to_str(), in_cache, no_demo).expect_err("a file is no model directory");
        assert!(format!("{error:#}").contains("a file, not a model directory"), "{error:#}");
    }

    #[test]
    fn a_missing_path_is_not_taken_for_a_repo() {
        for spec in ["/no/such/model", "./missing/model", "../missing", "a/b/c", "~/models/x"] {
            let error = resolve_with(Some(spec), in_cache, no_demo).expect_err("no such directory");
            let message = format!("{error:#}");
            assert!(message.contains("no such directory") && !message.contains("hf:"), "{spec}: {message}");
        }
    }

    #[test]
    fn a_folder_with_a_generic_name_is_named_after_its_parent() {
        let parent = tempfile::tempdir().expect("creating a scratch folder");
        let dir = parent.path().join("tiny-moe").join("model");
        std::fs::create_dir_all(&dir).expect("creating the model folder");
        let model = resolve_with(dir.to_str(), not_installed, no_demo).expect("a directory resolves");
        assert_eq!(model.name, "tiny-moe");
    }

    #[test]
    fn known_and_hub_models_are_found_in_the_cache_under_their_client_names() {
        for (spec, name) in [
            ("qwen3.8-flash-next:4bit", "qwen3.8-flash-next:4bit"),
            ("hf:org/name", "org/name"),
            ("hf:org/name@v1.0", "org/name"),
        ] {
            let model = resolve_with(Some(spec), in_cache, no_demo).expect("the cache has it");
            assert_eq!(model, ResolvedModel { dir: PathBuf::from("/cache").join(spec), name: name.into(), is_demo: false });
        }
    }

    #[test]
    fn a_named_model_missing_from_the_cache_is_an_error_not_the_demo() {
        let error = resolve_with(Some("hf:org/name"), not_installed, no_demo).expect_err("not downloaded");
        assert!(format!("{error:#}").contains("hf:org/name is not downloaded"), "{error:#}");
    }

    #[test]
    fn no_name_runs_the_default_model_when_installed_else_the_demo() {
        let model = resolve_with(None, in_cache, no_demo).expect("the default model is installed");
        assert_eq!(model.name, pull::DEFAULT_MODEL);
        assert!(!model.is_demo);

        let demo = resolve_with(None, not_installed, || Ok(PathBuf::from("/demo"))).expect("the demo is bundled");
        assert_eq!(demo, ResolvedModel { dir: PathBuf::from("/demo"), name: demo::NAME.into(), is_demo: true });
    }

    #[test]
    fn the_demos_served_name_runs_it() {
        let demo = resolve_with(Some(demo::NAME), in_cache, || Ok(PathBuf::from("/demo"))).expect("the demo is bundled");
        assert_eq!(demo, ResolvedModel { dir: PathBuf::from("/demo"), name: demo::NAME.into(), is_demo: true });
    }
}
