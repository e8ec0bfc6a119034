//! The interactive chat (`slotstream run` with no prompt on a terminal),
//! driven through a pseudo-terminal as a user would: two turns (the second
//! reuses the first's state), Ctrl-C in the middle of an answer stops the
//! answer and not the chat, and `/bye` leaves.
#![cfg(target_os = "linux")]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A child on a pseudo-terminal, and everything it has written to it.
struct Terminal {
    child: Child,
    input: File,
    output: Arc<Mutex<Vec<u8>>>,
}

impl Terminal {
    fn spawn(command: &mut Command) -> Terminal {
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty fills two descriptors we then own.
        let rc = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both were just opened and are owned here.
        let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let stdio = |fd: &OwnedFd| Stdio::from(fd.try_clone().expect("duplicating the terminal"));
        command.stdin(stdio(&slave)).stdout(stdio(&slave)).stderr(stdio(&slave));
        // SAFETY: setsid and ioctl are async-signal-safe; the child becomes
        // the session leader with the terminal as its controlling one, so
        // Ctrl-C written to the terminal sends it SIGINT.
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("starting slotstream on a terminal");
        drop(slave);
        let input = File::from(master.try_clone().expect("duplicating the terminal"));
        let mut reader = File::from(master);
        let output = Arc::new(Mutex::new(Vec::new()));
        let sink = output.clone();
        std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            // Ends with EIO once the child has closed the terminal.
            while let Ok(n) = reader.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                sink.lock().expect("the output buffer").extend_from_slice(&buffer[..n]);
            }
        });
        Terminal { child, input, output }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().expect("the output buffer")).into_owned()
    }

    fn len(&self) -> usize {
        self.output.lock().expect("the output buffer").len()
    }

    fn type_keys(&mut self, keys: &str) {
        self.input.write_all(keys.as_bytes()).expect("typing on the terminal");
    }

    /// Waits until the output after byte `from` contains `needle`; returns
    /// the offset just past it.
    fn wait_for(&mut self, needle: &str, from: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let text = self.text();
            if let Some(at) = text.get(from..).and_then(|rest| rest.find(needle)) {
                return from + at + needle.len();
            }
            if Instant::now() > deadline || matches!(self.child.try_wait(), Ok(Some(_))) {
                let _ = self.child.kill();
                panic!("waited for {needle:?} after byte {from}; the terminal shows:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `N reused` of a turn's note, which starts at `from`.
fn reused(text: &str, from: usize) -> usize {
    let note = &text[from..];
    let end = note.find(" reused").expect("a turn's note says how many tokens were reused");
    note[..end].rsplit(' ').next().and_then(|n| n.parse().ok()).expect("a number before ' reused'")
}

#[test]
fn two_turns_ctrl_c_mid_answer_and_bye() {
    let demo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/demo/model");
    let mut command = Command::new(env!("CARGO_BIN_EXE_slotstream"));
    // --ignore-eos: the demo ends its answers within a few dozen tokens, and the
    // third turn needs one long enough to interrupt.
    command.arg("run").arg("--model").arg(demo).args(["--backend", "cpu", "--max-tokens", "16", "--ignore-eos"]).env("TERM", "xterm");
    let mut terminal = Terminal::spawn(&mut command);

    let mut at = terminal.wait_for(">>> ", 0);
    terminal.type_keys("Where did the ship sail?\r");
    let first = terminal.wait_for("prompt tokens, ", at);
    at = terminal.wait_for(">>> ", first);
    assert_eq!(reused(&terminal.text(), first), 0, "the first turn has nothing to reuse");

    // A message of two lines; the first turn's state is reused.
    terminal.type_keys("\"\"\"And then\r");
    at = terminal.wait_for("... ", at);
    terminal.type_keys("what happened?\"\"\"\r");
    let second = terminal.wait_for("prompt tokens, ", at);
    at = terminal.wait_for(">>> ", second);
    assert!(reused(&terminal.text(), second) > 0, "the second turn should feed only the new message:\n{}", terminal.text());

    // A long answer, stopped by Ctrl-C; the chat goes on.
    terminal.type_keys("/set max_tokens 3000\r");
    at = terminal.wait_for("(set max_tokens)", at);
    at = terminal.wait_for(">>> ", at);
    terminal.type_keys("Tell me the whole story.\r");
    let asked = terminal.wait_for("story.", at);
    while terminal.len() < asked + 40 {
        std::thread::sleep(Duration::from_millis(10));
    }
    terminal.type_keys("\u{3}");
    at = terminal.wait_for(", stopped)", asked);
    at = terminal.wait_for(">>> ", at);

    terminal.type_keys("/bye\r");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = terminal.child.try_wait().expect("polling the chat") {
            break status;
        }
        assert!(Instant::now() < deadline, "/bye did not end the chat:\n{}", terminal.text());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}\n{}", terminal.text());
    let _ = at;
}

/// Lines typed ahead in one burst (pasted, or typed while an answer runs)
/// are each answered in turn: the line editor keeps what it read past the
/// first line for the next prompt.
#[test]
fn lines_typed_ahead_in_one_burst_are_each_answered() {
    let demo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/demo/model");
    let mut command = Command::new(env!("CARGO_BIN_EXE_slotstream"));
    command.arg("run").arg("--model").arg(demo).args(["--backend", "cpu", "--max-tokens", "4"]).env("TERM", "xterm");
    let mut terminal = Terminal::spawn(&mut command);

    let at = terminal.wait_for(">>> ", 0);
    terminal.type_keys("Where did the ship sail?\rWho was on it?\r/bye\r");
    let first = terminal.wait_for("prompt tokens, ", at);
    terminal.wait_for("prompt tokens, ", first);
    let deadline = Instant::now() + Duration::from_secs(30);
    while terminal.child.try_wait().expect("polling the chat").is_none() {
        assert!(Instant::now() < deadline, "the third line typed ahead (/bye) did not end the chat:\n{}", terminal.text());
        std::thread::sleep(Duration::from_millis(20));
    }
}
