//! The host reference of MoE routing ([`crate::Gating`]): what the CPU
//! backend runs and what device kernels are tested against.

use crate::Gating;

/// One token's experts (best first) and their weights from its router logits.
///
/// Experts are ranked by logit (equivalently by probability, without the
/// ties that rounding `exp` could make), ties to the lower id.
pub fn route_row(logits: &[f32], g: Gating) -> (Vec<u32>, Vec<f32>) {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    order.truncate(g.top_k);
    let mut weights: Vec<f32> = order.iter().map(|&e| exps[e as usize] / total).collect();
    if g.normalize {
        let s: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= s);
    }
    (order, weights)
}

/// Routes of `tokens` rows of logits as the rows of a routes tensor: each
/// row the `top_k` ids (as f32 bit patterns) and then their weights.
pub fn route_rows(logits: &[f32], g: Gating) -> Vec<f32> {
    let k = g.top_k;
    let mut out = Vec::with_capacity(logits.len() / g.experts.max(1) * 2 * k);
    for row in logits.chunks_exact(g.experts.max(1)) {
        let (ids, weights) = route_row(row, g);
        out.extend(ids.iter().map(|&e| f32::from_bits(e)));
        out.extend(weights);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_picks_top_k_and_normalizes() {
        let g = Gating { experts: 4, top_k: 2, normalize: true };
        let (ids, w) = route_row(&[0.0, 3.0, 1.0, 2.0], g);
        assert_eq!(ids, vec![1, 3]);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let (_, w) = route_row(&[0.0, 3.0, 1.0, 2.0], Gating { normalize: false, ..g });
        assert!(w.iter().sum::<f32>() < 1.0);
    }

    #[test]
    fn ties_go_to_the_lower_id_and_rows_carry_ids_as_bits() {
        let g = Gating { experts: 3, top_k: 2, normalize: false };
        let rows = route_rows(&[1.0, 2.0, 2.0, 5.0, 5.0, 5.0], g);
        let ids: Vec<u32> = [0, 1, 4, 5].iter().map(|&i| rows[i].to_bits()).collect();
        assert_eq!(ids, vec![1, 2, 0, 1]);
        assert!((rows[6] - 1.0 / 3.0).abs() < 1e-6);
    }
}
