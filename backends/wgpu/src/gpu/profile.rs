//! Kernel timing: while profiling is on, every dispatch gets its own compute
//! pass with timestamps, and each submission's timings are read back and
//! summed by kernel (entry point).

use std::collections::HashMap;

use slotstream_backend::{BackendError, Result};

use super::Gpu;

/// Dispatches timed per submission when profiling.
const MAX_TIMED: u32 = 2048;

/// Time spent in one kernel family, summed over submissions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FamilyTime {
    pub dispatches: u64,
    pub seconds: f64,
}

/// Timestamps of the dispatches of one submission.
pub(super) struct Timing {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    families: Vec<&'static str>,
}

impl Timing {
    /// Timestamp writes for the pass of the next dispatch (of `family`), or
    /// `None` once this submission has timed as many as the query set holds.
    pub(super) fn next_pass(&mut self, family: &'static str) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        if self.families.len() as u32 >= MAX_TIMED {
            return None;
        }
        self.families.push(family);
        let i = self.families.len() as u32 - 1;
        Some(wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        })
    }

    /// Records resolving this submission's timestamps into a host-readable
    /// buffer, which it returns (`None` when nothing was timed).
    pub(super) fn resolve(&self, device: &wgpu::Device, encoder: &mut wgpu::CommandEncoder) -> Option<wgpu::Buffer> {
        if self.families.is_empty() {
            return None;
        }
        let n = self.families.len() as u32 * 2;
        encoder.resolve_query_set(&self.queries, 0..n, &self.resolve, 0);
        let staging = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size: n as u64 * 8,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        encoder.copy_buffer_to_buffer(&self.resolve, 0, &staging, 0, n as u64 * 8);
        Some(staging)
    }

    /// The same queries, ready for the next submission.
    pub(super) fn restart(self) -> Timing {
        Timing { families: Vec::new(), ..self }
    }
}

impl Gpu {
    /// Adds the timings `staging` holds (from [`Timing::resolve`]) to the profile.
    pub(super) fn record_timings(&self, timing: &Timing, staging: &wgpu::Buffer) -> Result<()> {
        let ticks = self.read_back(staging)?;
        let period = self.queue.get_timestamp_period() as f64 * 1e-9;
        if let Ok(mut prof) = self.profile.lock() {
            if let Some(prof) = prof.as_mut() {
                for (i, family) in timing.families.iter().enumerate() {
                    let (a, b) = (ticks_at(&ticks, 2 * i), ticks_at(&ticks, 2 * i + 1));
                    let e = prof.entry(family).or_default();
                    e.dispatches += 1;
                    e.seconds += b.saturating_sub(a) as f64 * period;
                }
            }
        }
        Ok(())
    }

    /// Starts (or stops) timing every dispatch by kernel family.
    pub fn set_profiling(&self, on: bool) -> Result<()> {
        if on && !self.can_time {
            return Err(BackendError::Unsupported(format!("{} has no timestamp queries", self.info.name)));
        }
        self.flush()?;
        let mut p = self.pending()?;
        p.timing = on.then(|| Timing {
            queries: self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("kernel timing"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * MAX_TIMED,
            }),
            resolve: self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kernel timing"),
                size: 2 * MAX_TIMED as u64 * 8,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            families: Vec::new(),
        });
        if let Ok(mut prof) = self.profile.lock() {
            *prof = on.then(HashMap::new);
        }
        Ok(())
    }

    /// Kernel time by family since profiling started.
    pub fn profile(&self) -> Vec<(String, FamilyTime)> {
        let mut v: Vec<(String, FamilyTime)> = self
            .profile
            .lock()
            .ok()
            .and_then(|p| p.as_ref().map(|m| m.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()))
            .unwrap_or_default();
        v.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
        v
    }
}

fn ticks_at(bytes: &[u8], i: usize) -> u64 {
    bytes.get(i * 8..i * 8 + 8).map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])).unwrap_or(0)
}
