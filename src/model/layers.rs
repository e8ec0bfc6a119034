//! Building blocks shared by the Qwen MoE families, written against the backend
//! trait: attention (optionally gated, partial RoPE), Gated DeltaNet, dense MLP
//! and the routed-expert block with an optional sigmoid-gated shared expert.

use anyhow::{Context, Result};
use std::borrow::Cow;

use slotstream_backend::{Backend, GateAct, HostMatrix, MatrixData, MatrixFormat, State, Tensor, TokenRoute, Weight};

use crate::checkpoint::Checkpoint;
use crate::experts::ExpertCache;

/// Loads `{prefix}` as a `[rows, cols]` linear layer.
pub fn linear(b: &dyn Backend, ck: &Checkpoint, prefix: &str, rows: usize, cols: usize) -> Result<Weight> {
    let m = ck.matrix(prefix, &[], rows, cols)?;
    upload(b, &m, prefix)
}

pub fn upload(b: &dyn Backend, m: &HostMatrix<'_>, what: &str) -> Result<Weight> {
    b.load_weight(m).with_context(|| format!("loading '{what}'"))
}

/// Loads a 1-D float parameter, optionally adding `shift` (for zero-centred norms).
pub fn vector(b: &dyn Backend, ck: &Checkpoint, name: &str, len: usize, shift: f32) -> Result<Tensor> {
    let mut v = ck.f32_tensor(name, &[len])?;
    if shift != 0.0 {
        v.iter_mut().for_each(|x| *x += shift);
    }
    Ok(b.upload(&v, &[len])?)
}

/// Whether several linear layers over one input are concatenated into one
/// weight (one matmul) at load time; `SLOTSTREAM_FUSED_PROJECTIONS=0` keeps
/// them apart (for before/after measurements).
fn fuse_projections() -> bool {
    std::env::var("SLOTSTREAM_FUSED_PROJECTIONS").map_or(true, |v| v != "0")
}

/// Rows of single matrices of one format (same columns) one after another.
pub fn concat_rows(parts: &[&HostMatrix<'_>]) -> Result<HostMatrix<'static>> {
    let first = parts.first().context("concat_rows: no parts")?;
    let mut rows = 0;
    let mut data = match &first.data {
        MatrixData::Dense { dtype, .. } => MatrixData::Dense { dtype: *dtype, bytes: Cow::Owned(Vec::new()) },
        MatrixData::Affine { bits, group_size, scale_dtype, .. } => MatrixData::Affine {
            bits: *bits,
            group_size: *group_size,
            words: Cow::Owned(Vec::new()),
            scale_dtype: *scale_dtype,
            scales: Cow::Owned(Vec::new()),
            biases: Cow::Owned(Vec::new()),
        },
    };
    for p in parts {
        if p.experts != 1 || p.cols != first.cols || MatrixFormat::of(p) != MatrixFormat::of(first) {
            anyhow::bail!("concat_rows: parts differ in shape or format");
        }
        rows += p.rows;
        match (&mut data, &p.data) {
            (MatrixData::Dense { bytes, .. }, MatrixData::Dense { bytes: b, .. }) => bytes.to_mut().extend_from_slice(b),
            (
                MatrixData::Affine { words, scales, biases, .. },
                MatrixData::Affine { words: pw, scales: ps, biases: pb, .. },
            ) => {
                words.to_mut().extend_from_slice(pw);
                scales.to_mut().extend_from_slice(ps);
                biases.to_mut().extend_from_slice(pb);
            }
            _ => anyhow::bail!("concat_rows: parts differ in format"),
        }
    }
    let m = HostMatrix { experts: 1, rows, cols: first.cols, data };
    m.validate()?;
    Ok(m)
}

/// Linear layers that read the same input (q/k/v, gate/up, ...). Consecutive
/// parts stored alike are concatenated into one weight at load time, so one
/// matmul computes them; each part is then a column slice of its output (a
/// view, not a copy, on backends that can for one-token inputs).
pub struct Projections {
    /// Each weight with the (rows) of the parts it holds, in order.
    groups: Vec<(Weight, Vec<usize>)>,
}

impl Projections {
    pub fn load(b: &dyn Backend, parts: &[(HostMatrix<'_>, String)]) -> Result<Projections> {
        let mut groups = Vec::new();
        let mut i = 0;
        while i < parts.len() {
            let mut j = i + 1;
            while fuse_projections()
                && j < parts.len()
                && parts[j].0.experts == 1
                && parts[i].0.experts == 1
                && parts[j].0.cols == parts[i].0.cols
                && MatrixFormat::of(&parts[j].0) == MatrixFormat::of(&parts[i].0)
            {
                j += 1;
            }
            let names: Vec<&str> = parts[i..j].iter().map(|p| p.1.as_str()).collect();
            let weight = if j - i == 1 {
                upload(b, &parts[i].0, &parts[i].1)?
            } else {
                let refs: Vec<&HostMatrix<'_>> = parts[i..j].iter().map(|p| &p.0).collect();
                upload(b, &concat_rows(&refs)?, &names.join(" + "))?
            };
            groups.push((weight, parts[i..j].iter().map(|p| p.0.rows).collect()));
            i = j;
        }
        Ok(Projections { groups })
    }

    /// Loads `(prefix, rows, cols)` linear layers.
    pub fn linears(b: &dyn Backend, ck: &Checkpoint, specs: &[(String, usize, usize)]) -> Result<Projections> {
        let parts = specs
            .iter()
            .map(|(p, r, c)| Ok((ck.matrix(p, &[], *r, *c)?, p.clone())))
            .collect::<Result<Vec<_>>>()?;
        Projections::load(b, &parts)
    }

    /// Every part's output `[tokens, rows]`, in load order.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Vec<Tensor>> {
        let mut out = Vec::new();
        for (w, rows) in &self.groups {
            let y = b.matmul(x, w)?;
            if rows.len() == 1 {
                out.push(y);
                continue;
            }
            let mut at = 0;
            for &r in rows {
                out.push(b.slice_cols(&y, at, r)?);
                at += r;
            }
        }
        Ok(out)
    }

    /// Matmuls per forward.
    pub fn weights(&self) -> usize {
        self.groups.len()
    }
}

/// Row order that turns per-group interleaved blocks into contiguous blocks.
/// The input holds `groups` groups, each the concatenation of blocks of the
/// given sizes; the output holds block 0 of every group, then block 1, ...
pub fn deinterleave_rows(groups: usize, block_sizes: &[usize]) -> Vec<usize> {
    let group_len: usize = block_sizes.iter().sum();
    let mut order = Vec::with_capacity(groups * group_len);
    let mut offset = 0;
    for &size in block_sizes {
        for g in 0..groups {
            order.extend(g * group_len + offset..g * group_len + offset + size);
        }
        offset += size;
    }
    order
}

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

/// Full (softmax) attention with q/k RMSNorm, (partial) RoPE, GQA and an
/// optional sigmoid output gate.
pub struct Attention {
    /// q (followed by the gate when `gated`), k and v projections.
    pub qkv: Projections,
    pub o_proj: Weight,
    pub q_norm: RmsNorm,
    pub k_norm: RmsNorm,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f32,
    pub gated: bool,
    /// QSA: picks the key blocks each query attends to once the context
    /// outgrows the indexer's budget (qwen4_exp).
    pub indexer: Option<crate::model::qsa::Indexer>,
}

impl Attention {
    pub fn new_state(&self, b: &dyn Backend) -> Result<State> {
        Ok(b.new_kv_cache(self.kv_heads, self.head_dim)?)
    }

    /// `x: [tokens, hidden]`, the first token at position `start`.
    pub fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        cache: &mut State,
        indexer_state: Option<&mut crate::model::qsa::IndexerState>,
        start: usize,
    ) -> Result<Tensor> {
        let tokens = x.rows();
        let selection = match (&self.indexer, indexer_state) {
            (Some(ix), Some(st)) => ix.select(b, x, st, start)?,
            (None, None) => None,
            _ => anyhow::bail!("attention layer and its state disagree about the QSA indexer"),
        };
        let (h, kvh, hd) = (self.heads, self.kv_heads, self.head_dim);
        let [projected, k, v]: [Tensor; 3] =
            self.qkv.forward(b, x)?.try_into().map_err(|_| anyhow::anyhow!("attention needs q, k and v projections"))?;
        let (q, gate) = if self.gated {
            (b.slice_cols(&projected, 0, h * hd)?, Some(b.slice_cols(&projected, h * hd, h * hd)?))
        } else {
            (projected, None)
        };
        let q = self.q_norm.forward(b, &q)?;
        let k = self.k_norm.forward(b, &k)?;
        if b.kv_len(cache)? != start {
            anyhow::bail!("KV cache holds {} positions but the call starts at {start}", b.kv_len(cache)?);
        }
        let q = b.rope(&q.reshape(&[tokens, h, hd])?, hd, self.rotary_dim, self.rope_theta, start)?;
        let k = b.rope(&k.reshape(&[tokens, kvh, hd])?, hd, self.rotary_dim, self.rope_theta, start)?;
        let q = q.reshape(&[tokens, h * hd])?;
        let k = k.reshape(&[tokens, kvh * hd])?;
        let mut out = b.attention(&q, &k, &v, cache, h, (hd as f32).powf(-0.5), selection.as_ref())?;
        if let Some(gate) = gate {
            out = b.sigmoid_mul(&out, &gate)?;
        }
        Ok(b.matmul(&out, &self.o_proj)?)
    }
}

/// The input projections of a Gated DeltaNet layer.
pub enum DeltaProjections {
    /// qwen3_next: `[q | k | v | z]` and `[b | a]`, loaded with their rows
    /// regrouped so that each part is one contiguous block.
    Fused(Projections),
    /// qwen4_exp: `qkv`, `z`, `b`, `a`, one projection each.
    Split(Projections),
}

/// Gated DeltaNet linear attention (qwen3_next, qwen4_exp).
pub struct GatedDeltaNet {
    pub projections: DeltaProjections,
    /// Activation of the output gate `z`.
    pub gate_act: GateAct,
    pub conv_weight: Tensor,
    pub a_log: Tensor,
    pub dt_bias: Tensor,
    pub norm: Tensor,
    pub out_proj: Weight,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    pub eps: f32,
}

/// Conv window and recurrent matrix of one Gated DeltaNet layer.
pub struct DeltaState {
    pub conv: State,
    pub recurrent: State,
}

impl GatedDeltaNet {
    fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    pub fn new_state(&self, b: &dyn Backend) -> Result<DeltaState> {
        Ok(DeltaState {
            conv: b.new_conv_state(self.conv_channels(), self.conv_kernel, 1)?,
            recurrent: b.new_recurrent_state(self.value_heads, self.key_dim, self.value_dim)?,
        })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor, st: &mut DeltaState) -> Result<Tensor> {
        let key_total = self.key_heads * self.key_dim;
        let value_total = self.value_heads * self.value_dim;
        let channels = self.conv_channels();
        let (mixed, z, beta_raw, a) = match &self.projections {
            DeltaProjections::Fused(p) => {
                let [qkvz, ba]: [Tensor; 2] =
                    p.forward(b, x)?.try_into().map_err(|_| anyhow::anyhow!("expected qkvz and ba projections"))?;
                (
                    b.slice_cols(&qkvz, 0, channels)?,
                    b.slice_cols(&qkvz, channels, value_total)?,
                    b.slice_cols(&ba, 0, self.value_heads)?,
                    b.slice_cols(&ba, self.value_heads, self.value_heads)?,
                )
            }
            DeltaProjections::Split(p) => {
                let [qkv, z, beta_raw, a]: [Tensor; 4] =
                    p.forward(b, x)?.try_into().map_err(|_| anyhow::anyhow!("expected qkv, z, b and a projections"))?;
                (qkv, z, beta_raw, a)
            }
        };
        let conv = b.causal_conv1d_silu(&mixed, &self.conv_weight, &mut st.conv)?;
        let q = b.slice_cols(&conv, 0, key_total)?;
        let k = b.slice_cols(&conv, key_total, key_total)?;
        let v = b.slice_cols(&conv, 2 * key_total, value_total)?;
        // Unit-norm q and k; the readout scale 1/sqrt(key_dim) is folded into q.
        let q = b.l2_normalize(&q, self.key_dim, 1e-6, (self.key_dim as f32).powf(-0.5))?;
        let k = b.l2_normalize(&k, self.key_dim, 1e-6, 1.0)?;
        let (g, beta) = b.delta_gates(&a, &beta_raw, &self.a_log, &self.dt_bias)?;
        let y = b.gated_delta(&q, &k, &v, &g, &beta, self.key_heads, &mut st.recurrent)?;
        let y = b.rms_norm_gated(&y, &z, &self.norm, self.value_dim, self.eps, self.gate_act)?;
        Ok(b.matmul(&y, &self.out_proj)?)
    }
}

/// SwiGLU feed-forward: `down(silu(gate x) * up x)`.
pub struct Mlp {
    /// gate and up projections.
    pub gate_up: Projections,
    pub down: Weight,
}

impl Mlp {
    pub fn load(b: &dyn Backend, ck: &Checkpoint, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp> {
        Ok(Mlp {
            gate_up: Projections::linears(
                b,
                ck,
                &[(format!("{prefix}.gate_proj"), inter, hidden), (format!("{prefix}.up_proj"), inter, hidden)],
            )?,
            down: linear(b, ck, &format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] =
            self.gate_up.forward(b, x)?.try_into().map_err(|_| anyhow::anyhow!("expected gate and up projections"))?;
        self.finish(b, &gate, &up)
    }

    /// `down(silu(gate) * up)` from already projected gate and up.
    pub fn finish(&self, b: &dyn Backend, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        Ok(b.matmul(&b.silu_mul(gate, up)?, &self.down)?)
    }
}

/// Routed experts (softmax router, top-k) plus an optional shared expert whose
/// output is scaled by `sigmoid(shared_gate x)`. The experts themselves live in
/// the model's [`ExpertCache`], addressed by `moe_index`.
pub struct MoeBlock {
    /// The router, preceded by the shared expert's gate and up projections
    /// and followed by its one-row output gate when there is a shared expert.
    pub inputs: Projections,
    /// Experts (router rows).
    pub experts: usize,
    /// Index of this block among the model's MoE layers.
    pub moe_index: usize,
    pub top_k: usize,
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
    #[allow(clippy::too_many_arguments)]
    pub fn load(b: &dyn Backend, ck: &Checkpoint, m: &str, hidden: usize, experts: usize, shared_inter: usize,
        moe_index: usize, top_k: usize, norm_topk_prob: bool) -> Result<MoeBlock> {
        let router = (format!("{m}.gate"), experts, hidden);
        let (specs, shared_down) = if shared_inter > 0 {
            let s = format!("{m}.shared_expert");
            (
                vec![
                    (format!("{s}.gate_proj"), shared_inter, hidden),
                    (format!("{s}.up_proj"), shared_inter, hidden),
                    router,
                    (format!("{m}.shared_expert_gate"), 1, hidden),
                ],
                Some(linear(b, ck, &format!("{s}.down_proj"), hidden, shared_inter)?),
            )
        } else {
            (vec![router], None)
        };
        Ok(MoeBlock {
            inputs: Projections::linears(b, ck, &specs)?,
            experts,
            moe_index,
            top_k,
            norm_topk_prob,
            shared_down,
        })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor, experts: &mut ExpertCache) -> Result<Tensor> {
        let parts = self.inputs.forward(b, x)?;
        let router = if self.shared_down.is_some() { &parts[2] } else { &parts[0] };
        // The one GPU-to-CPU read of a MoE layer: the router's choice decides
        // which experts the cache must hold.
        let logits = b.download(router)?;
        let n = self.experts;
        let routes: Vec<TokenRoute> =
            logits.chunks_exact(n).map(|l| route(l, self.top_k, self.norm_topk_prob)).collect();
        let mut y = experts.run_layer(b, self.moe_index, x, &routes, self.top_k)?;
        if let Some(down) = &self.shared_down {
            let act = b.silu_mul(&parts[0], &parts[1])?;
            y = b.add_sigmoid_mul(&y, &b.matmul(&act, down)?, &parts[3])?;
        }
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deinterleave_groups_blocks() {
        // Two groups of [a a b c c c]: blocks of 2, 1, 3.
        let order = deinterleave_rows(2, &[2, 1, 3]);
        assert_eq!(order, vec![0, 1, 6, 7, 2, 8, 3, 4, 5, 9, 10, 11]);
    }

    #[test]
    fn routing_picks_top_k_and_normalizes() {
        let r = route(&[0.0, 3.0, 1.0, 2.0], 2, true);
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let r = route(&[0.0, 3.0, 1.0, 2.0], 2, false);
        assert!(r.weights.iter().sum::<f32>() < 1.0);
    }
}
