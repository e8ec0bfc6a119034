//! Weight matrices and the expert pool in device memory.
//!
//! A weight is split by rows into shards that each fit one storage binding
//! (`max_storage_buffer_binding_size`: 128 MiB on lavapipe, 2 GiB on an H200).
//! A shard is one buffer: the packed rows, then (affine) the scales and the
//! biases in their stored precision, laid out as `wgsl/weights.wgsl` reads
//! them. The expert pool is sharded the same way by slots.

use slotstream_backend::{shape_error, BackendError, DType, ExpertMatrix, HostMatrix, MatrixData, MatrixFormat, Result};
use wgpu::WriteOnly;

use crate::gpu::{Claim, Gpu, Held};
use crate::options::Q4Layout;
use crate::params::{WeightDesc, NO_SLOT};
use crate::parts::fill_rows;

/// `fmt` of interleaved 4-bit rows (see `wgsl/weights.wgsl`).
const FMT_Q4_INTERLEAVED: u32 = 4;

impl WeightDesc {
    /// Whether the shard holds interleaved 4-bit rows (the int8 and eight-row kernels' format).
    pub fn is_interleaved_q4(&self) -> bool {
        self.fmt == FMT_Q4_INTERLEAVED
    }
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

fn pad16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// How one row of a matrix is stored on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    fmt: u32,
    bits: u32,
    group_size: u32,
    scale_kind: u32,
    cols: usize,
    /// Bytes of packed values per row (a multiple of 16).
    value_bytes: usize,
    /// Bytes of scales (and of biases) per row.
    scale_bytes: usize,
}

impl RowLayout {
    pub fn new(format: MatrixFormat, cols: usize) -> Result<RowLayout> {
        let layout = match format {
            MatrixFormat::Dense(d) => RowLayout {
                fmt: dtype_code(d),
                bits: 8 * d.size() as u32,
                group_size: 1,
                scale_kind: 0,
                cols,
                value_bytes: cols * d.size(),
                scale_bytes: 0,
            },
            MatrixFormat::Affine { bits, group_size, scale_dtype } => {
                if !matches!(bits, 2 | 4 | 8) || group_size == 0 || cols % group_size != 0 || group_size % 32 != 0 {
                    return Err(BackendError::Unsupported(format!(
                        "the wgpu backend supports 2/4/8-bit affine weights with group sizes that are multiples of 32 \
                         (got {bits} bits, group size {group_size}, {cols} columns)"
                    )));
                }
                RowLayout {
                    fmt: 3,
                    bits,
                    group_size: group_size as u32,
                    scale_kind: dtype_code(scale_dtype),
                    cols,
                    value_bytes: cols * bits as usize / 8,
                    scale_bytes: cols / group_size * scale_dtype.size(),
                }
            }
        };
        if layout.value_bytes % 16 != 0 {
            return Err(BackendError::Unsupported(format!(
                "the wgpu backend needs rows of a multiple of 16 bytes; {cols} columns of {format:?} are {} bytes",
                layout.value_bytes
            )));
        }
        Ok(layout)
    }

    /// The layout of a standalone weight (not an expert pool slot): 4-bit
    /// affine rows with 16-bit scales are stored interleaved (fmt 4, see
    /// `wgsl/weights.wgsl`) unless `q4` asks for the MLX order.
    pub fn for_weight(format: MatrixFormat, cols: usize, q4: Q4Layout) -> Result<RowLayout> {
        let mut layout = RowLayout::new(format, cols)?;
        if layout.fmt == 3 && layout.bits == 4 && matches!(layout.scale_kind, 1 | 2) && q4 == Q4Layout::Interleaved {
            layout.fmt = FMT_Q4_INTERLEAVED;
        }
        Ok(layout)
    }

    /// Bytes one row takes in a shard, padding aside.
    fn row_bytes(&self) -> usize {
        self.value_bytes + 2 * self.scale_bytes
    }

    /// Offsets (in u32 words) of the scales and biases in a shard of `rows`
    /// rows (fmt 4: both the offset of the (scale, bias) pairs).
    fn offsets(&self, rows: usize) -> (usize, usize) {
        let values = rows * self.value_bytes;
        if self.fmt == FMT_Q4_INTERLEAVED {
            return (values / 4, values / 4);
        }
        let scales = pad16(rows * self.scale_bytes);
        (values / 4, (values + scales) / 4)
    }

    /// Bytes of a shard of `rows` rows, padding included.
    fn shard_bytes(&self, rows: usize) -> usize {
        if self.fmt == FMT_Q4_INTERLEAVED {
            return pad16(rows * self.value_bytes + 2 * rows * self.scale_bytes);
        }
        rows * self.value_bytes + 2 * pad16(rows * self.scale_bytes)
    }

    /// The `WeightDesc` of a shard of `rows` rows.
    pub fn desc(&self, rows: usize) -> WeightDesc {
        let (s, b) = self.offsets(rows);
        WeightDesc {
            fmt: self.fmt,
            bits: self.bits,
            group_size: self.group_size,
            scale_kind: self.scale_kind,
            cols: self.cols as u32,
            row_words: (self.value_bytes / 4) as u32,
            scales_off: s as u32,
            biases_off: b as u32,
        }
    }
}

/// Rows `[row_start, row_start + rows)` of a weight in one buffer.
pub struct Shard {
    pub buffer: wgpu::Buffer,
    pub row_start: usize,
    pub rows: usize,
    pub desc: WeightDesc,
}

/// A `[experts, rows, cols]` weight owned by the wgpu backend; rows of all
/// experts are numbered consecutively across shards.
pub struct GpuWeight {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub shards: Vec<Shard>,
    pub bytes: usize,
    /// The shards' bytes in the device's ledger.
    _claim: Claim,
}

/// The stored bytes of a host matrix: (values, scales, biases).
fn host_parts<'a>(m: &'a HostMatrix<'_>) -> (&'a [u8], &'a [u8], &'a [u8]) {
    match &m.data {
        MatrixData::Dense { bytes, .. } => (bytes, &[], &[]),
        MatrixData::Affine { words, scales, biases, .. } => (words, scales, biases),
    }
}

/// The interleaved (fmt 4) order of one 4-bit row's u32 words: destination
/// word `4c + k` of 16-byte chunk `c` (tile `j = c / 32`, lane `v = c % 32`,
/// `t` chunks in the tile) holds MLX word `128j + t*k + v`, i.e. columns
/// `1024j + 8tk + 8v .. +8`. Consecutive chunks then cover consecutive runs of
/// 8 columns, so the lanes of a subgroup that read one chunk each read x
/// contiguously.
/// `dst` takes the row's whole 16-byte chunks (`src.len() / 16 * 16` bytes).
pub fn interleave_q4_row(src: &[u8], dst: &mut [u8]) {
    let chunks = src.len() / 16;
    // Tile by tile (32 chunks; the last may have fewer, `t`), chunk v of a
    // tile takes the tile's words v, t + v, 2t + v and 3t + v: streaming
    // writes every missed expert through here, and a transpose of whole
    // tiles runs ~2x faster than a lookup per word.
    let mut c0 = 0;
    while c0 < chunks {
        let t = 32.min(chunks - c0);
        let (s, d) = (&src[16 * c0..16 * (c0 + t)], &mut dst[16 * c0..16 * (c0 + t)]);
        for (v, chunk) in d.chunks_exact_mut(16).enumerate() {
            for k in 0..4 {
                let w = 4 * (t * k + v);
                chunk[4 * k..4 * k + 4].copy_from_slice(&s[w..w + 4]);
            }
        }
        c0 += t;
    }
}

/// Writes the shard bytes for rows `[r0, r1)` of `m` into `dst` (exactly
/// `layout.shard_bytes(r1 - r0)` bytes, padding zeroed) a row at a time, so
/// the image is never built in host memory of its own: `dst` is the
/// upload's staging.
fn write_shard(layout: &RowLayout, m: &HostMatrix<'_>, r0: usize, r1: usize, dst: &mut WriteOnly<'_, [u8]>) {
    let (values, scales, biases) = host_parts(m);
    let (vb, sb, rows) = (layout.value_bytes, layout.scale_bytes, r1 - r0);
    if layout.fmt == FMT_Q4_INTERLEAVED {
        write_q4_values(&values[r0 * vb..r1 * vb], vb, &mut dst.slice(..rows * vb));
        // (scale, bias) pairs, one u32 per group: the scale in the low half.
        write_pairs(&scales[r0 * sb..r1 * sb], &biases[r0 * sb..r1 * sb], &mut dst.slice(rows * vb..rows * vb + 2 * rows * sb));
        dst.slice(rows * vb + 2 * rows * sb..).fill(0);
        return;
    }
    dst.slice(..rows * vb).copy_from_slice(&values[r0 * vb..r1 * vb]);
    if sb > 0 {
        let (n, padded) = (rows * sb, pad16(rows * sb));
        for (k, part) in [scales, biases].into_iter().enumerate() {
            let at = rows * vb + k * padded;
            dst.slice(at..at + n).copy_from_slice(&part[r0 * sb..r1 * sb]);
            dst.slice(at + n..at + padded).fill(0);
        }
    }
}

/// 4-bit rows of `vb` bytes each from `values`, interleaved, into `dst`.
fn write_q4_values(values: &[u8], vb: usize, dst: &mut WriteOnly<'_, [u8]>) {
    let mut row = vec![0u8; vb];
    for (r, src) in values.chunks_exact(vb).enumerate() {
        interleave_q4_row(src, &mut row);
        dst.slice(r * vb..(r + 1) * vb).copy_from_slice(&row);
    }
}

/// The interleaved layout's (scale, bias) pair words of `scales` and
/// `biases` (16-bit each) into `dst`, 4 KiB of scales at a time.
fn write_pairs(scales: &[u8], biases: &[u8], dst: &mut WriteOnly<'_, [u8]>) {
    const RUN: usize = 4096;
    let mut run = Vec::with_capacity(2 * RUN);
    for (k, (sc, bi)) in scales.chunks(RUN).zip(biases.chunks(RUN)).enumerate() {
        run.clear();
        for (s, b) in sc.chunks_exact(2).zip(bi.chunks_exact(2)) {
            run.extend_from_slice(&[s[0], s[1], b[0], b[1]]);
        }
        dst.slice(2 * RUN * k..2 * RUN * k + run.len()).copy_from_slice(&run);
    }
}

impl GpuWeight {
    pub fn upload(gpu: &Gpu, m: &HostMatrix<'_>, q4: Q4Layout) -> Result<GpuWeight> {
        m.validate()?;
        let layout = RowLayout::for_weight(MatrixFormat::of(m), m.cols, q4)?;
        let total_rows = m.experts * m.rows;
        let per_shard = (gpu.max_shard() as usize - 64) / layout.row_bytes().max(1);
        if per_shard == 0 {
            return Err(BackendError::Unsupported(format!(
                "one row of {} bytes exceeds the adapter's storage binding limit",
                layout.row_bytes()
            )));
        }
        let mut shards = Vec::new();
        let mut bytes = 0;
        let mut r0 = 0;
        while r0 < total_rows {
            let r1 = (r0 + per_shard).min(total_rows);
            let len = layout.shard_bytes(r1 - r0);
            bytes += len;
            let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
            let buffer = gpu.buffer_filled("weight", len, usage, |dst| write_shard(&layout, m, r0, r1, dst))?;
            gpu.staged(len as u64)?;
            shards.push(Shard { buffer, row_start: r0, rows: r1 - r0, desc: layout.desc(r1 - r0) });
            r0 = r1;
        }
        let _claim = gpu.ledger.claim(Held::Weights, shards.iter().map(|s| s.buffer.size()).sum());
        Ok(GpuWeight { experts: m.experts, rows: m.rows, cols: m.cols, shards, bytes, _claim })
    }
}

/// One matrix kind (gate, up or down) of the expert pool, sharded by slots.
pub struct PoolMatrix {
    pub layout: RowLayout,
    /// Rows of one expert matrix.
    pub rows: usize,
    pub buffers: Vec<wgpu::Buffer>,
    _claim: Claim,
}

impl PoolMatrix {
    fn new(gpu: &Gpu, format: MatrixFormat, rows: usize, cols: usize, slots: usize, per_shard: usize, q4: Q4Layout) -> Result<PoolMatrix> {
        let layout = RowLayout::for_weight(format, cols, q4)?;
        if (rows * layout.scale_bytes) % 4 != 0 {
            return Err(BackendError::Unsupported(format!(
                "expert matrices of {rows} rows with {} scale bytes per row do not fill whole words",
                layout.scale_bytes
            )));
        }
        let mut usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
        if gpu.mapped_primary {
            usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::MAP_WRITE;
        }
        let mut buffers = Vec::new();
        let mut s0 = 0;
        while s0 < slots {
            let n = per_shard.min(slots - s0);
            buffers.push(gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("expert pool"),
                size: pad16(layout.shard_bytes(n * rows)) as u64,
                usage,
                mapped_at_creation: false,
            }));
            s0 += n;
        }
        let _claim = gpu.ledger.claim(Held::ExpertPool, buffers.iter().map(|b| b.size()).sum());
        Ok(PoolMatrix { layout, rows, buffers, _claim })
    }

    fn slot_bytes(&self) -> usize {
        self.rows * self.layout.row_bytes()
    }

    /// Writes one expert's matrix into `slot` (local to shard `shard` of
    /// `shard_slots` slots) from its row `row_off` on (the up half of a
    /// gate-and-up matrix starts at `rows / 2`).
    fn write(&self, gpu: &Gpu, shard: usize, local: usize, shard_slots: usize, m: &HostMatrix<'_>, row_off: usize) -> Result<()> {
        m.validate()?;
        let q4 = if self.layout.fmt == FMT_Q4_INTERLEAVED { Q4Layout::Interleaved } else { Q4Layout::Mlx };
        let format = RowLayout::for_weight(MatrixFormat::of(m), m.cols, q4)?;
        if format != self.layout || row_off + m.rows > self.rows || m.experts != 1 {
            return Err(shape_error(
                "write_expert",
                format!("a [{} x {}] {:?} matrix does not fit the pool's [{} x {}] {:?} slots", m.rows, m.cols, MatrixFormat::of(m), self.rows, self.layout.cols, self.layout),
            ));
        }
        let buffer = &self.buffers[shard];
        let (values, scales, biases) = host_parts(m);
        let rows_in_shard = shard_slots * self.rows;
        let (s_off, b_off) = self.layout.offsets(rows_in_shard);
        let first_row = local * self.rows + row_off;
        if self.layout.fmt == FMT_Q4_INTERLEAVED {
            // Interleaved rows, then one (scale, bias) pair word per group (as `write_shard`).
            let (vb, sb) = (self.layout.value_bytes, self.layout.scale_bytes);
            let part = gpu.pool_write_part;
            gpu.write_pool(buffer, (first_row * vb) as u64, m.rows * vb, |dst| fill_rows(values, vb, dst, vb, part, |s, d| write_q4_values(s, vb, d)))?;
            let at = s_off as u64 * 4 + (2 * first_row * sb) as u64;
            return gpu.write_pool(buffer, at, 2 * m.rows * sb, |dst| write_pairs(scales, biases, dst));
        }
        let copy = |at: u64, bytes: &[u8]| gpu.write_pool(buffer, at, bytes.len(), |dst| dst.copy_from_slice(bytes));
        let vb = self.layout.value_bytes;
        let part = gpu.pool_write_part;
        gpu.write_pool(buffer, (first_row * vb) as u64, values.len(), |dst| fill_rows(values, vb, dst, vb, part, |s, d| d.copy_from_slice(s)))?;
        if self.layout.scale_bytes > 0 {
            let at = (first_row * self.layout.scale_bytes) as u64;
            copy(s_off as u64 * 4 + at, scales)?;
            copy(b_off as u64 * 4 + at, biases)?;
        }
        Ok(())
    }
}

/// The wgpu backend's expert slot pool. Each slot's gate and up matrices
/// sit side by side in one matrix (`gate_up`: gate rows, then up rows), so
/// one dispatch computes both and their SwiGLU product.
pub struct GpuPool {
    pub gate_up: PoolMatrix,
    pub down: PoolMatrix,
    /// Rows of one expert's gate (and of its up) matrix.
    pub intermediate: usize,
    pub slots: usize,
    /// Slots per shard (the last shard may hold fewer).
    pub per_shard: usize,
    /// The slot table: u32 slot of each key, `NO_SLOT` for none.
    pub table: wgpu::Buffer,
    /// The host's copy of the slot table, as of the last recorded mapping:
    /// which shards a layer's experts are in.
    host_table: Vec<u32>,
}

impl GpuPool {
    /// A pool of `slots` experts for a slot table of `keys` (layers x
    /// experts). When it holds every expert, 4-bit matrices with 16-bit scales
    /// are kept interleaved (fmt 4, as standalone weights; faster to read)
    /// unless `q4` asks for the MLX order. A streaming pool keeps the MLX order:
    /// its slots are rewritten on every miss, and interleaving costs the host
    /// a permuting copy of every byte read from disk.
    pub fn new(gpu: &Gpu, hidden: usize, inter: usize, formats: [MatrixFormat; 3], slots: usize, keys: usize, q4: Q4Layout) -> Result<GpuPool> {
        let q4 = if slots >= keys { q4 } else { Q4Layout::Mlx };
        if formats[0] != formats[1] {
            return Err(BackendError::Unsupported(format!(
                "the experts' gate and up projections are stored differently ({:?} and {:?}); the wgpu backend \
                 keeps them in one matrix and needs them alike (--backend cpu runs such checkpoints)",
                formats[0], formats[1]
            )));
        }
        let probe = [RowLayout::new(formats[0], hidden)?, RowLayout::new(formats[2], inter)?];
        let largest = (probe[0].row_bytes() * 2 * inter).max(probe[1].row_bytes() * hidden);
        let per_shard = ((gpu.max_shard() as usize - 64) / largest.max(1)).min(slots.max(1));
        if per_shard == 0 {
            return Err(BackendError::Unsupported(format!(
                "one expert matrix of {largest} bytes exceeds the adapter's storage binding limit"
            )));
        }
        Ok(GpuPool {
            gate_up: PoolMatrix::new(gpu, formats[0], 2 * inter, hidden, slots, per_shard, q4)?,
            down: PoolMatrix::new(gpu, formats[2], hidden, inter, slots, per_shard, q4)?,
            intermediate: inter,
            slots,
            per_shard,
            table: gpu.buffer_with(
                "slot table",
                &vec![0xff; 4 * keys.max(1)],
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            )?,
            host_table: vec![NO_SLOT; keys],
        })
    }

    /// Records slot table entries `[key, slot or NO_SLOT]` in the host's copy
    /// (the device's are set by `moe::map`; the caller checked the keys).
    pub fn mapped(&mut self, entries: &[[u32; 2]]) {
        for &[key, slot] in entries {
            if let Some(e) = self.host_table.get_mut(key as usize) {
                *e = slot;
            }
        }
    }

    /// Whether the host's copy of the slot table maps `key` to a slot.
    pub fn maps(&self, key: usize) -> bool {
        self.host_table.get(key).is_some_and(|&s| s != NO_SLOT)
    }

    /// The shards holding the slots of keys `[key_base, key_base + keys)` (a
    /// layer's experts): every shard from the first to the last that holds
    /// one of them, none when none has a slot. A pool that holds the model
    /// keeps each layer's experts in consecutive slots, so a layer is in one
    /// shard, or two where a shard ends inside it.
    pub fn shards_of(&self, key_base: usize, keys: usize) -> std::ops::Range<usize> {
        if self.shards() == 1 {
            return 0..1;
        }
        let end = (key_base + keys).min(self.host_table.len());
        let mapped = self.host_table.get(key_base..end).unwrap_or_default().iter().filter(|&&s| s != NO_SLOT);
        let (lo, hi) = mapped.fold((usize::MAX, 0), |(lo, hi), &s| {
            let shard = s as usize / self.per_shard;
            (lo.min(shard), hi.max(shard + 1))
        });
        if lo > hi {
            0..0
        } else {
            lo..hi
        }
    }

    pub fn bytes(&self) -> usize {
        (self.gate_up.slot_bytes() + self.down.slot_bytes()) * self.slots
    }

    /// Bytes of a slot's larger matrix (gate and up, or down): what one
    /// shard holds a whole number of.
    pub fn largest_slot_matrix(&self) -> usize {
        self.gate_up.slot_bytes().max(self.down.slot_bytes())
    }

    /// Slots held by shard `shard`.
    pub fn shard_slots(&self, shard: usize) -> usize {
        self.per_shard.min(self.slots - shard * self.per_shard)
    }

    pub fn shards(&self) -> usize {
        self.down.buffers.len()
    }

    /// Writes an expert into `slot` (none of its matrices is staged unless
    /// all three fit); its copies go out as `Gpu::pool_written` says.
    pub fn write(&self, gpu: &Gpu, slot: usize, gate: &HostMatrix<'_>, up: &HostMatrix<'_>, down: &HostMatrix<'_>) -> Result<()> {
        self.check_matrix(slot, ExpertMatrix::Gate, gate)?;
        self.check_matrix(slot, ExpertMatrix::Up, up)?;
        self.check_matrix(slot, ExpertMatrix::Down, down)?;
        self.stage_matrix(gpu, slot, ExpertMatrix::Gate, gate)?;
        self.stage_matrix(gpu, slot, ExpertMatrix::Up, up)?;
        self.stage_matrix(gpu, slot, ExpertMatrix::Down, down)?;
        gpu.pool_written()
    }

    /// Writes one of an expert's matrices into `slot`; its copy goes out as
    /// `Gpu::pool_written` says.
    pub fn write_matrix(&self, gpu: &Gpu, slot: usize, which: ExpertMatrix, m: &HostMatrix<'_>) -> Result<()> {
        self.check_matrix(slot, which, m)?;
        self.stage_matrix(gpu, slot, which, m)?;
        gpu.pool_written()
    }

    /// The slot exists and `m` has the rows of the pool's `which` matrices
    /// (`PoolMatrix::write` checks the rest of its shape).
    fn check_matrix(&self, slot: usize, which: ExpertMatrix, m: &HostMatrix<'_>) -> Result<()> {
        if slot >= self.slots {
            return Err(shape_error("write_expert", format!("slot {slot} of a pool of {}", self.slots)));
        }
        let rows = if which == ExpertMatrix::Down { self.down.rows } else { self.intermediate };
        if m.rows != rows {
            return Err(shape_error("write_expert", format!("a {which:?} matrix of {} rows for a pool's of {rows}", m.rows)));
        }
        Ok(())
    }

    /// Stages a matrix [`GpuPool::check_matrix`] passed.
    fn stage_matrix(&self, gpu: &Gpu, slot: usize, which: ExpertMatrix, m: &HostMatrix<'_>) -> Result<()> {
        let (shard, local) = (slot / self.per_shard, slot % self.per_shard);
        let n = self.shard_slots(shard);
        match which {
            ExpertMatrix::Gate => self.gate_up.write(gpu, shard, local, n, m, 0),
            ExpertMatrix::Up => self.gate_up.write(gpu, shard, local, n, m, self.intermediate),
            ExpertMatrix::Down => self.down.write(gpu, shard, local, n, m, 0),
        }
    }
}

impl PoolMatrix {
    /// Columns of one expert matrix.
    pub fn layout_cols(&self) -> usize {
        self.layout.cols
    }
}

#[cfg(test)]
mod tests {
    use super::interleave_q4_row;

    /// The documented order, word by word: destination word `4c + k` holds
    /// source word `128j + t*k + v` (tile `j`, lane `v`, `t` chunks in the tile).
    #[test]
    fn interleaved_rows_follow_the_documented_word_order() {
        for bytes in [16, 48, 512, 528, 1024, 1040, 4176] {
            let src: Vec<u8> = (0..bytes).map(|i| (i * 13 + 1) as u8).collect();
            let mut got = vec![0u8; bytes];
            interleave_q4_row(&src, &mut got);
            let chunks = bytes / 16;
            for c in 0..chunks {
                let (j, v) = (c / 32, c % 32);
                let t = 32.min(chunks - 32 * j);
                for k in 0..4 {
                    let w = 128 * j + t * k + v;
                    assert_eq!(got[16 * c + 4 * k..16 * c + 4 * k + 4], src[4 * w..4 * w + 4], "{bytes} bytes, chunk {c}, word {k}");
                }
            }
        }
    }
}
