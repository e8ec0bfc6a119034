//! Rendering a chat template: minijinja with transformers' settings, its
//! steps (fuel) and output bounded, in a child process of this program whose
//! memory is bounded (on every OS: its heap is capped) where
//! [`isolate_chat_templates`] was called (a template comes with a model,
//! which a client may pull). Without that call (library use, tests) a
//! template renders in the calling process, its steps and output bounded
//! but not its memory.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use serde::Serialize;

/// One rendering of a chat template: the template, the file it came from
/// (for errors), its variables, and its bounds.
#[derive(Serialize, serde::Deserialize)]
pub(super) struct TemplateJob {
    pub(super) template: String,
    pub(super) origin: String,
    pub(super) context: serde_json::Map<String, serde_json::Value>,
    pub(super) fuel: u64,
    /// Bytes of messages and tools, which the output may be twice of (plus a base).
    pub(super) input_bytes: usize,
    pub(super) messages: usize,
}

/// The executable that renders chat templates in a process of their own
/// (see [`isolate_chat_templates`]); unset, they render in this process.
pub(super) static TEMPLATE_RENDERER: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// The argument that makes this executable a chat template's renderer
/// ([`template_renderer_main`]).
pub const TEMPLATE_RENDERER_ARG: &str = "__render-chat-template";

/// Renders chat templates from now on in a child process of `exe` (this
/// program, which calls [`template_renderer_main`] when given
/// [`TEMPLATE_RENDERER_ARG`]) whose memory is bounded: minijinja bounds a
/// template's steps (fuel) and its output, but not the size of its values,
/// so a template that doubles a string 30 times would take gigabytes here.
pub fn isolate_chat_templates(exe: std::path::PathBuf) {
    let _ = TEMPLATE_RENDERER.set(exe);
}

/// Memory a chat template's renderer may use: a base, plus a multiple of the
/// messages' bytes for the copies the template makes. Every OS caps its heap
/// (the bytes of every value minijinja makes, through the process's
/// allocator); Linux bounds its data segment and private mappings as well
/// (`RLIMIT_DATA`, which macOS does not enforce). See [`crate::memory_cap::cap_memory`].
const TEMPLATE_MEMORY_BASE_BYTES: u64 = 256 << 20;
const TEMPLATE_MEMORY_PER_INPUT_BYTE: u64 = 16;

/// The renderer's side: reads a [`TemplateJob`] (JSON) from stdin under its
/// memory limit, writes the prompt to stdout, or an error to stderr (exit 2).
/// A template that needs more memory than the limit aborts the renderer.
pub fn template_renderer_main() -> std::process::ExitCode {
    use std::io::{Read, Write};
    let mut input = String::new();
    let rendered = std::io::stdin()
        .read_to_string(&mut input)
        .context("reading the chat template's job")
        .and_then(|_| serde_json::from_str::<TemplateJob>(&input).context("reading the chat template's job"))
        .and_then(|job| {
            drop(std::mem::take(&mut input));
            crate::memory_cap::cap_memory(TEMPLATE_MEMORY_BASE_BYTES + TEMPLATE_MEMORY_PER_INPUT_BYTE * job.input_bytes as u64)?;
            job.render()
        });
    match rendered {
        Ok(text) if std::io::stdout().write_all(text.as_bytes()).is_ok() => std::process::ExitCode::SUCCESS,
        Ok(_) => std::process::ExitCode::FAILURE,
        Err(e) => {
            let _ = std::io::stderr().write_all(format!("{e:#}\n").as_bytes());
            std::process::ExitCode::from(2)
        }
    }
}

impl TemplateJob {
    /// Renders in this process.
    pub(super) fn render(&self) -> Result<String> {
        let mut env = minijinja::Environment::new();
        // As transformers renders chat templates.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(self.fuel));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", python_tojson);
        let origin = &self.origin;
        let fix = "fix the template, or send the prompt raw (run --raw, \"raw\": true on /api/generate, /v1/completions)";
        env.add_template("chat", &self.template).with_context(|| format!("the chat template in {origin} does not parse; {fix}"))?;
        let tmpl = env.get_template("chat").context("loading the chat template")?;
        let ctx: std::collections::BTreeMap<&str, minijinja::Value> =
            self.context.iter().map(|(k, v)| (k.as_str(), minijinja::Value::from_serialize(v))).collect();
        let (input_bytes, limit) = (self.input_bytes, TEMPLATE_OUTPUT_BASE_BYTES + 2 * self.input_bytes);
        let mut out = BoundedText { text: Vec::new(), limit };
        let rendered = tmpl.render_captured_to(ctx, &mut out).map(|_| ());
        match rendered {
            Ok(()) => String::from_utf8(out.text).context("the chat template rendered text that is not UTF-8"),
            Err(e) if out.text.len() >= limit => Err(anyhow!(
                "the chat template in {origin} wrote over {limit} bytes for {input_bytes} bytes of messages; it is broken or hostile ({e})"
            )),
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => Err(anyhow!(
                "the chat template in {origin} did more work than {messages} message(s) can need and was stopped; it is broken or hostile",
                messages = self.messages
            )),
            Err(e) => Err(e).with_context(|| format!("rendering the chat template in {origin} (it refused these messages or is broken)")),
        }
    }

    /// Renders in a child process of `exe` under its memory limit.
    pub(super) fn render_isolated(&self, exe: &Path) -> Result<String> {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let origin = &self.origin;
        let mut child = Command::new(exe)
            .arg(TEMPLATE_RENDERER_ARG)
            // One that stops at its memory cap aborts: without a backtrace, which takes seconds and memory.
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} to render the chat template", exe.display()))?;
        let job = serde_json::to_vec(self)?;
        let mut stdin = child.stdin.take().context("the renderer's stdin")?;
        // Written from a thread while the output is read, so neither side waits on a full pipe.
        let writer = std::thread::spawn(move || stdin.write_all(&job));
        let output = child.wait_with_output().context("waiting for the chat template's renderer")?;
        let _ = writer.join();
        let stderr = String::from_utf8_lossy(&output.stderr);
        match output.status.code() {
            Some(0) => String::from_utf8(output.stdout).context("the chat template rendered text that is not UTF-8"),
            Some(2) => Err(anyhow!("{}", stderr.trim_end())),
            _ => {
                let limit = TEMPLATE_MEMORY_BASE_BYTES + TEMPLATE_MEMORY_PER_INPUT_BYTE * self.input_bytes as u64;
                Err(anyhow!(
                    "the chat template in {origin} needed more than {} MiB of memory for {} bytes of messages and was stopped; \
                     it is broken or hostile ({}: {})",
                    limit >> 20,
                    self.input_bytes,
                    output.status,
                    stderr.lines().find(|l| l.contains("memory allocation")).or_else(|| stderr.lines().next()).unwrap_or("no message")
                ))
            }
        }
    }
}

/// Work a chat template may do: a base plus an allowance per message (real
/// templates take a few hundred instructions per message; a template that
/// loops without end is stopped within about a second).
pub(super) const TEMPLATE_FUEL_BASE: u64 = 2_000_000;
pub(super) const TEMPLATE_FUEL_PER_MESSAGE: u64 = 10_000;
/// Bytes a chat template may write beyond twice its messages' size.
const TEMPLATE_OUTPUT_BASE_BYTES: usize = 1 << 20;

/// A rendered template, refusing to grow past `limit` bytes.
struct BoundedText {
    text: Vec<u8>,
    limit: usize,
}

impl std::io::Write for BoundedText {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + bytes.len() > self.limit {
            self.text.extend_from_slice(&bytes[..self.limit - self.text.len()]);
            return Err(std::io::Error::other("the chat template's output is over its limit"));
        }
        self.text.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `tojson` as transformers defines it for chat templates: Python's
/// `json.dumps` separators (`", "` and `": "`), non-ASCII kept as is.
fn python_tojson(value: minijinja::Value) -> std::result::Result<minijinja::Value, minijinja::Error> {
    struct PythonStyle;
    impl serde_json::ser::Formatter for PythonStyle {
        fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonStyle);
    serde::Serialize::serialize(&value, &mut ser)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(minijinja::Value::from_safe_string(text))
}

