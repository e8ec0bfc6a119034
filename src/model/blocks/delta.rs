//! Gated DeltaNet linear attention (qwen3_next, qwen4_exp): a causal
//! convolution, then the gated delta rule over a fixed-size recurrent state.

use anyhow::Result;
use slotstream_backend::{Backend, DeltaInputs, GateAct, State, Tensor, Weight};

use super::projections::Projections;
use crate::model::arch::DeltaDims;

/// Gated DeltaNet. Its projections name their outputs `qkv` (the
/// convolution's input: q, k and v side by side), `z` (the output gate), `b`
/// (beta) and `a` (the decay), however the checkpoint stores them.
pub struct GatedDeltaNet {
    pub projections: Projections,
    /// Activation of the output gate `z`.
    pub gate_act: GateAct,
    pub conv_weight: Tensor,
    pub a_log: Tensor,
    pub dt_bias: Tensor,
    pub norm: Tensor,
    pub out_proj: Weight,
    pub dims: DeltaDims,
    pub eps: f32,
}

/// Conv window and recurrent matrix of one Gated DeltaNet layer.
pub struct DeltaState {
    pub conv: State,
    pub recurrent: State,
}

impl DeltaState {
    pub fn clone_with(&self, b: &dyn Backend) -> Result<DeltaState> {
        Ok(DeltaState { conv: b.clone_state(&self.conv)?, recurrent: b.clone_state(&self.recurrent)? })
    }
}

impl GatedDeltaNet {
    pub fn new_state(&self, b: &dyn Backend) -> Result<DeltaState> {
        let d = &self.dims;
        Ok(DeltaState {
            conv: b.new_conv_state(d.conv_channels(), d.conv_kernel, 1)?,
            recurrent: b.new_recurrent_state(d.value_heads, d.key_dim, d.value_dim)?,
        })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor, st: &mut DeltaState) -> Result<Tensor> {
        let p = self.projections.forward(b, x)?;
        let y = self.mix(b, p.get("qkv")?, p.get("a")?, p.get("b")?, st)?;
        self.output(b, &y, p.get("z")?)
    }

    /// One token of each of several sequences (row `i` of `x` is sequence
    /// `i`'s, with its own convolution window and recurrent state
    /// `states[i]`): the projections take every row in one product, the
    /// recurrence runs per sequence.
    pub fn forward_batch(&self, b: &dyn Backend, x: &Tensor, states: &mut [&mut DeltaState]) -> Result<Tensor> {
        let p = self.projections.forward(b, x)?;
        let (qkv, a, beta) = (p.get("qkv")?, p.get("a")?, p.get("b")?);
        let mut ys = Vec::with_capacity(states.len());
        for (i, st) in states.iter_mut().enumerate() {
            let row = |t: &Tensor| b.slice_rows(t, i, 1);
            ys.push(self.mix(b, &row(qkv)?, &row(a)?, &row(beta)?, st)?);
        }
        let y = b.concat_rows(&ys.iter().collect::<Vec<_>>())?;
        self.output(b, &y, p.get("z")?)
    }

    /// The convolution and the gated delta rule over one sequence's rows.
    fn mix(&self, b: &dyn Backend, qkv: &Tensor, a: &Tensor, beta: &Tensor, st: &mut DeltaState) -> Result<Tensor> {
        let d = &self.dims;
        let key_total = d.key_heads * d.key_dim;
        let value_total = d.value_heads * d.value_dim;
        let conv = b.causal_conv1d_silu(qkv, &self.conv_weight, &mut st.conv)?;
        let q = b.slice_cols(&conv, 0, key_total)?;
        let k = b.slice_cols(&conv, key_total, key_total)?;
        let v = b.slice_cols(&conv, 2 * key_total, value_total)?;
        // Unit-norm q and k; the readout scale 1/sqrt(key_dim) is folded into q.
        let inputs = DeltaInputs { q: &q, k: &k, v: &v, a, b: beta, a_log: &self.a_log, dt_bias: &self.dt_bias };
        Ok(b.gated_delta_step(inputs, d.key_heads, (d.key_dim as f32).powf(-0.5), 1e-6, &mut st.recurrent)?)
    }

    /// The gated norm and the output projection.
    fn output(&self, b: &dyn Backend, y: &Tensor, z: &Tensor) -> Result<Tensor> {
        let y = b.rms_norm_gated(y, z, &self.norm, self.dims.value_dim, self.eps, self.gate_act)?;
        Ok(b.matmul(&y, &self.out_proj)?)
    }
}
