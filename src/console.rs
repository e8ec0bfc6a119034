//! Printing for the command line, where `println!` and `eprintln!` would panic
//! on a closed pipe or a full disk. Output on stdout is the product: its write
//! errors are returned (a closed pipe is told apart by [`is_closed_pipe`] so
//! the command can end quietly). Notes on stderr are best effort: losing a
//! progress line is no reason to stop a download or a server.

use std::fmt;
use std::io::{self, Write};

use anyhow::{Context, Result};

/// Writes `text` to stdout and flushes it, so a write error shows up here and
/// not at exit, where it would be lost.
pub fn print(text: &str) -> Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).context("writing to stdout")
}

/// [`print`] with a newline.
pub fn print_line(text: impl fmt::Display) -> Result<()> {
    print(&format!("{text}\n"))
}

/// Writes a line to stderr, ignoring write errors (see the module's comment).
pub fn note_args(args: fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

/// `eprintln!` that never panics: a line to stderr, best effort.
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::console::note_args(format_args!($($arg)*))
    };
}

/// Whether `error` comes from writing to a pipe whose reader has gone (as
/// `slotstream doctor | head -1`): the reader's choice, so a quiet exit.
pub fn is_closed_pipe(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<io::Error>())
        .any(|e| e.kind() == io::ErrorKind::BrokenPipe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_pipe_is_told_apart_from_other_write_errors() {
        let closed = anyhow::Error::new(io::Error::from(io::ErrorKind::BrokenPipe)).context("writing to stdout");
        assert!(is_closed_pipe(&closed));
        let full = anyhow::Error::new(io::Error::from_raw_os_error(libc::ENOSPC)).context("writing to stdout");
        assert!(!is_closed_pipe(&full));
    }
}
