//! The code's shape, checked: no import cycle among the modules of `src/`,
//! `backends/core` or `backends/wgpu`, one reader of `config.json`, no source
//! file over 600 lines, and the `SLOTSTREAM_*` environment read only by the
//! options structs (ARCHITECTURE.md says why each matters).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/model/blocks/moe.rs` -> `model::blocks::moe`; `mod.rs` names its folder.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("a file under src/").with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// Source text without `//` comments (doc comments name modules freely).
fn code_of(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// Every `crate::a::b...`, `super::...` and `self::...` path in `code`, resolved
/// against `module`, cut to the longest known module.
fn references(module: &[String], code: &str, known: &BTreeSet<Vec<String>>) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    let bytes = code.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start) {
            let at = from + at;
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let path: String =
                code[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
            let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            let mut base: Vec<String> = match segments[0] {
                "crate" => Vec::new(),
                _ => module.to_vec(),
            };
            let mut rest = &segments[1..];
            if segments[0] == "super" {
                base.pop();
                while rest.first() == Some(&"super") {
                    base.pop();
                    rest = &rest[1..];
                }
            }
            let full: Vec<String> = base.into_iter().chain(rest.iter().map(|s| s.to_string())).collect();
            if let Some(target) = (1..=full.len()).rev().map(|n| full[..n].to_vec()).find(|m| known.contains(m)) {
                // A module reaching into its own children or parents is nesting, not an edge.
                let nested = target.starts_with(module) || module.starts_with(&target);
                if !nested {
                    out.insert(target);
                }
            }
        }
    }
    out
}

fn src_files() -> (PathBuf, Vec<PathBuf>) {
    crate_files("src")
}

/// The `.rs` files under a crate's source folder (relative to the root).
fn crate_files(dir: &str) -> (PathBuf, Vec<PathBuf>) {
    let src = Path::new(ROOT).join(dir);
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    (src, files)
}

/// Source folders of the crates checked for import cycles (`backends/cpu`
/// still has one: `kv_cache` and `kv_q8`).
const CRATE_SOURCES: [&str; 3] = ["src", "backends/core/src", "backends/wgpu/src"];

/// A path from `start` back to itself through `edges`, if there is one.
fn cycle_from(start: &[String], edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    let mut stack: Vec<Vec<Vec<String>>> = vec![vec![start.to_vec()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        let node = path.last().expect("a path is never empty");
        for next in edges.get(node).into_iter().flatten() {
            if next == start {
                return Some(path.iter().cloned().chain([next.clone()]).collect());
            }
            if seen.insert(next.clone()) {
                stack.push(path.iter().cloned().chain([next.clone()]).collect());
            }
        }
    }
    None
}

/// An import cycle among the modules of the crate whose sources are in `src`,
/// seen at every depth: `plan::costs -> generate` with `generate -> plan` is
/// a cycle between `plan` and `generate` even though `plan` itself only
/// declares `costs`. The crate root (`lib.rs`, `main.rs`) is every module's
/// parent, not a node.
fn import_cycle(src: &Path, files: &[PathBuf]) -> Option<String> {
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .filter(|f| !f.ends_with("main.rs") && !f.ends_with("lib.rs"))
        .map(|f| (module_of(src, f), code_of(&std::fs::read_to_string(f).expect("reading a source file"))))
        .collect();
    let known: BTreeSet<Vec<String>> = modules.keys().cloned().collect();
    let deepest = known.iter().map(|m| m.len()).max().unwrap_or(1);
    for depth in 1..=deepest {
        let cut = |m: &Vec<String>| m[..m.len().min(depth)].to_vec();
        let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (m, code) in &modules {
            for target in references(m, code, &known) {
                let (from, to) = (cut(m), cut(&target));
                // Within one module at this depth, or a module and its own parent: nesting.
                if from != to && !from.starts_with(&to) && !to.starts_with(&from) {
                    edges.entry(from).or_default().insert(to);
                }
            }
        }
        for start in edges.keys() {
            if let Some(cycle) = cycle_from(start, &edges) {
                let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
                return Some(format!("{depth} deep: {}", names.join(" -> ")));
            }
        }
    }
    None
}

/// No import cycle among the modules of any crate of the workspace.
#[test]
fn src_modules_import_no_cycle() {
    for dir in CRATE_SOURCES {
        let (src, files) = crate_files(dir);
        if let Some(cycle) = import_cycle(&src, &files) {
            panic!("import cycle among the modules of {dir}, {cycle}");
        }
    }
}

#[test]
fn config_json_is_read_in_one_place() {
    let (src, files) = src_files();
    let readers: Vec<String> = files
        .iter()
        .filter(|f| code_of(&std::fs::read_to_string(f).expect("reading a source file")).contains("join(\"config.json\")"))
        .map(|f| module_of(&src, f).join("::"))
        .collect();
    assert_eq!(readers, ["model::arch"], "config.json must be read only by model::arch (ModelArch)");
}

#[test]
fn no_source_file_is_over_600_lines() {
    let mut files = Vec::new();
    for dir in ["src", "backends", "tests", "examples"] {
        rust_files(&Path::new(ROOT).join(dir), &mut files);
    }
    let long: Vec<String> = files
        .iter()
        .map(|f| (f, std::fs::read_to_string(f).expect("reading a source file").lines().count()))
        .filter(|(_, n)| *n > 600)
        .map(|(f, n)| format!("{} ({n} lines)", f.display()))
        .collect();
    assert!(long.is_empty(), "split these by concern: {long:?}");
}

#[test]
fn slotstream_environment_is_read_only_by_options_structs() {
    let mut files = Vec::new();
    rust_files(&Path::new(ROOT).join("src"), &mut files);
    for crate_dir in ["backends/core/src", "backends/cpu/src", "backends/wgpu/src"] {
        rust_files(&Path::new(ROOT).join(crate_dir), &mut files);
    }
    let allowed = ["src/model/options.rs", "backends/cpu/src/options.rs", "backends/wgpu/src/options.rs"];
    let readers: Vec<String> = files
        .iter()
        .filter(|f| {
            let code = code_of(&std::fs::read_to_string(f).expect("reading a source file"));
            code.contains("env::var") && code.contains("\"SLOTSTREAM_")
        })
        .map(|f| f.strip_prefix(ROOT).unwrap_or(f).to_string_lossy().trim_start_matches('/').to_string())
        .filter(|f| !allowed.contains(&f.as_str()))
        .collect();
    assert!(readers.is_empty(), "SLOTSTREAM_* read outside the options structs: {readers:?}");
}

/// `println!` and `eprintln!` panic on a closed pipe or a full disk
/// (`slotstream doctor | head -1`, `> /dev/full`); the library and the command
/// line print through `console`, which reports stdout's write errors and never
/// panics on stderr's. Test code (after `#[cfg(test)]`) may print freely.
#[test]
fn printing_goes_through_console() {
    let (src, files) = src_files();
    let printers: Vec<String> = files
        .iter()
        .filter(|f| !f.ends_with("console.rs") && !f.ends_with("tests.rs"))
        .filter(|f| {
            let text = std::fs::read_to_string(f).expect("reading a source file");
            let code = code_of(text.split("#[cfg(test)]").next().unwrap_or(""));
            ["println!", "print!(", "eprint!(", "writeln!(std::io::std"].iter().any(|m| code.contains(m))
        })
        .map(|f| f.strip_prefix(&src).unwrap_or(f).display().to_string())
        .collect();
    assert!(printers.is_empty(), "print through slotstream::console (note!, console::print_line): {printers:?}");
}
