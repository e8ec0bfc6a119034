//! What attention ops take besides tensors: the key selection of
//! block-sparse attention and the query/key norm with rotary embedding that
//! [`Backend::attention_qk_norm`] applies first.

use crate::{Backend, Result, State, Tensor};

/// Which keys each query of an attention call may see (block-sparse attention).
///
/// Keys are grouped in blocks of `block` positions. Query `t` of the call has
/// `per_query` entries `blocks[t*per_query..(t+1)*per_query]`:
/// - if the first entry is [`KeySelection::DENSE`], the query attends causally
///   to every key up to its own position;
/// - otherwise it attends to the keys of the listed blocks (entries equal to
///   [`KeySelection::UNUSED`] are ignored; listed blocks lie wholly at or
///   before the query), plus its own trailing partial block: the keys from
///   `((p+1)/block)*block` to its position `p`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySelection {
    pub block: usize,
    pub per_query: usize,
    pub blocks: Vec<u32>,
}

impl KeySelection {
    pub const DENSE: u32 = u32::MAX - 1;
    pub const UNUSED: u32 = u32::MAX;

    /// Keys query `t` at position `pos` may attend to, in increasing order.
    pub fn keys_of(&self, t: usize, pos: usize) -> Vec<usize> {
        let row = &self.blocks[t * self.per_query..(t + 1) * self.per_query];
        if row.first() == Some(&Self::DENSE) {
            return (0..=pos).collect();
        }
        let mut keys: Vec<usize> = row
            .iter()
            .filter(|&&b| b != Self::UNUSED)
            .flat_map(|&b| (b as usize * self.block)..((b as usize + 1) * self.block))
            .filter(|&k| k <= pos)
            .collect();
        keys.extend(((pos + 1) / self.block * self.block)..=pos);
        keys.sort_unstable();
        keys.dedup();
        keys
    }
}

/// The per-head RMSNorm (with its weight) and rotary embedding applied to the
/// raw queries and keys before attention, as [`Backend::rms_norm_rope_pair`]
/// takes them: `weights`/`eps` for q then k, rotation of the first
/// `rotary_dim` values of each head, the call's first token at `start_pos`.
#[derive(Clone, Copy)]
pub struct QkNorm<'a> {
    pub weights: [&'a Tensor; 2],
    pub eps: [f32; 2],
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope: crate::Rope,
    pub start_pos: usize,
}

/// [`Backend::attention_qk_norm`] from the backend's separate ops (its
/// default, and a fused backend's answer for the calls its kernel does not take).
#[allow(clippy::too_many_arguments)]
pub fn attention_qk_norm_composed<B: Backend + ?Sized>(
    b: &B,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cache: &mut State,
    heads: usize,
    scale: f32,
    selection: Option<&KeySelection>,
    n: &QkNorm<'_>,
) -> Result<Tensor> {
    let (q_shape, k_shape) = ([q.rows(), q.cols()], [k.rows(), k.cols()]);
    let (q, k) = b.rms_norm_rope_pair(q, k, n.weights, n.head_dim, n.eps, n.rotary_dim, n.rope, n.start_pos)?;
    let (q, k) = (q.reshape(&q_shape)?, k.reshape(&k_shape)?);
    b.attention(&q, &k, v, cache, heads, scale, selection)
}
