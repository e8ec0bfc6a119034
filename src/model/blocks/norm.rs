//! RMSNorm with a learned weight.

use anyhow::Result;
use slotstream_backend::{Backend, Tensor};

/// RMSNorm with its (already shifted) weight.
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f32,
}

impl RmsNorm {
    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(b.rms_norm(x, Some(&self.weight), self.weight.numel(), self.eps)?)
    }

    /// `(x + y, norm(x + y))`: a residual add and this norm in one op.
    pub fn add_forward(&self, b: &dyn Backend, x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(b.add_rms_norm(x, y, &self.weight, self.weight.numel(), self.eps)?)
    }
}
