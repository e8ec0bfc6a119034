//! `slotstream doctor`: this machine (or a simulated one) and a model, the
//! memory plan, free disk and the expected decode speed at several cache
//! sizes, built once as a [`DoctorReport`] that prints as JSON (serde) or as
//! the table users read (`Display`).

use std::fmt;
use std::path::Path;

use anyhow::{bail, Result};
use serde::Serialize;

use crate::backend_spec::BackendSpec;
use crate::note;
use crate::plan::rates::RateSource;
use crate::plan::{self, MachineMemory, ModelCosts, Plan, PlanRequest, RateCache, RateKeys, GB};
use crate::probe::{self, Measurement, ProbeLimits};
use crate::{disk, pull};

/// Names that mean the flagship, whose sizes are known without its weights.
const FLAGSHIP_NAMES: [&str; 2] = ["qwen3.8-flash-next:4bit", "qwen3.8-flash-next"];

/// The model `doctor` plans when none is named: the one `run` takes, the
/// flagship where it is installed, else the bundled demo (said on stderr,
/// with how to plan the flagship before downloading it).
pub fn default_model() -> String {
    let installed = pull::InstallStatus::of_known(pull::DEFAULT_MODEL).is_ok_and(|s| s.installed_at.is_some());
    if installed {
        return pull::DEFAULT_MODEL.to_string();
    }
    note!(
        "note: no model installed, so this plans the bundled demo, as `run` would use it; \
         `slotstream doctor --model {}` plans the flagship before it is pulled",
        pull::DEFAULT_MODEL
    );
    crate::demo::NAME.to_string()
}

/// Experts per layer the speed table shows, besides the model's minimum and
/// all of its experts (the reference measurements' pool sizes).
const TABLE_EXPERTS_PER_LAYER: [usize; 5] = [30, 60, 120, 150, 205];

/// What `doctor` was asked about.
#[derive(Clone, Debug, Default)]
pub struct DoctorRequest {
    /// A model directory, or a flagship name (see [`FLAGSHIP_NAMES`]).
    pub model: String,
    pub plan: PlanRequest,
    pub machine: MachineOverrides,
    /// The backend whose measured rates the estimate uses (auto when
    /// unset); none is created for a simulated machine.
    pub backend: Option<BackendSpec>,
    /// Measure this machine's rates first and keep them (`--measure`).
    pub measure: bool,
}

/// Figures that replace this machine's (`--sim-*`), in GB; with any of them
/// set the whole machine is simulated, with RAM defaulting to this one's.
#[derive(Clone, Debug, Default)]
pub struct MachineOverrides {
    pub ram_gb: Option<f64>,
    pub available_gb: Option<f64>,
    pub working_set_gb: Option<f64>,
}

impl MachineOverrides {
    fn machine(&self) -> Result<MachineMemory> {
        for (flag, value, zero_allowed) in [
            ("--sim-ram", self.ram_gb, false),
            ("--sim-available", self.available_gb, true),
            ("--sim-working-set", self.working_set_gb, false),
        ] {
            if let Some(gb) = value {
                let least_ok = if zero_allowed { gb >= 0.0 } else { gb > 0.0 };
                if !(gb.is_finite() && least_ok && gb <= 1e6) {
                    let least = if zero_allowed { "0" } else { "a number above 0" };
                    bail!("{flag} {gb} is not a size in GB: expected {least} to 1000000");
                }
            }
        }
        let detected = MachineMemory::detect();
        if self.ram_gb.is_none() && self.available_gb.is_none() && self.working_set_gb.is_none() {
            return Ok(detected);
        }
        let ram_gb = self.ram_gb.unwrap_or(detected.total_ram as f64 / GB);
        Ok(MachineMemory::simulated(ram_gb, self.available_gb, self.working_set_gb))
    }
}

/// Everything `doctor` reports.
#[derive(Clone, Debug, Serialize)]
pub struct DoctorReport {
    pub machine: MachineMemory,
    /// The backend the rates are for (none on a simulated machine).
    pub backend: Option<String>,
    /// What `--measure` measured.
    pub measured: Option<Measurement>,
    pub model: ModelCosts,
    /// Free space where the model lives (the working directory for a model
    /// known by name); `None` where it cannot be measured.
    pub disk_free_bytes: Option<u64>,
    /// For a model known by name: whether it is downloaded, and whether it
    /// would fit on the disk that holds the cache.
    pub install: Option<pull::InstallStatus>,
    pub plan: Plan,
    /// Expected speed by cache size, from the model's minimum to all experts.
    pub expected: Vec<ExpectedSpeed>,
}

/// One row of the speed table.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ExpectedSpeed {
    pub experts_per_layer: usize,
    pub pool_gb: f64,
    /// The whole process at this pool size, for the planned context.
    pub peak_gb: f64,
    pub decode_tokens_per_second_estimate: f64,
    /// Whether the estimate came from the model's timed runs on this machine
    /// (else from the rates).
    pub from_timed_runs: bool,
}

impl DoctorReport {
    /// Reads the model's costs (from its directory, or the flagship's known
    /// sizes), the machine's memory and free disk, and plans.
    pub fn build(request: &DoctorRequest) -> Result<DoctorReport> {
        // The bundled demo by the name `serve` lists it under, as `run` takes it.
        let demo_dir = (request.model == crate::demo::NAME && !Path::new(&request.model).is_dir()).then(crate::demo::model_dir).transpose()?;
        let model_path = demo_dir.as_deref().unwrap_or(Path::new(&request.model));
        let known = FLAGSHIP_NAMES.contains(&request.model.as_str());
        let mut model = if known {
            ModelCosts::flagship()
        } else {
            // No backend is chosen here: plan for an f32 KV cache, the largest.
            ModelCosts::from_model_dir(model_path, slotstream_backend::KvCacheType::F32)?
        };
        let mut machine = request.machine.machine()?;
        let install = if known { Some(pull::InstallStatus::of_known(pull::DEFAULT_MODEL)?) } else { None };
        // A file system that cannot say its free space leaves the line out of the report.
        let disk_free_bytes = match &install {
            Some(status) => status.cache_free_bytes,
            None => disk::free_bytes(model_path).ok(),
        };
        // The model's files, where they are: a named model where it is installed.
        let model_dir = match &install {
            Some(status) => status.installed_at.clone(),
            None => Some(model_path.to_path_buf()),
        };
        let (mut backend, mut measured) = (None, None);
        if machine.rates.compute_source == RateSource::Simulated {
            if request.measure {
                bail!("--measure measures this machine: leave out the --sim-* flags");
            }
        } else {
            let key_dir = model_dir.clone().or_else(|| install.as_ref().map(|s| s.cache.clone())).unwrap_or_default();
            let created = request.backend.clone().unwrap_or_default().create()?;
            // The model's own decode is known by its files, where they are here.
            let model_key =
                model_dir.as_deref().and_then(|dir| crate::model::ModelArch::read(dir).and_then(|a| plan::hits::model_key(&a)).ok());
            let keys = RateKeys::new(&created.name(), &model.expert_format, &key_dir, model.expert_record_bytes, model_key.as_deref());
            backend = Some(created.name());
            let path = RateCache::path()?;
            let mut cache = match RateCache::load(&path) {
                Ok(cache) => cache,
                Err(e) if request.measure => {
                    note!("note: replacing measured rates that cannot be read: {e:#}");
                    RateCache::default()
                }
                Err(e) => {
                    note!("note: estimates use default rates: {e:#}");
                    RateCache::default()
                }
            };
            if request.measure {
                note!("measuring this machine's rates (a few seconds)...");
                let limits = ProbeLimits::default();
                measured = Some(probe::measure_into(&mut cache, &keys, created, &model.expert_format, model_dir.as_deref(), &limits)?);
                cache.save(&path)?;
            }
            machine.rates = cache.apply(&keys, machine.rates);
        }
        // The hit rate this model's own runs measured here, else the assumed one.
        if let Some(dir) = &model_dir {
            match crate::model::ModelArch::read(dir).and_then(|arch| plan::hits::curve_for(&arch)) {
                Ok(curve) => model.hit_curve = curve,
                Err(e) => note!("note: {e:#}"),
            }
        }
        let plan = plan::plan(&model, &machine, &request.plan)?;
        let expected = expected_speeds(&model, &machine, request.plan.context_tokens);
        Ok(DoctorReport { machine, backend, measured, model, disk_free_bytes, install, plan, expected })
    }
}

/// The speed table's rows: the model's minimum pool, the reference sizes
/// that fit the model, and every expert.
fn expected_speeds(model: &ModelCosts, machine: &MachineMemory, context_tokens: usize) -> Vec<ExpectedSpeed> {
    let floor = plan::FLOOR_EXPERTS_PER_LAYER.max(model.top_k).min(model.experts_per_layer);
    let mut sizes: Vec<usize> = std::iter::once(floor)
        .chain(TABLE_EXPERTS_PER_LAYER)
        .chain([model.experts_per_layer])
        .filter(|&n| n >= floor && n <= model.experts_per_layer)
        .collect();
    sizes.dedup();
    let fixed_bytes = model.fixed_bytes(context_tokens) + model.runtime_bytes(plan::DEFAULT_PREFILL_CHUNK);
    sizes
        .into_iter()
        .map(|experts_per_layer| {
            let slots = experts_per_layer * model.moe_layers;
            let pool_bytes = slots as u64 * model.expert_record_bytes;
            let estimate = model.estimate_decode(slots, &machine.rates);
            ExpectedSpeed {
                experts_per_layer,
                pool_gb: pool_bytes as f64 / GB,
                peak_gb: (fixed_bytes + pool_bytes) as f64 / GB,
                decode_tokens_per_second_estimate: estimate.tokens_per_second(),
                from_timed_runs: estimate.from_runs.is_some(),
            }
        })
        .collect()
}

/// The report as users read it on a terminal.
impl fmt::Display for DoctorReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let model = &self.model;
        writeln!(f, "machine: {}", self.machine.describe())?;
        writeln!(
            f,
            "model:   {} ({} MoE layers x {} experts, top-{}; {:.2} GB resident, {:.2} GB routed experts, {:.2} MB per expert)",
            model.name,
            model.moe_layers,
            model.experts_per_layer,
            model.top_k,
            model.resident_bytes as f64 / GB,
            model.routed_expert_bytes() as f64 / GB,
            model.expert_record_bytes as f64 / 1e6
        )?;
        if model.extra_bytes > 0 || model.mtp_bytes > 0 {
            let mtp = if model.mtp_bytes > 0 { format!("{:.2} GB", model.mtp_bytes as f64 / GB) } else { "none".to_string() };
            writeln!(f, "         n-gram row cache {:.0} MB; MTP head {mtp}", model.extra_bytes as f64 / 1e6)?;
        }
        match &self.install {
            Some(status) => writeln!(f, "install: {}", describe_install(status))?,
            None => {
                if let Some(free) = self.disk_free_bytes {
                    writeln!(f, "disk:    {:.1} GB free where the model lives", free as f64 / GB)?;
                }
            }
        }
        if let Some(backend) = &self.backend {
            writeln!(f, "backend: {backend}")?;
        }
        if let Some(measured) = &self.measured {
            writeln!(f, "measured: {}", measured.describe())?;
        }
        writeln!(f, "{}", self.plan.banner(model, &self.machine))?;
        if self.expected.iter().any(|row| row.from_timed_runs) {
            write!(f, "expected speed by cache size (estimates; *: from this model's timed runs here, else from the rates):")?;
        } else {
            write!(f, "expected speed by cache size (estimates):")?;
        }
        for row in &self.expected {
            write!(
                f,
                "\n  {:>4} experts/layer  pool {:>6.1} GB  peak {:>6.1} GB  ~{:.1} tok/s{}",
                row.experts_per_layer,
                row.pool_gb,
                row.peak_gb,
                row.decode_tokens_per_second_estimate,
                if row.from_timed_runs { " *" } else { "" }
            )?;
        }
        Ok(())
    }
}

/// One line: where the model is, or what downloading it would take.
fn describe_install(status: &pull::InstallStatus) -> String {
    if let Some(dir) = &status.installed_at {
        return format!("installed in {}", dir.display());
    }
    let size = status.download_bytes as f64 / GB;
    let mut s = format!(
        "not installed: `slotstream pull {}` downloads {size:.1} GB into {}",
        status.model,
        status.cache.display()
    );
    match status.cache_free_bytes {
        Some(free) if free >= status.download_bytes => s += &format!(" ({:.1} GB free: it fits)", free as f64 / GB),
        Some(free) => {
            s += &format!(
                " ({:.1} GB free: it would NOT fit; free {:.1} GB more, or point HF_HUB_CACHE at a larger disk)",
                free as f64 / GB,
                size - free as f64 / GB
            )
        }
        None => s += " (free space unknown)",
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flagship_on(ram_gb: f64) -> DoctorReport {
        let request = DoctorRequest {
            model: "qwen3.8-flash-next:4bit".into(),
            plan: PlanRequest { context_tokens: 4096, ..Default::default() },
            machine: MachineOverrides { ram_gb: Some(ram_gb), available_gb: Some(ram_gb * 0.8), working_set_gb: None },
            ..Default::default()
        };
        DoctorReport::build(&request).expect("the flagship plans without its weights")
    }

    #[test]
    fn simulated_sizes_must_be_positive_finite_gigabytes() {
        for (ram, available, says) in [
            (Some(-1.0), None, "--sim-ram -1 is not a size in GB"),
            (Some(f64::NAN), None, "--sim-ram NaN is not a size in GB"),
            (Some(0.0), None, "--sim-ram 0 is not a size in GB"),
            (Some(16.0), Some(f64::INFINITY), "--sim-available inf is not a size in GB"),
        ] {
            let request = DoctorRequest {
                model: "qwen3.8-flash-next:4bit".into(),
                machine: MachineOverrides { ram_gb: ram, available_gb: available, working_set_gb: None },
                ..Default::default()
            };
            let error = DoctorReport::build(&request).expect_err(says);
            assert!(error.to_string().contains(says), "{error}");
        }
    }

    #[test]
    fn the_speed_table_runs_from_the_floor_to_every_expert() {
        let report = flagship_on(48.0);
        let sizes: Vec<usize> = report.expected.iter().map(|row| row.experts_per_layer).collect();
        assert_eq!(sizes, [14, 30, 60, 120, 150, 205, 512]);
        assert!(report.expected.windows(2).all(|w| w[0].peak_gb < w[1].peak_gb), "peak grows with the pool");
    }

    #[test]
    fn the_install_line_says_whether_the_download_would_fit() {
        let status = |free: Option<u64>, installed: Option<&str>| pull::InstallStatus {
            model: "qwen3.8-flash-next:4bit".into(),
            installed_at: installed.map(Into::into),
            cache: "/cache".into(),
            download_bytes: 103_800_000_000,
            cache_free_bytes: free,
        };
        let small = describe_install(&status(Some(79_000_000_000), None));
        assert!(small.starts_with("not installed") && small.contains("would NOT fit") && small.contains("24.8 GB more"), "{small}");
        let large = describe_install(&status(Some(200_000_000_000), None));
        assert!(large.contains("it fits"), "{large}");
        assert_eq!(describe_install(&status(None, Some("/cache/snap"))), "installed in /cache/snap");
    }

    #[test]
    fn json_and_table_come_from_the_same_report() {
        let report = flagship_on(48.0);
        let json = serde_json::to_value(&report).expect("the report serializes");
        for field in ["machine", "backend", "measured", "model", "disk_free_bytes", "install", "plan", "expected"] {
            assert!(json.get(field).is_some(), "doctor --json lost {field}: {json}");
        }
        assert_eq!(json["expected"][0]["experts_per_layer"], 14);
        assert_eq!(json["machine"]["source"], "simulated");

        let table = report.to_string();
        assert!(table.starts_with("machine: 48.0 GB RAM, 38.4 GB reclaimable (simulated)\n"), "{table}");
        assert!(table.contains("slotstream memory plan (auto)"), "{table}");
        // Counts of two and three digits line up in one column.
        assert!(table.contains("\n    14 experts/layer  pool "), "{table}");
        assert!(table.contains("\n   512 experts/layer  pool "), "{table}");
    }
}
