//! What the integration tests share: the fixture models and their oracle goldens.
#![allow(dead_code)] // each test binary uses a different part

pub mod raw_server;
pub mod tools_server;

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

/// Relative L2 the last-position logits may differ from the oracle's (see parity.rs).
pub const MAX_REL_L2: f64 = 1e-4;

/// A greedy request for `max_tokens` after `prompt_ids`, stopping at no end token.
pub fn greedy_request(prompt_ids: &[u32], max_tokens: usize) -> slotstream::generate::GenerateRequest {
    slotstream::generate::GenerateRequest {
        prompt_ids: prompt_ids.to_vec(),
        max_tokens,
        sampling: slotstream::sampling::SamplingParams::default(),
        stop: vec![],
        ignore_eos: true,
    }
}

/// The wgpu half of a test that compares it with the CPU backend: the
/// backend with the environment's options (lavapipe is enough), or `None`
/// (said on stderr) where `SLOTSTREAM_SKIP_GPU_TESTS=1`. No adapter fails the
/// test with instructions.
pub fn wgpu_half() -> Option<slotstream_wgpu::WgpuBackend> {
    use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};
    if std::env::var("SLOTSTREAM_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("SLOTSTREAM_SKIP_GPU_TESTS=1: skipping the wgpu half");
        return None;
    }
    let backend = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions::from_env()).unwrap_or_else(|e| {
        panic!(
            "no GPU adapter: {e}\nInstall a Vulkan driver (apt-get install -y mesa-vulkan-drivers; \
             VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json XDG_RUNTIME_DIR=/tmp) \
             or set SLOTSTREAM_SKIP_GPU_TESTS=1"
        )
    });
    Some(backend)
}

/// Checks an engine on every golden case of a fixture: last-position logits
/// within [`MAX_REL_L2`] and greedy tokens identical to the oracle's.
pub fn check_against_oracle(e: &slotstream::generate::Engine, name: &str) {
    use slotstream::generate::GenerateRequest;
    use slotstream::sampling::SamplingParams;
    let backend = e.backend.name();
    for case in golden(name).cases {
        let mut state = e.new_state().unwrap();
        let logits = e.prefill(&case.prompt_ids, &mut state).unwrap();
        let err = rel_l2(&logits, &case.last_logits);
        assert!(err <= MAX_REL_L2, "{name}/{} on {backend}: last-position logits rel L2 {err:.3e} > {MAX_REL_L2:e}", case.name);
        let req = GenerateRequest {
            prompt_ids: case.prompt_ids.clone(),
            max_tokens: case.greedy_ids.len(),
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: true,
        };
        let out = e.generate(&req, |_| std::ops::ControlFlow::Continue(())).unwrap();
        assert_eq!(out.generated_ids, case.greedy_ids, "{name}/{} on {backend}: greedy tokens differ from the oracle", case.name);
        eprintln!("{name}/{} on {backend}: rel L2 {err:.2e}, {} greedy tokens identical", case.name, out.generated_ids.len());
    }
}

/// Runs `slotstream run --json` on a fixture's short case with `backend`,
/// checks that it succeeds and returns the oracle's greedy ids, and hands back
/// the JSON for further checks.
pub fn run_json_matches_oracle(name: &str, backend: &str) -> (Case, serde_json::Value) {
    let case = case(name, "short");
    // The CPU backend's int8 activations (its default for 4-bit weights) are
    // ~1e-3 off; the oracle comparison needs its exact f32 path.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .env("SLOTSTREAM_CPU_MATMUL", "exact")
        .args(["run", "--backend", backend, "--raw", "--json", "--ignore-eos", "--max-tokens"])
        .arg(case.greedy_ids.len().to_string())
        .arg("--model")
        .arg(fixture(name))
        .arg("--prompt")
        .arg(&case.prompt_text)
        .output()
        .expect("running slotstream");
    assert!(out.status.success(), "slotstream run failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json prints one JSON object");
    let ids: Vec<u32> = serde_json::from_value(v["generated_ids"].clone()).unwrap();
    assert_eq!(ids, case.greedy_ids, "{name}: `run --backend {backend} --json` greedy ids differ from the oracle");
    (case, v)
}

/// Loads models for in-process test servers on the CPU backend's exact
/// (f32-activation) matmuls, so outputs compare equal however a prompt is fed.
pub struct FixtureLoader {
    /// Never stop at end-of-sequence tokens (for long generations).
    pub no_eos: bool,
    /// Load the MTP head (speculative decoding) when the model has one.
    pub mtp: bool,
}

impl slotstream::server::ModelLoader for FixtureLoader {
    /// Fixtures are tiny: any machine has room for all of them.
    fn footprint(&self, _dir: &Path, _reclaimable: u64) -> anyhow::Result<u64> {
        Ok(0)
    }

    fn load(&self, dir: &Path) -> anyhow::Result<slotstream::server::LoadedEngine> {
        let opts = slotstream::model::LoadOptions { mtp: self.mtp, ..Default::default() };
        let mut engine =
            slotstream::generate::Engine::load(dir, Box::new(slotstream_cpu::CpuBackend::exact()), &opts)?;
        if self.no_eos {
            engine.codec.eos_ids.clear();
        }
        Ok(slotstream::server::LoadedEngine { engine, plan: None, elastic: None })
    }
}

/// Server options for tests: the defaults of `slotstream serve`, no pulls.
pub fn server_options(max_context: usize, queue: usize) -> slotstream::server::ServerOptions {
    slotstream::server::ServerOptions {
        max_context,
        prefix_cache: true,
        queue,
        timeouts: slotstream::server::Timeouts::default(),
        origins: Vec::new(),
        keep_alive: slotstream::server::DEFAULT_KEEP_ALIVE,
        max_loaded_models: slotstream::server::DEFAULT_MAX_LOADED_MODELS,
        parallel: 1,
        pulls: None,
    }
}

/// Serves `app` on an ephemeral loopback port from a background thread (two
/// runtime workers) until the test process ends; returns the address.
pub fn serve_in_background(app: std::sync::Arc<slotstream::server::AppState>) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding an ephemeral port");
    let addr = listener.local_addr().expect("the bound address");
    listener.set_nonblocking(true).expect("a non-blocking listener");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("adopting the listener");
            slotstream::server::serve_on(listener, app, std::future::pending()).await.expect("serving");
        });
    });
    addr
}
