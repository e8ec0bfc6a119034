//! The rates the decode-speed estimate works from, and where they came from:
//! measured on this machine by `slotstream doctor --measure` and kept in
//! `rates.json` in slotstream's cache folder, keyed by machine, backend,
//! weight format and disk, or, where nothing was measured, the defaults
//! fitted on the reference machine (BENCHMARKS.md, "Plan estimates"). What a
//! streaming token costs (its compute, each missed expert) is measured in a
//! real decode of the model from a small pool, kept under the model too;
//! without that measurement a miss costs its read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Result;
use serde::{Deserialize, Serialize};
use slotstream_backend::{DType, MatrixFormat};

/// How fast the backend decodes: weights per second and a cost per layer.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct ComputeRates {
    /// Weight bytes a decode step gets through per second (GB/s): memory
    /// bandwidth on a GPU, the cores' int8 matmul rate on the CPU.
    pub weight_gbps: f64,
    /// Fixed cost per MoE layer per token (dispatch, synchronisation, the
    /// layer's small operations), milliseconds.
    pub layer_overhead_ms: f64,
}

/// How fast the disk serves a layer's missed experts (direct I/O, many
/// reads in flight).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct DiskRates {
    pub read_gbps: f64,
    /// Time to the first byte of a batch of expert reads, milliseconds.
    pub read_latency_ms: f64,
}

/// What the model's own decode from a pool smaller than it cost on this
/// machine, split as the probe split it: a token's compute (the resident
/// compute at the compute rates measured with it, at most the decode's time
/// not waiting on reads) and, per missed expert, the rest beyond one read
/// latency per layer that missed (the read, the part of the upload the reads
/// in flight did not hide, the work a miss adds outside the wait).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct MissRates {
    /// Milliseconds per missed expert.
    pub miss_ms: f64,
    /// Milliseconds of compute per token.
    pub token_ms: f64,
}

/// Where a set of rates came from.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "kebab-case", tag = "from")]
pub enum RateSource {
    /// Fitted on the reference machine; nothing was measured here.
    Defaults,
    /// A simulated machine's (`doctor --sim-*`).
    Simulated,
    /// Measured on this machine at `unix_seconds`.
    Measured { unix_seconds: u64 },
}

/// Everything the estimate needs besides the model's sizes.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Rates {
    pub compute: ComputeRates,
    pub compute_source: RateSource,
    pub disk: DiskRates,
    pub disk_source: RateSource,
    /// The model's own decode from a small pool, timed here (`doctor
    /// --measure` with the model); none: a miss costs its read at `disk`'s
    /// rate.
    pub miss: Option<Measured<MissRates>>,
    /// Which of the model's timed runs (`hits.json`) are this machine's
    /// ([`RateKeys::runs`]); none (a simulated machine, rates not read): no
    /// run is.
    pub runs_key: Option<String>,
}

impl Rates {
    /// Defaults, or a simulated machine's rates.
    pub fn unmeasured(compute: ComputeRates, disk: DiskRates, source: RateSource) -> Rates {
        Rates { compute, compute_source: source.clone(), disk, disk_source: source, miss: None, runs_key: None }
    }

    /// One line for users: the figures and where they came from.
    pub fn describe(&self, now_unix: u64) -> String {
        let c = &self.compute;
        let d = &self.disk;
        let figures = |source: &RateSource, text: String| match source {
            RateSource::Measured { unix_seconds } => format!("{text} measured {}", age(now_unix.saturating_sub(*unix_seconds))),
            RateSource::Defaults => format!("{text} default"),
            RateSource::Simulated => format!("{text} simulated"),
        };
        let compute = figures(&self.compute_source, format!("weights {:.1} GB/s + {:.2} ms per layer", c.weight_gbps, c.layer_overhead_ms));
        let disk = figures(&self.disk_source, format!("expert reads {:.2} GB/s + {:.2} ms", d.read_gbps, d.read_latency_ms));
        let miss = match &self.miss {
            Some(m) => format!(
                "a missed expert {:.2} ms beyond {:.2} ms of compute a token in this model's decode measured {}",
                m.rates.miss_ms,
                m.rates.token_ms,
                age(now_unix.saturating_sub(m.unix_seconds))
            ),
            None => "a missed expert costs its read (this model's decode not timed here)".to_string(),
        };
        let mut s = format!("{compute}; {disk}; {miss}");
        if self.compute_source == RateSource::Defaults || self.disk_source == RateSource::Defaults {
            s += " (defaults are the reference machine's, not measured here: `slotstream doctor --measure --model DIR` measures them)";
        }
        s
    }
}

/// "5 min ago", "3 h ago", "2 days ago".
fn age(seconds: u64) -> String {
    match seconds {
        0..=59 => "just now".into(),
        60..=3599 => format!("{} min ago", seconds / 60),
        3600..=172_799 => format!("{} h ago", seconds / 3600),
        _ => format!("{} days ago", seconds / 86_400),
    }
}

pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A weight format as a key and for users: `4-bit g64`, `bf16`.
pub fn format_label(format: &MatrixFormat) -> String {
    let dtype = |d: &DType| format!("{d:?}").to_lowercase();
    match format {
        MatrixFormat::Dense(d) => dtype(d),
        MatrixFormat::Affine { bits, group_size, .. } => format!("{bits}-bit g{group_size}"),
    }
}

/// What a measurement is filed under: this machine with this backend and
/// weight format (compute), this machine's disk that holds the model, for
/// reads of about this size (a rate fitted to 60 KB reads says little about
/// 3 MB ones), and for the model's own decode from a small pool, all of
/// those and the model ([`crate::plan::hits::model_key`]); for the model's
/// own timed runs, which `hits.json` keeps by model, this machine, backend and
/// disk ([`runs_key`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RateKeys {
    pub compute: String,
    pub disk: Option<String>,
    pub decode: Option<String>,
    pub runs: Option<String>,
}

impl RateKeys {
    /// Keys for a model in `dir` (which need not exist: then no disk key)
    /// whose expert records of `record_bytes` are stored as `format`, run by
    /// the backend named `backend`; `model` is the model's key where its
    /// files are here.
    pub fn new(backend: &str, format: &MatrixFormat, dir: &Path, record_bytes: u64, model: Option<&str>) -> RateKeys {
        let machine = machine_name();
        let disk = disk_name(dir).map(|disk| format!("{disk} | {}", read_size_class(record_bytes)));
        let compute = format!("{machine} | {backend} | {}", format_label(format));
        RateKeys {
            runs: runs_key(backend, dir),
            decode: disk.as_ref().zip(model).map(|(disk, model)| format!("{compute} | {disk} | model {model}")),
            disk: disk.map(|disk| format!("{machine} | {disk}")),
            compute,
        }
    }
}

/// What a model's timed runs are filed under (in `hits.json`, by model):
/// this machine, the backend named `backend` (with its threads) and the disk
/// that holds `dir`; the model fixes the weight format and the read size.
/// `None` if `dir` does not exist.
pub fn runs_key(backend: &str, dir: &Path) -> Option<String> {
    disk_name(dir).map(|disk| format!("{} | {backend} | {disk}", machine_name()))
}

/// `experts of ~64 KB`: the record size to the nearest power of two.
fn read_size_class(record_bytes: u64) -> String {
    let class = 1u64 << ((record_bytes.max(1) as f64).log2().round() as u32).min(62);
    match class {
        0..=1023 => format!("experts of ~{class} B"),
        1024..=1_048_575 => format!("experts of ~{} KB", class >> 10),
        _ => format!("experts of ~{} MB", class >> 20),
    }
}

/// This machine: its host name and CPU model (a shared home folder may
/// hold measurements of several machines).
fn machine_name() -> String {
    let host = host_name().unwrap_or_else(|| "unknown host".into());
    match cpu_model() {
        Some(cpu) => format!("{host} ({cpu})"),
        None => host,
    }
}

/// The kernel's host name (`uname -n`), on Linux and macOS alike.
fn host_name() -> Option<String> {
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `name.len()` bytes into `name`.
    let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast::<libc::c_char>(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let host = String::from_utf8_lossy(&name[..end]).trim().to_string();
    (rc == 0 && !host.is_empty()).then_some(host)
}

#[cfg(not(target_os = "macos"))]
fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string())
}

/// `Apple M2 Pro`: the `machdep.cpu.brand_string` sysctl.
#[cfg(target_os = "macos")]
fn cpu_model() -> Option<String> {
    let mut brand = [0u8; 256];
    let mut size = brand.len();
    // SAFETY: sysctlbyname writes at most `size` bytes into `brand` and the length it wrote into `size`.
    let rc = unsafe {
        libc::sysctlbyname(c"machdep.cpu.brand_string".as_ptr(), brand.as_mut_ptr().cast(), &mut size, std::ptr::null_mut(), 0)
    };
    if rc != 0 {
        return None;
    }
    let end = brand[..size.min(brand.len())].iter().position(|&b| b == 0).unwrap_or(size.min(brand.len()));
    Some(String::from_utf8_lossy(&brand[..end]).trim().to_string()).filter(|b| !b.is_empty())
}

/// The device that holds `path` (`/dev/vda1 (253:1)` where the kernel names
/// it), or `None` if `path` does not exist.
fn disk_name(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let (major, minor) = device_numbers(std::fs::metadata(path).ok()?.dev());
    let name = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/uevent"))
        .ok()
        .and_then(|u| u.lines().find_map(|l| l.strip_prefix("DEVNAME=").map(|n| format!("/dev/{n} "))));
    Some(format!("{}({major}:{minor})", name.unwrap_or_default()))
}

/// A device number's major and minor numbers, as this OS encodes them.
fn device_numbers(dev: u64) -> (u64, u64) {
    if cfg!(target_os = "macos") {
        darwin_device_numbers(dev)
    } else {
        glibc_device_numbers(dev)
    }
}

/// glibc's encoding (Linux, `gnu_dev_major`/`gnu_dev_minor`): 32 bits of
/// each, split so that small numbers fit in the low 16 bits.
fn glibc_device_numbers(dev: u64) -> (u64, u64) {
    (((dev >> 8) & 0xfff) | ((dev >> 32) & 0xffff_f000), (dev & 0xff) | ((dev >> 12) & 0xffff_ff00))
}

/// Darwin's 32-bit `dev_t`: 8 bits of major, then 24 of minor.
fn darwin_device_numbers(dev: u64) -> (u64, u64) {
    ((dev >> 24) & 0xff, dev & 0xff_ffff)
}

/// One measurement as kept on disk.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Measured<T> {
    pub rates: T,
    pub unix_seconds: u64,
    /// What the probe did, for a reader of the file.
    pub how: String,
}

/// The most measurements of each kind the file keeps (the newest).
const MAX_ENTRIES: usize = 64;

/// `rates.json`: measurements by key.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RateCache {
    #[serde(default)]
    pub compute: BTreeMap<String, Measured<ComputeRates>>,
    #[serde(default)]
    pub disks: BTreeMap<String, Measured<DiskRates>>,
    /// Each model's own decode from a small pool (by [`RateKeys::decode`]).
    #[serde(default)]
    pub decodes: BTreeMap<String, Measured<MissRates>>,
}

impl RateCache {
    /// Where measurements are kept.
    pub fn path() -> Result<PathBuf> {
        Ok(crate::user_cache::dir()?.join("rates.json"))
    }

    /// The measurements in `path`; none if the file does not exist.
    pub fn load(path: &Path) -> Result<RateCache> {
        crate::user_cache::read_json(path, "measured rates", "delete it and run `slotstream doctor --measure`")
    }

    /// Writes the file whole (a reader never sees half of it).
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::user_cache::write_json(path, self)
    }

    pub fn record_compute(&mut self, key: &str, measured: Measured<ComputeRates>) {
        self.compute.insert(key.to_string(), measured);
        keep_newest(&mut self.compute);
    }

    pub fn record_disk(&mut self, key: &str, measured: Measured<DiskRates>) {
        self.disks.insert(key.to_string(), measured);
        keep_newest(&mut self.disks);
    }

    pub fn record_decode(&mut self, key: &str, measured: Measured<MissRates>) {
        self.decodes.insert(key.to_string(), measured);
        keep_newest(&mut self.decodes);
    }

    /// `rates` with what was measured under `keys` in place of defaults, and
    /// the key of this machine's timed runs of the model ([`RateKeys::runs`]).
    /// Figures that are not positive finite numbers (a hand-edited file) are
    /// passed over.
    pub fn apply(&self, keys: &RateKeys, mut rates: Rates) -> Rates {
        if let Some(m) = self.compute.get(&keys.compute) {
            if positive(m.rates.weight_gbps) && (positive(m.rates.layer_overhead_ms) || m.rates.layer_overhead_ms == 0.0) {
                rates.compute = m.rates;
                rates.compute_source = RateSource::Measured { unix_seconds: m.unix_seconds };
            }
        }
        if let Some(m) = keys.disk.as_ref().and_then(|k| self.disks.get(k)) {
            if positive(m.rates.read_gbps) && (positive(m.rates.read_latency_ms) || m.rates.read_latency_ms == 0.0) {
                rates.disk = m.rates;
                rates.disk_source = RateSource::Measured { unix_seconds: m.unix_seconds };
            }
        }
        if let Some(m) = keys.decode.as_ref().and_then(|k| self.decodes.get(k)) {
            if [m.rates.miss_ms, m.rates.token_ms].iter().all(|x| x.is_finite() && *x >= 0.0) {
                rates.miss = Some(m.clone());
            }
        }
        rates.runs_key = keys.runs.clone();
        rates
    }
}

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

fn keep_newest<T>(map: &mut BTreeMap<String, Measured<T>>) {
    while map.len() > MAX_ENTRIES {
        let Some(oldest) = map.iter().min_by_key(|(_, m)| m.unix_seconds).map(|(k, _)| k.clone()) else { return };
        map.remove(&oldest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Rates {
        Rates::unmeasured(
            ComputeRates { weight_gbps: 12.0, layer_overhead_ms: 0.1 },
            DiskRates { read_gbps: 0.7, read_latency_ms: 0.4 },
            RateSource::Defaults,
        )
    }

    fn keys() -> RateKeys {
        RateKeys {
            compute: "host | cpu (2 threads) | 4-bit g64".into(),
            disk: Some("host | /dev/vda1 (253:1)".into()),
            decode: Some("host | cpu (2 threads) | 4-bit g64 | /dev/vda1 (253:1) | experts of ~2 MB | model 0123".into()),
            runs: Some("host | cpu (2 threads) | /dev/vda1 (253:1)".into()),
        }
    }

    #[test]
    fn measured_rates_replace_the_defaults_they_were_measured_for() {
        let mut cache = RateCache::default();
        let compute = ComputeRates { weight_gbps: 9.0, layer_overhead_ms: 0.05 };
        cache.record_compute(&keys().compute, Measured { rates: compute, unix_seconds: 100, how: "test".into() });
        let rates = cache.apply(&keys(), defaults());
        assert_eq!(rates.compute, compute);
        assert_eq!(rates.runs_key, keys().runs, "the runs of this machine, backend and disk are the estimate's");
        assert_eq!(rates.compute_source, RateSource::Measured { unix_seconds: 100 });
        assert_eq!(rates.disk_source, RateSource::Defaults, "no disk was measured");
        let line = rates.describe(100 + 7200);
        assert!(line.contains("weights 9.0 GB/s + 0.05 ms per layer measured 2 h ago"), "{line}");
        assert!(line.contains("expert reads 0.70 GB/s + 0.40 ms default") && line.contains("doctor --measure"), "{line}");
        assert!(line.contains("a missed expert costs its read (this model's decode not timed here)"), "{line}");

        let miss = Measured { rates: MissRates { miss_ms: 4.2, token_ms: 16.5 }, unix_seconds: 160, how: "test".into() };
        cache.record_decode(keys().decode.as_deref().expect("a key"), miss.clone());
        let rates = cache.apply(&keys(), defaults());
        assert_eq!(rates.miss, Some(miss.clone()));
        let line = rates.describe(160 + 300);
        assert!(line.contains("a missed expert 4.20 ms beyond 16.50 ms of compute a token in this model's decode measured 5 min ago"), "{line}");
        let another_model = RateKeys { decode: keys().decode.map(|k| k.replace("model 0123", "model 4567")), ..keys() };
        assert_eq!(cache.apply(&another_model, defaults()).miss, None, "another model's decode does not apply");
        let nonsense = Measured { rates: MissRates { miss_ms: 4.2, token_ms: f64::NAN }, ..miss };
        cache.record_decode(keys().decode.as_deref().expect("a key"), nonsense);
        assert_eq!(cache.apply(&keys(), defaults()).miss, None, "a figure that is not a time is passed over");

        let other = RateKeys { compute: "host | wgpu | 4-bit g64".into(), disk: None, decode: None, runs: None };
        assert_eq!(read_size_class(61_440), "experts of ~64 KB");
        assert_eq!(read_size_class(2_654_208), "experts of ~2 MB");
        assert_eq!(cache.apply(&other, defaults()), defaults(), "another backend's measurement does not apply");
    }

    /// A model's timed decode is filed under the machine, backend, format
    /// and disk, and the model: another model on the same disk has its own.
    #[test]
    fn a_timed_decode_is_filed_under_its_model() {
        let dir = tempfile::tempdir().expect("a scratch folder");
        let format = MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::BF16 };
        let keys = RateKeys::new("cpu (2 threads)", &format, dir.path(), 2_654_208, Some("0123"));
        let decode = keys.decode.clone().expect("a disk and a model");
        assert!(decode.starts_with(&keys.compute) && decode.ends_with("| experts of ~2 MB | model 0123"), "{decode}");
        assert_eq!(RateKeys::new("cpu (2 threads)", &format, dir.path(), 2_654_208, None).decode, None, "no model key");
        let runs = keys.runs.clone().expect("a disk");
        let disk = keys.disk.as_deref().and_then(|d| d.split(" | ").nth(1)).expect("a disk key");
        assert!(runs.starts_with(&machine_name()) && runs.ends_with(&format!("| cpu (2 threads) | {disk}")), "{runs}");
        let wgpu = RateKeys::new("wgpu (Vulkan)", &format, dir.path(), 61_440, Some("0123"));
        assert_ne!(wgpu.runs, keys.runs, "another backend's runs are not this one's");
        let absent = RateKeys::new("cpu (2 threads)", &format, &dir.path().join("absent"), 2_654_208, Some("0123"));
        assert_eq!((absent.disk, absent.decode, absent.runs), (None, None, None), "no files here");
    }

    /// `ls -l /dev`'s numbers: Linux's vda1 is 253:1 (glibc splits both
    /// numbers: large ones keep their high bits); a Mac's disk3s1 is 1:13.
    #[test]
    fn device_numbers_decode_as_each_os_encodes_them() {
        let makedev = |major: u64, minor: u64| ((major & 0xfff) << 8) | ((major & !0xfff) << 32) | (minor & 0xff) | ((minor & !0xff) << 12);
        assert_eq!(glibc_device_numbers(0xfd01), (253, 1));
        assert_eq!(glibc_device_numbers(makedev(0x1103, 0x12345)), (0x1103, 0x12345));
        assert_eq!(darwin_device_numbers(0x0100_000d), (1, 13));
        assert_eq!(darwin_device_numbers(0x1000_0005), (16, 5));
        // `st_dev` is a signed 32-bit number on macOS: a negative one widened to u64 keeps its low bits.
        assert_eq!(darwin_device_numbers(-16_777_203i64 as u64), (255, 13));
        assert_ne!(glibc_device_numbers(0x0100_000d), (1, 13), "glibc's decoding gives a Mac's numbers wrong");
    }

    #[test]
    fn the_machine_is_named_by_its_host_name() {
        let host = host_name().expect("a host name");
        assert!(machine_name().starts_with(&host), "{}", machine_name());
        // The same name as before gethostname (measurements kept by earlier versions stay found).
        #[cfg(target_os = "linux")]
        assert_eq!(std::fs::read_to_string("/proc/sys/kernel/hostname").expect("the kernel's host name").trim(), host);
    }

    #[test]
    fn the_file_round_trips_and_refuses_what_is_not_rates() {
        let dir = tempfile::tempdir().expect("a scratch folder");
        let path = dir.path().join("sub/rates.json");
        assert_eq!(RateCache::load(&path).expect("a missing file is no measurement"), RateCache::default());
        let mut cache = RateCache::default();
        cache.record_disk("host | disk", Measured { rates: DiskRates { read_gbps: 1.5, read_latency_ms: 0.2 }, unix_seconds: 5, how: "x".into() });
        cache.save(&path).expect("saving");
        assert_eq!(RateCache::load(&path).expect("loading"), cache);
        std::fs::write(&path, "not json").expect("writing");
        let error = RateCache::load(&path).expect_err("garbage is refused");
        assert!(format!("{error:#}").contains("delete it"), "{error:#}");
    }

    #[test]
    fn nonsense_figures_are_passed_over_and_the_file_stays_bounded() {
        let mut cache = RateCache::default();
        let bad = ComputeRates { weight_gbps: f64::NAN, layer_overhead_ms: 0.1 };
        cache.record_compute(&keys().compute, Measured { rates: bad, unix_seconds: 1, how: String::new() });
        assert_eq!(cache.apply(&keys(), defaults()), Rates { runs_key: keys().runs, ..defaults() });
        for i in 0..(MAX_ENTRIES as u64 + 10) {
            cache.record_disk(&format!("disk {i}"), Measured { rates: DiskRates { read_gbps: 1.0, read_latency_ms: 0.1 }, unix_seconds: i, how: String::new() });
        }
        assert_eq!(cache.disks.len(), MAX_ENTRIES);
        assert!(!cache.disks.contains_key("disk 0") && cache.disks.contains_key(&format!("disk {}", MAX_ENTRIES + 9)));
    }
}
