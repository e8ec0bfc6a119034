//! Progress for long transfers and hashing: a bar with rate and ETA on a terminal,
//! plain periodic lines when stderr is a file or a pipe (CI logs, `2>log`), and
//! per-file events for a [`PullObserver`] (the server's `/api/pull` stream).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{DecimalBytes, HumanDuration, ProgressBar, ProgressStyle};

use crate::note;

/// Plain mode prints at most one progress line this often.
const PLAIN_INTERVAL: Duration = Duration::from_secs(5);
/// An observer hears about one file's bytes at most this often (and always at its end).
const OBSERVER_INTERVAL: Duration = Duration::from_millis(100);

/// What a pull reports as it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PullEvent {
    /// Finding out which files the model has (the hub's listing or the pins).
    Manifest,
    /// Bytes of one file present so far.
    File { path: String, digest: String, total: u64, completed: u64 },
    /// Every byte of a file is there; it is being hashed.
    Verifying { path: String },
}

/// Hears a pull's [`PullEvent`]s; called from download threads, so it must not block long.
pub trait PullObserver: Send + Sync {
    fn event(&self, event: PullEvent);

    /// Whether whoever asked for the pull has gone, so the pull should stop.
    /// The downloads stop between reads; the bytes on disk and their records
    /// stay, and the next pull resumes from them.
    fn cancelled(&self) -> bool {
        false
    }
}

/// One file's bytes, for the observer.
struct FileCount {
    digest: String,
    total: u64,
    completed: u64,
    last_event: Option<Instant>,
}

pub struct Progress {
    verb: &'static str,
    total: u64,
    /// Bytes that were already done when this run started (not counted in the rate).
    initial: u64,
    done: AtomicU64,
    started: Instant,
    bar: Option<ProgressBar>,
    last_plain_line: Mutex<Instant>,
    observer: Option<Arc<dyn PullObserver>>,
    files: Mutex<HashMap<String, FileCount>>,
}

impl Progress {
    /// `verb` says what is counted ("downloaded", "hashed").
    pub fn new(verb: &'static str, total: u64, initial: u64) -> Progress {
        let terminal = std::io::stderr().is_terminal()
            && std::env::var("TERM").map(|t| t != "dumb").unwrap_or(true);
        let bar = terminal.then(|| {
            let style = ProgressStyle::with_template(
                "{msg:>10} [{bar:32}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} ETA {eta}",
            )
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            let bar = ProgressBar::new(total).with_style(style).with_message(verb);
            bar.set_position(initial);
            bar.reset_eta();
            bar
        });
        let started = Instant::now();
        Progress {
            verb,
            total,
            initial,
            done: AtomicU64::new(initial),
            started,
            bar,
            last_plain_line: Mutex::new(started),
            observer: None,
            files: Mutex::new(HashMap::new()),
        }
    }

    /// Reports each file's bytes to `observer` (no bar: whoever observes shows them).
    /// `files` are (path, digest, size, bytes already there).
    pub fn observed(
        mut self,
        observer: Option<Arc<dyn PullObserver>>,
        files: impl IntoIterator<Item = (String, String, u64, u64)>,
    ) -> Progress {
        let Some(observer) = observer else { return self };
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let mut counts = HashMap::new();
        for (path, digest, total, completed) in files {
            observer.event(PullEvent::File { path: path.clone(), digest: digest.clone(), total, completed });
            counts.insert(path, FileCount { digest, total, completed, last_event: Some(Instant::now()) });
        }
        self.files = Mutex::new(counts);
        self.observer = Some(observer);
        self
    }

    /// `bytes` more of the file `path`.
    pub fn add_to(&self, path: &str, bytes: u64) {
        self.add(bytes);
        let Some(observer) = &self.observer else { return };
        let event = {
            let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
            let Some(file) = files.get_mut(path) else { return };
            file.completed = (file.completed + bytes).min(file.total);
            let due = file.last_event.is_none_or(|t| t.elapsed() >= OBSERVER_INTERVAL) || file.completed == file.total;
            if !due {
                return;
            }
            file.last_event = Some(Instant::now());
            PullEvent::File { path: path.to_string(), digest: file.digest.clone(), total: file.total, completed: file.completed }
        };
        observer.event(event);
    }

    /// Whether the observer, if any, has asked the pull to stop.
    pub fn cancelled(&self) -> bool {
        self.observer.as_ref().is_some_and(|o| o.cancelled())
    }

    /// Tells the observer, if any, that `path` is being hashed.
    pub fn verifying(&self, path: &str) {
        if let Some(observer) = &self.observer {
            observer.event(PullEvent::Verifying { path: path.to_string() });
        }
    }

    pub fn add(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        match &self.bar {
            Some(bar) => bar.inc(bytes),
            None => {
                let Ok(mut last) = self.last_plain_line.try_lock() else { return };
                if last.elapsed() >= PLAIN_INTERVAL {
                    *last = Instant::now();
                    note!("{}", self.summary(done));
                }
            }
        }
    }

    /// A message that should not tear the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => note!("{line}"),
        }
    }

    pub fn note_retry(&self, line: &str) {
        self.println(&format!("  retry: {line}"));
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        let done = self.done.load(Ordering::Relaxed);
        if done > self.initial {
            note!("{}", self.summary(done));
        }
    }

    fn summary(&self, done: u64) -> String {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = (done.saturating_sub(self.initial)) as f64 / elapsed;
        let percent = if self.total == 0 { 100.0 } else { done as f64 * 100.0 / self.total as f64 };
        let mut line = format!(
            "{} {} of {} ({percent:.0}%) at {}/s",
            self.verb,
            DecimalBytes(done),
            DecimalBytes(self.total),
            DecimalBytes(rate as u64)
        );
        if rate > 0.0 && done < self.total {
            let left = Duration::from_secs_f64((self.total - done) as f64 / rate);
            line.push_str(&format!(", about {} left", HumanDuration(left)));
        }
        line
    }
}
