//! `--backend`: which compute backend runs the model, as the user names it
//! (`auto`, `cpu`, `cpu:exact`, `wgpu`, `wgpu:software`, `wgpu:NAME`, a wgpu
//! form optionally ending in `:exact`), with `--kv-cache` (how its KV caches
//! store keys and values), and building that backend.

use std::fmt;
use std::str::FromStr;

use anyhow::Result;
use slotstream_backend::{Backend, BackendError, KvCacheType};
use slotstream_cpu::{CpuBackend, CpuOptions};
use slotstream_wgpu::{AdapterChoice, MatmulMode, WgpuBackend, WgpuOptions};

use crate::note;

/// What `--backend` and `--kv-cache` ask for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendSpec {
    pub kind: BackendKind,
    /// How KV caches store keys and values; `None`: the backend's default
    /// (f16 on the fast backends, f32 on `:exact` ones).
    pub kv_cache: Option<KvCacheType>,
}

/// What a `--backend` value asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// A real GPU through wgpu if there is one, else the CPU (never a
    /// software rasterizer, which is slower than the CPU backend).
    Auto,
    /// The CPU backend: int8 activations for 4-bit weights, or f32 everywhere
    /// when `exact` (the reference the oracle tests use).
    Cpu { exact: bool },
    /// The wgpu backend on the adapter `adapter` picks, failing when there is
    /// none. `exact` keeps f32 activations in one-token 4-bit matmuls.
    Wgpu { adapter: AdapterChoice, exact: bool },
}

/// The accepted forms: the whole error for a spec that is none of them
/// (clap's message already quotes the value and the flag).
const ACCEPTED: &str = "expected auto, cpu, cpu:exact, wgpu, wgpu:software or wgpu:NAME (a wgpu spec may end in :exact)";

impl Default for BackendSpec {
    /// `auto`, each backend's default KV cache.
    fn default() -> Self {
        BackendSpec { kind: BackendKind::Auto, kv_cache: None }
    }
}

/// A `--backend` value with the backend's default KV cache.
impl FromStr for BackendSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<BackendSpec, String> {
        Ok(BackendSpec { kind: text.parse()?, kv_cache: None })
    }
}

/// The `--backend` value.
impl fmt::Display for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.kind.fmt(f)
    }
}

impl FromStr for BackendKind {
    type Err = String;

    fn from_str(text: &str) -> Result<BackendKind, String> {
        let spec = text.trim();
        match spec {
            "auto" => return Ok(BackendKind::Auto),
            "cpu" => return Ok(BackendKind::Cpu { exact: false }),
            "cpu:exact" => return Ok(BackendKind::Cpu { exact: true }),
            _ => {}
        }
        let (wgpu, exact) = match spec.strip_suffix(":exact") {
            Some(rest) => (rest, true),
            None => (spec, false),
        };
        let adapter = match wgpu {
            "wgpu" => AdapterChoice::auto(),
            other => match other.strip_prefix("wgpu:") {
                Some(choice) => choice.parse().map_err(|e| format!("{e}"))?,
                None => return Err(ACCEPTED.to_string()),
            },
        };
        Ok(BackendKind::Wgpu { adapter, exact })
    }
}

/// The canonical spelling, which parses back to the same spec.
impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendKind::Auto => f.write_str("auto"),
            BackendKind::Cpu { exact } => f.write_str(if *exact { "cpu:exact" } else { "cpu" }),
            BackendKind::Wgpu { adapter, exact } => {
                f.write_str("wgpu")?;
                if adapter.allow_software {
                    f.write_str(":software")?;
                } else if let Some(name) = &adapter.name_contains {
                    write!(f, ":{name}")?;
                }
                if *exact {
                    f.write_str(":exact")?;
                }
                Ok(())
            }
        }
    }
}

/// Which compute backend runs the model.
#[derive(clap::Args, Clone)]
pub struct BackendArgs {
    /// `auto` (a real GPU through wgpu if there is one, else the CPU), `cpu` (int8
    /// activations for 4-bit weights, like llama.cpp), `cpu:exact` (f32 activations
    /// everywhere: the reference the oracle tests use), `wgpu` (a real GPU or fail),
    /// `wgpu:software` (allow a software rasterizer such as lavapipe, for tests) or
    /// `wgpu:NAME` (an adapter whose name contains NAME). On a real GPU one-token 4-bit
    /// matmuls take int8 activations; a `:exact` suffix (`wgpu:exact`, ...) or
    /// `SLOTSTREAM_WGPU_MATMUL=exact` keeps f32 (a software rasterizer, only used by
    /// tests, defaults to f32; `SLOTSTREAM_WGPU_MATMUL=int8` overrides).
    #[arg(long, default_value = "auto")]
    pub backend: BackendSpec,
    /// How KV caches store keys and values: `f16` (half of f32's memory; the
    /// default but where matmuls are f32: `:exact` and software rasterizers), `q8` (llama.cpp's q8_0: int8 in blocks of 32 with an f16 scale,
    /// about half of f16's again, for longer contexts in the same memory) or `f32`
    /// (what `:exact` backends keep; they refuse the others).
    #[arg(long, value_name = "f16|q8|f32")]
    pub kv_cache: Option<KvCacheType>,
}

impl BackendArgs {
    /// The backend the flags ask for.
    pub fn spec(&self) -> Result<BackendSpec> {
        self.backend.clone().with_kv_cache(self.kv_cache)
    }
}

/// Why the wgpu backend could not open, in the words of the flags that
/// change it (the backend names its own settings).
fn no_gpu_reason(e: &BackendError) -> String {
    let text = match e {
        BackendError::Device(m) => m.clone(),
        other => other.to_string(),
    };
    text.replace("the adapter choice `software` accepts it", "--backend wgpu:software uses it")
}

impl BackendSpec {
    /// Generations `serve` runs at once unless told: the CPU backend
    /// batches their decode steps; a GPU runs one generation at a time
    /// until its backend batches too (and `auto` may pick one).
    pub fn default_parallel(&self) -> usize {
        match self.kind {
            BackendKind::Cpu { .. } => 4,
            BackendKind::Auto | BackendKind::Wgpu { .. } => 1,
        }
    }

    /// The spec with `--kv-cache`: refused with an `:exact` backend unless
    /// f32 (an exact backend is the oracle tests' reference; its KV stays f32).
    pub fn with_kv_cache(self, kv_cache: Option<KvCacheType>) -> Result<BackendSpec> {
        let exact = matches!(self.kind, BackendKind::Cpu { exact: true } | BackendKind::Wgpu { exact: true, .. });
        if let (true, Some(kv)) = (exact, kv_cache.filter(|&kv| kv != KvCacheType::F32)) {
            anyhow::bail!(
                "--backend {} keeps an f32 KV cache (the exact reference), so --kv-cache {kv} does not apply; drop :exact or --kv-cache",
                self.kind
            );
        }
        Ok(BackendSpec { kv_cache, ..self })
    }

    fn cpu_options(&self, exact: bool) -> CpuOptions {
        let matmul = if exact { slotstream_cpu::MatmulMode::Exact } else { CpuOptions::from_env().matmul };
        CpuOptions { matmul, kv_cache: self.kv_cache, ..CpuOptions::from_env() }
    }

    /// Builds the backend. `auto` without a usable GPU falls back to the CPU
    /// with a note on stderr; an explicit wgpu spec fails instead. The wgpu
    /// backend picks its matmul mode by adapter unless `SLOTSTREAM_WGPU_MATMUL`
    /// or an `:exact` spec decides.
    pub fn create(&self) -> Result<Box<dyn Backend>> {
        let (backend, no_gpu) = self.create_quietly()?;
        if let Some(why) = no_gpu {
            note!("note: no usable GPU, so the CPU runs the model (--backend cpu chooses it without looking for one): {why}");
        }
        Ok(backend)
    }

    /// [`Self::create`] without the note: with why `auto` found no usable
    /// GPU, when it fell back to the CPU.
    pub fn create_quietly(&self) -> Result<(Box<dyn Backend>, Option<String>)> {
        match &self.kind {
            BackendKind::Cpu { exact } => Ok((Box::new(CpuBackend::with_options(self.cpu_options(*exact))), None)),
            BackendKind::Auto => {
                // A mistyped SLOTSTREAM_WGPU_* setting is an error, not a reason to use the CPU.
                WgpuOptions::check_process_env().map_err(|e| anyhow::anyhow!("the GPU settings in the environment: {e}"))?;
                let options = WgpuOptions { kv_cache: self.kv_cache, ..WgpuOptions::from_env() };
                match WgpuBackend::with_options(&AdapterChoice::auto(), options) {
                    Ok(gpu) => Ok((Box::new(gpu), None)),
                    Err(e) => Ok((Box::new(CpuBackend::with_options(self.cpu_options(false))), Some(no_gpu_reason(&e)))),
                }
            }
            BackendKind::Wgpu { adapter, exact } => {
                let mut options = WgpuOptions { kv_cache: self.kv_cache, ..WgpuOptions::from_env() };
                if *exact {
                    options.matmul = Some(MatmulMode::Exact);
                }
                let gpu = WgpuBackend::with_options(adapter, options)
                    .map_err(|e| anyhow::anyhow!("--backend {self}: {}; --backend cpu runs the model on the CPU", no_gpu_reason(&e)))?;
                Ok((Box::new(gpu), None))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> BackendKind {
        text.parse::<BackendKind>().unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
    }

    fn named(name: &str) -> AdapterChoice {
        AdapterChoice { name_contains: Some(name.into()), allow_software: false }
    }

    #[test]
    fn every_documented_form_parses() {
        assert_eq!(parse("auto"), BackendKind::Auto);
        assert_eq!(parse(" cpu "), BackendKind::Cpu { exact: false });
        assert_eq!(parse("cpu:exact"), BackendKind::Cpu { exact: true });
        assert_eq!(parse("wgpu"), BackendKind::Wgpu { adapter: AdapterChoice::auto(), exact: false });
        assert_eq!(parse("wgpu:exact"), BackendKind::Wgpu { adapter: AdapterChoice::auto(), exact: true });
        assert_eq!(parse("wgpu:software"), BackendKind::Wgpu { adapter: AdapterChoice::allow_software(), exact: false });
        assert_eq!(parse("wgpu:software:exact"), BackendKind::Wgpu { adapter: AdapterChoice::allow_software(), exact: true });
        assert_eq!(parse("wgpu:NVIDIA"), BackendKind::Wgpu { adapter: named("nvidia"), exact: false });
        assert_eq!(parse("wgpu:h200:exact"), BackendKind::Wgpu { adapter: named("h200"), exact: true });
    }

    #[test]
    fn the_canonical_spelling_parses_back() {
        for text in ["auto", "cpu", "cpu:exact", "wgpu", "wgpu:exact", "wgpu:software", "wgpu:software:exact", "wgpu:h200:exact"] {
            assert_eq!(parse(text).to_string(), text);
        }
    }

    #[test]
    fn an_unknown_spec_lists_the_accepted_forms() {
        for bad in ["gpu", "cuda", "auto:exact", "cpu:exact:exact", "wgpux", ""] {
            let error = bad.parse::<BackendKind>().expect_err(bad);
            assert!(error.contains("expected auto, cpu, cpu:exact, wgpu"), "{bad:?}: {error}");
        }
    }

    #[test]
    fn an_exact_backend_keeps_its_f32_kv_cache() {
        let spec = |text: &str| text.parse::<BackendSpec>().expect(text);
        for exact in ["cpu:exact", "wgpu:software:exact"] {
            for kv in [KvCacheType::F16, KvCacheType::Q8] {
                let e = spec(exact).with_kv_cache(Some(kv)).expect_err(exact).to_string();
                assert!(e.contains(&format!("--backend {exact} keeps an f32 KV cache")) && e.contains(&format!("--kv-cache {kv}")), "{e}");
            }
            assert_eq!(spec(exact).with_kv_cache(Some(KvCacheType::F32)).expect(exact).kv_cache, Some(KvCacheType::F32));
        }
        let q8 = spec("cpu").with_kv_cache(Some(KvCacheType::Q8)).expect("cpu q8");
        assert_eq!(q8.create().expect("the CPU backend").kv_cache_type(), KvCacheType::Q8);
        assert_eq!(q8.to_string(), "cpu");
    }
}
