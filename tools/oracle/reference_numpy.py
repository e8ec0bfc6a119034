"""Independent float64 numpy forward of the fixtures, written from the math.

This is not the oracle (mlx-lm is); it is a second, plain implementation that
reads the checkpoint files itself (HF layout: own sanitize; MLX layout: own
4/8-bit affine unpacking) and checks that the math described in
tools/oracle/README.md reproduces the goldens.  It also measures how far the
float32 goldens are from a float64 computation, which is the tolerance a
float32 reimplementation should expect.

    .venv/bin/python tools/oracle/reference_numpy.py [tests/fixtures]
"""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for load_file)


# ---------------------------------------------------------------- loading --

def dequantize(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int):
    """MLX affine: u32 words, element i of a word at bits [bits*i, bits*(i+1))."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*w.shape[:-1], w.shape[-1] * per_word).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), group, axis=-1)
    b = np.repeat(biases.astype(np.float64), group, axis=-1)
    return s * q + b


def load_weights(d: Path, config: dict) -> dict:
    raw = {}
    for f in sorted(d.glob("model*.safetensors")):
        raw.update(load_file(str(f)))
    quant = config.get("quantization")
    w = {}
    for k, v in raw.items():
        if k.endswith((".scales", ".biases")):
            continue
        if quant is not None and k.endswith(".weight") and f"{k[:-7]}.scales" in raw:
            p = k[:-7]
            q = quant.get(p, quant)
            if q.get("mode", "affine") != "affine":
                raise ValueError(f"{p}: mode {q['mode']} not supported")
            w[k] = dequantize(v, raw[f"{p}.scales"], raw[f"{p}.biases"], q["bits"], q["group_size"])
        else:
            w[k] = v.astype(np.float64)
    # Vision-language checkpoints (qwen3_5_moe): the language model's names.
    w = {k.removeprefix("language_model.").replace("model.language_model.", "model.", 1): v for k, v in w.items()}
    if not any(".experts." in k for k in w):
        return w  # MLX layout: already stacked / shifted / [C, K, 1]
    # HF layout -> the layout this file computes with.
    out = {}
    E = config["num_experts"]
    for k, v in w.items():
        if k.endswith(".mlp.experts.gate_up_proj"):  # transformers 5: [E, 2I, H], gate first
            prefix = k.removesuffix(".experts.gate_up_proj")
            half = v.shape[1] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"], out[f"{prefix}.switch_mlp.up_proj.weight"] = v[:, :half], v[:, half:]
            continue
        if k.endswith(".mlp.experts.down_proj"):
            out[k.replace(".experts.down_proj", ".switch_mlp.down_proj.weight")] = v
            continue
        if ".mlp.experts." in k:
            prefix, rest = k.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            stacked = out.setdefault(f"{prefix}.mlp.switch_mlp.{proj}", [None] * E)
            stacked[int(e)] = v
            continue
        if config["model_type"] in ("qwen3_next", "qwen3_5_moe"):
            if k.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight",
                           "model.norm.weight", ".q_norm.weight", ".k_norm.weight")):
                v = v + 1.0  # HF stores w of a (1+w) norm
            if k.endswith("conv1d.weight"):
                v = np.moveaxis(v, 2, 1)  # [C, 1, K] -> [C, K, 1]
        out[k] = v
    for k in [k for k in out if isinstance(out[k], list)]:
        out[k] = np.stack(out.pop(k))
    return out


# ----------------------------------------------------------------- layers --

def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def linear(x, w):
    return x @ w.T


def yarn_frequencies(inv, dims, theta, scaling, max_positions):
    """YaRN (Peng et al. 2023, "NTK-by-parts" + attention factor), from the paper's formulas.

    A pair whose wavelength 2*pi/inv turns more than beta_fast times over the trained
    context L keeps its frequency; fewer than beta_slow times, it is divided by the
    factor s; between, a linear blend over the pair index. The pair index that turns r
    times is d * ln(L / (2*pi*r)) / (2 ln theta). cos and sin are scaled by the
    attention factor (default 0.1 ln s + 1).
    """
    s = float(scaling["factor"])
    L = float(scaling.get("original_max_position_embeddings") or max_positions)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def pair_turning(r):
        return dims * np.log(L / (2 * np.pi * r)) / (2 * np.log(theta))

    low, high = pair_turning(fast), pair_turning(slow)
    if scaling.get("truncate", True):
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, dims - 1.0)
    if low == high:
        high += 0.001
    slowed = np.clip((np.arange(len(inv), dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    blended = inv / s * slowed + inv * (1.0 - slowed)
    factor = scaling.get("attention_factor")
    if factor is None:
        def m(scale):
            return 1.0 if s <= 1 else 0.1 * scale * np.log(s) + 1.0
        ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        factor = m(ms) / m(ms_all) if ms and ms_all else m(1.0)
    return blended, float(factor)


def rope(x, dims, cfg, positions):
    """Rotate-half (non-interleaved) RoPE on the first `dims` features. x: [L, H, D].

    Plain RoPE at cfg["rope_theta"], or YaRN when cfg["rope_scaling"] asks for it.
    """
    half, theta = dims // 2, float(cfg["rope_theta"])
    inv = theta ** (-np.arange(0, half, dtype=np.float64) * 2.0 / dims)
    magnitude = 1.0
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "yarn":
        inv, magnitude = yarn_frequencies(inv, dims, theta, scaling, cfg.get("max_position_embeddings"))
    elif kind != "default":
        raise ValueError(f"rope_scaling {kind} is not implemented here")
    ang = positions[:, None] * inv[None, :]
    cos, sin = magnitude * np.cos(ang)[:, None, :], magnitude * np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., dims:]], axis=-1)


def attention(q, k, v, scale):
    """Causal GQA. q: [L, Hq, D], k/v: [L, Hkv, D] -> [L, Hq, D]."""
    L, Hq, _ = q.shape
    rep = Hq // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # head h uses kv head h // rep
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    s = np.where(np.tril(np.ones((L, L), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def mlp(x, w, p):
    return linear(silu(linear(x, w[f"{p}.gate_proj.weight"])) * linear(x, w[f"{p}.up_proj.weight"]),
                  w[f"{p}.down_proj.weight"])


def moe(x, w, p, cfg):
    """softmax over all experts -> top-k -> (optionally) renormalise -> weighted sum."""
    probs = np.exp(linear(x, w[f"{p}.gate.weight"]))
    probs /= probs.sum(-1, keepdims=True)
    k = cfg["num_experts_per_tok"]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        idx = np.argsort(-probs[t], kind="stable")[:k]
        sc = probs[t, idx]
        if cfg["norm_topk_prob"]:
            sc = sc / sc.sum()
        for e, s in zip(idx, sc):
            g = w[f"{p}.switch_mlp.gate_proj.weight"][e] @ x[t]
            u = w[f"{p}.switch_mlp.up_proj.weight"][e] @ x[t]
            y[t] += s * (w[f"{p}.switch_mlp.down_proj.weight"][e] @ (silu(g) * u))
    if f"{p}.shared_expert_gate.weight" in w:
        y += sigmoid(linear(x, w[f"{p}.shared_expert_gate.weight"])) * mlp(x, w, f"{p}.shared_expert")
    return y


def qwen3_moe_attention(x, w, p, cfg):
    L = x.shape[0]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, pos = cfg["rms_norm_eps"], np.arange(L, dtype=np.float64)
    q = rms_norm(linear(x, w[f"{p}.q_proj.weight"]).reshape(L, nh, hd), w[f"{p}.q_norm.weight"], eps)
    k = rms_norm(linear(x, w[f"{p}.k_proj.weight"]).reshape(L, nkv, hd), w[f"{p}.k_norm.weight"], eps)
    v = linear(x, w[f"{p}.v_proj.weight"]).reshape(L, nkv, hd)
    q, k = rope(q, hd, cfg, pos), rope(k, hd, cfg, pos)
    return linear(attention(q, k, v, hd ** -0.5).reshape(L, nh * hd), w[f"{p}.o_proj.weight"])


def qwen3_next_attention(x, w, p, cfg):
    """Gated attention: q_proj gives [query | gate] per head; output * sigmoid(gate)."""
    L = x.shape[0]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, pos = cfg["rms_norm_eps"], np.arange(L, dtype=np.float64)
    qg = linear(x, w[f"{p}.q_proj.weight"]).reshape(L, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
    q = rms_norm(q, w[f"{p}.q_norm.weight"], eps)
    k = rms_norm(linear(x, w[f"{p}.k_proj.weight"]).reshape(L, nkv, hd), w[f"{p}.k_norm.weight"], eps)
    v = linear(x, w[f"{p}.v_proj.weight"]).reshape(L, nkv, hd)
    rd = int(hd * cfg["partial_rotary_factor"])
    q, k = rope(q, rd, cfg, pos), rope(k, rd, cfg, pos)
    o = attention(q, k, v, hd ** -0.5).reshape(L, nh * hd)
    return linear(o * sigmoid(gate), w[f"{p}.o_proj.weight"])


def gated_deltanet(x, w, p, cfg):
    L = x.shape[0]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    r = nv // nk
    if f"{p}.in_proj_qkv.weight" in w:
        # qwen3_5_moe: [all q | all k | all v], z, b and a, each its own projection.
        qkv = linear(x, w[f"{p}.in_proj_qkv.weight"])
        q = qkv[:, :nk * dk].reshape(L, nk, dk)
        k = qkv[:, nk * dk:2 * nk * dk].reshape(L, nk, dk)
        v = qkv[:, 2 * nk * dk:].reshape(L, nv, dv)
        z = linear(x, w[f"{p}.in_proj_z.weight"]).reshape(L, nv, dv)
        b, a = linear(x, w[f"{p}.in_proj_b.weight"]), linear(x, w[f"{p}.in_proj_a.weight"])
    else:
        # qwen3_next groups per key head: [q(dk) k(dk) v(r*dv) z(r*dv)] and [b(r) a(r)].
        qkvz = linear(x, w[f"{p}.in_proj_qkvz.weight"]).reshape(L, nk, 2 * dk + 2 * r * dv)
        ba = linear(x, w[f"{p}.in_proj_ba.weight"]).reshape(L, nk, 2 * r)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(L, nv, dv)
        z = qkvz[..., 2 * dk + r * dv:].reshape(L, nv, dv)
        b, a = ba[..., :r].reshape(L, nv), ba[..., r:].reshape(L, nv)

    # Causal depthwise conv over channels [all q | all k | all v], then SiLU.
    mixed = np.concatenate([q.reshape(L, -1), k.reshape(L, -1), v.reshape(L, -1)], axis=-1)
    cw = w[f"{p}.conv1d.weight"][:, :, 0]  # [C, K]; tap K-1 multiplies the current token
    padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed], axis=0)
    conv = silu(sum(padded[j:j + L] * cw[:, j] for j in range(K)))
    q = conv[:, :nk * dk].reshape(L, nk, dk)
    k = conv[:, nk * dk:2 * nk * dk].reshape(L, nk, dk)
    v = conv[:, 2 * nk * dk:].reshape(L, nv, dv)

    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = sigmoid(b)
    g = np.exp(-np.exp(w[f"{p}.A_log"]) * softplus(a + w[f"{p}.dt_bias"]))

    state = np.zeros((nv, dv, dk))
    y = np.zeros((L, nv, dv))
    for t in range(L):
        for h in range(nv):
            kh, qh = k[t, h // r], q[t, h // r]  # value head h reads key head h // r
            state[h] *= g[t, h]
            delta = (v[t, h] - state[h] @ kh) * beta[t, h]
            state[h] += np.outer(delta, kh)
            y[t, h] = state[h] @ qh
    out = rms_norm(y, w[f"{p}.norm.weight"], cfg["rms_norm_eps"]) * silu(z)  # plain w, no 1+
    return linear(out.reshape(L, nv * dv), w[f"{p}.out_proj.weight"])


def forward(w, cfg, ids):
    """Returns (logits of every position, per-layer hidden state of the last position)."""
    x = w["model.embed_tokens.weight"][np.array(ids)]
    eps = cfg["rms_norm_eps"]
    per_layer = []
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        h = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        if cfg["model_type"] == "qwen3_moe":
            x = x + qwen3_moe_attention(h, w, f"{p}.self_attn", cfg)
        elif (l + 1) % cfg["full_attention_interval"] != 0:
            x = x + gated_deltanet(h, w, f"{p}.linear_attn", cfg)
        else:
            x = x + qwen3_next_attention(h, w, f"{p}.self_attn", cfg)
        h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        if f"{p}.mlp.gate.weight" in w:
            x = x + moe(h, w, f"{p}.mlp", cfg)
        else:
            x = x + mlp(h, w, f"{p}.mlp")
        per_layer.append(x[-1].copy())
    x = rms_norm(x, w["model.norm.weight"], eps)
    return linear(x, w["lm_head.weight"]), per_layer


def check_fixture(d: Path) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    if "text_config" in cfg:  # a vision-language checkpoint: its language model's settings
        rope = cfg["text_config"].get("rope_parameters", {})
        cfg = cfg["text_config"] | {k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope} | {
            k: cfg[k] for k in ("model_type", "quantization") if k in cfg}
    golden = json.loads((d / "golden.json").read_text())
    w = load_weights(d, cfg)
    result = {}
    for case in golden["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"][:-1]
        logits, per_layer = forward(w, cfg, ids)
        P = len(case["prompt_ids"])
        want = np.array(case["last_logits"])
        result[f"{case['name']}.last_logits_max_abs_err"] = float(np.max(np.abs(logits[P - 1] - want)))
        greedy = [int(i) for i in np.argmax(logits[P - 1:], axis=-1)]
        result[f"{case['name']}.greedy_match"] = greedy == case["greedy_ids"]
        if case["name"] == "short":
            short_logits, short_layers = forward(w, cfg, case["prompt_ids"])
            errs = [float(np.max(np.abs(a - np.array(b))))
                    for a, b in zip(short_layers, golden["debug"]["short_layer_outputs"])]
            result["short.layer_outputs_max_abs_err"] = max(errs)
    return result


def main():
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "tests" / "fixtures"
    ok = True
    # qwen4_exp_tiny's goldens come from its own numpy oracle (tools/oracle/qwen4_exp).
    for d in sorted(p for p in root.iterdir() if (p / "golden.json").exists() and p.name != "qwen4_exp_tiny"):
        r = check_fixture(d)
        print(d.name, json.dumps(r))
        ok &= all(v for k, v in r.items() if k.endswith("greedy_match"))
        ok &= all(v < 1e-3 for k, v in r.items() if k.endswith("_err"))
    if not ok:
        raise SystemExit("numpy reference disagrees with the goldens")


if __name__ == "__main__":
    main()
