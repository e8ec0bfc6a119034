//! What a model is made of: the model names `pull` understands, the pinned manifests
//! compiled into the binary, and the manifest record kept for `hf:` models so that a
//! later `run` can tell, offline, which files are missing.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// The model `run`, `serve` and `pull` use when none is named.
pub const DEFAULT_MODEL: &str = "qwen3.8-flash-next:4bit";

/// Known models: name and the published manifest, compiled in so the pinned sizes
/// and hashes cannot drift from what this binary was tested with.
const KNOWN_MODELS: &[(&str, &str)] = &[(
    "qwen3.8-flash-next:4bit",
    include_str!("manifests/qwen3.8-flash-next.json"),
)];

/// The names of the models with a compiled-in manifest.
pub fn known_model_names() -> impl Iterator<Item = &'static str> {
    KNOWN_MODELS.iter().map(|(name, _)| *name)
}

/// How a file's content is pinned. Hugging Face names LFS blobs by their sha256 and
/// small (plain git) files by their git blob sha1, and reports that name as the ETag.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Digest {
    Sha256(String),
    /// sha1 of `"blob {len}\0"` followed by the content, as git computes it.
    GitSha1(String),
}

impl Digest {
    pub fn hex(&self) -> &str {
        match self {
            Digest::Sha256(hex) | Digest::GitSha1(hex) => hex,
        }
    }

    pub fn algorithm(&self) -> &'static str {
        match self {
            Digest::Sha256(_) => "sha256",
            Digest::GitSha1(_) => "git sha1",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Path inside the repository, `/`-separated.
    pub path: String,
    pub size: u64,
    pub digest: Digest,
    /// A missing optional file does not make the model incomplete.
    pub optional: bool,
}

/// A repository at a revision that files can be fetched from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// `org/name` on the hub.
    pub repo: String,
    /// Commit hash for pinned models; for `hf:` models the commit the hub resolved.
    pub revision: String,
}

/// Every file of one model at one revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Where the model is stored in the cache; files come from here first.
    pub primary: Source,
    /// Mirrors tried, in order, for a file the primary does not have (the flagship's
    /// optional `mtp.safetensors` lives only on a mirror).
    pub mirrors: Vec<Source>,
    pub files: Vec<ManifestFile>,
}

/// A model as the user names it on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSpec {
    /// A model whose manifest is compiled into the binary.
    Known { name: String, manifest: Manifest },
    /// `hf:ORG/NAME[@REVISION]`: any hub repository, described by the hub's metadata.
    Hub { repo: String, revision: String },
}

impl ModelSpec {
    pub fn parse(spec: &str) -> Result<ModelSpec> {
        if let Some(rest) = spec.strip_prefix("hf:") {
            let (repo, revision) = match rest.split_once('@') {
                Some((repo, revision)) => (repo, revision),
                None => (rest, "main"),
            };
            check_repo_id(repo).with_context(|| format!("reading the model name {spec:?}"))?;
            check_revision(revision).with_context(|| format!("reading the model name {spec:?}"))?;
            return Ok(ModelSpec::Hub { repo: repo.to_string(), revision: revision.to_string() });
        }
        for (name, json) in KNOWN_MODELS {
            if *name == spec {
                let manifest = parse_published_manifest(json)
                    .with_context(|| format!("reading the compiled-in manifest of {name}"))?;
                return Ok(ModelSpec::Known { name: name.to_string(), manifest });
            }
        }
        let known: Vec<&str> = KNOWN_MODELS.iter().map(|(name, _)| *name).collect();
        bail!(
            "unknown model {spec:?}; known models: {}; any Hugging Face repository: hf:ORG/NAME[@REVISION]",
            known.join(", ")
        )
    }

    /// The argument that names this model to `slotstream pull`.
    pub fn display_name(&self) -> String {
        match self {
            ModelSpec::Known { name, .. } => name.clone(),
            ModelSpec::Hub { repo, revision } if revision == "main" => format!("hf:{repo}"),
            ModelSpec::Hub { repo, revision } => format!("hf:{repo}@{revision}"),
        }
    }

    /// The repository whose cache folder holds the model.
    pub fn cache_repo(&self) -> &str {
        match self {
            ModelSpec::Known { manifest, .. } => &manifest.primary.repo,
            ModelSpec::Hub { repo, .. } => repo,
        }
    }
}

fn check_repo_id(repo: &str) -> Result<()> {
    let valid_part = |part: &str| {
        !part.is_empty()
            && part != "."
            && part != ".."
            && part.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    match repo.split_once('/') {
        Some((org, name)) if valid_part(org) && valid_part(name) => Ok(()),
        _ => bail!("{repo:?} is not a Hugging Face repository id; expected ORG/NAME"),
    }
}

/// Refuses a revision that is neither a commit hash nor a valid git ref name (the
/// rules of `git check-ref-format`), so a revision can never climb out of the
/// cache's `refs/` folder or name an absolute path when it is joined onto it.
pub fn check_revision(revision: &str) -> Result<()> {
    if is_commit_hash(revision) {
        return Ok(());
    }
    let bad_char = |c: char| c.is_ascii_control() || " ~^:?*[\\".contains(c);
    let bad_part = |part: &str| part.is_empty() || part.starts_with('.') || part.ends_with(".lock");
    let valid = !revision.is_empty()
        && revision.len() <= 255
        && revision != "@"
        && !revision.ends_with('.')
        && !revision.contains("..")
        && !revision.contains("@{")
        && !revision.chars().any(bad_char)
        && !revision.split('/').any(bad_part);
    if !valid {
        bail!(
            "the revision {revision:?} is not a branch, tag or commit: use a 40-hex commit hash or a git ref \
             name (letters, digits, '-', '_', '.', '/'; no '..', no leading '/' or '.'), as in hf:ORG/NAME@main"
        );
    }
    Ok(())
}

/// A commit hash, as opposed to a branch or tag name.
pub fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// The published manifest format (`src/pull/manifests/*.json`).
#[derive(Deserialize)]
struct PublishedManifest {
    sources: Vec<Source>,
    files: Vec<PublishedFile>,
}

#[derive(Deserialize)]
struct PublishedFile {
    path: String,
    size: u64,
    sha256: String,
    optional: bool,
}

fn parse_published_manifest(json: &str) -> Result<Manifest> {
    let published: PublishedManifest = serde_json::from_str(json)?;
    let mut sources = published.sources.into_iter();
    let Some(primary) = sources.next() else { bail!("the manifest lists no source repository") };
    let files = published
        .files
        .into_iter()
        .map(|f| {
            if f.sha256.len() != 64 || !f.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
                bail!("{}: {:?} is not a sha256", f.path, f.sha256);
            }
            Ok(ManifestFile {
                path: f.path,
                size: f.size,
                digest: Digest::Sha256(f.sha256.to_ascii_lowercase()),
                optional: f.optional,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Manifest { primary, mirrors: sources.collect(), files })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flagship_manifest_pins_every_file() {
        let ModelSpec::Known { manifest, .. } = ModelSpec::parse(DEFAULT_MODEL).unwrap() else {
            panic!("the default model is not a known model");
        };
        assert_eq!(manifest.primary.repo, "pipenetwork/Qwen3.8-Flash-Next-MLX-4bit");
        assert!(is_commit_hash(&manifest.primary.revision));
        assert_eq!(manifest.files.len(), 25);
        let required: u64 = manifest.files.iter().filter(|f| !f.optional).map(|f| f.size).sum();
        assert_eq!(required, 103_793_508_077);
        let optional: Vec<&str> =
            manifest.files.iter().filter(|f| f.optional).map(|f| f.path.as_str()).collect();
        assert_eq!(optional, ["mtp.safetensors"]);
    }

    #[test]
    fn hub_specs_parse_with_and_without_revision() {
        assert_eq!(
            ModelSpec::parse("hf:org/name").unwrap(),
            ModelSpec::Hub { repo: "org/name".into(), revision: "main".into() }
        );
        assert_eq!(
            ModelSpec::parse("hf:org/name@v1.0").unwrap().display_name(),
            "hf:org/name@v1.0"
        );
        for bad in ["hf:org", "hf:/name", "hf:org/na/me", "hf:../x", "hf:org/name@", "nope"] {
            assert!(ModelSpec::parse(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn revisions_are_commits_or_git_ref_names_never_paths() {
        let commit = "0123456789abcdef0123456789abcdef01234567";
        for good in ["main", "v1.0", "refs/pr/1", "release-2024_01", commit] {
            let spec = format!("hf:org/name@{good}");
            assert!(ModelSpec::parse(&spec).is_ok(), "{spec} should be accepted");
        }
        for bad in [
            "/etc/passwd", "/tmp/x", "../x", "a/../../b", "a//b", "a/", ".hidden", "a/.b", "x.lock",
            "a\\b", "a b", "a:b", "a~1", "a^", "a?", "a*", "a[", "a@{1}", "@", "ends.", "tab\t", "nul\0",
            "C:\\Windows",
        ] {
            let spec = format!("hf:org/name@{bad}");
            let error = ModelSpec::parse(&spec).expect_err(&spec);
            assert!(format!("{error:#}").contains("is not a branch, tag or commit"), "{spec}: {error:#}");
        }
    }
}
