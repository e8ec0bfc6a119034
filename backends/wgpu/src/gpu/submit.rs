//! Periodic submissions on a thread of their own.
//!
//! Ending a compute pass (where wgpu-core validates, tracks and encodes every
//! dispatch recorded in it), finishing the command buffer and submitting it
//! cost an H200's host about 6 µs per decode dispatch, several times what
//! recording the dispatch costs; on the recording thread that time came
//! between the GPU and the next work it could run. The submitter takes the
//! open pass and encoder of each periodic submission and does that part while
//! the recording thread goes on with the next dispatches.
//!
//! Jobs run in the order they are sent, and every other queue operation (a
//! submission the host asked for, a queue write, a wait for the GPU) first
//! waits for the jobs sent before it ([`Submitter::wait`]), so the queue sees
//! the same operations in the same order as without the thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use slotstream_backend::{BackendError, Result};

/// One periodic submission: the pass to end, its encoder, and the queue
/// writes (ring inputs, parameter arenas) that must land before it.
pub(super) struct Job {
    pub pass: Option<wgpu::ComputePass<'static>>,
    pub encoder: wgpu::CommandEncoder,
    pub writes: Vec<(wgpu::Buffer, Vec<u8>)>,
}

#[derive(Default)]
struct Progress {
    sent: u64,
    done: u64,
    /// A job that panicked: its commands may not have reached the queue.
    failed: bool,
}

type Shared = Arc<(Mutex<Progress>, Condvar)>;

pub(super) struct Submitter {
    /// `None` only while dropping.
    tx: Option<mpsc::Sender<Job>>,
    progress: Shared,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Submitter {
    /// Starts the thread; `busy_ns` adds up the host time it spends.
    pub fn start(queue: wgpu::Queue, busy_ns: Arc<AtomicU64>) -> Result<Submitter> {
        let (tx, rx) = mpsc::channel::<Job>();
        let progress: Shared = Arc::default();
        let shared = progress.clone();
        let thread = std::thread::Builder::new()
            .name("wgpu-submit".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let start = std::time::Instant::now();
                    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| submit(&queue, job))).is_ok();
                    busy_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    let (lock, done) = &*shared;
                    if let Ok(mut p) = lock.lock() {
                        p.done += 1;
                        p.failed |= !ok;
                    }
                    done.notify_all();
                }
            })
            .map_err(|e| BackendError::Device(format!("starting the submission thread: {e}")))?;
        Ok(Submitter { tx: Some(tx), progress, thread: Some(thread) })
    }

    /// Hands `job` to the thread.
    pub fn send(&self, job: Job) -> Result<()> {
        let lost = || BackendError::Device("the submission thread has stopped".into());
        let tx = self.tx.as_ref().ok_or_else(lost)?;
        // Counted before sending, so that a wait never misses a job in flight.
        self.progress.0.lock().map_err(|_| lost())?.sent += 1;
        tx.send(job).map_err(|_| lost())
    }

    /// Waits until every job sent so far has been submitted.
    pub fn wait(&self) -> Result<()> {
        let (lock, done) = &*self.progress;
        let poisoned = |_| BackendError::Device("the submission thread's progress was poisoned".into());
        let mut p = lock.lock().map_err(poisoned)?;
        while p.done < p.sent {
            p = done.wait(p).map_err(poisoned)?;
        }
        if p.failed {
            return Err(BackendError::Device("a submission failed on the submission thread".into()));
        }
        Ok(())
    }
}

impl Drop for Submitter {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has run every job.
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn submit(queue: &wgpu::Queue, job: Job) {
    let Job { pass, encoder, writes } = job;
    drop(pass);
    for (buffer, data) in &writes {
        queue.write_buffer(buffer, 0, data);
    }
    queue.submit([encoder.finish()]);
}
