//! The n-gram embedding table of qwen4_exp's PLE layer, streamed from disk.
//!
//! Each token selects `(ngram_size-1) * heads_per_ngram` rows (16 on the
//! flagship): for every n-gram order n in 2..=ngram_size, the last n tokens are
//! hashed (odd multipliers, XOR, in wrapping 64-bit arithmetic) and reduced
//! modulo one prime table size per head, offset into one global row space. The
//! space is split into `split_ngram_parts` shard tensors (128 on the flagship,
//! 32 GB in all), so rows are read by id with positioned reads, never mapped,
//! and kept in a bounded cache of dequantized rows.
//!
//! Hashing starts from a 2-token context of EOS and never looks across an
//! EOS: a token whose preceding n-1 tokens include an EOS sees EOS in their
//! place.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use slotstream_backend::{HostMatrix, MatrixData, MatrixFormat};

use crate::model::config::Qwen4Config;
use crate::checkpoint::Checkpoint;
use crate::direct_io::DirectFile;
use crate::model::layer::RowCacheStats;

struct RowCache {
    rows: HashMap<u64, Arc<[f32]>>,
    /// Insertion order, for FIFO eviction.
    order: std::collections::VecDeque<u64>,
    capacity: usize,
    stats: RowCacheStats,
}

/// Where one shard's pieces start: (file, byte offset) of the packed values,
/// then of the scales and biases when quantized.
struct ShardPieces {
    pieces: Vec<(usize, u64)>,
}

/// Hash parameters and on-disk location of one layer's n-gram table.
pub struct NgramStore {
    /// The checkpoint files holding shards, opened for reads around the page cache.
    files: Vec<DirectFile>,
    shards: Vec<ShardPieces>,
    rows_per_shard: u64,
    format: MatrixFormat,
    head_dim: usize,
    multipliers: Vec<i64>,
    sizes: Vec<i64>,
    offsets: Vec<i64>,
    ngram_size: usize,
    heads_per_ngram: usize,
    eos: u32,
    cache: Mutex<RowCache>,
    /// Threads for row reads: they wait on the disk, and they run while the
    /// compute pool is busy with layer 0, so they must not be its threads.
    io: rayon::ThreadPool,
}

/// Bytes of one row of `cols` values stored as `format`: (weight, scales+biases each).
fn row_bytes(format: MatrixFormat, cols: usize) -> (usize, usize) {
    match format {
        MatrixFormat::Dense(dt) => (cols * dt.size(), 0),
        MatrixFormat::Affine { bits, group_size, scale_dtype } => {
            (cols * bits as usize / 8, cols / group_size * scale_dtype.size())
        }
    }
}

impl NgramStore {
    /// Opens the table under `prefix` (`model.layers.1.ple.ple_embedding`),
    /// shaped as `q` says; `eos` starts and separates n-gram contexts.
    pub fn open(ck: Arc<Checkpoint>, prefix: &str, q: &Qwen4Config, eos: u32, cache_rows: usize) -> Result<NgramStore> {
        let (shards, embed_dim, ngram_size, heads_per_ngram) =
            (q.split_ngram_parts, q.ple_embed_dim, q.ngram_size, q.heads_per_ngram);
        let heads = q.ngram_heads();
        if shards == 0 {
            bail!("config.json text_config: split_ngram_parts is 0 (the n-gram table needs at least one shard)");
        }
        if heads == 0 || embed_dim % heads != 0 {
            bail!("config.json: ple_embed_dim {embed_dim} is not a multiple of {heads} n-gram heads");
        }
        let head_dim = embed_dim / heads;
        let multipliers = ck.i64_tensor(&format!("{prefix}.layer_multipliers"), &[ngram_size])?;
        let sizes = ck.i64_tensor(&format!("{prefix}.ngram_heads_vocab_sizes"), &[heads])?;
        let offsets = ck.i64_tensor(&format!("{prefix}.ngram_heads_offsets"), &[heads])?;
        if sizes.iter().any(|&s| s <= 0) {
            bail!("'{prefix}.ngram_heads_vocab_sizes' holds a size that is not positive");
        }
        let names: Vec<String> = (0..shards).map(|i| format!("{prefix}.ngram_embedding.shard_{i}")).collect();
        let first = ck.entry(&format!("{}.weight", names[0]))?;
        let rows_per_shard = first.shape.first().copied().context("n-gram shard 0 has no shape")?;
        let format = ck.matrix_layout(&names[0], &[], rows_per_shard, head_dim)?.format;
        for n in &names[1..] {
            let f = ck.matrix_layout(n, &[], rows_per_shard, head_dim)?.format;
            if f != format {
                bail!("n-gram shard '{n}' is stored as {f:?} but shard 0 as {format:?}");
            }
        }
        // Open each file holding a shard once; note where each piece starts.
        let mut files = Vec::new();
        let mut file_index: HashMap<std::path::PathBuf, usize> = HashMap::new();
        let mut shard_pieces = Vec::with_capacity(names.len());
        for n in &names {
            let layout = ck.matrix_layout(n, &[], rows_per_shard, head_dim)?;
            let mut pieces = Vec::new();
            for t in &layout.tensors {
                let e = ck.entry(t)?;
                let path = ck.path_of(e).to_path_buf();
                let f = match file_index.get(&path) {
                    Some(&i) => i,
                    None => {
                        files.push(DirectFile::open(&path)?);
                        file_index.insert(path, files.len() - 1);
                        files.len() - 1
                    }
                };
                pieces.push((f, e.start as u64));
            }
            shard_pieces.push(ShardPieces { pieces });
        }
        let total_rows = rows_per_shard as i64 * shards as i64;
        let end = sizes.iter().zip(&offsets).map(|(s, o)| s + o).max().unwrap_or(0);
        if offsets.iter().any(|&o| o < 0) || end > total_rows {
            bail!("n-gram head offsets and sizes reach row {end}, beyond the {total_rows} rows of the {shards} shards");
        }
        let io = rayon::ThreadPoolBuilder::new()
            .num_threads(8)
            .thread_name(|i| format!("ngram-read-{i}"))
            .build()
            .context("starting the n-gram row read threads")?;
        Ok(NgramStore {
            io,
            files,
            shards: shard_pieces,
            rows_per_shard: rows_per_shard as u64,
            format,
            head_dim,
            multipliers,
            sizes,
            offsets,
            ngram_size,
            heads_per_ngram,
            eos,
            cache: Mutex::new(RowCache {
                rows: HashMap::new(),
                order: Default::default(),
                capacity: cache_rows.max(1),
                stats: RowCacheStats { capacity_rows: cache_rows.max(1), ..Default::default() },
            }),
        })
    }

    pub fn embed_dim(&self) -> usize {
        self.head_dim * self.heads()
    }

    fn heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }

    /// Bytes of one row on disk (100 on the flagship).
    pub fn row_disk_bytes(&self) -> usize {
        let (w, s) = row_bytes(self.format, self.head_dim);
        w + 2 * s
    }

    /// Tokens of history a row id depends on: `ngram_size-1`.
    pub fn context_len(&self) -> usize {
        self.ngram_size - 1
    }

    /// The hash context after the tokens `recent`: their last `ngram_size-1`,
    /// EOS in place of any before the first token.
    pub fn context_from(&self, recent: &[u32]) -> Vec<u32> {
        let n = self.context_len();
        let kept = &recent[recent.len().saturating_sub(n)..];
        let mut context = vec![self.eos; n - kept.len()];
        context.extend_from_slice(kept);
        context
    }

    /// Global row ids `[ids.len() * heads]` of `ids`, which follow `context`.
    pub fn ngram_ids(&self, context: &[u32], ids: &[u32]) -> Vec<u64> {
        let history: Vec<u32> = context.iter().chain(ids).copied().collect();
        let first = context.len();
        let mut out = Vec::with_capacity(ids.len() * self.heads());
        for p in first..history.len() {
            // shifted[s]: the token s places back, or EOS when an EOS lies in
            // between (or is that token) or the start is passed.
            let shifted: Vec<i64> = (0..self.ngram_size)
                .map(|s| {
                    if s == 0 {
                        history[p]
                    } else if p < s || history[p - s..p].contains(&self.eos) {
                        self.eos
                    } else {
                        history[p - s]
                    }
                })
                .map(|t| t as i64)
                .collect();
            for n in 2..=self.ngram_size {
                let mut mixed = shifted[0].wrapping_mul(self.multipliers[0]);
                for (k, &tok) in shifted.iter().enumerate().take(n).skip(1) {
                    mixed ^= tok.wrapping_mul(self.multipliers[k]);
                }
                let lo = (n - 2) * self.heads_per_ngram;
                for h in lo..lo + self.heads_per_ngram {
                    out.push((mixed.rem_euclid(self.sizes[h]) + self.offsets[h]) as u64);
                }
            }
        }
        out
    }

    /// The embedding rows of `row_ids`, concatenated per token:
    /// `[row_ids.len() / heads, embed_dim]` as f32.
    pub fn embeddings(&self, row_ids: &[u64]) -> Result<Vec<f32>> {
        let missing: Vec<u64> = {
            let mut c = self.lock()?;
            let mut missing: Vec<u64> = row_ids.iter().copied().filter(|r| !c.rows.contains_key(r)).collect();
            missing.sort_unstable();
            missing.dedup();
            c.stats.hits += (row_ids.len() - row_ids.iter().filter(|r| missing.binary_search(r).is_ok()).count()) as u64;
            missing
        };
        let fetched: Vec<(u64, Arc<[f32]>)> =
            self.io.install(|| missing.par_iter().map(|&r| Ok((r, self.read_row(r)?))).collect::<Result<Vec<_>>>())?;
        let mut out = Vec::with_capacity(row_ids.len() * self.head_dim);
        let mut c = self.lock()?;
        c.stats.misses += row_ids.iter().filter(|r| missing.binary_search(r).is_ok()).count() as u64;
        c.stats.bytes_read += (fetched.len() * self.row_disk_bytes()) as u64;
        let local: HashMap<u64, Arc<[f32]>> = fetched.iter().cloned().collect();
        for r in row_ids {
            let row = match c.rows.get(r) {
                Some(v) => v.clone(),
                None => local.get(r).cloned().context("internal: an n-gram row was neither cached nor read")?,
            };
            out.extend_from_slice(&row);
        }
        for (r, v) in fetched {
            if c.rows.len() >= c.capacity {
                if let Some(old) = c.order.pop_front() {
                    c.rows.remove(&old);
                }
            }
            if c.rows.len() < c.capacity {
                c.rows.insert(r, v);
                c.order.push_back(r);
            }
        }
        c.stats.cached_rows = c.rows.len();
        Ok(out)
    }

    pub fn stats(&self) -> RowCacheStats {
        self.cache.lock().map(|c| c.stats.clone()).unwrap_or_default()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, RowCache>> {
        self.cache.lock().map_err(|_| anyhow::anyhow!("the n-gram row cache was poisoned by an earlier failure"))
    }

    /// Reads and dequantizes one row.
    fn read_row(&self, row: u64) -> Result<Arc<[f32]>> {
        let shard = (row / self.rows_per_shard) as usize;
        let r = (row % self.rows_per_shard) as usize;
        let pieces = &self.shards.get(shard).with_context(|| format!("n-gram row {row} is beyond the last shard"))?.pieces;
        let (wb, sb) = row_bytes(self.format, self.head_dim);
        let read = |i: usize, len: usize| -> Result<Vec<u8>> {
            let (f, start) = pieces[i];
            self.files[f].read(start + (r * len) as u64, len).with_context(|| format!("reading n-gram row {row}"))
        };
        let words = read(0, wb)?;
        let data = match self.format {
            MatrixFormat::Dense(dtype) => MatrixData::Dense { dtype, bytes: words.into() },
            MatrixFormat::Affine { bits, group_size, scale_dtype } => MatrixData::Affine {
                bits,
                group_size,
                words: words.into(),
                scale_dtype,
                scales: read(1, sb)?.into(),
                biases: read(2, sb)?.into(),
            },
        };
        let m = HostMatrix { experts: 1, rows: 1, cols: self.head_dim, data };
        Ok(m.to_f32().into())
    }
}
