//! Routed experts (softmax router, top-k) plus an optional shared expert whose
//! output is scaled by `sigmoid(shared_gate x)`. The experts themselves live in
//! the model's [`ExpertCache`], addressed by the block's MoE index.

use anyhow::Result;
use slotstream_backend::{Backend, Tensor, TokenRoute, Weight};

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

/// Softmax over all router logits, keep the `k` largest probabilities
/// (renormalised to sum to one when `normalize`).
pub fn route(logits: &[f32], k: usize, normalize: bool) -> TokenRoute {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    // Highest probability first; ties broken by the lower expert id.
    order.sort_by(|&a, &b| exps[b as usize].total_cmp(&exps[a as usize]).then(a.cmp(&b)));
    order.truncate(k);
    let mut weights: Vec<f32> = order.iter().map(|&e| exps[e as usize] / total).collect();
    if normalize {
        let s: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= s);
    }
    TokenRoute { experts: order, weights }
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
        // The one GPU-to-CPU read of a MoE layer: the router's choice decides
        // which experts the cache must hold.
        let logits = b.download(p.get("router")?)?;
        let routes: Vec<TokenRoute> =
            logits.chunks_exact(self.experts).map(|l| route(l, self.top_k, self.norm_topk_prob)).collect();
        let mut y = experts.run_layer(b, self.moe_index, x, &routes, self.top_k)?;
        if let Some(down) = &self.shared_down {
            let act = b.silu_mul(p.get("shared_gate")?, p.get("shared_up")?)?;
            y = b.add_sigmoid_mul(&y, &b.matmul(&act, down)?, p.get("shared_expert_gate")?)?;
        }
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_picks_top_k_and_normalizes() {
        let r = route(&[0.0, 3.0, 1.0, 2.0], 2, true);
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let r = route(&[0.0, 3.0, 1.0, 2.0], 2, false);
        assert!(r.weights.iter().sum::<f32>() < 1.0);
    }
}
