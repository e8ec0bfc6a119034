//! `--backend`: which compute backend runs the model, as the user names it
//! (`auto`, `cpu`, `cpu:exact`, `wgpu`, `wgpu:software`, `wgpu:NAME`, a wgpu
//! form optionally ending in `:exact`), and building that backend.

use std::fmt;
use std::str::FromStr;

use anyhow::Result;
use slotstream_backend::{Backend, BackendError};
use slotstream_cpu::CpuBackend;
use slotstream_wgpu::{AdapterChoice, MatmulMode, WgpuBackend, WgpuOptions};

use crate::note;

/// What a `--backend` value asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendSpec {
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

impl FromStr for BackendSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<BackendSpec, String> {
        let spec = text.trim();
        match spec {
            "auto" => return Ok(BackendSpec::Auto),
            "cpu" => return Ok(BackendSpec::Cpu { exact: false }),
            "cpu:exact" => return Ok(BackendSpec::Cpu { exact: true }),
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
        Ok(BackendSpec::Wgpu { adapter, exact })
    }
}

/// The canonical spelling, which parses back to the same spec.
impl fmt::Display for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendSpec::Auto => f.write_str("auto"),
            BackendSpec::Cpu { exact } => f.write_str(if *exact { "cpu:exact" } else { "cpu" }),
            BackendSpec::Wgpu { adapter, exact } => {
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
        match self {
            BackendSpec::Cpu { .. } => 4,
            BackendSpec::Auto | BackendSpec::Wgpu { .. } => 1,
        }
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
        match self {
            BackendSpec::Cpu { exact: false } => Ok((Box::new(CpuBackend::new()), None)),
            BackendSpec::Cpu { exact: true } => Ok((Box::new(CpuBackend::exact()), None)),
            BackendSpec::Auto => {
                // A mistyped SLOTSTREAM_WGPU_* setting is an error, not a reason to use the CPU.
                WgpuOptions::check_process_env().map_err(|e| anyhow::anyhow!("the GPU settings in the environment: {e}"))?;
                match WgpuBackend::with_options(&AdapterChoice::auto(), WgpuOptions::from_env()) {
                    Ok(gpu) => Ok((Box::new(gpu), None)),
                    Err(e) => Ok((Box::new(CpuBackend::new()), Some(no_gpu_reason(&e)))),
                }
            }
            BackendSpec::Wgpu { adapter, exact } => {
                let mut options = WgpuOptions::from_env();
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

    fn parse(text: &str) -> BackendSpec {
        text.parse().unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
    }

    fn named(name: &str) -> AdapterChoice {
        AdapterChoice { name_contains: Some(name.into()), allow_software: false }
    }

    #[test]
    fn every_documented_form_parses() {
        assert_eq!(parse("auto"), BackendSpec::Auto);
        assert_eq!(parse(" cpu "), BackendSpec::Cpu { exact: false });
        assert_eq!(parse("cpu:exact"), BackendSpec::Cpu { exact: true });
        assert_eq!(parse("wgpu"), BackendSpec::Wgpu { adapter: AdapterChoice::auto(), exact: false });
        assert_eq!(parse("wgpu:exact"), BackendSpec::Wgpu { adapter: AdapterChoice::auto(), exact: true });
        assert_eq!(parse("wgpu:software"), BackendSpec::Wgpu { adapter: AdapterChoice::allow_software(), exact: false });
        assert_eq!(parse("wgpu:software:exact"), BackendSpec::Wgpu { adapter: AdapterChoice::allow_software(), exact: true });
        assert_eq!(parse("wgpu:NVIDIA"), BackendSpec::Wgpu { adapter: named("nvidia"), exact: false });
        assert_eq!(parse("wgpu:h200:exact"), BackendSpec::Wgpu { adapter: named("h200"), exact: true });
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
            let error = bad.parse::<BackendSpec>().expect_err(bad);
            assert!(error.contains("expected auto, cpu, cpu:exact, wgpu"), "{bad:?}: {error}");
        }
    }
}
