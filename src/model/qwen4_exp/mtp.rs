//! The multi-token-prediction (MTP) head of qwen4_exp, the draft head of its
//! speculative decoding.
//!
//! Entry `i` of the head combines the main model's hidden streams at position
//! `i` (before the final collapse) with the embedding of token `i+1`: both are
//! RMS-normalised, projected (one `[H, H]` weight shared by every stream for
//! the hidden part), added, and run through one full-attention decoder layer
//! with its own KV cache (RoPE position `i`) and its own collapse; the shared
//! `lm_head` then gives the draft for token `i+2`.

use std::path::Path;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use slotstream_backend::{Backend, Tensor, Weight};

use super::hyper::{HyperMixer, HyperResidual};
use super::qsa::gated_attention;
use crate::checkpoint::Checkpoint;
use crate::experts::ExpertCache;
use crate::model::blocks::moe::MoeBlock;
use crate::model::blocks::norm::RmsNorm;
use crate::model::blocks::weights::LoadCx;
use crate::model::decoder::{experts_lock, DecoderModel, DraftHead};
use crate::model::layer::{DecoderLayer, FeedForward, Mixer, MixerState};
use crate::model::load::{expert_cache, Layout};
use crate::model::options::ExpertSlots;
use crate::model::speculative::DraftState;

pub struct MtpHead {
    pub fc_embedding: Weight,
    /// `[hidden, hidden]`, applied to each stream.
    pub fc_hidden: Weight,
    pub norm_embedding: RmsNorm,
    /// `[streams*hidden]`: one RMS statistic over all streams together.
    pub norm_hidden: Tensor,
    pub layer: DecoderLayer,
    pub head: HyperMixer,
    /// The head's own routed experts, all resident.
    pub experts: Mutex<ExpertCache>,
    pub streams: usize,
    pub hidden: usize,
    pub eps: f32,
    /// Bytes of the head's weights (`mtp.safetensors`).
    pub bytes: u64,
}

impl MtpHead {
    /// The head from `mtp.safetensors` (tensors under `mtp.`, quantized like the main model).
    pub fn load(cx: &LoadCx<'_>, path: &Path) -> Result<MtpHead> {
        let mut ck = Checkpoint::open_file(path, cx.arch.quant.clone())?;
        ck.strip_prefix("mtp.");
        let cx = cx.with_checkpoint(&ck);
        let c = &cx.arch.text;
        let h = c.hidden_size;
        let hc = cx.arch.qwen4.as_ref().context("internal: an MTP head without qwen4_exp settings")?.hc_count;
        let attention = gated_attention(&cx, "layers.0.self_attn")?;
        let layer = DecoderLayer {
            residual: Box::new(HyperResidual {
                attn: HyperMixer::load(&cx, "layers.0.attn_hyper_connection", true)?,
                mlp: HyperMixer::load(&cx, "layers.0.mlp_hyper_connection", true)?,
                ple: None,
            }),
            mixer: Mixer::Attention(attention),
            ffn: FeedForward::Moe(MoeBlock::load(&cx, "layers.0.mlp", c.shared_expert_intermediate_size, 0, true)?),
        };
        let experts = expert_cache(&cx, Layout::Mlx, &["layers.0.mlp".to_string()], ExpertSlots::All, &[])?;
        let head = MtpHead {
            fc_embedding: cx.linear("fc_embedding", h, h)?,
            fc_hidden: cx.linear("fc_hidden", h, h)?,
            norm_embedding: cx.rms_norm("pre_fc_norm_embedding.weight", h, 0.0)?,
            norm_hidden: cx.vector("pre_fc_norm_hidden.weight", hc * h, 0.0)?,
            layer,
            head: HyperMixer::load(&cx, "hyper_connection_mixer", false)?,
            experts: Mutex::new(experts),
            streams: hc,
            hidden: h,
            eps: c.rms_norm_eps,
            bytes: ck.bytes_where(|_| true),
        };
        let unused = ck.unused();
        if !unused.is_empty() {
            bail!("mtp.safetensors has tensors the MTP head does not use: {}", unused.join(", "));
        }
        Ok(head)
    }
}

impl DraftHead for MtpHead {
    fn bytes(&self) -> u64 {
        self.bytes
    }

    fn new_state(&self, b: &dyn Backend) -> Result<DraftState> {
        if !matches!(self.layer.mixer, Mixer::Attention(_)) {
            bail!("the MTP head's layer is not full attention");
        }
        Ok(DraftState::new(self.layer.new_state(b)?))
    }

    fn feed(&self, b: &dyn Backend, model: &DecoderModel, st: &mut DraftState, tokens: &[u32], tokens_start: usize, last: usize)
        -> Result<Option<Tensor>> {
        if last < st.len {
            return Ok(None);
        }
        let first = st.len;
        let next = (first + 1).checked_sub(tokens_start).and_then(|a| tokens.get(a..=last + 1 - tokens_start));
        let next = next.context("internal: the MTP head was fed tokens it was not given")?;
        let n = next.len();
        let (hc, d) = (self.streams, self.hidden);
        let hidden = st.gather(b, first, last)?;
        let e = self.norm_embedding.forward(b, &b.embed(&model.embed, next)?)?;
        let e = b.matmul(&e, &self.fc_embedding)?;
        let hm = b.rms_norm(&hidden, Some(&self.norm_hidden), hc * d, self.eps)?;
        let f = b.matmul(&hm.reshape(&[n * hc, d])?, &self.fc_hidden)?.reshape(&[n, hc * d])?;
        let fused = b.add(&f, &b.repeat_cols(&e, hc)?)?;
        let mut experts = experts_lock(&self.experts)?;
        let out = self.layer.forward(b, &fused, &[], first, &mut st.layer, None, &mut experts)?;
        drop(experts);
        st.len = last + 1;
        // The last two rows stay: `trim` may drop the entries they fed.
        st.rows.retain(|&start, t| start + t.rows() >= last);
        let x = self.head.mix(b, &b.slice_rows(&out, n - 1, 1)?)?.0;
        Ok(Some(model.vocab_logits(b, &x)?))
    }

    fn trim(&self, b: &dyn Backend, st: &mut DraftState, position: usize) -> Result<()> {
        let keep = position.saturating_sub(1);
        st.rows.retain(|&start, _| start < position);
        if st.len > keep {
            if let MixerState::Attention(a) = &mut st.layer.mixer {
                a.truncate(b, keep)?;
            }
            st.len = keep;
        }
        Ok(())
    }
}
