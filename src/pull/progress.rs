//! Progress for long transfers and hashing: a bar with rate and ETA on a terminal,
//! plain periodic lines when stderr is a file or a pipe (CI logs, `2>log`).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{HumanBytes, HumanDuration, ProgressBar, ProgressStyle};

use crate::note;

/// Plain mode prints at most one progress line this often.
const PLAIN_INTERVAL: Duration = Duration::from_secs(5);

pub struct Progress {
    verb: &'static str,
    total: u64,
    /// Bytes that were already done when this run started (not counted in the rate).
    initial: u64,
    done: AtomicU64,
    started: Instant,
    bar: Option<ProgressBar>,
    last_plain_line: Mutex<Instant>,
}

impl Progress {
    /// `verb` says what is counted ("downloaded", "hashed").
    pub fn new(verb: &'static str, total: u64, initial: u64) -> Progress {
        let terminal = std::io::stderr().is_terminal()
            && std::env::var("TERM").map(|t| t != "dumb").unwrap_or(true);
        let bar = terminal.then(|| {
            let style = ProgressStyle::with_template(
                "{msg:>10} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
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
            HumanBytes(done),
            HumanBytes(self.total),
            HumanBytes(rate as u64)
        );
        if rate > 0.0 && done < self.total {
            let left = Duration::from_secs_f64((self.total - done) as f64 / rate);
            line.push_str(&format!(", about {} left", HumanDuration(left)));
        }
        line
    }
}
