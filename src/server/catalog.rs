//! What the server answers for: every model pulled into the Hugging Face cache
//! (found again on each look, so a pull or a delete shows at once) and each
//! `--model` directory, by the name clients put in `model`. Names are only
//! ever compared with the catalog's own; none becomes a path.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{lock, ModelInfo};
use crate::model::ModelArch;
use crate::note;

/// Where a served model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A directory given with `--model`: served, never deleted.
    Directory,
    /// Pulled into the hub cache; `spec` is how `slotstream pull` names it.
    Pulled { spec: String },
}

/// One model the server can load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogEntry {
    pub name: String,
    pub dir: PathBuf,
    pub origin: Origin,
}

impl CatalogEntry {
    /// Whether a request's `model` names this model: the name itself,
    /// `NAME:latest`, and for pulled models the `hf:` spelling too.
    pub fn answers_to(&self, requested: &str) -> bool {
        let requested = requested.trim();
        let requested = requested.strip_suffix(":latest").unwrap_or(requested);
        if requested == self.name {
            return true;
        }
        matches!(&self.origin, Origin::Pulled { spec } if spec == requested)
    }
}

/// The models the server answers for.
pub struct ModelCatalog {
    /// `--model` directories, by name, in the order given.
    directories: Vec<(String, PathBuf)>,
    /// The hub cache pulled models live in; `None` serves only the directories.
    hub_cache: Option<PathBuf>,
    /// Descriptions read so far, by folder (snapshots never change in place;
    /// a `--model` directory is read once).
    described: Mutex<HashMap<PathBuf, Option<ModelInfo>>>,
}

impl ModelCatalog {
    pub fn new(directories: Vec<(String, PathBuf)>, hub_cache: Option<PathBuf>) -> ModelCatalog {
        ModelCatalog { directories, hub_cache, described: Mutex::new(HashMap::new()) }
    }

    pub fn hub_cache(&self) -> Option<&Path> {
        self.hub_cache.as_deref()
    }

    /// Every model, `--model` directories first; a pulled model whose name a
    /// directory already uses is left out (the directory wins).
    pub fn entries(&self) -> Vec<CatalogEntry> {
        let mut entries: Vec<CatalogEntry> = self
            .directories
            .iter()
            .map(|(name, dir)| CatalogEntry { name: name.clone(), dir: dir.clone(), origin: Origin::Directory })
            .collect();
        if let Some(root) = &self.hub_cache {
            for model in crate::pull::installed_models(root) {
                if !entries.iter().any(|e| e.name == model.name) {
                    entries.push(CatalogEntry { name: model.name, dir: model.dir, origin: Origin::Pulled { spec: model.spec } });
                }
            }
        }
        entries
    }

    /// The model a request names, if the server has it.
    pub fn find(&self, requested: &str) -> Option<CatalogEntry> {
        // Directories answer without a look at the cache.
        let directory = self.directories.iter().find(|(name, dir)| {
            CatalogEntry { name: name.clone(), dir: dir.clone(), origin: Origin::Directory }.answers_to(requested)
        });
        if let Some((name, dir)) = directory {
            return Some(CatalogEntry { name: name.clone(), dir: dir.clone(), origin: Origin::Directory });
        }
        self.entries().into_iter().find(|e| e.answers_to(requested))
    }

    /// The entry's description (read once; `None` when its folder does not
    /// hold a model this server can read, which is noted once).
    pub fn describe(&self, entry: &CatalogEntry) -> Option<ModelInfo> {
        if let Some(known) = lock(&self.described).get(&entry.dir) {
            return known.clone().map(|info| ModelInfo { name: entry.name.clone(), ..info });
        }
        let info = match ModelArch::read(&entry.dir) {
            Ok(arch) => Some(ModelInfo::describe(&arch, entry.name.clone())),
            Err(e) => {
                note!("{} ({}) is not a model slotstream can serve: {e:#}", entry.name, entry.dir.display());
                None
            }
        };
        lock(&self.described).insert(entry.dir.clone(), info.clone());
        info
    }

    /// Forgets what was read about a folder (a deleted model).
    pub fn forget(&self, dir: &Path) {
        lock(&self.described).remove(dir);
    }

    /// The names the server answers for, for "not found" messages.
    pub fn names(&self) -> Vec<String> {
        self.entries().into_iter().map(|e| e.name).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_with_latest_and_the_pull_spelling() {
        let dir = CatalogEntry { name: "tiny".into(), dir: "/m".into(), origin: Origin::Directory };
        assert!(dir.answers_to("tiny") && dir.answers_to("tiny:latest") && dir.answers_to(" tiny "));
        assert!(!dir.answers_to("tiny:7b") && !dir.answers_to("hf:tiny"));
        let pulled =
            CatalogEntry { name: "org/name".into(), dir: "/c".into(), origin: Origin::Pulled { spec: "hf:org/name".into() } };
        assert!(pulled.answers_to("org/name") && pulled.answers_to("hf:org/name") && pulled.answers_to("org/name:latest"));
        assert!(!pulled.answers_to("org/other"));
    }

    #[test]
    fn directories_come_first_and_a_missing_cache_adds_nothing() {
        let scratch = tempfile::tempdir().expect("a scratch folder");
        let catalog = ModelCatalog::new(
            vec![("a".into(), "/models/a".into()), ("b".into(), "/models/b".into())],
            Some(scratch.path().join("no-cache")),
        );
        assert_eq!(catalog.names(), ["a", "b"]);
        assert_eq!(catalog.find("b:latest").map(|e| e.dir), Some(PathBuf::from("/models/b")));
        assert_eq!(catalog.find("c"), None);
    }
}
