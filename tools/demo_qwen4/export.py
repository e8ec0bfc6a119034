"""Write a trained tools/demo_qwen4/train.py model in the real on-disk layout of the MLX 4-bit
Qwen3.8-Flash-Next checkpoint, with the quantizer and shard writer of
tools/oracle/qwen4_exp/fixture.py:

- 4-bit affine, group 64: embed_tokens, lm_head, hyper-connection down/up, GDN in_proj_qkv/z and
  out_proj, attention q/k/v/o, routed and shared experts, PLE key/value projections, MTP fc_*;
  the 16 n-gram shards at group 32;
- bf16: norms, conv weights ([C, K, 1]), A_log, dt_bias, in_proj_a/b, router, shared_expert_gate,
  indexer index_qk_proj and its norms, block_inject_weight;
- int64: the n-gram buffers (multipliers, head vocab sizes, offsets);
- `language_model.` prefix in model-0000{1,2,3}.safetensors + index; the MTP head in
  mtp.safetensors; config.json with text_config.

Every parameter of the torch model is overwritten with the value the checkpoint stores
(dequantized / rounded to bf16), so the model afterwards computes what the files hold.
"""
import json
import os
from pathlib import Path

import numpy as np
import torch

import fixture  # tools/oracle/qwen4_exp (on sys.path via train.py)
from model import dequantize

BF16 = fixture.BF16


class Writer:
    def __init__(self):
        self.out = {}

    def q4(self, name, p, group=64, to_disk=lambda w: w, from_disk=lambda w: w):
        w = to_disk(p.detach().float().cpu().numpy().astype(np.float64))
        words, s, b = fixture.quantize_affine(w, group)
        self.out[name + ".weight"], self.out[name + ".scales"], self.out[name + ".biases"] = words, s, b
        deq = dequantize(words, s, b, group, 4)
        p.data.copy_(torch.from_numpy(from_disk(deq)).to(p.dtype))

    def bf16(self, name, p, to_disk=lambda w: w, from_disk=lambda w: w):
        w = to_disk(p.detach().float().cpu().numpy()).astype(np.float32).astype(BF16)
        self.out[name] = np.ascontiguousarray(w)
        p.data.copy_(torch.from_numpy(from_disk(w.astype(np.float32))).to(p.dtype))


CONV = dict(to_disk=lambda w: w.transpose(0, 2, 1), from_disk=lambda w: w.transpose(0, 2, 1))  # [C,1,K] <-> [C,K,1]


def hyper(W, pre, m):
    W.bf16(pre + ".hc_norm.weight", m.hc_norm)
    W.q4(pre + ".input_mix_weight_down", m.input_mix_weight_down.weight)
    W.q4(pre + ".input_mix_weight_up", m.input_mix_weight_up.weight)
    if m.block_inject_weight is not None:
        W.bf16(pre + ".block_inject_weight.weight", m.block_inject_weight.weight)


def moe(W, pre, m):
    W.bf16(pre + ".gate.weight", m.gate.weight)
    for n in ("gate", "up", "down"):
        W.q4(f"{pre}.switch_mlp.{n}_proj", getattr(m, f"{n}_proj"))
        W.q4(f"{pre}.shared_expert.{n}_proj", getattr(m, f"shared_{n}_proj").weight)
    W.bf16(pre + ".shared_expert_gate.weight", m.shared_expert_gate.weight)


def gdn(W, pre, m):
    W.q4(pre + ".in_proj_qkv", m.in_proj_qkv.weight)
    W.q4(pre + ".in_proj_z", m.in_proj_z.weight)
    W.bf16(pre + ".in_proj_b.weight", m.in_proj_b.weight)
    W.bf16(pre + ".in_proj_a.weight", m.in_proj_a.weight)
    W.bf16(pre + ".conv1d.weight", m.conv1d, **CONV)
    W.bf16(pre + ".A_log", m.A_log)
    W.bf16(pre + ".dt_bias", m.dt_bias)
    W.bf16(pre + ".norm.weight", m.norm)
    W.q4(pre + ".out_proj", m.out_proj.weight)


def attention(W, pre, m):
    for n in ("q", "k", "v", "o"):
        W.q4(f"{pre}.{n}_proj", getattr(m, f"{n}_proj").weight)
    W.bf16(pre + ".q_norm.weight", m.q_norm)
    W.bf16(pre + ".k_norm.weight", m.k_norm)
    W.bf16(pre + ".indexer.index_qk_proj.weight", m.indexer.index_qk_proj.weight)
    W.bf16(pre + ".indexer.q_layernorm.weight", m.indexer.q_layernorm)
    W.bf16(pre + ".indexer.k_layernorm.weight", m.indexer.k_layernorm)


def ple(W, pre, m, ng):
    e = pre + ".ple_embedding."
    W.out[e + "layer_multipliers"] = np.array(ng.mults, dtype=np.int64)
    W.out[e + "ngram_heads_vocab_sizes"] = np.array(ng.sizes, dtype=np.int64)
    W.out[e + "ngram_heads_offsets"] = np.array(ng.offsets, dtype=np.int64)
    rows = ng.rows
    for k in range(ng.total_rows // rows):
        part = torch.nn.Parameter(m.table.data[k * rows:(k + 1) * rows].clone())
        W.q4(e + f"ngram_embedding.shard_{k}", part, group=part.shape[1])
        m.table.data[k * rows:(k + 1) * rows] = part.data
    W.q4(pre + ".key_proj", m.key_proj.weight)
    W.q4(pre + ".value_proj", m.value_proj.weight)
    W.bf16(pre + ".norm_key.weight", m.norm_key)
    W.bf16(pre + ".norm_query.weight", m.norm_query)
    W.bf16(pre + ".norm_conv.weight", m.norm_conv)
    W.bf16(pre + ".conv1d.weight", m.conv1d, **CONV)


def layer(W, pre, L, ng):
    if L.ple is not None:
        ple(W, pre + ".ple", L.ple, ng)
    hyper(W, pre + ".attn_hyper_connection", L.attn_hyper_connection)
    hyper(W, pre + ".mlp_hyper_connection", L.mlp_hyper_connection)
    if L.kind == "linear_attention":
        gdn(W, pre + ".linear_attn", L.linear_attn)
    else:
        attention(W, pre + ".self_attn", L.self_attn)
    moe(W, pre + ".mlp", L.mlp)


def write_model(model, tc, ng, out_dir):
    out_dir = Path(out_dir)
    W = Writer()
    W.q4("model.embed_tokens", model.embed_tokens.weight)
    W.q4("lm_head", model.lm_head.weight)
    hyper(W, "model.hyper_connection_mixer", model.hyper_connection_mixer)
    for i, L in enumerate(model.layers):
        layer(W, f"model.layers.{i}", L, ng)
    M = Writer()
    M.q4("mtp.fc_embedding", model.mtp_fc_embedding.weight)
    M.q4("mtp.fc_hidden", model.mtp_fc_hidden.weight)
    M.bf16("mtp.pre_fc_norm_embedding.weight", model.mtp_pre_fc_norm_embedding)
    M.bf16("mtp.pre_fc_norm_hidden.weight", model.mtp_pre_fc_norm_hidden)
    layer(M, "mtp.layers.0", model.mtp_layer, ng)
    hyper(M, "mtp.hyper_connection_mixer", model.mtp_mixer)

    fixture.TEXT_CONFIG.clear()
    fixture.TEXT_CONFIG.update(tc)
    fixture.write_checkpoint(out_dir, {fixture.LM + k: v for k, v in W.out.items()}, M.out)
    # the fixture's placeholders, adapted to this vocabulary and width
    cfg = fixture.config()
    V = tc["vocab_size"]
    cfg.update(image_token_id=V - 2, video_token_id=V - 1, vision_start_token_id=V - 2, vision_end_token_id=V - 1)
    cfg["vision_config"] = dict(cfg["vision_config"], out_hidden_size=tc["hidden_size"])
    fixture.write_json(out_dir / "config.json", cfg)
    eos = tc["eos_token_id"]
    fixture.write_json(out_dir / "generation_config.json",
                       {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False})
    n = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"wrote {out_dir}: {len(W.out)} + {len(M.out)} (MTP) tensors, {n / 1e6:.2f} MB", flush=True)


@torch.no_grad()
def check_logits(model, ids, ng, device):
    """Float32 logits of the quantized model on token ids (200 tokens: several GDN chunks), for
    the oracle comparison (tools/demo_qwen4/check_oracle.py): main last_logits and the MTP draft
    logits of the last entry (hidden state at T-2 with token T-1), from an empty state."""
    x = torch.tensor([ids], device=device)
    gid = torch.from_numpy(ng.ids(x.cpu().numpy())).to(device)
    logits, hid, _ = model(x, gid)
    mlog, _ = model.mtp(hid[:, :-1], x[:, 1:])
    return dict(ids=ids, last_logits=logits[0, -1].double().cpu().tolist(),
                argmax=logits[0].argmax(-1).cpu().tolist(),
                mtp_last_logits=mlog[0, -1].double().cpu().tolist(),
                mtp_argmax=mlog[0].argmax(-1).cpu().tolist())
