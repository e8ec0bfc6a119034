//! SwiGLU feed-forward: `down(silu(gate x) * up x)`.

use anyhow::Result;
use slotstream_backend::{Backend, Tensor, Weight};

use super::projections::Projections;
use super::weights::LoadCx;

pub struct Mlp {
    /// Outputs `gate` and `up`.
    pub gate_up: Projections,
    pub down: Weight,
}

impl Mlp {
    pub fn load(cx: &LoadCx<'_>, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp> {
        Ok(Mlp {
            gate_up: cx.linears(&[
                ("gate", format!("{prefix}.gate_proj"), inter, hidden),
                ("up", format!("{prefix}.up_proj"), inter, hidden),
            ])?,
            down: cx.linear(&format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        let p = self.gate_up.forward(b, x)?;
        Ok(b.matmul(&b.silu_mul(p.get("gate")?, p.get("up")?)?, &self.down)?)
    }
}
