"""Float64 numpy forward pass for the qwen4_exp (Qwen3.8-Flash-Next) text model + MTP head.

Written from the math (see README.md next to this file), independent of mlx / mlx-lm.
It reads a checkpoint from disk in the MLX 4-bit layout (``language_model.*`` keys,
U32 packed weights + BF16 scales/biases, BF16 norms/routers, I64 n-gram buffers),
dequantizes every tensor to float64 once and then runs everything in float64.

The forward is written as a *chunk* step over an explicit ``State``: a cache-free pass
is one chunk from a fresh state, and prefill-in-chunks / token-by-token decode are
several calls on the same state. Every per-token decision (indexer block selection,
n-gram context, conv states) is defined per query position, so the result does not
depend on how a sequence is cut into chunks; ``build.py`` checks this.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from safetensors.numpy import load_file

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
PLE_SEED_STRIDE = 10007
DEFAULT_SEED = 1234  # config.json has no `seed`; the reference uses transformers' default


# ----------------------------------------------------------------------------- hashing


def splitmix64(v: int) -> int:
    v = (v + GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * SPLITMIX_M1) & MASK64
    v = ((v ^ (v >> 27)) * SPLITMIX_M2) & MASK64
    return (v ^ (v >> 31)) & MASK64


def is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    d = 3
    while d * d <= v:
        if v % d == 0:
            return False
        d += 2
    return True


def ngram_tables(tc: dict, ple_layer_index: int):
    """(multipliers[ngram_size], head sizes[n_heads], head offsets[n_heads], rows_per_shard)."""
    n = tc["ngram_size"]
    n_heads = (n - 1) * tc["heads_per_ngram"]
    # head h of PLE layer j uses the (j*n_heads + h + 1)-th prime >= base
    primes, p = [], tc["ngram_vocab_size_base"] - 1
    while len(primes) < (ple_layer_index + 1) * n_heads:
        p += 1
        while not is_prime(p):
            p += 1
        primes.append(p)
    sizes = primes[ple_layer_index * n_heads:]
    offsets = [int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]])]
    total = int(sum(sizes))
    div = tc["make_ngram_vocab_size_divisible_by"]
    padded = -(-total // div) * div
    rows_per_shard = -(-padded // tc["split_ngram_parts"])
    max_long = (1 << 63) - 1
    half = max(1, (max_long // max(tc["vocab_size"], 1)) // 2)
    base_seed = tc.get("seed", DEFAULT_SEED) + PLE_SEED_STRIDE * ple_layer_index
    mults = [2 * (splitmix64((base_seed + GAMMA * (i + 1)) & MASK64) % half) + 1 for i in range(n)]
    return mults, sizes, offsets, rows_per_shard


def to_i64(v: int) -> int:
    v &= MASK64
    return v - (1 << 64) if v >> 63 else v


def shift_right(hist: List[int], s: int, eos: int) -> List[int]:
    """history[p-s], or EOS when p-s < 0 or an EOS lies in history[p-s .. p-1]."""
    out = []
    for p in range(len(hist)):
        src = p - s
        if s == 0:
            out.append(hist[p])
        elif src < 0 or any(t == eos for t in hist[src:p]):
            out.append(eos)
        else:
            out.append(hist[src])
    return out


def ngram_global_ids(hist: List[int], mults, sizes, offsets, ngram_size, heads_per_ngram, eos):
    """Global n-gram row ids [len(hist), (ngram_size-1)*heads_per_ngram] for every history slot."""
    shifted = [shift_right(hist, s, eos) for s in range(ngram_size)]
    rows = []
    for p in range(len(hist)):
        row = []
        for n in range(2, ngram_size + 1):
            mixed = to_i64(shifted[0][p] * mults[0])
            for j in range(1, n):
                mixed = to_i64(mixed ^ to_i64(shifted[j][p] * mults[j]))
            lo = (n - 2) * heads_per_ngram
            for h in range(lo, lo + heads_per_ngram):
                row.append(mixed % sizes[h] + offsets[h])  # Python % = floor mod, >= 0
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- loading


def unpack_u32(w: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*w.shape[:-1], w.shape[-1] * per)


def dequantize(w, scales, biases, group: int, bits: int) -> np.ndarray:
    q = unpack_u32(w, bits).astype(np.float64)
    n_in = q.shape[-1]
    if n_in // group != scales.shape[-1] or n_in % group:
        raise ValueError(f"group {group} does not fit in={n_in} scales={scales.shape}")
    q = q.reshape(*q.shape[:-1], n_in // group, group)
    out = q * scales.astype(np.float64)[..., None] + biases.astype(np.float64)[..., None]
    return out.reshape(*q.shape[:-2], n_in)


def load_tensors(paths: List[Path], quant: dict, strip_prefix: str = "") -> Dict[str, np.ndarray]:
    raw: Dict[str, np.ndarray] = {}
    for p in paths:
        for k, v in load_file(str(p)).items():
            if k.startswith("vision_tower."):
                continue
            if strip_prefix and k.startswith(strip_prefix):
                k = k[len(strip_prefix):]
            raw[k] = v
    out: Dict[str, np.ndarray] = {}
    for k, v in raw.items():
        if k.endswith(".scales") or k.endswith(".biases"):
            continue
        mod = k[: -len(".weight")] if k.endswith(".weight") else None
        if mod is not None and mod + ".scales" in raw:
            q = quant.get(mod, {}) if isinstance(quant.get(mod), dict) else {}
            g, b = q.get("group_size", quant["group_size"]), q.get("bits", quant["bits"])
            out[k] = dequantize(v, raw[mod + ".scales"], raw[mod + ".biases"], g, b)
        elif v.dtype == np.int64:
            out[k] = v
        else:
            out[k] = v.astype(np.float64)
    return out


# ----------------------------------------------------------------------------- math helpers


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.logaddexp(0.0, x)


def rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_groups(x, group, eps):
    s = x.shape
    return rms(x.reshape(*s[:-1], -1, group), eps).reshape(s)


class State:
    """Everything a chunked/streaming run carries between calls."""

    def __init__(self, n_layers: int, ctx: List[int]):
        self.pos = 0
        self.ngram_ctx = list(ctx)  # last ngram_size-1 token ids (EOS-filled at start)
        self.layers = [dict() for _ in range(n_layers)]


class Qwen4Exp:
    def __init__(self, fixture_dir: Path, indexer_rule: str = "per_query"):
        fixture_dir = Path(fixture_dir)
        cfg = json.loads((fixture_dir / "config.json").read_text())
        self.cfg = cfg
        tc = self.tc = cfg["text_config"]
        quant = cfg["quantization"]
        index = json.loads((fixture_dir / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        self.W = load_tensors([fixture_dir / f for f in files], quant, strip_prefix="language_model.")
        mtp_path = fixture_dir / "mtp.safetensors"
        self.M = load_tensors([mtp_path], quant) if mtp_path.exists() else {}
        self.indexer_rule = indexer_rule

        self.H = tc["hidden_size"]
        self.hc = tc["hc_count"]
        self.eps = tc["rms_norm_eps"]
        self.layer_types = tc["layer_types"]
        eos = tc["eos_token_id"]
        self.eos = eos[0] if isinstance(eos, list) else eos
        rp = tc.get("rope_parameters") or {}
        theta = float(rp.get("rope_theta", tc.get("rope_theta", 1e7)))
        prf = float(rp.get("partial_rotary_factor", tc["partial_rotary_factor"]))
        self.rot = int(tc["head_dim"] * prf)
        self.inv_freq = theta ** (-np.arange(0, self.rot, 2, dtype=np.float64) / self.rot)
        # PLE layers: decoder layer i hosts PLE j when ple_layer_ids[j] == i + 1
        self.ple_of_layer = {
            i: tc["ple_layer_ids"].index(i + 1)
            for i in range(tc["num_hidden_layers"])
            if (i + 1) in tc["ple_layer_ids"]
        }
        self.ngram = {}
        for i, j in self.ple_of_layer.items():
            mults, sizes, offsets, rows = ngram_tables(tc, j)
            pre = f"model.layers.{i}.ple.ple_embedding."
            # like the reference, the buffers used are the checkpoint's
            ck = (
                [int(x) for x in self.W[pre + "layer_multipliers"]],
                [int(x) for x in self.W[pre + "ngram_heads_vocab_sizes"]],
                [int(x) for x in self.W[pre + "ngram_heads_offsets"]],
            )
            self.ngram[i] = dict(mults=ck[0], sizes=ck[1], offsets=ck[2], rows=rows,
                                 recomputed=(mults, sizes, offsets))
        self.stats = None  # set to a dict to record router / indexer statistics

    # ------------------------------------------------------------------ pieces
    def lin(self, P, name, x):
        return x @ P[name + ".weight"].T

    def rope(self, x, pos):
        """x [..., S, (heads,) d] rotated over its first `rot` dims at positions pos [S]."""
        f = np.asarray(pos, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([f, f], axis=-1)
        cos, sin = np.cos(emb), np.sin(emb)
        if x.ndim == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        half = self.rot // 2
        xr = x[..., : self.rot]
        rot = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
        return np.concatenate([xr * cos + rot * sin, x[..., self.rot:]], axis=-1)

    def gated_residual(self, P, pre, h, combine=True):
        S = h.shape[0]
        normed = rms_groups(h, self.H, self.eps) * P[pre + ".hc_norm.weight"]
        t = silu(self.lin(P, pre + ".input_mix_weight_down", normed) / self.hc)
        w = sigmoid(self.lin(P, pre + ".input_mix_weight_up", t)).reshape(S, self.hc, self.H)
        mixed = (w * normed.reshape(S, self.hc, self.H)).mean(axis=1)
        if not combine:
            return mixed
        inject = 2.0 * sigmoid(self.lin(P, pre + ".block_inject_weight", normed) / self.hc)
        return mixed, inject

    def gdn(self, P, pre, x, st):
        tc = self.tc
        S = x.shape[0]
        nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        K = tc["linear_conv_kernel_dim"]
        qkv = self.lin(P, pre + ".in_proj_qkv", x)
        z = self.lin(P, pre + ".in_proj_z", x).reshape(S, nv, dv)
        b = self.lin(P, pre + ".in_proj_b", x)
        a = self.lin(P, pre + ".in_proj_a", x)
        C = qkv.shape[1]
        cw = P[pre + ".conv1d.weight"][:, :, 0]  # [C, K]
        prev = st.get("conv", np.zeros((K - 1, C)))
        full = np.concatenate([prev, qkv], axis=0)
        st["conv"] = full[-(K - 1):].copy()
        conv = sum(cw[:, k][None, :] * full[k: k + S] for k in range(K))
        conv = silu(conv)
        kd = nk * dk
        q = conv[:, :kd].reshape(S, nk, dk)
        k = conv[:, kd: 2 * kd].reshape(S, nk, dk)
        v = conv[:, 2 * kd:].reshape(S, nv, dv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        beta = sigmoid(b)
        g = np.exp(-np.exp(P[pre + ".A_log"]) * softplus(a + P[pre + ".dt_bias"]))
        kh = np.arange(nv) // (nv // nk)
        Sst = st.get("ssm", np.zeros((nv, dv, dk)))
        y = np.zeros((S, nv, dv))
        for t in range(S):
            kk, qq = k[t][kh], q[t][kh]
            Sst = Sst * g[t][:, None, None]
            delta = (v[t] - np.einsum("hvk,hk->hv", Sst, kk)) * beta[t][:, None]
            Sst = Sst + delta[:, :, None] * kk[:, None, :]
            y[t] = np.einsum("hvk,hk->hv", Sst, qq)
        st["ssm"] = Sst
        o = rms(y, self.eps) * P[pre + ".norm.weight"] * sigmoid(z)
        return self.lin(P, pre + ".out_proj", o.reshape(S, nv * dv))

    def indexer_mask(self, P, pre, x, st, pos, tag):
        """Boolean [S, kv_len] attention mask produced by the QSA indexer (always causal)."""
        tc = self.tc
        nI, ihd = tc["indexer_n_heads"], tc["indexer_head_dim"]
        cr, budget = tc["indexer_compress_ratio"], tc["indexer_budget"]
        topk = budget // cr
        qk = x @ P[pre + ".index_qk_proj.weight"].T
        q = qk[:, : nI * ihd].reshape(-1, nI, ihd)
        rk = qk[:, nI * ihd:]  # kv_heads == 1
        keys = np.concatenate([st["idx_keys"], rk], 0) if "idx_keys" in st else rk
        st["idx_keys"] = keys
        kv_len = keys.shape[0]
        S = x.shape[0]
        key_pos = np.arange(kv_len)
        mask = key_pos[None, :] <= np.asarray(pos)[:, None]
        if self.indexer_rule == "reference" and kv_len <= budget:
            return mask
        n_blocks = kv_len // cr
        if n_blocks == 0:
            return mask
        pooled = keys[: n_blocks * cr].reshape(n_blocks, cr, ihd).mean(axis=1)
        pooled = rms(pooled, self.eps) * P[pre + ".k_layernorm.weight"]
        pooled = self.rope(pooled, np.arange(n_blocks) * cr)
        qn = rms(q, self.eps) * P[pre + ".q_layernorm.weight"]
        qn = self.rope(qn, pos)
        pre_relu = np.einsum("shd,nd->snh", qn, pooled) / math.sqrt(ihd)
        scores = np.maximum(pre_relu, 0.0).sum(-1)
        for s in range(S):
            p = int(pos[s])
            n_vis = (p + 1) // cr  # blocks entirely at or before p
            if self.indexer_rule == "per_query" and n_vis <= topk:
                continue  # every visible block kept: identical to the causal mask
            kcount = min(topk, n_blocks) if self.indexer_rule == "reference" else topk
            cand = np.arange(n_vis)
            sc = scores[s, :n_vis]
            order = sorted(cand.tolist(), key=lambda n: (-sc[n], n))
            kept = order[:kcount]
            row = np.zeros(kv_len, dtype=bool)
            for n in kept:
                row[n * cr: n * cr + cr] = True
            row[n_vis * cr: p + 1] = True
            row &= key_pos <= p
            if self.stats is not None and n_vis > kcount:
                srt = np.sort(sc)[::-1]
                zero = sc == 0.0
                self.stats["indexer"].append(dict(
                    # how clearly the zero-score blocks are zero / the others positive
                    zero_margin=float(-pre_relu[s, :n_vis][zero].max()) if zero.any() else None,
                    min_positive=float(sc[~zero].min()) if (~zero).any() else None,
                    tag=tag, pos=p, n_vis=n_vis, last_kept=float(srt[kcount - 1]),
                    first_dropped=float(srt[kcount]),
                    changed=bool((row != mask[s]).any())))
            mask[s] = row
        return mask

    def attention(self, P, pre, x, st, tag):
        tc = self.tc
        S = x.shape[0]
        nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
        pos = st["pos0"] + np.arange(S)
        mask = self.indexer_mask(P, pre + ".indexer", x, st, pos, tag)
        qg = self.lin(P, pre + ".q_proj", x).reshape(S, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(S, nh * hd)
        q = rms(q, self.eps) * P[pre + ".q_norm.weight"]
        k = rms(self.lin(P, pre + ".k_proj", x).reshape(S, nkv, hd), self.eps) * P[pre + ".k_norm.weight"]
        v = self.lin(P, pre + ".v_proj", x).reshape(S, nkv, hd)
        q, k = self.rope(q, pos), self.rope(k, pos)
        K = np.concatenate([st["K"], k], 0) if "K" in st else k
        V = np.concatenate([st["V"], v], 0) if "V" in st else v
        st["K"], st["V"] = K, V
        if self.stats is not None:
            self.stats.setdefault("masks", []).append((tag, pos.copy(), mask.copy()))
        kvh = np.arange(nh) // (nh // nkv)
        sc = np.einsum("shd,khd->hsk", q, K[:, kvh]) * hd ** -0.5
        sc = np.where(mask[None], sc, -np.inf)
        sc = sc - sc.max(-1, keepdims=True)
        p = np.exp(sc)
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hsk,khd->shd", p, V[:, kvh]).reshape(S, nh * hd)
        return self.lin(P, pre + ".o_proj", o * sigmoid(gate))

    def moe(self, P, pre, x, tag):
        tc = self.tc
        k = tc["num_experts_per_tok"]
        logits = x @ P[pre + ".gate.weight"].T
        order = np.argsort(-logits, axis=-1, kind="stable")
        top = order[:, :k]
        srt = np.take_along_axis(logits, order, -1)
        if self.stats is not None:
            self.stats["router"].append((tag, float((srt[:, k - 1] - srt[:, k]).min())))
        sel = np.take_along_axis(logits, top, -1)
        w = np.exp(sel - sel.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        Wg, Wu, Wd = (P[pre + f".switch_mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        out = np.zeros_like(x)
        for s in range(x.shape[0]):
            for j in range(k):
                e = top[s, j]
                hdn = silu(Wg[e] @ x[s]) * (Wu[e] @ x[s])
                out[s] += w[s, j] * (Wd[e] @ hdn)
        se = pre + ".shared_expert"
        shared = self.lin(P, se + ".down_proj",
                          silu(self.lin(P, se + ".gate_proj", x)) * self.lin(P, se + ".up_proj", x))
        return out + sigmoid(self.lin(P, pre + ".shared_expert_gate", x)) * shared

    def ple(self, P, pre, i, h, ids, st_model, st):
        tc = self.tc
        ng = self.ngram[i]
        S = h.shape[0]
        ctx_len = tc["ngram_size"] - 1
        hist = list(st_model.ngram_ctx) + [int(t) for t in ids]
        gid = ngram_global_ids(hist, ng["mults"], ng["sizes"], ng["offsets"],
                               tc["ngram_size"], tc["heads_per_ngram"], self.eos)[-S:]
        gid = np.asarray(gid, dtype=np.int64)
        st["new_ctx"] = hist[-ctx_len:]
        if self.stats is not None:
            self.stats.setdefault("ngram_ids", []).append(gid.copy())
        rows = ng["rows"]
        emb = np.stack([
            np.concatenate([P[f"{pre}.ple_embedding.ngram_embedding.shard_{g // rows}.weight"][g % rows]
                            for g in r]) for r in gid])
        hc, H = self.hc, self.H
        key = (rms_groups(self.lin(P, pre + ".key_proj", emb), H, self.eps)
               * P[pre + ".norm_key.weight"]).reshape(S, hc, H)
        value = self.lin(P, pre + ".value_proj", emb)
        query = (rms_groups(h, H, self.eps) * P[pre + ".norm_query.weight"]).reshape(S, hc, H)
        gate = (key * query).sum(-1) / math.sqrt(H)
        gate = np.sqrt(np.maximum(np.abs(gate), 1e-6)) * np.sign(gate)
        gated = (sigmoid(gate)[:, :, None] * value[:, None, :]).reshape(S, hc * H)
        cin = rms_groups(gated, H, self.eps) * P[pre + ".norm_conv.weight"]
        K, dil = tc["ple_conv_kernel_size"], tc["ngram_size"]
        n_state = (K - 1) * dil
        full = np.concatenate([st.get("ple_conv", np.zeros((n_state, hc * H))), cin], 0)
        st["ple_conv"] = full[-n_state:].copy()
        cw = P[pre + ".conv1d.weight"][:, :, 0]
        conv = sum(cw[:, k][None, :] * full[k * dil: k * dil + S] for k in range(K))
        return gated + silu(conv)

    def decoder_layer(self, P, pre, ltype, h, st, tag, ple_i=None, ids=None, st_model=None):
        if ple_i is not None:
            h = h + self.ple(P, pre + ".ple", ple_i, h, ids, st_model, st)
        x, inj = self.gated_residual(P, pre + ".attn_hyper_connection", h)
        if ltype == "linear_attention":
            x = self.gdn(P, pre + ".linear_attn", x, st)
        else:
            x = self.attention(P, pre + ".self_attn", x, st, tag)
        S = h.shape[0]
        h = h + (inj[:, :, None] * x[:, None, :]).reshape(S, -1)
        x, inj = self.gated_residual(P, pre + ".mlp_hyper_connection", h)
        x = self.moe(P, pre + ".mlp", x, tag)
        return h + (inj[:, :, None] * x[:, None, :]).reshape(S, -1)

    # ------------------------------------------------------------------ model
    def new_state(self) -> State:
        return State(len(self.layer_types), [self.eos] * (self.tc["ngram_size"] - 1))

    def embed(self, ids):
        return self.W["model.embed_tokens.weight"][np.asarray(ids)]

    def forward(self, ids, state: Optional[State] = None, layer_outputs: Optional[list] = None):
        """Process one chunk. Returns (logits [S,V], pre-mixer hyper state [S,hc*H], mixed [S,H])."""
        st = state if state is not None else self.new_state()
        ids = [int(t) for t in ids]
        S = len(ids)
        h = np.tile(self.embed(ids), (1, self.hc))
        new_ctx = None
        for i, lt in enumerate(self.layer_types):
            ls = st.layers[i]
            ls["pos0"] = st.pos
            h = self.decoder_layer(self.W, f"model.layers.{i}", lt, h, ls, tag=f"L{i}",
                                   ple_i=i if i in self.ple_of_layer else None, ids=ids, st_model=st)
            if "new_ctx" in ls:
                new_ctx = ls.pop("new_ctx")
            if layer_outputs is not None:
                layer_outputs.append(h.copy())
        if new_ctx is not None:
            st.ngram_ctx = new_ctx
        st.pos += S
        mixed = self.gated_residual(self.W, "model.hyper_connection_mixer", h, combine=False)
        return mixed @ self.W["lm_head.weight"].T, h, mixed

    # ------------------------------------------------------------------ MTP
    def new_mtp_state(self):
        return {"pos": 0, "layer": {}}

    def mtp_forward(self, next_ids, hidden, mst=None):
        """MTP entries: token ids [N] (token i+1) and main-model pre-mixer hyper states [N, hc*H]."""
        M = self.M
        mst = mst if mst is not None else self.new_mtp_state()
        N = len(next_ids)
        e = rms(self.embed(next_ids), self.eps) * M["mtp.pre_fc_norm_embedding.weight"]
        e = self.lin(M, "mtp.fc_embedding", e)
        hm = rms(hidden, self.eps) * M["mtp.pre_fc_norm_hidden.weight"]  # one statistic over hc*H
        f = self.lin(M, "mtp.fc_hidden", hm.reshape(N, self.hc, self.H))
        fused = (e[:, None, :] + f).reshape(N, self.hc * self.H)
        ls = mst["layer"]
        ls["pos0"] = mst["pos"]
        h = self.decoder_layer(M, "mtp.layers.0", "full_attention", fused, ls, tag="MTP")
        mst["pos"] += N
        mixed = self.gated_residual(M, "mtp.hyper_connection_mixer", h, combine=False)
        return mixed @ self.W["lm_head.weight"].T, h
