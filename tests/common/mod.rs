//! What the integration tests share: the fixture models and their oracle goldens.
#![allow(dead_code)] // each test binary uses a different part

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// `tests/fixtures/<name>/golden.json`, written by tools/oracle.
#[derive(Deserialize)]
pub struct Golden {
    pub cases: Vec<Case>,
}

#[derive(Deserialize)]
pub struct Case {
    pub name: String,
    pub prompt_text: String,
    pub prompt_ids: Vec<u32>,
    pub last_logits: Vec<f32>,
    pub greedy_ids: Vec<u32>,
}

/// The four seeded test models.
pub const FIXTURES: [&str; 4] = ["qwen3_moe_hf", "qwen3_moe_mlx4", "qwen3_next_hf", "qwen3_next_mlx4"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub fn golden(name: &str) -> Golden {
    let path = fixture(name).join("golden.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The golden case called `name` ("short" or "long").
pub fn case(fixture_name: &str, name: &str) -> Case {
    golden(fixture_name)
        .cases
        .into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("{fixture_name} has no '{name}' case"))
}

/// `||got - want|| / ||want||`.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "logit vector lengths differ");
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}
