//! How much memory this machine has and can give us now.
//!
//! Linux: `/proc/meminfo` (MemTotal, MemAvailable), capped by the process's
//! cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`) limit, so a
//! container limited to 8 GB on a 64 GB host plans for 8 GB. macOS: physical
//! memory and reclaimable pages from the kernel, and the Metal working-set
//! limit (see [`macos`]).

use serde::Serialize;

use super::rates::{ComputeRates, DiskRates, RateSource, Rates};

/// Memory figures the planner uses.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct MachineMemory {
    pub total_ram: u64,
    /// Reclaimable now (free + caches the OS can drop).
    pub available: u64,
    /// GPU working-set limit on unified-memory machines.
    pub gpu_working_set: Option<u64>,
    /// Rates for the decode-speed estimate: measured on this machine where
    /// `doctor --measure` measured them, else defaults ([`Rates`]).
    pub rates: Rates,
    /// Where the memory figures came from.
    pub source: String,
}

impl MachineMemory {
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{:.1} GB RAM, {:.1} GB reclaimable",
            self.total_ram as f64 / 1e9,
            self.available as f64 / 1e9
        );
        if let Some(ws) = self.gpu_working_set {
            s += &format!(", GPU working set {:.1} GB", ws as f64 / 1e9);
        }
        s + &format!(" ({})", self.source)
    }

    /// A simulated machine (for `doctor --sim-*` and tests).
    pub fn simulated(ram_gb: f64, available_gb: Option<f64>, working_set_gb: Option<f64>) -> MachineMemory {
        MachineMemory {
            total_ram: (ram_gb * 1e9) as u64,
            available: (available_gb.unwrap_or(ram_gb * 0.8) * 1e9) as u64,
            gpu_working_set: working_set_gb.map(|g| (g * 1e9) as u64),
            rates: if working_set_gb.is_some() {
                Rates::unmeasured(APPLE_COMPUTE, APPLE_DISK, RateSource::Simulated)
            } else {
                Rates::unmeasured(linux::compute_rates(linux::REFERENCE_CORES), linux::DISK, RateSource::Simulated)
            },
            source: "simulated".into(),
        }
    }

    /// This machine, now.
    pub fn detect() -> MachineMemory {
        #[cfg(target_os = "macos")]
        {
            macos::detect()
        }
        #[cfg(not(target_os = "macos"))]
        {
            linux::detect()
        }
    }
}

/// Default rates of an Apple-silicon GPU and its SSD, for macOS and for a
/// simulated machine with a GPU working set (not measured here).
pub const APPLE_COMPUTE: ComputeRates = ComputeRates { weight_gbps: 200.0, layer_overhead_ms: 0.2 };
pub const APPLE_DISK: DiskRates = DiskRates { read_gbps: 7.0, read_latency_ms: 0.1 };

/// Linux figures (and the rates a simulated machine without a GPU working
/// set gets).
pub mod linux {

    use super::{ComputeRates, DiskRates};

    /// Weight bytes per second one core's int8 matmuls get through at decode,
    /// and the most memory bandwidth gives all of them.
    pub const CORE_WEIGHT_GBPS: f64 = 6.0;
    pub const MEMORY_GBPS: f64 = 20.0;
    pub const LAYER_OVERHEAD_MS: f64 = 0.1;
    /// Direct-I/O expert reads and their latency, measured on the reference
    /// machine (a cloud VM's SSD; a local NVMe drive reads faster).
    pub const DISK: DiskRates = DiskRates { read_gbps: 0.7, read_latency_ms: 0.4 };
    /// Cores of the machine the rates were measured on (a simulated machine's).
    pub const REFERENCE_CORES: usize = 2;

    /// The default compute rates of `cores` CPU threads: what they get
    /// through, bounded by memory bandwidth.
    pub fn compute_rates(cores: usize) -> ComputeRates {
        ComputeRates {
            weight_gbps: (CORE_WEIGHT_GBPS * cores.max(1) as f64).min(MEMORY_GBPS),
            layer_overhead_ms: LAYER_OVERHEAD_MS,
        }
    }

    fn meminfo_kb(text: &str, key: &str) -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    }

    /// Parses `/proc/meminfo`: (total, available) in bytes.
    pub fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
        let total = meminfo_kb(text, "MemTotal")? * 1024;
        let available = meminfo_kb(text, "MemAvailable").map(|k| k * 1024).unwrap_or(total / 2);
        Some((total, available))
    }

    fn read_u64(path: &str) -> Option<u64> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    /// The memory limit and usage of this process's cgroup, v2 or v1.
    /// "Unlimited" (v2 `max`, v1 a huge number) gives `None`.
    pub fn cgroup_limit(self_cgroup: &str, root: &str) -> Option<(u64, u64)> {
        for line in self_cgroup.lines() {
            let mut parts = line.splitn(3, ':');
            let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            if id == "0" && controllers.is_empty() {
                // cgroup v2: the limit is the tightest along the path.
                let mut dir = format!("{root}{path}");
                let mut best: Option<(u64, u64)> = None;
                loop {
                    if let Some(limit) = read_u64(&format!("{dir}/memory.max")) {
                        let usage = read_u64(&format!("{dir}/memory.current")).unwrap_or(0);
                        if best.is_none_or(|(l, _)| limit < l) {
                            best = Some((limit, usage));
                        }
                    }
                    match dir.rfind('/') {
                        Some(i) if dir.len() > root.len() => dir.truncate(i),
                        _ => break,
                    }
                }
                if best.is_some() {
                    return best;
                }
            } else if controllers.split(',').any(|c| c == "memory") {
                let dir = format!("{root}/memory{path}");
                for d in [dir.as_str(), &format!("{root}/memory")] {
                    if let Some(limit) = read_u64(&format!("{d}/memory.limit_in_bytes")) {
                        if limit < (1u64 << 60) {
                            let usage = read_u64(&format!("{d}/memory.usage_in_bytes")).unwrap_or(0);
                            return Some((limit, usage));
                        }
                    }
                }
            }
        }
        None
    }

    #[cfg(not(target_os = "macos"))]
    pub fn detect() -> super::MachineMemory {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let (mut total, mut available) = parse_meminfo(&meminfo).unwrap_or((8_000_000_000, 4_000_000_000));
        let mut source = "/proc/meminfo".to_string();
        let self_cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        if let Some((limit, usage)) = cgroup_limit(&self_cgroup, "/sys/fs/cgroup") {
            if limit < total {
                total = limit;
                available = available.min(limit.saturating_sub(usage));
                source = format!("cgroup memory limit {:.1} GB", limit as f64 / 1e9);
            }
        }
        super::MachineMemory {
            total_ram: total,
            available,
            gpu_working_set: None,
            // The compute pool's threads (`--threads`, else every core).
            rates: super::Rates::unmeasured(compute_rates(rayon::current_num_threads()), DISK, super::RateSource::Defaults),
            source,
        }
    }
}

#[cfg(any(target_os = "macos", test))]
pub mod macos {
    //! macOS figures. Compiled for aarch64-apple-darwin in CI; not run there.

    /// Metal's recommended working set, as macOS sets it by default: about
    /// two thirds of RAM up to 36 GB, three quarters above. `iogpu.wired_limit_mb`
    /// overrides it when the user has raised the limit.
    pub fn default_working_set(total_ram: u64) -> u64 {
        if total_ram <= 36_000_000_000 {
            total_ram / 3 * 2
        } else {
            total_ram / 4 * 3
        }
    }

    #[cfg(target_os = "macos")]
    fn sysctl_u64(name: &str) -> Option<u64> {
        let cname = std::ffi::CString::new(name).ok()?;
        let mut value: u64 = 0;
        let mut size = std::mem::size_of::<u64>();
        // SAFETY: sysctlbyname writes at most `size` bytes into `value`.
        let rc = unsafe {
            libc::sysctlbyname(cname.as_ptr(), &mut value as *mut u64 as *mut libc::c_void, &mut size, std::ptr::null_mut(), 0)
        };
        (rc == 0).then_some(value)
    }

    /// Free, inactive, purgeable and speculative pages: what can be had now.
    #[cfg(target_os = "macos")]
    fn reclaimable_bytes() -> Option<u64> {
        // SAFETY: host_statistics64 fills a vm_statistics64 of the given count.
        unsafe {
            let mut stats: libc::vm_statistics64 = std::mem::zeroed();
            let mut count = (std::mem::size_of::<libc::vm_statistics64>() / std::mem::size_of::<libc::integer_t>()) as libc::mach_msg_type_number_t;
            #[allow(deprecated)]
            let host = libc::mach_host_self();
            let rc = libc::host_statistics64(host, libc::HOST_VM_INFO64, &mut stats as *mut _ as libc::host_info64_t, &mut count);
            if rc != 0 {
                return None;
            }
            let page = sysctl_u64("hw.pagesize").unwrap_or(16384);
            let pages = stats.free_count as u64 + stats.inactive_count as u64 + stats.purgeable_count as u64 + stats.speculative_count as u64;
            Some(pages * page)
        }
    }

    #[cfg(target_os = "macos")]
    pub fn detect() -> super::MachineMemory {
        let total = sysctl_u64("hw.memsize").unwrap_or(16_000_000_000);
        let available = reclaimable_bytes().unwrap_or(total / 2);
        let working_set = match sysctl_u64("iogpu.wired_limit_mb") {
            Some(mb) if mb > 0 => mb * 1_000_000,
            _ => default_working_set(total),
        };
        super::MachineMemory {
            total_ram: total,
            available,
            gpu_working_set: Some(working_set),
            rates: super::Rates::unmeasured(super::APPLE_COMPUTE, super::APPLE_DISK, super::RateSource::Defaults),
            source: "macOS vm statistics".into(),
        }
    }
}

#[cfg(all(test, not(target_os = "macos")))]
mod tests {
    use super::linux::*;

    #[test]
    fn meminfo_is_parsed() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(parse_meminfo(text), Some((24_576_000_000, 12_288_000_000)));
    }

    #[test]
    fn cgroup_v2_limit_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_str().unwrap();
        std::fs::create_dir_all(format!("{root}/box")).unwrap();
        std::fs::write(format!("{root}/box/memory.max"), "8000000000\n").unwrap();
        std::fs::write(format!("{root}/box/memory.current"), "1000000000\n").unwrap();
        assert_eq!(cgroup_limit("0::/box\n", root), Some((8_000_000_000, 1_000_000_000)));
        std::fs::write(format!("{root}/box/memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_limit("0::/box\n", root), None);
    }

    #[test]
    fn cgroup_v1_limit_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_str().unwrap();
        std::fs::create_dir_all(format!("{root}/memory/job")).unwrap();
        std::fs::write(format!("{root}/memory/job/memory.limit_in_bytes"), "8000000000\n").unwrap();
        std::fs::write(format!("{root}/memory/job/memory.usage_in_bytes"), "500\n").unwrap();
        assert_eq!(cgroup_limit("4:memory:/job\n3:cpu:/\n", root), Some((8_000_000_000, 500)));
    }
}
