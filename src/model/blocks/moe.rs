//! Routed experts (softmax router, top-k: [`Gating`], routed by the backend) plus an optional shared expert whose
//! output is scaled by `sigmoid(shared_gate x)`. The experts themselves live in
//! the model's [`ExpertCache`], addressed by the block's MoE index.

use anyhow::{Context, Result};
use slotstream_backend::{Backend, Gating, Routes, Tensor, Weight};

use super::projections::Projections;
use crate::experts::ExpertCache;
use super::weights::LoadCx;

pub struct MoeBlock {
    /// The router and, with a shared expert, its one-row output gate
    /// `shared_expert_gate` stored after it (fused into one weight when both
    /// are stored alike, so that routing takes one product).
    pub router: Projections,
    /// Experts (router rows).
    pub experts: usize,
    /// Index of this block among the model's MoE layers.
    pub moe_index: usize,
    pub top_k: usize,
    /// Renormalise the top-k probabilities to sum to one.
    pub norm_topk_prob: bool,
    pub shared: Option<SharedExpert>,
}

/// A shared expert: `down(silu(gate x) * up x)`, scaled by
/// `sigmoid(shared_expert_gate x)` (that row lives with the router).
pub struct SharedExpert {
    /// `shared_gate` and `shared_up`.
    pub inputs: Projections,
    pub down: Weight,
}

impl MoeBlock {
    /// Loads `{m}.gate` (the router) and, when `shared_inter > 0`, the
    /// sigmoid-gated shared expert `{m}.shared_expert{,_gate}`.
    pub fn load(cx: &LoadCx<'_>, m: &str, shared_inter: usize, moe_index: usize, norm_topk_prob: bool) -> Result<MoeBlock> {
        let c = &cx.arch.text;
        let (hidden, experts) = (c.hidden_size, c.num_experts);
        let router = ("router", format!("{m}.gate"), experts, hidden);
        let (router, shared) = if shared_inter > 0 {
            let s = format!("{m}.shared_expert");
            let inputs = cx.linears(&[
                ("shared_gate", format!("{s}.gate_proj"), shared_inter, hidden),
                ("shared_up", format!("{s}.up_proj"), shared_inter, hidden),
            ])?;
            let down = cx.linear(&format!("{s}.down_proj"), hidden, shared_inter)?;
            let gate = ("shared_expert_gate", format!("{m}.shared_expert_gate"), 1, hidden);
            (cx.linears(&[router, gate])?, Some(SharedExpert { inputs, down }))
        } else {
            (cx.linears(&[router])?, None)
        };
        Ok(MoeBlock { router, experts, moe_index, top_k: c.num_experts_per_tok, norm_topk_prob, shared })
    }

    /// Routes `x`: the routes and, with a shared expert, its gate's logit.
    fn route(&self, b: &dyn Backend, x: &Tensor) -> Result<(Routes, Option<Tensor>)> {
        let gating = Gating { experts: self.experts, top_k: self.top_k, normalize: self.norm_topk_prob };
        // The router's product and the routing in one op where the router
        // (with the shared expert's gate after it) is one weight.
        Ok(match self.router.single() {
            Some(w) => b.route_matmul(x, w, gating)?,
            None => {
                let p = self.router.forward(b, x)?;
                let gate = if self.shared.is_some() { Some(p.get("shared_expert_gate")?.clone()) } else { None };
                (b.route(p.get("router")?, gating)?, gate)
            }
        })
    }

    /// The block's output for `x`. `next` is the model's next MoE block: a
    /// streaming pool guesses its experts from `x` and reads them ahead.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, experts: &mut ExpertCache, next: Option<&MoeBlock>) -> Result<Tensor> {
        let (routes, shared_gate) = self.route(b, x)?;
        let mut ids = None;
        if let Some(next) = next.filter(|_| experts.wants_guess(x.rows())) {
            let (guess, _) = next.route(b, x)?;
            ids = Some(experts.guess_next(b, next.moe_index, &guess, &routes)?);
        }
        let Some(shared) = &self.shared else {
            return experts.run_layer(b, self.moe_index, x, &routes, ids);
        };
        let gate = shared_gate.context("internal: the router gave no shared expert gate")?;
        if let Some(gate_up) = shared.inputs.single() {
            let s = slotstream_backend::SharedExpert { gate_up, down: &shared.down, gate: &gate, key: None };
            return experts.run_layer_shared(b, self.moe_index, x, &routes, ids, s);
        }
        let y = experts.run_layer(b, self.moe_index, x, &routes, ids)?;
        let p = shared.inputs.forward(b, x)?;
        let act = b.silu_mul(p.get("shared_gate")?, p.get("shared_up")?)?;
        Ok(b.matmul_gated_add(&y, &act, &shared.down, &gate)?)
    }
}
