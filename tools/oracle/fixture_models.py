"""Tiny random Qwen3-MoE and Qwen3-Next models, written in Hugging Face layout.

Weights are drawn with numpy's `default_rng` (never MLX's RNG), rounded to
bfloat16, and kept in two layouts:

* "intended": the parameter names and shapes of mlx-lm's model classes
  (stacked `switch_mlp` experts, Qwen3-Next norms already holding 1+w,
  conv1d as [C, K, 1]).  This is what the model is supposed to compute with.
* Hugging Face: the reverse of mlx-lm's `sanitize` (one tensor per expert,
  zero-centred Qwen3-Next norms, conv1d as [C, 1, K]), saved with the
  safetensors numpy API as bf16, the way transformers writes checkpoints.

`build_fixtures.py` proves the two agree by loading the HF directory through
mlx-lm (which runs `sanitize`) and comparing against the intended weights.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

BF16 = ml_dtypes.bfloat16

# Token ids of the shared tokenizer (see tokenizer_train.py).
BOS_TOKEN_ID = 509  # <|endoftext|>
EOS_TOKEN_ID = 511  # <|im_end|>


@dataclass(frozen=True)
class FixtureSpec:
    name: str  # model family: "qwen3_moe" or "qwen3_next"
    seed: int
    config: dict
    init_weights: Callable[[np.random.Generator, dict], Dict[str, np.ndarray]]
    to_hf: Callable[[Dict[str, np.ndarray], dict], Dict[str, np.ndarray]]
    # How the HF checkpoint is split into shards: list of key predicates.
    shards: List[Callable[[str], bool]]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 and return the value as float32 (exactly representable)."""
    return np.asarray(x, dtype=np.float32).astype(BF16).astype(np.float32)


class Init:
    """Weight factory.  Every draw goes through one Generator in call order."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def normal(self, shape, std, mean=0.0):
        return bf16_round(mean + std * self.rng.standard_normal(shape, dtype=np.float32))

    def linear(self, out_dim, in_dim, gain=1.0):
        return self.normal((out_dim, in_dim), gain / np.sqrt(in_dim))

    def experts(self, n, out_dim, in_dim, gain=1.0):
        return self.normal((n, out_dim, in_dim), gain / np.sqrt(in_dim))

    def plain_norm(self, dim, spread=0.1):
        """RMSNorm weight used as-is (x * w)."""
        return self.normal((dim,), spread, mean=1.0)

    def shifted_norm(self, dim, spread=0.1):
        """RMSNorm weight of a (1+w) norm, in its applied form 1+w.

        Chosen on a 1/64 grid within [0.625, 1.375] so that both w and 1+w are
        exact in bf16: mlx-lm's sanitize adds 1.0 in bf16, and the round trip
        HF -> sanitize must reproduce the intended value bit for bit.
        """
        k = np.clip(np.round(spread * 64 * self.rng.standard_normal(dim)), -24, 24)
        return (1.0 + k / 64.0).astype(np.float32)


# --------------------------------------------------------------------------
# Qwen3-MoE
# --------------------------------------------------------------------------

QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": BOS_TOKEN_ID,
    "decoder_sparse_step": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "max_window_layers": 3,
    "mlp_only_layers": [0],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """Same rule as transformers and mlx-lm."""
    return (
        layer not in cfg["mlp_only_layers"]
        and cfg["num_experts"] > 0
        and (layer + 1) % cfg["decoder_sparse_step"] == 0
    )


# Scales that keep logits and router scores well separated (see README):
# logits come out with a std of about 6, router logits about 8.
LM_HEAD_GAIN = 6.0
ROUTER_GAIN = 8.0


def qwen3_moe_init(rng: np.random.Generator, cfg: dict) -> Dict[str, np.ndarray]:
    init = Init(rng)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    w = {"model.embed_tokens.weight": init.normal((V, H), 1.0)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        w[f"{p}.input_layernorm.weight"] = init.plain_norm(H)
        w[f"{p}.self_attn.q_proj.weight"] = init.linear(nh * hd, H)
        w[f"{p}.self_attn.k_proj.weight"] = init.linear(nkv * hd, H)
        w[f"{p}.self_attn.v_proj.weight"] = init.linear(nkv * hd, H)
        w[f"{p}.self_attn.o_proj.weight"] = init.linear(H, nh * hd)
        w[f"{p}.self_attn.q_norm.weight"] = init.plain_norm(hd)
        w[f"{p}.self_attn.k_norm.weight"] = init.plain_norm(hd)
        w[f"{p}.post_attention_layernorm.weight"] = init.plain_norm(H)
        if is_moe_layer(cfg, l):
            w[f"{p}.mlp.gate.weight"] = init.linear(E, H, ROUTER_GAIN)
            w[f"{p}.mlp.switch_mlp.gate_proj.weight"] = init.experts(E, I, H)
            w[f"{p}.mlp.switch_mlp.up_proj.weight"] = init.experts(E, I, H)
            w[f"{p}.mlp.switch_mlp.down_proj.weight"] = init.experts(E, H, I)
        else:
            Id = cfg["intermediate_size"]
            w[f"{p}.mlp.gate_proj.weight"] = init.linear(Id, H)
            w[f"{p}.mlp.up_proj.weight"] = init.linear(Id, H)
            w[f"{p}.mlp.down_proj.weight"] = init.linear(H, Id)
    w["model.norm.weight"] = init.plain_norm(H)
    w["lm_head.weight"] = init.linear(V, H, LM_HEAD_GAIN)
    return w


def unstack_experts(weights: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """mlx-lm `switch_mlp.{proj}.weight` [E, out, in] -> HF `experts.{e}.{proj}.weight`."""
    out = {}
    for k, v in weights.items():
        if ".mlp.switch_mlp." in k:
            prefix, rest = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{prefix}.experts.{e}.{rest}"] = v[e]
        else:
            out[k] = v
    return out


def qwen3_moe_to_hf(weights, cfg):
    return unstack_experts(weights)


# --------------------------------------------------------------------------
# Qwen3-Next
# --------------------------------------------------------------------------

QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": BOS_TOKEN_ID,
    "decoder_sparse_step": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "full_attention_interval": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 4096,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 64,
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}


def qwen3_next_is_linear(cfg: dict, layer: int) -> bool:
    return (layer + 1) % cfg["full_attention_interval"] != 0


def qwen3_next_init(rng: np.random.Generator, cfg: dict, split_projections: bool = False) -> Dict[str, np.ndarray]:
    init = Init(rng)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    K = cfg["linear_conv_kernel_dim"]
    E, I, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim

    w = {"model.embed_tokens.weight": init.normal((V, H), 1.0)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        w[f"{p}.input_layernorm.weight"] = init.shifted_norm(H)
        if qwen3_next_is_linear(cfg, l):
            a = f"{p}.linear_attn"
            if split_projections:  # qwen3_5_moe: q|k|v, z, b and a apart, not grouped per key head
                w[f"{a}.in_proj_qkv.weight"] = init.linear(2 * key_dim + value_dim, H)
                w[f"{a}.in_proj_z.weight"] = init.linear(value_dim, H)
                w[f"{a}.in_proj_b.weight"] = init.linear(nv, H)
                w[f"{a}.in_proj_a.weight"] = init.linear(nv, H)
            else:
                w[f"{a}.in_proj_qkvz.weight"] = init.linear(2 * key_dim + 2 * value_dim, H)
                w[f"{a}.in_proj_ba.weight"] = init.linear(2 * nv, H)
            # MLX Conv1d layout [out_channels, kernel, in_channels / groups].
            w[f"{a}.conv1d.weight"] = init.normal((conv_dim, K, 1), 0.5)
            # Decay rate A in [0.05, 0.6]: state survives a few tokens, so the
            # recurrence (and its carry across decode steps) is really tested.
            w[f"{a}.A_log"] = bf16_round(np.log(rng.uniform(0.05, 0.6, nv)))
            w[f"{a}.dt_bias"] = init.normal((nv,), 0.5)
            w[f"{a}.norm.weight"] = init.plain_norm(dv)
            w[f"{a}.out_proj.weight"] = init.linear(H, value_dim)
        else:
            s = f"{p}.self_attn"
            w[f"{s}.q_proj.weight"] = init.linear(nh * hd * 2, H)
            w[f"{s}.k_proj.weight"] = init.linear(nkv * hd, H)
            w[f"{s}.v_proj.weight"] = init.linear(nkv * hd, H)
            w[f"{s}.o_proj.weight"] = init.linear(H, nh * hd)
            w[f"{s}.q_norm.weight"] = init.shifted_norm(hd)
            w[f"{s}.k_norm.weight"] = init.shifted_norm(hd)
        w[f"{p}.post_attention_layernorm.weight"] = init.shifted_norm(H)
        if not is_moe_layer(cfg, l):
            raise ValueError("the qwen3_next fixture has MoE on every layer")
        m = f"{p}.mlp"
        w[f"{m}.gate.weight"] = init.linear(E, H, ROUTER_GAIN)
        w[f"{m}.switch_mlp.gate_proj.weight"] = init.experts(E, I, H)
        w[f"{m}.switch_mlp.up_proj.weight"] = init.experts(E, I, H)
        w[f"{m}.switch_mlp.down_proj.weight"] = init.experts(E, H, I)
        w[f"{m}.shared_expert.gate_proj.weight"] = init.linear(Is, H)
        w[f"{m}.shared_expert.up_proj.weight"] = init.linear(Is, H)
        w[f"{m}.shared_expert.down_proj.weight"] = init.linear(H, Is)
        w[f"{m}.shared_expert_gate.weight"] = init.linear(1, H)
    w["model.norm.weight"] = init.shifted_norm(H)
    w["lm_head.weight"] = init.linear(V, H, LM_HEAD_GAIN)
    return w


# Exactly the suffixes mlx-lm's qwen3_next sanitize shifts by +1 (1-D only).
QWEN3_NEXT_SHIFTED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def qwen3_next_to_hf(weights, cfg):
    out = {}
    for k, v in unstack_experts(weights).items():
        if k.endswith(QWEN3_NEXT_SHIFTED_NORMS):
            hf = (v - 1.0).astype(np.float32)
            if not np.array_equal(bf16_round(hf), hf):
                raise ValueError(f"{k}: 1+w norm weight not exact in bf16")
            v = hf
        elif k.endswith("conv1d.weight"):
            v = np.ascontiguousarray(np.moveaxis(v, 2, 1))  # [C, K, 1] -> [C, 1, K]
        out[k] = v
    return out


def next_shard_of(key: str) -> int:
    """Shard 1: embeddings and layers 0-1; shard 2: layers 2-3, final norm, lm_head."""
    key = key.replace("model.language_model.", "model.", 1)
    if key.startswith("model.layers."):
        return 0 if int(key.split(".")[2]) < 2 else 1
    return 0 if key.startswith("model.embed_tokens") else 1


# --------------------------------------------------------------------------
# Qwen3.5-MoE (Qwen3.5-35B-A3B and relatives): Qwen3-Next's trunk with the
# Gated DeltaNet projections apart, inside a vision-language checkpoint
# (`text_config`; tensors under `model.language_model.` in transformers,
# `language_model.model.` in mlx-lm) whose transformers layout fuses each
# layer's experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`).
# --------------------------------------------------------------------------

QWEN3_5_MOE_TEXT_CONFIG = {
    k: v for k, v in QWEN3_NEXT_CONFIG.items()
    if k not in ("architectures", "model_type", "partial_rotary_factor", "rope_theta", "rope_scaling", "transformers_version")
} | {
    "model_type": "qwen3_5_moe_text",
    "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}

QWEN3_5_MOE_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": QWEN3_5_MOE_TEXT_CONFIG,
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 2, "hidden_size": 64, "out_hidden_size": 128},
    "image_token_id": 248056,
    "tie_word_embeddings": False,
    "transformers_version": "5.2.0",
}


def qwen3_5_moe_init(rng: np.random.Generator, cfg: dict) -> Dict[str, np.ndarray]:
    w = qwen3_next_init(rng, cfg["text_config"], split_projections=True)
    return {f"language_model.{k}": v for k, v in w.items()}


def qwen3_5_moe_to_hf(weights, cfg):
    """mlx-lm's names and forms -> transformers': zero-centred norms, conv1d
    [C, 1, K], fused experts, `model.language_model.` prefix."""
    out = {}
    for k, v in weights.items():
        k = k.removeprefix("language_model.")
        if ".mlp.switch_mlp." in k:
            prefix, proj = k.split(".mlp.switch_mlp.")
            if proj == "down_proj.weight":
                out[f"{prefix}.mlp.experts.down_proj"] = v
            elif proj == "gate_proj.weight":
                up = weights[f"language_model.{prefix}.mlp.switch_mlp.up_proj.weight"]
                out[f"{prefix}.mlp.experts.gate_up_proj"] = np.concatenate([v, up], axis=1)
            continue
        out[k] = v
    out = qwen3_next_to_hf(out, cfg)
    return {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in out.items()}


SPECS = {
    "qwen3_moe": FixtureSpec(
        name="qwen3_moe",
        seed=14,  # chosen so greedy margins and router gaps stay large (README)
        config=QWEN3_MOE_CONFIG,
        init_weights=qwen3_moe_init,
        to_hf=qwen3_moe_to_hf,
        shards=[lambda k: True],
    ),
    "qwen3_next": FixtureSpec(
        name="qwen3_next",
        seed=14,  # same criterion, searched separately
        config=QWEN3_NEXT_CONFIG,
        init_weights=qwen3_next_init,
        to_hf=qwen3_next_to_hf,
        shards=[lambda k: next_shard_of(k) == 0, lambda k: next_shard_of(k) == 1],
    ),
    "qwen3_5_moe": FixtureSpec(
        name="qwen3_5_moe",
        seed=28,  # same criterion, searched separately
        config=QWEN3_5_MOE_CONFIG,
        init_weights=qwen3_5_moe_init,
        to_hf=qwen3_5_moe_to_hf,
        shards=[lambda k: next_shard_of(k) == 0, lambda k: next_shard_of(k) == 1],
    ),
}


def intended_weights(spec: FixtureSpec, seed: int = None) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed if seed is None else seed)
    return spec.init_weights(rng, spec.config)


def generation_config(spec: FixtureSpec) -> dict:
    # Like Qwen chat checkpoints: stop on <|im_end|> or <|endoftext|>.
    return {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
        "pad_token_id": BOS_TOKEN_ID,
        "transformers_version": spec.config["transformers_version"],
    }


def write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_hf_checkpoint(spec: FixtureSpec, weights: Dict[str, np.ndarray], out_dir: Path) -> None:
    """Write config.json, generation_config.json and bf16 safetensors (sharded if asked)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = spec.to_hf(weights, spec.config)
    hf = {k: np.ascontiguousarray(v.astype(BF16)) for k, v in sorted(hf.items())}
    n = len(spec.shards)
    if n == 1:
        save_file(hf, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        assigned = set()
        for i, belongs in enumerate(spec.shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            part = {k: v for k, v in hf.items() if belongs(k)}
            if assigned & part.keys():
                raise ValueError("a tensor is assigned to two shards")
            assigned |= part.keys()
            save_file(part, str(out_dir / fname), metadata={"format": "pt"})
            for k, v in part.items():
                weight_map[k] = fname
                total += v.nbytes
        if assigned != hf.keys():
            raise ValueError("some tensors are in no shard")
        write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )
    for f in out_dir.glob("*.safetensors"):
        f.chmod(0o644)  # safetensors writes 0600
    write_json(out_dir / "config.json", spec.config)
    write_json(out_dir / "generation_config.json", generation_config(spec))
