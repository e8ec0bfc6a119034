//! Linear layers that read the same input (q/k/v, gate/up, the router and the
//! shared expert's inputs, ...), fused into as few matmuls as their storage
//! allows, with each output reached by its name.

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, HostMatrix, MatrixFormat, Tensor, Weight};

/// Row order that turns per-group interleaved blocks into contiguous blocks.
/// The input holds `groups` groups, each the concatenation of blocks of the
/// given sizes; the output holds block 0 of every group, then block 1, ...
pub fn deinterleave_rows(groups: usize, block_sizes: &[usize]) -> Vec<usize> {
    let group_len: usize = block_sizes.iter().sum();
    let mut order = Vec::with_capacity(groups * group_len);
    let mut offset = 0;
    for &size in block_sizes {
        for g in 0..groups {
            order.extend(g * group_len + offset..g * group_len + offset + size);
        }
        offset += size;
    }
    order
}

/// One matrix to load: the named outputs its rows hold (a checkpoint may
/// store several projections in one tensor), and the checkpoint module it came
/// from (for error messages).
pub struct ProjectionPart<'a> {
    pub outputs: Vec<(&'static str, usize)>,
    pub matrix: HostMatrix<'a>,
    pub module: String,
}

impl<'a> ProjectionPart<'a> {
    /// A matrix holding one output.
    pub fn new(output: &'static str, matrix: HostMatrix<'a>, module: impl Into<String>) -> Self {
        ProjectionPart { outputs: vec![(output, matrix.rows)], matrix, module: module.into() }
    }

    /// A matrix whose rows hold several outputs, one after another.
    pub fn split(outputs: &[(&'static str, usize)], matrix: HostMatrix<'a>, module: impl Into<String>) -> Result<Self> {
        let module = module.into();
        let rows: usize = outputs.iter().map(|o| o.1).sum();
        if rows != matrix.rows {
            bail!("'{module}' has {} rows, not the {rows} of its parts", matrix.rows);
        }
        Ok(ProjectionPart { outputs: outputs.to_vec(), matrix, module })
    }
}

/// Linear layers over one input. Consecutive parts stored alike are
/// concatenated into one weight at load time (unless fusing is turned off),
/// so one matmul computes them; each output is then a column slice of the
/// product (a view, not a copy, on backends that can for one-token inputs).
pub struct Projections {
    /// Each weight with the (name, rows) of the outputs it holds, in order.
    groups: Vec<(Weight, Vec<(&'static str, usize)>)>,
}

/// The outputs of [`Projections::forward`], by name.
pub struct ProjectionOutputs {
    outputs: Vec<(&'static str, Tensor)>,
}

impl ProjectionOutputs {
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.outputs
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| t)
            .with_context(|| format!("internal: no projection output named '{name}'"))
    }
}

impl Projections {
    pub fn load(b: &dyn Backend, parts: &[ProjectionPart<'_>], fuse: bool) -> Result<Projections> {
        let mut groups = Vec::new();
        let mut i = 0;
        while i < parts.len() {
            let mut j = i + 1;
            let first = &parts[i].matrix;
            while fuse
                && j < parts.len()
                && parts[j].matrix.experts == 1
                && first.experts == 1
                && parts[j].matrix.cols == first.cols
                && MatrixFormat::of(&parts[j].matrix) == MatrixFormat::of(first)
            {
                j += 1;
            }
            let group = &parts[i..j];
            let weight = if group.len() == 1 {
                upload(b, first, &parts[i].module)?
            } else {
                let names: Vec<&str> = group.iter().map(|p| p.module.as_str()).collect();
                let refs: Vec<&HostMatrix<'_>> = group.iter().map(|p| &p.matrix).collect();
                upload(b, &HostMatrix::concat_rows(&refs)?, &names.join(" + "))?
            };
            groups.push((weight, group.iter().flat_map(|p| p.outputs.iter().copied()).collect()));
            i = j;
        }
        Ok(Projections { groups })
    }

    /// The one weight holding every output, in load order, when they were
    /// all fused into one.
    pub fn single(&self) -> Option<&Weight> {
        match &self.groups[..] {
            [(w, _)] => Some(w),
            _ => None,
        }
    }

    /// Every output `[tokens, rows]`.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<ProjectionOutputs> {
        let mut outputs = Vec::new();
        for (w, parts) in &self.groups {
            let y = b.matmul(x, w)?;
            if let [(name, _)] = parts[..] {
                outputs.push((name, y));
                continue;
            }
            let mut at = 0;
            for &(name, rows) in parts {
                outputs.push((name, b.slice_cols(&y, at, rows)?));
                at += rows;
            }
        }
        Ok(ProjectionOutputs { outputs })
    }
}

/// Hands a host matrix to the backend, naming it in errors.
pub fn upload(b: &dyn Backend, m: &HostMatrix<'_>, what: &str) -> Result<Weight> {
    b.load_weight(m).with_context(|| format!("loading '{what}'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deinterleave_groups_blocks() {
        // Two groups of [a a b c c c]: blocks of 2, 1, 3.
        let order = deinterleave_rows(2, &[2, 1, 3]);
        assert_eq!(order, vec![0, 1, 6, 7, 2, 8, 3, 4, 5, 9, 10, 11]);
    }
}
