//! RMSNorm, and the two places it wraps a model: the pre-norm residual of a
//! decoder layer and the final norm before `lm_head`.

use anyhow::Result;
use slotstream_backend::{Backend, Tensor};

use crate::model::layer::{Block, Head, Residual, ResidualInputs};

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

/// `h = x + mixer(input_norm(x)); h + ffn(post_norm(h))` (qwen3_moe, qwen3_next).
pub struct PreNorm {
    pub input: RmsNorm,
    pub post: RmsNorm,
}

impl Residual for PreNorm {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        _inputs: ResidualInputs<'_>,
        block: &mut dyn FnMut(Block, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let h = b.add(x, &block(Block::Mixer, &self.input.forward(b, x)?)?)?;
        let ff = block(Block::FeedForward, &self.post.forward(b, &h)?)?;
        Ok(b.add(&h, &ff)?)
    }
}

impl Head for RmsNorm {
    fn collapse(&self, b: &dyn Backend, h: &Tensor) -> Result<Tensor> {
        self.forward(b, h)
    }
}
