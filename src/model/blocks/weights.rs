//! Reading a block's weights from a checkpoint by name, onto a backend.

use anyhow::{bail, Result};
use slotstream_backend::{Backend, HostMatrix, Tensor, Weight};

use super::norm::RmsNorm;
use super::projections::{upload, ProjectionPart, Projections};
use crate::checkpoint::Checkpoint;
use crate::model::arch::ModelArch;
use crate::model::options::LoadOptions;

/// What a family's loader works with: the backend, the checkpoint, its
/// description and the options; weights are fetched by name.
#[derive(Clone, Copy)]
pub struct LoadCx<'a> {
    pub b: &'a dyn Backend,
    pub ck: &'a Checkpoint,
    pub arch: &'a ModelArch,
    pub opts: &'a LoadOptions,
}

impl<'a> LoadCx<'a> {
    /// The same, reading another checkpoint (the MTP head's file).
    pub fn with_checkpoint<'b>(&self, ck: &'b Checkpoint) -> LoadCx<'b>
    where
        'a: 'b,
    {
        LoadCx { b: self.b, ck, arch: self.arch, opts: self.opts }
    }

    pub fn matrix(&self, prefix: &str, rows: usize, cols: usize) -> Result<HostMatrix<'a>> {
        self.ck.matrix(prefix, &[], rows, cols)
    }

    /// `{prefix}` as a `[rows, cols]` linear layer.
    pub fn linear(&self, prefix: &str, rows: usize, cols: usize) -> Result<Weight> {
        upload(self.b, &self.matrix(prefix, rows, cols)?, prefix)
    }

    /// A 1-D float parameter, plus `shift` (for zero-centred norms).
    pub fn vector(&self, name: &str, len: usize, shift: f32) -> Result<Tensor> {
        let mut v = self.ck.f32_tensor(name, &[len])?;
        if shift != 0.0 {
            v.iter_mut().for_each(|x| *x += shift);
        }
        Ok(self.b.upload(&v, &[len])?)
    }

    pub fn rms_norm(&self, name: &str, len: usize, shift: f32) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: self.vector(name, len, shift)?, eps: self.arch.text.rms_norm_eps })
    }

    /// Matrices over one input, fused as the options allow.
    pub fn projections(&self, parts: &[ProjectionPart<'_>]) -> Result<Projections> {
        Projections::load(self.b, parts, self.opts.fuse_projections)
    }

    /// `(output, prefix, rows, cols)` linear layers over one input.
    pub fn linears(&self, specs: &[(&'static str, String, usize, usize)]) -> Result<Projections> {
        let parts = specs
            .iter()
            .map(|(out, p, r, c)| Ok(ProjectionPart::new(out, self.matrix(p, *r, *c)?, p.clone())))
            .collect::<Result<Vec<_>>>()?;
        self.projections(&parts)
    }

    /// A depthwise convolution weight stored `[channels, 1, kernel]`
    /// (transformers) or `[channels, kernel, 1]` (mlx-lm), the same bytes in
    /// both orders, as `[channels, kernel]`.
    pub fn conv_weight(&self, name: &str, channels: usize, k: usize) -> Result<Tensor> {
        let shape = self.ck.entry(name)?.shape.clone();
        if shape != [channels, 1, k] && shape != [channels, k, 1] {
            bail!(
                "tensor '{name}' has shape {shape:?}, expected [{channels}, 1, {k}] (transformers) or [{channels}, {k}, 1] (mlx-lm)"
            );
        }
        Ok(self.b.upload(&self.ck.f32_tensor(name, &shape)?, &[channels, k])?)
    }
}
