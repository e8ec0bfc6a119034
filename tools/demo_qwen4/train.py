#!/usr/bin/env python3
"""Train a small qwen4_exp (Qwen3.8-Flash-Next) model with its MTP head on public-domain text.

The model is written here in PyTorch from the math in tools/oracle/qwen4_exp/README.md (the same
math as the float64 oracle tools/oracle/qwen4_exp/model.py):
hyper-connections over hc streams, Gated DeltaNet (split projections, sigmoid output gate; chunked
WY form of the delta rule), QSA full attention (gated queries, partial RoPE; the indexer is dense
below its budget, so during training it is inert and its weights stay at their random init),
MoE with a shared expert (computed densely: every expert, weighted by the top-k softmax, zero
elsewhere), the PLE n-gram embedding on one layer, and the MTP head trained on the next-next
token from the main model's pre-final-mixer hidden streams (detached).

Seeded. Stops after --minutes of training. Logs train/held-out loss, MTP loss and next-next
accuracy to training_log.json. Then it quantizes the weights to the real on-disk MLX 4-bit layout
(tools/demo_qwen4/export.py, which reuses tools/oracle/qwen4_exp/fixture.py), loads the
dequantized values back and records float32 logits and the held-out perplexity of the quantized
model (what the engine and the oracle must reproduce).

    python3 tools/demo_qwen4/train.py --corpus .demo_corpus --out $OUT/model --minutes 4.5
    python3 tools/demo_qwen4/train.py --corpus ../shared/corpus --out /tmp/m --device cpu \
        --steps 3 --batch 2 --seq 64     # smoke test on a CPU
"""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "oracle", "qwen4_exp"))

from model import ngram_tables  # noqa: E402  (the oracle's n-gram tables: same numbers by construction)

FILES = ["shakespeare.txt", "stdlib_mobydick.txt", "stdlib_sotu.txt"]
EOS = 4096

# Overrides of tools/oracle/qwen4_exp/fixture.py's TEXT_CONFIG (the real config layout).
DIMS = dict(
    vocab_size=4160,
    bos_token_id=EOS,
    eos_token_id=EOS,
    hidden_size=256,
    num_hidden_layers=6,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
    full_attention_interval=3,
    hc_count=4,
    hc_lowrank=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=256,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=64,
    indexer_budget=1024,
    indexer_compress_ratio=4,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=2000,
    make_ngram_vocab_size_divisible_by=128,
    split_ngram_parts=16,
    ple_embed_dim=512,
    ple_layer_ids=[2],
    ple_conv_kernel_size=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)
ROPE_THETA = 1e7


def text_config():
    import fixture  # noqa: needs ml_dtypes + safetensors

    tc = dict(fixture.TEXT_CONFIG)
    tc.update(DIMS)
    tc["rope_parameters"] = dict(tc["rope_parameters"], rope_theta=int(ROPE_THETA))
    tc["mtp"] = dict(tc["mtp"], rope_theta=int(ROPE_THETA))
    return tc


# ----------------------------------------------------------------------------- n-gram ids


class Ngram:
    def __init__(self, tc, ple_index=0):
        self.mults, self.sizes, self.offsets, self.rows = ngram_tables(tc, ple_index)
        self.n, self.hpn = tc["ngram_size"], tc["heads_per_ngram"]
        self.total_rows = self.rows * tc["split_ngram_parts"]

    def ids(self, win):
        """Global n-gram row ids [B, T, (n-1)*hpn] of windows [B, T], each from an empty
        context ([eos]*(n-1)); a shift never crosses an EOS."""
        B, T = win.shape
        n = self.n
        hist = np.concatenate([np.full((B, n - 1), EOS, dtype=np.int64), win.astype(np.int64)], 1)
        P = np.arange(n - 1, T + n - 1)
        sh = [hist[:, P]]
        for s in range(1, n):
            bad = np.zeros((B, T), dtype=bool)
            for j in range(1, s + 1):
                bad |= hist[:, P - j] == EOS
            sh.append(np.where(bad, EOS, hist[:, P - s]))
        out = []
        for m in range(2, n + 1):
            mixed = sh[0] * self.mults[0]
            for j in range(1, m):
                mixed = mixed ^ (sh[j] * self.mults[j])
            for h in range((m - 2) * self.hpn, (m - 1) * self.hpn):
                out.append(mixed % self.sizes[h] + self.offsets[h])
        return np.stack(out, -1)


# ----------------------------------------------------------------------------- model


AMP = {"device": "cuda", "on": False}  # autocast device type and whether losses() enabled it


def act_dtype(default):
    return torch.bfloat16 if AMP["on"] else default


def rms(x, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def lin(i, o, std=0.02):
    m = nn.Linear(i, o, bias=False)
    nn.init.normal_(m.weight, std=std)
    return m


class HyperMixer(nn.Module):
    """GatedResidual: per-stream RMSNorm, low-rank sigmoid weights, mean over streams; the inject
    gains 2*sigmoid(block_inject(normed)/hc) when `inject`."""

    def __init__(self, H, hc, R, inject=True):
        super().__init__()
        self.H, self.hc = H, hc
        self.hc_norm = nn.Parameter(torch.ones(hc * H))
        self.input_mix_weight_down = lin(hc * H, R)
        self.input_mix_weight_up = lin(R, hc * H)
        self.block_inject_weight = lin(hc * H, hc) if inject else None

    def forward(self, h):  # h [B, T, hc, H] float32
        B, T = h.shape[:2]
        normed = rms(h) * self.hc_norm.view(self.hc, self.H)
        flat = normed.reshape(B, T, self.hc * self.H)
        t = F.silu(self.input_mix_weight_down(flat).float() / self.hc)
        w = torch.sigmoid(self.input_mix_weight_up(t).float()).view(B, T, self.hc, self.H)
        mixed = (w * normed).mean(2)
        if self.block_inject_weight is None:
            return mixed, None
        inj = 2.0 * torch.sigmoid(self.block_inject_weight(flat).float() / self.hc)
        return mixed, inj


def chunk_gated_delta(q, k, v, g, beta, C=64):
    """Gated delta rule, chunked (WY form), float32. q (already scaled), k [B,T,Hh,dk]; v [B,T,Hh,dv];
    g = log decay and beta [B,T,Hh]. Per step: S = e^g S; S += beta (v - S k) k^T; y = S q."""
    with torch.autocast(AMP["device"], enabled=False):
        return _chunk_gated_delta(q.float(), k.float(), v.float(), g.float(), beta.float(), C)


def _chunk_gated_delta(q, k, v, g, beta, C):
    B, T, Hh, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    Tp = T + pad
    N = Tp // C
    tr = lambda t: t.transpose(1, 2).reshape(B, Hh, N, C, *t.shape[3:])  # noqa: E731
    q, k, v, g, beta = tr(q), tr(k), tr(v), tr(g), tr(beta)
    G = g.cumsum(-1)  # [B,Hh,N,C]
    kb, vb = k * beta[..., None], v * beta[..., None]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(incl, G[..., :, None] - G[..., None, :], float("-inf")).exp()
    A = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    M = A + torch.eye(C, device=q.device)
    u = torch.linalg.solve_triangular(M, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(M, kb * G.exp()[..., None], upper=False, unitriangular=True)
    S = q.new_zeros(B, Hh, dk, dv)
    outs = []
    for n in range(N):
        qn, kn, Gn = q[:, :, n], k[:, :, n], G[:, :, n]
        U = u[:, :, n] - w[:, :, n] @ S
        att = (qn @ kn.transpose(-1, -2)) * decay[:, :, n]
        outs.append((qn * Gn.exp()[..., None]) @ S + att @ U)
        last = Gn[..., -1:]
        S = S * last.exp()[..., None] + (kn * (last - Gn).exp()[..., None]).transpose(-1, -2) @ U
    y = torch.stack(outs, 2).reshape(B, Hh, Tp, dv)[:, :, :T]
    return y.transpose(1, 2)  # [B,T,Hh,dv]


class GatedDeltaNet(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        H = c["hidden_size"]
        self.nk, self.nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.K = c["linear_conv_kernel_dim"]
        self.C = 2 * self.nk * self.dk + self.nv * self.dv
        self.in_proj_qkv = lin(H, self.C)
        self.in_proj_z = lin(H, self.nv * self.dv)
        self.in_proj_b = lin(H, self.nv)
        self.in_proj_a = lin(H, self.nv)
        self.conv1d = nn.Parameter(torch.empty(self.C, 1, self.K).uniform_(-0.5, 0.5))
        self.A_log = nn.Parameter(torch.empty(self.nv).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(self.nv).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.norm = nn.Parameter(torch.ones(self.dv))
        self.out_proj = lin(self.nv * self.dv, H, out_std)

    def forward(self, x, pos=None):
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        conv = F.conv1d(F.pad(qkv.transpose(1, 2), (self.K - 1, 0)), self.conv1d.to(qkv.dtype), groups=self.C)
        conv = F.silu(conv.float()).transpose(1, 2)
        kd = self.nk * self.dk
        q = conv[..., :kd].reshape(B, T, self.nk, self.dk)
        k = conv[..., kd:2 * kd].reshape(B, T, self.nk, self.dk)
        v = conv[..., 2 * kd:].reshape(B, T, self.nv, self.dv)
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * self.dk ** -0.5
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        rep = self.nv // self.nk
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        y = chunk_gated_delta(q, k, v, g, beta)
        z = self.in_proj_z(x).float().view(B, T, self.nv, self.dv)
        o = rms(y) * self.norm * torch.sigmoid(z)
        return self.out_proj(o.reshape(B, T, -1).to(x.dtype))


class Rope:
    def __init__(self, rot, theta):
        self.rot = rot
        self.inv_freq = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)

    def __call__(self, x, pos):  # x [B, T, heads, d] float32; pos [T]
        f = pos.double()[:, None] * self.inv_freq.to(pos.device)[None, :]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos().float()[:, None, :], emb.sin().float()[:, None, :]
        half = self.rot // 2
        xr = x[..., :self.rot]
        rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
        return torch.cat([xr * cos + rot * sin, x[..., self.rot:]], -1)


class Indexer(nn.Module):
    """QSA indexer weights. Dense below indexer_budget visible keys, so unused in training; the
    weights keep their random init (no gradient)."""

    def __init__(self, c):
        super().__init__()
        H, ihd = c["hidden_size"], c["indexer_head_dim"]
        self.index_qk_proj = lin(H, (c["indexer_n_heads"] + c["indexer_kv_heads"]) * ihd, H ** -0.5)
        self.q_layernorm = nn.Parameter(torch.ones(ihd))
        self.k_layernorm = nn.Parameter(torch.ones(ihd))
        for p in self.parameters():
            p.requires_grad_(False)


class Attention(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        H = c["hidden_size"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.q_proj = lin(H, self.nh * self.hd * 2)
        self.k_proj = lin(H, self.nkv * self.hd)
        self.v_proj = lin(H, self.nkv * self.hd)
        self.o_proj = lin(self.nh * self.hd, H, out_std)
        self.q_norm = nn.Parameter(torch.ones(self.hd))
        self.k_norm = nn.Parameter(torch.ones(self.hd))
        self.indexer = Indexer(c)
        self.rope = Rope(int(self.hd * c["partial_rotary_factor"]), ROPE_THETA)

    def forward(self, x, pos):
        B, T, _ = x.shape
        qg = self.q_proj(x).view(B, T, self.nh, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(B, T, self.nh * self.hd)
        q = rms(q) * self.q_norm
        k = rms(self.k_proj(x).view(B, T, self.nkv, self.hd)) * self.k_norm
        v = self.v_proj(x).view(B, T, self.nkv, self.hd)
        q, k = self.rope(q, pos), self.rope(k, pos)
        rep = self.nh // self.nkv
        dt = v.dtype
        q = q.to(dt).transpose(1, 2)
        k = k.to(dt).repeat_interleave(rep, 2).transpose(1, 2)
        v = v.repeat_interleave(rep, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale hd^-0.5
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o_proj(o * torch.sigmoid(gate))


class MoE(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        H, E, I, Is = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        self.E, self.I, self.k = E, I, c["num_experts_per_tok"]
        self.gate = lin(H, E)
        self.gate_proj = nn.Parameter(torch.randn(E, I, H) * 0.02)
        self.up_proj = nn.Parameter(torch.randn(E, I, H) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * out_std)
        self.shared_gate_proj = lin(H, Is)
        self.shared_up_proj = lin(H, Is)
        self.shared_down_proj = lin(Is, H, out_std)
        self.shared_expert_gate = lin(H, 1)

    def forward(self, x):  # x [B, T, H]
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        logits = self.gate(x).float()
        topv, topi = logits.topk(self.k, -1)
        dense = torch.zeros_like(logits).scatter(1, topi, torch.softmax(topv, -1))
        # switch-transformer balance loss: E * sum_e (share of routed slots) * (mean router prob)
        frac = torch.zeros_like(logits).scatter(1, topi, 1.0).mean(0) / self.k
        aux = self.E * (frac * torch.softmax(logits, -1).mean(0)).sum()
        E, I, H = self.E, self.I, shp[-1]
        gu = x @ torch.cat([self.gate_proj.reshape(E * I, H), self.up_proj.reshape(E * I, H)]).to(x.dtype).t()
        hmid = F.silu(gu[:, :E * I]) * gu[:, E * I:]
        hmid = (hmid.view(-1, E, I) * dense.to(hmid.dtype)[..., None]).reshape(-1, E * I)
        out = hmid @ self.down_proj.transpose(1, 2).reshape(E * I, H).to(x.dtype)
        shared = self.shared_down_proj(F.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x))
        out = out.float() + torch.sigmoid(self.shared_expert_gate(x).float()) * shared.float()
        return out.view(*shp[:-1], H), aux


class PLE(nn.Module):
    def __init__(self, c, ng: Ngram):
        super().__init__()
        H, hc, D = c["hidden_size"], c["hc_count"], c["ple_embed_dim"]
        self.H, self.hc, self.D = H, hc, D
        self.n_heads = (c["ngram_size"] - 1) * c["heads_per_ngram"]
        self.dil, self.K = c["ngram_size"], c["ple_conv_kernel_size"]
        self.table = nn.Parameter(torch.randn(ng.total_rows, D // self.n_heads))
        self.key_proj = lin(D, hc * H)
        self.value_proj = lin(D, H)
        self.norm_key = nn.Parameter(torch.ones(hc * H))
        self.norm_query = nn.Parameter(torch.ones(hc * H))
        self.norm_conv = nn.Parameter(torch.ones(hc * H))
        self.conv1d = nn.Parameter(torch.empty(hc * H, 1, self.K).uniform_(-0.5, 0.5))

    def forward(self, h, gid):  # h [B,T,hc,H] float32, gid [B,T,n_heads]
        B, T = h.shape[:2]
        hc, H = self.hc, self.H
        emb = self.table[gid].reshape(B, T, self.D)
        emb = emb.to(act_dtype(emb.dtype))
        key = rms(self.key_proj(emb).view(B, T, hc, H)) * self.norm_key.view(hc, H)
        value = self.value_proj(emb).float()
        query = rms(h) * self.norm_query.view(hc, H)
        gate = (key * query).sum(-1) / math.sqrt(H)
        gate = torch.sqrt(gate.abs().clamp_min(1e-6)) * torch.sign(gate)
        gated = torch.sigmoid(gate)[..., None] * value[:, :, None, :]  # [B,T,hc,H]
        cin = (rms(gated) * self.norm_conv.view(hc, H)).reshape(B, T, hc * H)
        pad = (self.K - 1) * self.dil
        conv = F.conv1d(F.pad(cin.transpose(1, 2), (pad, 0)), self.conv1d.float(), groups=hc * H, dilation=self.dil)
        return gated + F.silu(conv.transpose(1, 2)).view(B, T, hc, H)


class Layer(nn.Module):
    def __init__(self, c, kind, out_std, ng=None):
        super().__init__()
        H, hc, R = c["hidden_size"], c["hc_count"], c["hc_lowrank"]
        self.ple = PLE(c, ng) if ng is not None else None
        self.attn_hyper_connection = HyperMixer(H, hc, R)
        self.mlp_hyper_connection = HyperMixer(H, hc, R)
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, out_std)
        else:
            self.self_attn = Attention(c, out_std)
        self.mlp = MoE(c, out_std)

    def forward(self, h, pos, gid=None):
        if self.ple is not None:
            h = h + self.ple(h, gid)
        x, inj = self.attn_hyper_connection(h)
        x = x.to(act_dtype(x.dtype))
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        x = mixer(x, pos)
        h = h + inj[..., None] * x.float()[:, :, None, :]
        x, inj = self.mlp_hyper_connection(h)
        x = x.to(act_dtype(x.dtype))
        x, aux = self.mlp(x)
        return h + inj[..., None] * x.float()[:, :, None, :], aux


class Qwen4Exp(nn.Module):
    def __init__(self, c, ng: Ngram):
        super().__init__()
        H, hc, V, R = c["hidden_size"], c["hc_count"], c["vocab_size"], c["hc_lowrank"]
        self.H, self.hc = H, hc
        out_std = 0.02 / math.sqrt(2 * c["num_hidden_layers"])
        self.embed_tokens = nn.Embedding(V, H)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        ple_layers = {i for i in range(c["num_hidden_layers"]) if (i + 1) in c["ple_layer_ids"]}
        assert len(ple_layers) == 1
        self.layers = nn.ModuleList([
            Layer(c, t, out_std, ng if i in ple_layers else None) for i, t in enumerate(c["layer_types"])])
        self.ple_layer = min(ple_layers)
        self.hyper_connection_mixer = HyperMixer(H, hc, R, inject=False)
        self.lm_head = lin(H, V)
        # MTP head (embeddings and lm_head shared with the main model)
        self.mtp_fc_embedding = lin(H, H)
        self.mtp_fc_hidden = lin(H, H)
        self.mtp_pre_fc_norm_embedding = nn.Parameter(torch.ones(H))
        self.mtp_pre_fc_norm_hidden = nn.Parameter(torch.ones(hc * H))
        self.mtp_layer = Layer(c, "full_attention", out_std)
        self.mtp_mixer = HyperMixer(H, hc, R, inject=False)

    def forward(self, ids, gid):
        """Logits [B,T,V], the pre-final-mixer hyper state [B,T,hc,H], router balance loss."""
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        h = self.embed_tokens(ids).float()[:, :, None, :].expand(B, T, self.hc, self.H)
        aux = 0.0
        for layer in self.layers:
            h, a = layer(h, pos, gid)
            aux = aux + a
        mixed, _ = self.hyper_connection_mixer(h)
        return self.lm_head(mixed), h, aux / len(self.layers)

    def mtp(self, hidden, next_ids):
        """Draft logits of entries i: hidden state at i [B,N,hc,H] with token i+1 [B,N]."""
        B, N = next_ids.shape
        e = self.mtp_fc_embedding(rms(self.embed_tokens(next_ids)) * self.mtp_pre_fc_norm_embedding)
        hm = rms(hidden.reshape(B, N, self.hc * self.H)) * self.mtp_pre_fc_norm_hidden
        f = self.mtp_fc_hidden(hm.view(B, N, self.hc, self.H))
        fused = e.float()[:, :, None, :] + f.float()
        h, aux = self.mtp_layer(fused, torch.arange(N, device=next_ids.device))
        mixed, _ = self.mtp_mixer(h)
        return self.lm_head(mixed), aux


# ----------------------------------------------------------------------------- data / eval


def load_tokens(corpus, tok):
    """98% / 2% of each file. Cached in CORPUS/qwen4_demo_tokens.npz (written where possible)."""
    cache = os.path.join(corpus, "qwen4_demo_tokens.npz")
    if os.path.exists(cache):
        z = np.load(cache)
        return z["train"].astype(np.int64), z["held"].astype(np.int64)
    train, held = [], []
    for f in FILES:
        text = open(os.path.join(corpus, f), encoding="utf-8", errors="replace").read()
        ids = tok.encode(text).ids
        cut = int(len(ids) * 0.98)
        train.append(ids[:cut])
        held.append(ids[cut:])
    train, held = np.concatenate(train).astype(np.int64), np.concatenate(held).astype(np.int64)
    try:
        np.savez(cache, train=train.astype(np.int16), held=held.astype(np.int16))
    except OSError:
        pass
    return train, held


def losses(model, x, ng, device, amp):
    """x [B, T+1]: main next-token loss, MTP next-next loss, aux, and accuracy statistics."""
    inp, tgt = x[:, :-1], x[:, 1:]
    gid = torch.from_numpy(ng.ids(inp.numpy())).to(device)
    inp, tgt, xd = inp.to(device), tgt.to(device), x.to(device)
    AMP["on"] = amp
    with torch.autocast(AMP["device"], dtype=torch.bfloat16, enabled=amp):
        logits, hid, aux = model(inp, gid)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
        # entries i = 0..T-2: hidden at i, token i+1, target i+2
        mlog, maux = model.mtp(hid[:, :-1].detach(), xd[:, 1:-1])
        mloss = F.cross_entropy(mlog.float().flatten(0, 1), xd[:, 2:].flatten())
    AMP["on"] = False
    with torch.no_grad():
        margmax = mlog.argmax(-1)
        stats = dict(
            mtp_acc=(margmax == xd[:, 2:]).float().mean().item(),  # next-next token accuracy
            # the draft for i+2 against the main model's own argmax there (greedy acceptance proxy)
            mtp_agree=(margmax == logits[:, 1:].argmax(-1)).float().mean().item(),
            main_acc=(logits.argmax(-1) == tgt).float().mean().item(),
        )
    return loss, mloss, aux + maux, stats


@torch.no_grad()
def evaluate(model, held, seq, ng, device, amp, max_windows=64):
    model.eval()
    out = []
    for i in range(0, min(len(held) - seq - 1, max_windows * seq), seq):
        x = torch.from_numpy(held[i:i + seq + 1][None])
        loss, mloss, _, st = losses(model, x, ng, device, amp)
        out.append([loss.item(), mloss.item(), st["mtp_acc"], st["mtp_agree"], st["main_acc"]])
    model.train()
    m = np.mean(out, 0)
    return dict(held_out_loss=m[0], held_out_mtp_loss=m[1], held_out_mtp_acc=m[2],
                held_out_mtp_agree=m[3], held_out_acc=m[4])


@torch.no_grad()
def window_perplexity(model, ids, ng, device, window=256):
    """slotstream perplexity's windows: consecutive, each from an empty state; float32."""
    model.eval()
    nll, n = 0.0, 0
    for s in range(0, len(ids) - window + 1, window):
        w = torch.tensor([ids[s:s + window]])
        gid = torch.from_numpy(ng.ids(w.numpy())).to(device)
        logits, _, _ = model(w.to(device), gid)
        lp = torch.log_softmax(logits[0].double(), -1)
        tgt = w[0, 1:].to(device)
        nll -= lp[:-1].gather(1, tgt[:, None]).sum().item()
        n += window - 1
    return dict(window=window, windows=len(range(0, len(ids) - window + 1, window)), predicted_tokens=n,
                mean_nll=nll / n, perplexity=math.exp(nll / n))


@torch.no_grad()
def greedy(model, tok, ng, device, prompt, n=40, amp=False):
    ids = tok.encode(prompt).ids
    drafts = []
    for _ in range(n):
        x = torch.tensor([ids])
        gid = torch.from_numpy(ng.ids(x.numpy())).to(device)
        AMP["on"] = amp
        with torch.autocast(AMP["device"], dtype=torch.bfloat16, enabled=amp):
            logits, hid, _ = model(x.to(device), gid)
        AMP["on"] = False
        ids.append(int(logits[0, -1].argmax()))
    return tok.decode(ids)


# ----------------------------------------------------------------------------- main


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", default=os.path.join(HERE, "..", "demo", "tokenizer"))
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=4.5)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: time only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", type=int, default=-1, help="bf16 autocast (default: on for cuda)")
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--final-windows", type=int, default=128, help="held-out windows of the final evaluations")
    p.add_argument("--check-file", default=os.path.join(HERE, "..", "demo", "heldout_sample.txt"))
    a = p.parse_args()

    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    device = a.device
    amp = device == "cuda" if a.amp < 0 else bool(a.amp)
    AMP["device"] = "cuda" if device == "cuda" else "cpu"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == EOS
    tc = text_config()
    ng = Ngram(tc)
    train, held = load_tokens(a.corpus, tok)
    print(f"tokens: train {len(train)}, held-out {len(held)}", flush=True)

    model = Qwen4Exp(tc, ng).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp"))
    print(f"parameters: {n_params / 1e6:.2f}M (MTP head {n_mtp / 1e6:.2f}M)", flush=True)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=device == "cuda")
    budget = a.minutes * 60
    warmup = 100
    log = {"dims": DIMS, "params": n_params, "mtp_params": n_mtp, "seed": a.seed, "batch": a.batch, "seq": a.seq,
           "lr": a.lr, "mtp_weight": a.mtp_weight, "aux_weight": a.aux_weight, "steps": []}
    start = time.time()
    step, tokens_seen = 0, 0
    while True:
        elapsed = time.time() - start
        if elapsed > budget or (a.steps and step >= a.steps):
            break
        frac = elapsed / budget
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train) - a.seq - 1, size=a.batch)
        x = torch.from_numpy(np.stack([train[s:s + a.seq + 1] for s in starts]))
        loss, mloss, aux, st = losses(model, x, ng, device, amp)
        total = loss + a.mtp_weight * mloss + a.aux_weight * aux
        total.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += a.batch * a.seq
        if step % 50 == 0 or (a.steps and step == a.steps - 1):
            entry = {"step": step, "seconds": round(time.time() - start, 1), "tokens": tokens_seen, "lr": lr,
                     "train_loss": loss.item(), "train_mtp_loss": mloss.item(), "aux": float(aux),
                     "grad_norm": float(gn), **st}
            if step % a.eval_every == 0:
                entry.update(evaluate(model, held, a.seq, ng, device, amp, max_windows=16))
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
        step += 1
    train_seconds = time.time() - start
    final = evaluate(model, held, a.seq, ng, device, amp, max_windows=a.final_windows)
    log.update(train_seconds=round(train_seconds, 1), total_steps=step, tokens_seen=tokens_seen, final=final,
               final_held_out_perplexity=math.exp(final["held_out_loss"]))
    print(json.dumps({"final": final, "steps": step, "tokens": tokens_seen, "seconds": train_seconds}), flush=True)
    model.eval()
    log["greedy_sample_bf16"] = greedy(model, tok, ng, device, "The sea was calm, and the ship", amp=amp)
    print("sample:", log["greedy_sample_bf16"], flush=True)

    # quantize, write the checkpoint, load the dequantized weights back, and record what the
    # engine / oracle must reproduce (float32, no autocast)
    import export

    export.write_model(model, tc, ng, a.out)
    model = model.float()
    check_ids = tok.encode(open(a.check_file, encoding="utf-8").read(), add_special_tokens=False).ids
    log["quantized"] = dict(window_perplexity=window_perplexity(model, check_ids, ng, device),
                            held_out=evaluate(model, held, a.seq, ng, device, False, max_windows=a.final_windows))
    log["greedy_sample_quantized"] = greedy(model, tok, ng, device, "The sea was calm, and the ship")
    print(json.dumps(log["quantized"]), "\nsample (4-bit):", log["greedy_sample_quantized"], flush=True)
    log["check"] = export.check_logits(model, check_ids[:200], ng, device)
    with open(os.path.join(a.out, "training_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print("wrote", a.out, flush=True)


if __name__ == "__main__":
    main()
