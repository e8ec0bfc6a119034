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
}
