//! Routed experts (softmax router, top-k: [`Gating`], routed by the backend) plus an optional shared expert whose
//! output is scaled by `sigmoid(shared_gate x)`. The experts themselves live in
//! the model's [`ExpertCache`], addressed by the block's MoE index.

use anyhow::Result;
use slotstream_backend::{Backend, Gating, Tensor, Weight};

use super::projections::Projections;
use crate::experts::ExpertCache;
use super::weights::LoadCx;

pub struct MoeBlock {
    /// Outputs `router`, and with a shared expert its `shared_gate` and
    /// `shared_up` projections and its one-row output gate `shared_expert_gate`.
    pub inputs: Projections,
    /// Experts (router rows).
    pub experts: usize,
    /// Index of this block among the model's MoE layers.
    pub moe_index: usize,
    pub top_k: usize,
    /// Renormalise the top-k probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// The shared expert's down projection.
    pub shared_down: Option<Weight>,
}

impl MoeBlock {
    /// Loads `{m}.gate` (the router) and, when `shared_inter > 0`, the
    /// sigmoid-gated shared expert `{m}.shared_expert{,_gate}`.
    pub fn load(cx: &LoadCx<'_>, m: &str, shared_inter: usize, moe_index: usize, norm_topk_prob: bool) -> Result<MoeBlock> {
        let c = &cx.arch.text;
        let (hidden, experts) = (c.hidden_size, c.num_experts);
        let router = ("router", format!("{m}.gate"), experts, hidden);
        let (specs, shared_down) = if shared_inter > 0 {
            let s = format!("{m}.shared_expert");
            (
                vec![
                    ("shared_gate", format!("{s}.gate_proj"), shared_inter, hidden),
                    ("shared_up", format!("{s}.up_proj"), shared_inter, hidden),
                    router,
                    ("shared_expert_gate", format!("{m}.shared_expert_gate"), 1, hidden),
                ],
                Some(cx.linear(&format!("{s}.down_proj"), hidden, shared_inter)?),
            )
        } else {
            (vec![router], None)
        };
        Ok(MoeBlock {
            inputs: cx.linears(&specs)?,
            experts,
            moe_index,
            top_k: c.num_experts_per_tok,
            norm_topk_prob,
            shared_down,
        })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor, experts: &mut ExpertCache) -> Result<Tensor> {
        let p = self.inputs.forward(b, x)?;
        let gating = Gating { experts: self.experts, top_k: self.top_k, normalize: self.norm_topk_prob };
        let mut y = experts.run_layer(b, self.moe_index, x, p.get("router")?, gating)?;
        if let Some(down) = &self.shared_down {
            let act = b.silu_mul(p.get("shared_gate")?, p.get("shared_up")?)?;
            y = b.add_sigmoid_mul(&y, &b.matmul(&act, down)?, p.get("shared_expert_gate")?)?;
        }
        Ok(y)
    }
}
