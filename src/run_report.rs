//! What `slotstream run` reports after generating: one [`RunReport`] that
//! prints as the `--json` object (serde) or as the summary lines written to
//! stderr after the streamed text (`Display`).

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;
use slotstream_backend::DeviceMemory;

use crate::experts::CacheStats;
use crate::generate::GenerateOutput;
use crate::model::RowCacheStats;
use crate::plan::Plan;

/// One generation with the state of the engine after it.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport<'a> {
    /// Ids, text, finish reason and timings, at the top level of the JSON.
    #[serde(flatten)]
    pub output: &'a GenerateOutput,
    /// The backend's name (it says when int8 activations are on).
    pub backend: String,
    pub experts: CacheStats,
    /// The n-gram row cache, for models that have one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ngram_rows: Option<RowCacheStats>,
    pub plan: &'a Plan,
    /// `null` where the OS does not report it.
    pub peak_rss_bytes: Option<u64>,
    /// The backend's device memory by use, where it counts it (wgpu).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<DeviceMemoryReport>,
}

/// [`DeviceMemory`] as `run --json` writes it: bytes by use.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceMemoryReport {
    /// The device total's high-water mark (the bytes the backend asked for:
    /// the driver's own and the allocator's rounding come on top), each
    /// use's bytes then, and the pooled scratch in use then, by kind.
    pub peak_bytes: u64,
    pub at_peak: BTreeMap<&'static str, u64>,
    pub in_use_at_peak: BTreeMap<&'static str, u64>,
    /// The most pooled scratch in use at once, by kind then.
    pub scratch_peak_bytes: u64,
    pub scratch_at_peak: BTreeMap<&'static str, u64>,
    /// After the run.
    pub now_bytes: u64,
    pub now: BTreeMap<&'static str, u64>,
    /// The allocator's memory blocks (free space in them included) and the
    /// bytes allocated in them, after the run, where it reports them.
    pub allocator_block_bytes: Option<u64>,
    pub allocator_allocated_bytes: Option<u64>,
}

impl From<DeviceMemory> for DeviceMemoryReport {
    fn from(m: DeviceMemory) -> Self {
        let map = |v: Vec<(&'static str, u64)>| v.into_iter().collect();
        DeviceMemoryReport {
            peak_bytes: m.peak_bytes,
            at_peak: map(m.at_peak),
            in_use_at_peak: map(m.in_use_at_peak),
            scratch_peak_bytes: m.scratch_peak_bytes,
            scratch_at_peak: map(m.scratch_at_peak),
            now_bytes: m.now_bytes,
            now: map(m.now),
            allocator_block_bytes: m.allocator.map(|a| a.0),
            allocator_allocated_bytes: m.allocator.map(|a| a.1),
        }
    }
}

impl fmt::Display for DeviceMemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let list = |m: &BTreeMap<&'static str, u64>| {
            m.iter().filter(|(_, b)| **b > 0).map(|(k, b)| format!("{k} {:.0}", mib(*b))).collect::<Vec<_>>().join(", ")
        };
        write!(f, "device memory: peak {:.0} MiB ({})", mib(self.peak_bytes), list(&self.at_peak))?;
        write!(f, "; pooled scratch in use at most {:.0} MiB ({})", mib(self.scratch_peak_bytes), list(&self.scratch_at_peak))?;
        if let (Some(blocks), Some(used)) = (self.allocator_block_bytes, self.allocator_allocated_bytes) {
            write!(f, "; allocator blocks {:.0} MiB, {:.0} MiB allocated in them", mib(blocks), mib(used))?;
        }
        Ok(())
    }
}

/// The summary lines (no trailing newline).
impl fmt::Display for RunReport<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stats = &self.output.stats;
        write!(
            f,
            "prompt {} tokens, generated {} tokens, prefill {:.1} tok/s, decode {:.1} tok/s [{}]",
            stats.prompt_tokens,
            stats.generated_tokens,
            stats.prefill_tokens_per_second,
            stats.decode_tokens_per_second,
            self.backend
        )?;
        if let Some(n) = &self.ngram_rows {
            write!(
                f,
                "\nn-gram rows: {} hits, {} read ({:.1} KB), {} of {} cached",
                n.hits,
                n.misses,
                n.bytes_read as f64 / 1e3,
                n.cached_rows,
                n.capacity_rows
            )?;
        }
        if let Some(m) = &stats.mtp {
            write!(
                f,
                "\nmtp: {} drafted, {} accepted ({:.0}%), {} decode passes for {} tokens{}",
                m.drafted,
                m.accepted,
                100.0 * m.acceptance(),
                m.forward_passes,
                stats.generated_tokens,
                if m.paused { "; drafting paused: too few drafts accepted" } else { "" }
            )?;
        }
        let cache = &self.experts;
        let total = &cache.total;
        write!(
            f,
            "\nexperts: {} slots, hit rate {:.1}% ({} hits, {} misses), read {:.2} GB at {:.2} GB/s ({}), waited {:.2} s",
            cache.slots,
            100.0 * total.hit_rate(),
            total.hits,
            total.misses,
            total.bytes_read as f64 / 1e9,
            total.read_gb_per_second(),
            if cache.direct_io { "direct I/O" } else { "buffered I/O" },
            total.wait_seconds
        )?;
        if total.read_ahead > 0 {
            write!(f, "; read ahead {} guessed experts, {} of them used", total.read_ahead, total.read_ahead_used)?;
        }
        if total.disk_busy_seconds > 0.0 {
            write!(f, "; reads in flight {:.2} s", total.disk_busy_seconds)?;
        }
        let prompt = &stats.prefill_experts;
        if prompt.bytes_read > 0 {
            write!(f, "\nprompt: {}", prompt.describe())?;
        }
        if let Some(m) = &self.device_memory {
            write!(f, "\n{m}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{FinishReason, GenerateStats};
    use crate::plan::{MachineMemory, ModelCosts, PlanRequest};

    fn output() -> GenerateOutput {
        GenerateOutput {
            prompt_ids: vec![1, 2],
            generated_ids: vec![3],
            fed_end: None,
            text: "sea".into(),
            finish_reason: FinishReason::Length,
            stats: GenerateStats {
                prompt_tokens: 2,
                generated_tokens: 1,
                mtp: None,
                prefill_seconds: 0.5,
                decode_seconds: 0.25,
                prefill_tokens_per_second: 4.0,
                decode_tokens_per_second: 4.0,
                decode_experts: Default::default(),
                batched: None,
                prefill_experts: Default::default(),
            },
        }
    }

    #[test]
    fn the_json_keeps_the_output_at_the_top_level_and_leaves_out_absent_ngram_rows() {
        let machine = MachineMemory::simulated(48.0, None, None);
        let request = PlanRequest { context_tokens: 4096, ..Default::default() };
        let plan = crate::plan::plan(&ModelCosts::flagship(), &machine, &request).expect("the flagship plans on 48 GB");
        let output = output();
        let report = RunReport {
            output: &output,
            backend: "cpu".into(),
            experts: CacheStats::default(),
            ngram_rows: None,
            plan: &plan,
            peak_rss_bytes: None,
            device_memory: None,
        };
        let json = serde_json::to_value(&report).expect("the report serializes");
        assert_eq!(json["generated_ids"], serde_json::json!([3]));
        assert_eq!(json["finish_reason"], "length");
        assert_eq!(json["stats"]["prompt_tokens"], 2);
        assert!(json["stats"]["prefill_experts"]["passes"].is_number() && json["plan"]["prefill_chunk"].is_u64(), "{json}");
        assert_eq!(json["backend"], "cpu");
        assert!(json["peak_rss_bytes"].is_null() && json["plan"]["slots"].is_u64(), "{json}");
        assert!(json.get("ngram_rows").is_none(), "{json}");

        let summary = report.to_string();
        assert!(summary.starts_with("prompt 2 tokens, generated 1 tokens, prefill 4.0 tok/s, decode 4.0 tok/s [cpu]\nexperts: 0 slots"), "{summary}");
        assert!(json.get("device_memory").is_none() && !summary.contains("device memory"), "{json}");

        // A backend that counts its device memory: by use in the JSON, one line in the summary.
        let mib = 1 << 20;
        let memory = DeviceMemory {
            peak_bytes: 300 * mib,
            at_peak: vec![("weights", 200 * mib), ("kv_cache", 100 * mib), ("states", 0)],
            scratch_peak_bytes: 40 * mib,
            scratch_at_peak: vec![("tensors", 40 * mib)],
            allocator: Some((320 * mib, 310 * mib)),
            ..Default::default()
        };
        let report = RunReport { device_memory: Some(memory.into()), ..report };
        let json = serde_json::to_value(&report).expect("the report serializes");
        assert_eq!(json["device_memory"]["at_peak"]["kv_cache"], 100 * mib);
        assert_eq!(json["device_memory"]["allocator_block_bytes"], 320 * mib);
        let summary = report.to_string();
        let line = "device memory: peak 300 MiB (kv_cache 100, weights 200); pooled scratch in use at most 40 MiB (tensors 40); \
                    allocator blocks 320 MiB, 310 MiB allocated in them";
        assert!(summary.ends_with(line), "{summary}");
    }
}
