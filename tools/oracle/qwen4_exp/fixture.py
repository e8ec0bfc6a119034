"""Config and random weights of the tiny qwen4_exp fixture, written in the on-disk layout of the
real MLX 4-bit Qwen3.8-Flash-Next checkpoint (see README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from model import ngram_tables

BF16 = ml_dtypes.bfloat16
LM = "language_model."

TEXT_CONFIG = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 509,
    "dtype": "bfloat16",
    "eos_token_id": 509,
    "full_attention_interval": 3,
    "hc_count": 4,
    "hc_lowrank": 64,
    "head_dim": 64,
    "heads_per_ngram": 8,
    "hidden_act": "silu",
    "hidden_size": 128,
    "indexer_budget": 32,
    "indexer_compress_ratio": 4,
    "indexer_head_dim": 32,
    "indexer_kv_heads": 1,
    "indexer_n_heads": 4,
    "initializer_range": 0.02,
    "layer_types": ["linear_attention", "linear_attention", "full_attention",
                    "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_value_head_dim": 32,
    "make_ngram_vocab_size_divisible_by": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 4096,
    "model_type": "qwen4_exp_text",
    "moe_intermediate_size": 64,
    "mtp": {
        "hybrid": True,
        "layer_types": ["full_attention"],
        "mtp_use_hidden_state_from_layer": None,
        "num_hidden_layers": 1,
        "rope_theta": 10000000,
    },
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "ngram_size": 3,
    "ngram_vocab_size_base": 1000,
    "num_attention_heads": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 6,
    "num_key_value_heads": 2,
    "output_gate_type": "sigmoid",
    "output_router_logits": False,
    "pad_token_id": None,
    "partial_rotary_factor": 0.25,
    "ple_conv_kernel_size": 4,
    "ple_embed_dim": 512,
    "ple_layer_ids": [2],
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 64,
    "split_ngram_parts": 16,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 512,
}

VISION_CONFIG = {
    "deepstack_visual_indexes": [],
    "depth": 1,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 32,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "model_type": "qwen4_exp",
    "num_heads": 2,
    "num_position_embeddings": 16,
    "out_hidden_size": 128,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def quantization() -> dict:
    q = {"group_size": 64, "bits": 4}
    for k in range(TEXT_CONFIG["split_ngram_parts"]):
        q[f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{k}"] = {"group_size": 32, "bits": 4}
    return q


def config() -> dict:
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "image_token_id": 510,  # unused by the text model; vocab has no image tokens
        "language_model_only": False,
        "model_type": "qwen4_exp",
        "text_config": TEXT_CONFIG,
        "tie_word_embeddings": False,
        "transformers_version": "5.8.0.dev0",
        "video_token_id": 511,
        "vision_config": VISION_CONFIG,
        "vision_end_token_id": 511,
        "vision_start_token_id": 510,
        "quantization": quantization(),
        "quantization_config": quantization(),
        "model_file": "qwen4_exp.py",
    }


GENERATION_CONFIG = {"bos_token_id": 509, "eos_token_id": 509, "pad_token_id": 509, "do_sample": False}


# ----------------------------------------------------------------------------- quantization


def quantize_affine(w: np.ndarray, group: int, bits: int = 4):
    """MLX affine layout: w ~ scale*q + bias per group of `group` inputs, q in [0, 2^bits-1].

    scale = (max-min)/(2^bits-1) and bias = min, both rounded to bf16; q packed 32/bits per
    u32 word, element i of a word at bits [bits*i, bits*i+bits)."""
    n = (1 << bits) - 1
    shp = w.shape
    g = w.reshape(*shp[:-1], shp[-1] // group, group).astype(np.float64)
    mn, mx = g.min(-1), g.max(-1)
    scale = ((mx - mn) / n).astype(np.float32).astype(BF16)
    bias = mn.astype(np.float32).astype(BF16)
    s64, b64 = scale.astype(np.float64), bias.astype(np.float64)
    q = np.clip(np.rint((g - b64[..., None]) / s64[..., None]), 0, n).astype(np.uint32)
    per = 32 // bits
    q = q.reshape(*shp[:-1], shp[-1] // per, per)
    words = np.zeros(q.shape[:-1], dtype=np.uint32)
    for i in range(per):
        words |= q[..., i] << np.uint32(bits * i)
    return words, scale, bias


# ----------------------------------------------------------------------------- weights


class Gen:
    def __init__(self, seed: int, gains: dict):
        self.rng = np.random.default_rng(seed)
        self.gains = gains
        self.out: Dict[str, np.ndarray] = {}

    def normal(self, shape, std, mean=0.0):
        return mean + std * self.rng.standard_normal(shape)

    def q4(self, name, shape, gain=1.0, group=64, std=None):
        w = self.normal(shape, std if std is not None else gain / np.sqrt(shape[-1]))
        words, s, b = quantize_affine(w, group)
        self.out[name + ".weight"], self.out[name + ".scales"], self.out[name + ".biases"] = words, s, b

    def bf16(self, name, shape, std, mean=0.0):
        self.out[name] = self.normal(shape, std, mean).astype(np.float32).astype(BF16)

    def linear_bf16(self, name, out_dim, in_dim, gain=1.0):
        self.bf16(name + ".weight", (out_dim, in_dim), gain / np.sqrt(in_dim))

    def norm(self, name, dim, spread=0.1):
        self.bf16(name, (dim,), spread, mean=1.0)


def hyper_connection(g: Gen, pre: str, tc: dict, combine=True):
    hcd = tc["hc_count"] * tc["hidden_size"]
    g.norm(pre + ".hc_norm.weight", hcd)
    g.q4(pre + ".input_mix_weight_down", (tc["hc_lowrank"], hcd), g.gains["hc_down"])
    g.q4(pre + ".input_mix_weight_up", (hcd, tc["hc_lowrank"]), g.gains["hc_up"])
    if combine:
        g.linear_bf16(pre + ".block_inject_weight", tc["hc_count"], hcd, g.gains["inject"])


def moe(g: Gen, pre: str, tc: dict):
    H, E, I = tc["hidden_size"], tc["num_experts"], tc["moe_intermediate_size"]
    g.linear_bf16(pre + ".gate", E, H, g.gains["router"])
    g.q4(pre + ".switch_mlp.gate_proj", (E, I, H))
    g.q4(pre + ".switch_mlp.up_proj", (E, I, H))
    g.q4(pre + ".switch_mlp.down_proj", (E, H, I), g.gains["expert_down"])
    Is = tc["shared_expert_intermediate_size"]
    g.q4(pre + ".shared_expert.gate_proj", (Is, H))
    g.q4(pre + ".shared_expert.up_proj", (Is, H))
    g.q4(pre + ".shared_expert.down_proj", (H, Is), g.gains["expert_down"])
    g.linear_bf16(pre + ".shared_expert_gate", 1, H)


def full_attention(g: Gen, pre: str, tc: dict):
    H, nh, nkv, hd = tc["hidden_size"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    g.q4(pre + ".q_proj", (nh * hd * 2, H))
    g.q4(pre + ".k_proj", (nkv * hd, H))
    g.q4(pre + ".v_proj", (nkv * hd, H))
    g.q4(pre + ".o_proj", (H, nh * hd))
    g.norm(pre + ".q_norm.weight", hd)
    g.norm(pre + ".k_norm.weight", hd)
    ihd = tc["indexer_head_dim"]
    g.linear_bf16(pre + ".indexer.index_qk_proj",
                  (tc["indexer_n_heads"] + tc["indexer_kv_heads"]) * ihd, H, g.gains["indexer"])
    # the indexer scores see q/k only through these norms: their scale sets the score spread
    g.bf16(pre + ".indexer.q_layernorm.weight", (ihd,), 0.1 * g.gains["indexer_norm"], g.gains["indexer_norm"])
    g.bf16(pre + ".indexer.k_layernorm.weight", (ihd,), 0.1 * g.gains["indexer_norm"], g.gains["indexer_norm"])


def gated_deltanet(g: Gen, pre: str, tc: dict):
    H = tc["hidden_size"]
    nk, nv, dk, dv = (tc["linear_num_key_heads"], tc["linear_num_value_heads"],
                      tc["linear_key_head_dim"], tc["linear_value_head_dim"])
    C = 2 * nk * dk + nv * dv
    g.q4(pre + ".in_proj_qkv", (C, H))
    g.q4(pre + ".in_proj_z", (nv * dv, H))
    g.linear_bf16(pre + ".in_proj_b", nv, H)
    g.linear_bf16(pre + ".in_proj_a", nv, H)
    g.bf16(pre + ".conv1d.weight", (C, tc["linear_conv_kernel_dim"], 1), 0.5)
    g.out[pre + ".A_log"] = np.log(g.rng.uniform(0.5, 4.0, nv)).astype(np.float32).astype(BF16)
    g.out[pre + ".dt_bias"] = g.normal((nv,), 0.5).astype(np.float32).astype(BF16)
    g.norm(pre + ".norm.weight", dv)
    g.q4(pre + ".out_proj", (H, nv * dv))


def ple(g: Gen, pre: str, tc: dict, ple_index: int):
    H, hc, D = tc["hidden_size"], tc["hc_count"], tc["ple_embed_dim"]
    mults, sizes, offsets, rows = ngram_tables(tc, ple_index)
    n_heads = (tc["ngram_size"] - 1) * tc["heads_per_ngram"]
    hd = D // n_heads
    e = pre + ".ple_embedding."
    g.out[e + "layer_multipliers"] = np.array(mults, dtype=np.int64)
    g.out[e + "ngram_heads_vocab_sizes"] = np.array(sizes, dtype=np.int64)
    g.out[e + "ngram_heads_offsets"] = np.array(offsets, dtype=np.int64)
    for k in range(tc["split_ngram_parts"]):
        g.q4(e + f"ngram_embedding.shard_{k}", (rows, hd), group=hd, std=g.gains["ngram_emb"])
    g.q4(pre + ".key_proj", (hc * H, D))
    g.q4(pre + ".value_proj", (H, D))
    g.norm(pre + ".norm_key.weight", hc * H)
    g.norm(pre + ".norm_query.weight", hc * H)
    g.norm(pre + ".norm_conv.weight", hc * H)
    g.bf16(pre + ".conv1d.weight", (hc * H, tc["ple_conv_kernel_size"], 1), 0.5)


def decoder_layer(g: Gen, pre: str, tc: dict, ltype: str, ple_index=None):
    if ple_index is not None:
        ple(g, pre + ".ple", tc, ple_index)
    hyper_connection(g, pre + ".attn_hyper_connection", tc)
    hyper_connection(g, pre + ".mlp_hyper_connection", tc)
    if ltype == "linear_attention":
        gated_deltanet(g, pre + ".linear_attn", tc)
    else:
        full_attention(g, pre + ".self_attn", tc)
    moe(g, pre + ".mlp", tc)


def vision(g: Gen) -> Dict[str, np.ndarray]:
    vc = VISION_CONFIG
    d, p = vc["hidden_size"], vc["patch_size"]
    v = "vision_tower."
    g.bf16(v + "patch_embed.proj.weight", (d, vc["in_channels"], vc["temporal_patch_size"], p, p), 0.05)
    g.bf16(v + "patch_embed.proj.bias", (d,), 0.02)
    g.bf16(v + "pos_embed.weight", (vc["num_position_embeddings"], d), 0.02)
    g.bf16(v + "blocks.0.attn.qkv.weight", (3 * d, d), 0.05)
    g.bf16(v + "blocks.0.attn.qkv.bias", (3 * d,), 0.02)
    g.bf16(v + "blocks.0.attn.proj.weight", (d, d), 0.05)
    g.bf16(v + "blocks.0.attn.proj.bias", (d,), 0.02)
    g.norm(v + "blocks.0.norm1.weight", d)
    g.bf16(v + "blocks.0.norm1.bias", (d,), 0.02)


def language_model(seed: int, gains: dict) -> Dict[str, np.ndarray]:
    """All `language_model.*` and `vision_tower.*` tensors, keyed by their checkpoint names."""
    tc = TEXT_CONFIG
    g = Gen(seed, gains)
    H, V = tc["hidden_size"], tc["vocab_size"]
    g.q4("model.embed_tokens", (V, H), std=gains["embed"])
    g.q4("lm_head", (V, H), gains["lm_head"])
    hyper_connection(g, "model.hyper_connection_mixer", tc, combine=False)
    for i, lt in enumerate(tc["layer_types"]):
        pi = tc["ple_layer_ids"].index(i + 1) if (i + 1) in tc["ple_layer_ids"] else None
        decoder_layer(g, f"model.layers.{i}", tc, lt, pi)
    out = {LM + k: v for k, v in g.out.items()}
    gv = Gen(seed + 1000, gains)
    vision(gv)
    out.update(gv.out)
    return out


def mtp_head(seed: int, gains: dict) -> Dict[str, np.ndarray]:
    tc = TEXT_CONFIG
    g = Gen(seed, gains)
    H, hc = tc["hidden_size"], tc["hc_count"]
    g.q4("mtp.fc_embedding", (H, H))
    g.q4("mtp.fc_hidden", (H, H))
    g.norm("mtp.pre_fc_norm_embedding.weight", H)
    g.norm("mtp.pre_fc_norm_hidden.weight", hc * H)
    decoder_layer(g, "mtp.layers.0", tc, "full_attention")
    hyper_connection(g, "mtp.hyper_connection_mixer", tc, combine=False)
    return g.out


# ----------------------------------------------------------------------------- files


def shard_of(key: str) -> int:
    """Which of model-0000{1,2,3}.safetensors holds a tensor. Layers 1 and 3 straddle two files
    (the real checkpoint splits layers across shards too); embeddings/lm_head sit in the last."""
    k = key[len(LM):] if key.startswith(LM) else key
    if k.startswith("vision_tower.") or k.startswith("model.hyper_connection_mixer."):
        return 1
    if k.startswith("model.embed_tokens.") or k.startswith("lm_head."):
        return 3
    layer = int(k.split(".")[2])
    if layer == 0:
        return 1
    if layer == 1:
        if ".ngram_embedding.shard_" in k:
            return 1 if int(k.split("shard_")[1].split(".")[0]) < 8 else 2
        return 2 if ".mlp." in k else 1
    if layer == 2:
        return 2
    if layer == 3:
        return 3 if ".mlp.switch_mlp." in k else 2
    return 3


def write_json(path: Path, obj, indent=2):
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def write_checkpoint(out_dir: Path, lm: Dict[str, np.ndarray], mtp: Dict[str, np.ndarray]):
    out_dir.mkdir(parents=True, exist_ok=True)
    parts: List[Dict[str, np.ndarray]] = [{}, {}, {}]
    for k in sorted(lm):
        parts[shard_of(k) - 1][k] = np.ascontiguousarray(lm[k])
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}.safetensors"
        save_file(part, str(out_dir / fname), metadata={"format": "mlx"})
        for k, v in part.items():
            weight_map[k] = fname
            total += v.nbytes
    write_json(out_dir / "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    save_file({k: np.ascontiguousarray(mtp[k]) for k in sorted(mtp)}, str(out_dir / "mtp.safetensors"),
              metadata={"format": "mlx"})
    write_json(out_dir / "config.json", config())
    write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
