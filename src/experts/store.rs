//! Where every routed expert's bytes live on disk, and reading them.
//!
//! An expert record is its three projections, each stored as one piece (plain
//! floats) or three (MLX affine: packed values, scales, biases). In mlx-lm's
//! stacked layout each expert's slice of a piece is contiguous; in transformers'
//! older layout each expert has its own tensors; in its newer one gate and up
//! share one stacked tensor, each expert's slice holding both halves. Reads
//! bypass the page cache (`O_DIRECT` on Linux, `F_NOCACHE` on macOS) so the
//! memory budget means what it says; where the file system refuses that,
//! plain reads are used and the summary says so.

use std::borrow::Cow;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use slotstream_backend::{ExpertLayout, ExpertMatrix, HostExpert, HostMatrix, MatrixData, MatrixFormat};

use crate::checkpoint::Checkpoint;
use crate::direct_io::{DirectFile, RangeBuf, ReadBuffers};

use super::coalesce::{self, Piece, PieceBuf};

/// The pieces of one projection: values, then scales and biases if quantized.
#[derive(Clone, Debug)]
struct ProjectionPieces {
    pieces: Vec<Piece>,
}

/// An expert read into memory: each piece a view of the read that brought
/// it (reads of neighbouring pieces join: [`coalesce`]).
pub struct ExpertRecord {
    pieces: Vec<PieceBuf>,
}

/// What [`ExpertStore::read_each`] hands over: one matrix of a record, or
/// a whole record.
pub enum Handover<'a> {
    Matrix(ExpertMatrix, &'a HostMatrix<'a>),
    Whole(&'a HostExpert<'a>),
}

/// Where [`ExpertStore::read_each`] is, for its `progress` callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Every read of the call is issued.
    Issued,
    /// Fewer of them are in flight than there are read threads: a thread
    /// would stand idle (right after `Issued` when there are that few).
    Draining,
    /// The last of them has landed (right after `Draining` when there are
    /// none); not said after a failed read.
    Landed,
}

/// Locations of all routed experts of a model and the means to read them.
pub struct ExpertStore {
    pub layout: ExpertLayout,
    pub experts_per_layer: usize,
    pub layers: usize,
    files: Vec<DirectFile>,
    /// `[layer][expert][projection]`, flattened.
    locations: Vec<ProjectionPieces>,
    /// Per MoE layer, its shared expert's projections where the caller asked
    /// for it and it is shaped and stored as the routed experts are (a pool
    /// slot can hold it); read as expert `experts_per_layer` of its layer.
    shared: Vec<Option<Vec<ProjectionPieces>>>,
    io: rayon::ThreadPool,
    pub record_bytes: u64,
    busy: std::sync::Mutex<Busy>,
    /// Where landed pieces' buffers go back once written, for later reads.
    buffers: Arc<ReadBuffers>,
}

/// How long at least one of the store's reads was in flight: the disk busy
/// on its behalf ([`ExpertStore::busy_seconds`]), and each read's own time.
#[derive(Default)]
struct Busy {
    in_flight: usize,
    since: Option<Instant>,
    seconds: f64,
    reads: ReadTimes,
}

/// Reads that have ended and their seconds in flight, summed: over the busy
/// seconds, how many reads were in flight on average.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReadTimes {
    pub reads: u64,
    pub seconds: f64,
}

/// One read counted in [`Busy`] until dropped (also when the read panics).
struct InFlight<'a>(&'a std::sync::Mutex<Busy>, Instant);

impl<'a> InFlight<'a> {
    fn start(busy: &'a std::sync::Mutex<Busy>) -> InFlight<'a> {
        if let Ok(mut b) = busy.lock() {
            if b.in_flight == 0 {
                b.since = Some(Instant::now());
            }
            b.in_flight += 1;
        }
        InFlight(busy, Instant::now())
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Ok(mut b) = self.0.lock() {
            b.in_flight = b.in_flight.saturating_sub(1);
            b.reads.reads += 1;
            b.reads.seconds += self.1.elapsed().as_secs_f64();
            if b.in_flight == 0 {
                if let Some(t) = b.since.take() {
                    b.seconds += t.elapsed().as_secs_f64();
                }
            }
        }
    }
}

/// How a checkpoint names its routed experts' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertTensors {
    /// transformers before 5: one tensor per expert and projection
    /// (`experts.{e}.gate_proj.weight`).
    PerExpert,
    /// mlx-lm: each projection stacked over the experts
    /// (`switch_mlp.gate_proj.weight` `[E, out, in]`, quantized or not).
    Stacked,
    /// transformers 5: gate and up fused and stacked (`experts.gate_up_proj`
    /// `[E, 2I, H]`, gate first) beside `experts.down_proj` `[E, H, I]`;
    /// unquantized.
    Fused,
}

fn per_proj_index(name: &str) -> usize {
    match name {
        "gate_proj" => 0,
        "up_proj" => 1,
        _ => 2,
    }
}

impl ExpertStore {
    /// Default number of read threads: reads in flight at once.
    pub const READ_THREADS: usize = 16;
    /// Default bound of the read buffers kept for reuse (a layer's misses of
    /// the flagship are ~40 MB; counted in the planner's runtime share).
    pub const KEEP_READ_BUFFERS: usize = 64 << 20;

    /// Finds every expert of every MoE layer in the checkpoint. `layer_prefixes`
    /// are the MoE blocks' module paths (`model.layers.{i}.mlp`), `tensors`
    /// how the checkpoint names them; `shared[i]`: also the shared expert
    /// `{prefix}.shared_expert` of layer i, where it is stored as the routed
    /// experts are.
    pub fn new(
        ck: &Checkpoint,
        layer_prefixes: &[String],
        tensors: ExpertTensors,
        experts: usize,
        hidden: usize,
        intermediate: usize,
        read_threads: usize,
        shared: &[bool],
    ) -> Result<ExpertStore> {
        let mut files: Vec<DirectFile> = Vec::new();
        let mut file_index = std::collections::HashMap::new();
        let mut locations = Vec::with_capacity(layer_prefixes.len() * experts * 3);
        let mut layout: Option<ExpertLayout> = None;
        let projections = [("gate_proj", intermediate, hidden), ("up_proj", intermediate, hidden), ("down_proj", hidden, intermediate)];
        for prefix in layer_prefixes {
            let mut formats = Vec::new();
            // Per projection: its name, its tensors' names (expert 0's where
            // each expert has its own) and which part of each expert's slice
            // it is (fused gate and up: half 0 and 1 of 2).
            let mut per_proj = Vec::new();
            for (name, rows, cols) in projections {
                let m = match tensors {
                    ExpertTensors::Stacked => ck.matrix_layout(&format!("{prefix}.switch_mlp.{name}"), &[experts], rows, cols)?,
                    ExpertTensors::PerExpert => ck.matrix_layout(&format!("{prefix}.experts.0.{name}"), &[], rows, cols)?,
                    ExpertTensors::Fused if name == "down_proj" => {
                        ck.dense_layout(&format!("{prefix}.experts.down_proj"), &[experts, rows, cols])?
                    }
                    ExpertTensors::Fused => ck.dense_layout(&format!("{prefix}.experts.gate_up_proj"), &[experts, 2 * rows, cols])?,
                };
                formats.push(m.format);
                let part = match (tensors, name) {
                    (ExpertTensors::Fused, "gate_proj") => (0, 2),
                    (ExpertTensors::Fused, "up_proj") => (1, 2),
                    _ => (0, 1),
                };
                per_proj.push((name, m.tensors, part));
            }
            let this = ExpertLayout { hidden, intermediate, gate: formats[0], up: formats[1], down: formats[2] };
            match &layout {
                None => layout = Some(this),
                Some(l) if *l == this => {}
                Some(l) => bail!(
                    "experts of '{prefix}' are stored as {this:?} but earlier layers as {l:?}; \
                     mixed per-layer expert formats are not supported yet"
                ),
            }
            for e in 0..experts {
                for (name, names, (part, parts)) in &per_proj {
                    let mut pieces = Vec::new();
                    for first in names {
                        let tensor = if tensors == ExpertTensors::PerExpert {
                            // Validates every expert's tensors, not just expert 0's.
                            let m = format!("{prefix}.experts.{e}.{name}");
                            if e > 0 && first.ends_with(".weight") {
                                let (rows, cols) = if *name == "down_proj" { (hidden, intermediate) } else { (intermediate, hidden) };
                                if ck.matrix_layout(&m, &[], rows, cols)?.format != formats[per_proj_index(name)] {
                                    bail!("expert {e} of '{prefix}' is stored differently from expert 0");
                                }
                            }
                            first.replacen(&format!("{prefix}.experts.0."), &format!("{prefix}.experts.{e}."), 1)
                        } else {
                            first.clone()
                        };
                        let entry = ck.entry(&tensor)?;
                        let fi = open_once(&mut files, &mut file_index, &ck.dir.join(ck.file_of(entry)))?;
                        let total = (entry.end - entry.start) as u64;
                        let (offset, len) = if tensors == ExpertTensors::PerExpert {
                            (entry.start as u64, total)
                        } else {
                            let per = total / experts as u64;
                            let len = per / *parts as u64;
                            (entry.start as u64 + e as u64 * per + *part as u64 * len, len)
                        };
                        pieces.push(Piece { file: fi, offset, len });
                    }
                    locations.push(ProjectionPieces { pieces });
                }
            }
        }
        let Some(layout) = layout else { bail!("the model has no MoE layers") };
        // Each flagged layer's shared expert, where it is stored as the routed ones.
        let mut shared_locations = Vec::with_capacity(layer_prefixes.len());
        let formats = [layout.gate, layout.up, layout.down];
        for (i, prefix) in layer_prefixes.iter().enumerate() {
            let mut found = Vec::with_capacity(3);
            for ((name, rows, cols), format) in projections.into_iter().zip(formats) {
                if !shared.get(i).copied().unwrap_or(false) {
                    break;
                }
                let Ok(m) = ck.matrix_layout(&format!("{prefix}.shared_expert.{name}"), &[], rows, cols) else { break };
                if m.format != format {
                    break;
                }
                let mut pieces = Vec::new();
                for tensor in &m.tensors {
                    let entry = ck.entry(tensor)?;
                    let file = open_once(&mut files, &mut file_index, &ck.dir.join(ck.file_of(entry)))?;
                    pieces.push(Piece { file, offset: entry.start as u64, len: (entry.end - entry.start) as u64 });
                }
                found.push(ProjectionPieces { pieces });
            }
            shared_locations.push((found.len() == 3).then_some(found));
        }
        let record_bytes = locations[..3.min(locations.len())].iter().flat_map(|p| &p.pieces).map(|p| p.len).sum();
        let io = rayon::ThreadPoolBuilder::new()
            .num_threads(read_threads.max(1))
            .thread_name(|i| format!("expert-read-{i}"))
            // A job spawned here (a read ahead) that panicked would abort the
            // process; instead its result never arrives, and the expert is
            // read again when it is needed.
            .panic_handler(|_| crate::note!("warning: an expert read-ahead job panicked; its experts will be read when needed"))
            .build()
            .context("starting the expert read threads")?;
        let layers = layer_prefixes.len();
        let busy = Default::default();
        let buffers = Arc::new(ReadBuffers::new(Self::KEEP_READ_BUFFERS));
        Ok(ExpertStore { layout, experts_per_layer: experts, layers, files, locations, shared: shared_locations, io, record_bytes, busy, buffers })
    }

    /// Keep at most `bytes` of landed pieces' buffers for later reads (0: a
    /// new buffer for every read, as before; for measurements).
    pub fn keep_read_buffers(&mut self, bytes: usize) {
        self.buffers = Arc::new(ReadBuffers::new(bytes));
    }

    /// The id under which [`ExpertStore::read_many`] reads a layer's shared
    /// expert, and the layers that have one it can read.
    pub fn shared_id(&self) -> u32 {
        self.experts_per_layer as u32
    }

    pub fn shared_layers(&self) -> Vec<usize> {
        (0..self.layers).filter(|&l| self.shared.get(l).is_some_and(Option::is_some)).collect()
    }

    /// One read (a piece of a record, or a span over several), counted in
    /// the busy clock while in flight.
    fn read_piece(&self, piece: &Piece) -> Result<RangeBuf> {
        let _in_flight = InFlight::start(&self.busy);
        self.files[piece.file as usize].read_range_in(piece.offset, piece.len as usize, Some(&self.buffers))
    }

    /// Seconds so far during which at least one of the store's reads was in
    /// flight (the running stretch included): against a decode's seconds,
    /// how long the disk stood idle between reads.
    pub fn busy_seconds(&self) -> f64 {
        self.busy.lock().map_or(0.0, |b| b.seconds + b.since.map_or(0.0, |t| t.elapsed().as_secs_f64()))
    }

    /// The reads ended so far and their seconds in flight, summed.
    pub fn read_times(&self) -> ReadTimes {
        self.busy.lock().map_or(ReadTimes::default(), |b| b.reads)
    }

    /// Whether reads bypass the page cache.
    pub fn direct_io(&self) -> bool {
        self.files.iter().all(|f| f.is_direct())
    }

    /// Reads several experts of one layer with many reads in flight (pieces
    /// of neighbouring experts joined where they lie close: [`coalesce`]);
    /// returns the records in order and the seconds spent.
    pub fn read_many(&self, layer: usize, experts: &[u32]) -> Result<(Vec<ExpertRecord>, f64)> {
        if experts.is_empty() {
            // Waking the read pool (16 threads that spin before they sleep)
            // for nothing costs compute threads their cores.
            return Ok((Vec::new(), 0.0));
        }
        let start = Instant::now();
        let (requests, pieces, reads) = self.plan_reads(layer, experts);
        let landed: Vec<RangeBuf> = self.io.install(|| {
            reads
                .par_iter()
                .map(|r| {
                    let first = experts[requests[r.parts[0].0].0];
                    self.read_piece(&r.span).with_context(|| format!("reading expert {first} of MoE layer {layer}"))
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let mut views: Vec<Option<PieceBuf>> = requests.iter().map(|_| None).collect();
        for (r, buf) in reads.iter().zip(landed) {
            for (n, view) in coalesce::split(buf, r, &pieces) {
                views[n] = Some(view);
            }
        }
        let mut records: Vec<ExpertRecord> = experts.iter().map(|_| ExpertRecord { pieces: Vec::with_capacity(9) }).collect();
        for ((i, _, _), view) in requests.iter().zip(views) {
            records[*i].pieces.extend(view);
        }
        Ok((records, start.elapsed().as_secs_f64()))
    }

    /// [`ExpertStore::requests`], their pieces, and the reads that cover them.
    #[allow(clippy::type_complexity)]
    fn plan_reads(&self, layer: usize, experts: &[u32]) -> (Vec<(usize, usize, &Piece)>, Vec<&Piece>, Vec<coalesce::Read>) {
        let requests = self.requests(layer, experts);
        let pieces: Vec<&Piece> = requests.iter().map(|r| r.2).collect();
        let reads = coalesce::plan(&pieces, coalesce::JOIN_GAP, coalesce::MAX_READ);
        (requests, pieces, reads)
    }

    /// Expert `e` of `layer`'s projections ([`ExpertStore::shared_id`]: its
    /// shared expert's; none where it has none or `e` is out of range).
    fn projections(&self, layer: usize, e: u32) -> &[ProjectionPieces] {
        if e == self.shared_id() {
            return self.shared.get(layer).and_then(|s| s.as_deref()).unwrap_or(&[]);
        }
        let base = (layer * self.experts_per_layer + e as usize) * 3;
        self.locations.get(base..base + 3).unwrap_or(&[])
    }

    /// Every piece of `experts` of `layer`, in record order: (index into
    /// `experts`, matrix (gate 0, up 1, down 2), piece).
    fn requests(&self, layer: usize, experts: &[u32]) -> Vec<(usize, usize, &Piece)> {
        experts
            .iter()
            .enumerate()
            .flat_map(|(i, &e)| {
                self.projections(layer, e).iter().enumerate().flat_map(move |(m, p)| p.pieces.iter().map(move |piece| (i, m, piece)))
            })
            .collect()
    }

    /// [`ExpertStore::read_many`] on the read threads, queued behind the
    /// reads already issued there (an expert read ahead of its layer): the
    /// records and the seconds the reads took arrive on the channel.
    pub fn read_later(self: &Arc<Self>, layer: usize, experts: Vec<u32>) -> Receiver<Result<(Vec<ExpertRecord>, f64)>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let store = Arc::clone(self);
        self.io.spawn(move || {
            // Nobody waits when the guess went unused.
            let _ = tx.send(store.read_many(layer, &experts));
        });
        rx
    }

    /// [`ExpertStore::read_many`] that hands each matrix of each record to
    /// `each` (with the record's index into `experts`) on this thread as
    /// soon as its last piece lands, while the other reads go on: what the
    /// caller does with a matrix (an upload into its slot) overlaps the
    /// reads, and little is left to do once the last piece has landed. Once
    /// the reads are issued, `progress(Issued)` runs, `progress(Draining)`
    /// once a read thread would stand idle and `progress(Landed)` as the last
    /// lands, each before the landed matrix is handed over (what the disk
    /// should read next can go out then); the records `ready` gives (read
    /// elsewhere) go to `each` whole, as indices `experts.len()..`, as soon
    /// as `ready(false)` has them (`None`: not yet; asked between landings),
    /// or at the end from `ready(true)`, which waits. With `as_landed` off,
    /// the handover is the earlier one (for measurements): `ready(true)`
    /// first, then each record whole once its last piece has landed.
    /// Returns the seconds until the last piece landed (what `each` did
    /// after that is not counted). After an error nothing further is handed
    /// over.
    pub fn read_each(
        &self,
        layer: usize,
        experts: &[u32],
        as_landed: bool,
        mut ready: impl FnMut(bool) -> Option<Result<Vec<ExpertRecord>>>,
        mut progress: impl FnMut(Progress),
        mut each: impl FnMut(usize, Handover<'_>) -> Result<()>,
    ) -> Result<f64> {
        let mut handed = false;
        let mut hand_ready = |block: bool, each: &mut dyn FnMut(usize, Handover<'_>) -> Result<()>| -> Result<()> {
            if handed {
                return Ok(());
            }
            let records = match ready(block) {
                Some(records) => records?,
                None if block => bail!("the experts read ahead for MoE layer {layer} never came"),
                None => return Ok(()),
            };
            handed = true;
            records.iter().enumerate().try_for_each(|(j, r)| each(experts.len() + j, Handover::Whole(&self.host_expert(r))))
        };
        if experts.is_empty() {
            progress(Progress::Issued);
            progress(Progress::Draining);
            progress(Progress::Landed);
            hand_ready(true, &mut each)?;
            return Ok(0.0);
        }
        let start = Instant::now();
        let (requests, pieces, reads) = self.plan_reads(layer, experts);
        // Each matrix's pieces are consecutive requests: (first, count), by
        // 3 * record + matrix. A group (a matrix, or without `as_landed` a
        // record) is handed over once none of its pieces is left in flight.
        let group = |i: usize, m: usize| if as_landed { 3 * i + m } else { i };
        let mut spans = vec![(0usize, 0usize); 3 * experts.len()];
        let mut left = vec![0usize; 3 * experts.len()];
        for (n, &(i, m, _)) in requests.iter().enumerate() {
            let span = &mut spans[3 * i + m];
            if span.1 == 0 {
                span.0 = n;
            }
            span.1 += 1;
            left[group(i, m)] += 1;
        }
        // A matrix with nothing to read would never be handed over.
        if let Some(g) = spans.iter().position(|s| s.1 == 0) {
            bail!("expert {} of MoE layer {layer} has no stored {:?} matrix", experts[g / 3], ExpertMatrix::ALL[g % 3]);
        }
        let mut landed: Vec<Option<PieceBuf>> = requests.iter().map(|_| None).collect();
        let mut outcome = Ok(());
        let mut landed_at = 0.0;
        let (tx, rx) = std::sync::mpsc::channel();
        self.io.in_place_scope(|scope| {
            for (k, r) in reads.iter().enumerate() {
                let tx = tx.clone();
                let first = experts[requests[r.parts[0].0].0];
                scope.spawn(move |_| {
                    let read = self.read_piece(&r.span).with_context(|| format!("reading expert {first} of MoE layer {layer}"));
                    // The receiver outlives every read of the scope.
                    let _ = tx.send((k, read, Instant::now()));
                });
            }
            drop(tx);
            progress(Progress::Issued);
            let threads = self.io.current_num_threads();
            let mut in_flight = reads.len();
            let mut draining = in_flight < threads;
            if draining {
                progress(Progress::Draining);
            }
            outcome = hand_ready(!as_landed, &mut each);
            for (k, read, at) in rx {
                in_flight -= 1;
                if outcome.is_err() {
                    continue;
                }
                if !draining && in_flight < threads && read.is_ok() {
                    draining = true;
                    progress(Progress::Draining);
                }
                if in_flight == 0 && read.is_ok() {
                    progress(Progress::Landed);
                }
                // When the read landed, not when this thread got to it.
                landed_at = f64::max(landed_at, at.duration_since(start).as_secs_f64());
                let buf = match read {
                    Err(e) => {
                        outcome = Err(e);
                        continue;
                    }
                    Ok(buf) => buf,
                };
                for (n, view) in coalesce::split(buf, &reads[k], &pieces) {
                    if outcome.is_err() {
                        break;
                    }
                    landed[n] = Some(view);
                    let (i, m, _) = requests[n];
                    let g = group(i, m);
                    left[g] -= 1;
                    if left[g] == 0 {
                        // A matrix's pieces, or a record's (its matrices' spans are consecutive).
                        let (first, last) = if as_landed { (3 * i + m, 3 * i + m) } else { (3 * i, 3 * i + 2) };
                        let pieces: Vec<PieceBuf> =
                            landed[spans[first].0..spans[last].0 + spans[last].1].iter_mut().filter_map(Option::take).collect();
                        let which = ExpertMatrix::ALL[m];
                        outcome = if as_landed {
                            each(i, Handover::Matrix(which, &self.host_matrix(which, &pieces)))
                        } else {
                            each(i, Handover::Whole(&self.host_expert(&ExpertRecord { pieces })))
                        };
                        // Between handovers, as between landings.
                        if outcome.is_ok() {
                            outcome = hand_ready(false, &mut each);
                        }
                    }
                }
                if outcome.is_ok() {
                    outcome = hand_ready(false, &mut each);
                }
            }
            if outcome.is_ok() {
                outcome = hand_ready(true, &mut each);
            }
        });
        outcome?;
        Ok(landed_at)
    }

    /// Views a record as the host matrices the backend takes.
    pub fn host_expert<'a>(&self, r: &'a ExpertRecord) -> HostExpert<'a> {
        let l = &self.layout;
        let (g, u) = (pieces_of(l.gate), pieces_of(l.up));
        let n = r.pieces.len();
        let span = |a: usize, b: usize| &r.pieces[a.min(n)..b.min(n)];
        HostExpert {
            gate: self.host_matrix(ExpertMatrix::Gate, span(0, g)),
            up: self.host_matrix(ExpertMatrix::Up, span(g, g + u)),
            down: self.host_matrix(ExpertMatrix::Down, span(g + u, n)),
        }
    }

    /// Views one matrix's pieces (values, then scales and biases where
    /// quantized) as the host matrix the backend takes.
    fn host_matrix<'a>(&self, which: ExpertMatrix, pieces: &'a [PieceBuf]) -> HostMatrix<'a> {
        let l = &self.layout;
        let (rows, cols, format) = match which {
            ExpertMatrix::Gate => (l.intermediate, l.hidden, l.gate),
            ExpertMatrix::Up => (l.intermediate, l.hidden, l.up),
            ExpertMatrix::Down => (l.hidden, l.intermediate, l.down),
        };
        let mut pieces = pieces.iter();
        let mut take = || Cow::Borrowed(pieces.next().map(|p| p.bytes()).unwrap_or(&[]));
        let data = match format {
            MatrixFormat::Dense(dtype) => MatrixData::Dense { dtype, bytes: take() },
            MatrixFormat::Affine { bits, group_size, scale_dtype } => {
                let words = take();
                let scales = take();
                let biases = take();
                MatrixData::Affine { bits, group_size, words, scale_dtype, scales, biases }
            }
        };
        HostMatrix { experts: 1, rows, cols, data }
    }
}

/// Pieces of a matrix stored in `format`: its values, plus scales and
/// biases where quantized.
fn pieces_of(format: MatrixFormat) -> usize {
    match format {
        MatrixFormat::Dense(_) => 1,
        MatrixFormat::Affine { .. } => 3,
    }
}

/// The index of the file at `path` in `files`, opened on first use.
fn open_once(files: &mut Vec<DirectFile>, index: &mut std::collections::HashMap<std::path::PathBuf, u32>, path: &std::path::Path) -> Result<u32> {
    if let Some(&i) = index.get(path) {
        return Ok(i);
    }
    files.push(DirectFile::open(path)?);
    let i = (files.len() - 1) as u32;
    index.insert(path.to_path_buf(), i);
    Ok(i)
}
