//! Kernel timing: while profiling is on, a timestamp follows every dispatch
//! inside its compute pass (or, where the adapter cannot write timestamps
//! inside passes, every dispatch gets a pass of its own), and each
//! submission's timings are read back and summed by kernel (entry point).

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

/// Timestamps of the dispatches of one submission. Each dispatch's time is
/// the span between two queries: its own pass's beginning and end, or
/// (inside one pass) the query written after the dispatch before it, or at
/// the pass's beginning, and the one written after it.
pub(super) struct Timing {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    /// Timestamps written inside passes, after each dispatch.
    inside: bool,
    /// Each timed dispatch's kernel and its two queries.
    spans: Vec<(&'static str, u32, u32)>,
    /// Queries used by this submission.
    used: u32,
    /// The open pass's latest query (inside passes).
    last: Option<u32>,
}

impl Timing {
    pub(super) fn new(device: &wgpu::Device, inside: bool) -> Timing {
        Timing {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("kernel timing"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * MAX_TIMED,
            }),
            resolve: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kernel timing"),
                size: 2 * MAX_TIMED as u64 * 8,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            inside,
            spans: Vec::new(),
            used: 0,
            last: None,
        }
    }

    fn take_query(&mut self) -> Option<u32> {
        (self.used < 2 * MAX_TIMED).then(|| {
            self.used += 1;
            self.used - 1
        })
    }

    /// Timestamp writes for the pass about to be opened for a dispatch of
    /// `family` (`fresh`: no pass is open), or `None` where none is needed
    /// or the query set is used up. A dispatch timed by its own pass gets
    /// one each; inside passes, only a new pass gets one, at its beginning.
    pub(super) fn next_pass(&mut self, family: &'static str, fresh: bool) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        if self.inside {
            if !fresh {
                return None;
            }
            self.last = self.take_query();
            return Some(wgpu::ComputePassTimestampWrites {
                query_set: &self.queries,
                beginning_of_pass_write_index: Some(self.last?),
                end_of_pass_write_index: None,
            });
        }
        if self.used + 2 > 2 * MAX_TIMED {
            return None;
        }
        let (a, b) = (self.used, self.used + 1);
        self.used += 2;
        self.spans.push((family, a, b));
        Some(wgpu::ComputePassTimestampWrites { query_set: &self.queries, beginning_of_pass_write_index: Some(a), end_of_pass_write_index: Some(b) })
    }

    /// Inside passes: writes the timestamp that ends the dispatch of
    /// `family` just recorded in `pass`.
    pub(super) fn after_dispatch(&mut self, family: &'static str, pass: &mut wgpu::ComputePass<'static>) {
        if !self.inside {
            return;
        }
        let (Some(start), Some(end)) = (self.last, self.take_query()) else {
            self.last = None;
            return;
        };
        pass.write_timestamp(&self.queries, end);
        self.spans.push((family, start, end));
        self.last = Some(end);
    }

    /// Records resolving this submission's timestamps into a host-readable
    /// buffer, which it returns (`None` when nothing was timed).
    pub(super) fn resolve(&self, device: &wgpu::Device, encoder: &mut wgpu::CommandEncoder) -> Option<wgpu::Buffer> {
        if self.used == 0 {
            return None;
        }
        let n = self.used;
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
        Timing { spans: Vec::new(), used: 0, last: None, ..self }
    }
}

impl Gpu {
    /// Adds the timings `staging` holds (from [`Timing::resolve`]) to the profile.
    pub(super) fn record_timings(&self, timing: &Timing, staging: &wgpu::Buffer) -> Result<()> {
        let ticks = self.read_back(staging)?;
        let period = self.queue.get_timestamp_period() as f64 * 1e-9;
        if let Ok(mut prof) = self.profile.lock() {
            if let Some(prof) = prof.as_mut() {
                for &(family, a, b) in &timing.spans {
                    let (a, b) = (ticks_at(&ticks, a as usize), ticks_at(&ticks, b as usize));
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
        p.timing = on.then(|| Timing::new(&self.device, self.time_inside));
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
