#!/usr/bin/env python3
"""Write a llama.cpp GGUF (F16 or F32) from a qwen3_moe or qwen3_next safetensors checkpoint, without torch.

Reads the checkpoint's safetensors files directly (header + memory-mapped data) and
writes the GGUF with the `gguf` package (the copy bundled with llama.cpp at
vendor/llama.cpp/gguf-py, found through --gguf-py or $GGUF_PY, or an installed
`gguf`). MLX affine-quantized tensors (`X.weight` as uint32 words + `X.scales` +
`X.biases`) are dequantized, w = scale * q + bias, so llama.cpp runs the same
weights as slotstream; plain BF16/F16/F32 tensors are taken as they are.
Quantize the result with llama.cpp's own tool afterwards, e.g.

    python3 tools/peer/to_gguf.py --model /tmp/synth-moe --out /tmp/m-f16.gguf
    llama-quantize --pure /tmp/m-f16.gguf /tmp/m-q4_0.gguf Q4_0

or write Q4_0 directly (`--outtype q4_0`, what `llama-quantize --pure ... Q4_0` would
produce for these tensors: every 2-D/3-D weight in Q4_0, norms, routers, the conv
and 1-D tensors in F32). A 4-bit MLX tensor with group 64 whose biases are exactly
-8 x its scales (tools/synth.py --symmetric) holds w = s * (q - 8), which is Q4_0 with
d = s for both 32-value halves of each group: its bits are repacked, in parallel
(`--jobs`), without dequantizing. Any other tensor is dequantized and quantized with
gguf-py's numpy Q4_0 (slow: for small models or a few tensors).

What llama.cpp expects (learned from its convert_hf_to_gguf.py / conversion/qwen.py
and src/models/qwen3moe.cpp; nothing copied):
  * architecture "qwen3moe"; keys qwen3moe.{block_count, context_length,
    embedding_length, feed_forward_length, expert_feed_forward_length,
    attention.head_count, attention.head_count_kv, attention.key_length,
    attention.value_length, attention.layer_norm_rms_epsilon, rope.freq_base,
    expert_count, expert_used_count}, general.file_type;
  * a GGUF shape lists dimensions innermost first, so a row-major numpy array of
    shape (out, in) — the HF/MLX Linear layout — is ggml's {in, out}, which is what
    llama.cpp wants: token_embd {n_embd, n_vocab}, ffn_gate_exps/ffn_up_exps
    {n_embd, n_ff_exp, n_expert} (numpy (E, ff, embd), MLX switch_mlp layout),
    ffn_down_exps {n_ff_exp, n_embd, n_expert};
  * 1-D tensors, norms and the router (ffn_gate_inp) stay F32;
  * tokenizer: model "gpt2" (byte-level BPE), pre "qwen2", tokens padded with
    "[PADn]" (type UNUSED) up to the embedding's row count, token types, merges
    as "left right" strings (llama.cpp refuses a BPE vocabulary without merges).
"""

import argparse
import json
import os
import struct
import sys

import numpy as np


def import_gguf(path):
    for p in [path, os.environ.get("GGUF_PY"), "/tmp/slotstream-peer/llama.cpp/gguf-py"]:
        if p and os.path.isdir(p):
            sys.path.insert(0, p)
            break
    try:
        import yaml  # noqa: F401  (gguf.metadata imports it; nothing here uses it)
    except ImportError:
        import types
        sys.modules["yaml"] = types.ModuleType("yaml")
    import gguf  # noqa: E402
    return gguf


# ---------------------------------------------------------------- safetensors

ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32,
             "I32": np.int32, "U8": np.uint8, "I8": np.int8, "F64": np.float64}


class Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, memory-mapped."""

    def __init__(self, model_dir):
        self.dir = model_dir
        self.index = {}  # name -> (file, dtype, shape, offset)
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        if not files:
            sys.exit(f"no .safetensors files in {model_dir}")
        self.maps = {}
        for f in files:
            path = os.path.join(model_dir, f)
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            base = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                s, e = info["data_offsets"]
                self.index[name] = (path, info["dtype"], tuple(info["shape"]), base + s, e - s)

    def has(self, name):
        return name in self.index

    def raw(self, name):
        path, dtype, shape, off, nbytes = self.index[name]
        if path not in self.maps:
            self.maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        buf = self.maps[path][off:off + nbytes]
        return buf.view(ST_DTYPES[dtype]).reshape(shape), dtype

    def float(self, name):
        a, dtype = self.raw(name)
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


def dequant_mlx(ck, base, bits, group):
    """MLX affine: uint32 words hold 32/bits values, lowest bits first, along the
    input dim; groups of `group` inputs share one scale and one bias (bf16)."""
    w, _ = ck.raw(base + ".weight")
    scales = ck.float(base + ".scales")
    biases = ck.float(base + ".biases")
    per = 32 // bits
    mask = (1 << bits) - 1
    lead = w.shape[:-1]
    cols = w.shape[-1] * per
    out = np.empty(lead + (cols,), dtype=np.float32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    # Row blocks keep the uint32 expansion small for multi-GB expert tensors.
    w2 = w.reshape(-1, w.shape[-1])
    o2 = out.reshape(-1, cols)
    s2 = scales.reshape(-1, cols // group)
    b2 = biases.reshape(-1, cols // group)
    step = max(1, (1 << 22) // cols)
    for r in range(0, w2.shape[0], step):
        q = ((w2[r:r + step, :, None] >> shifts) & mask).reshape(-1, cols // group, group)
        o2[r:r + step] = (q * s2[r:r + step, :, None] + b2[r:r + step, :, None]).reshape(-1, cols)
    return out


class Loader:
    def __init__(self, ck, config):
        self.ck = ck
        q = config.get("quantization") or config.get("quantization_config") or {}
        self.q = q

    def _bits_group(self, base):
        ov = self.q.get(base) if isinstance(self.q.get(base), dict) else {}
        return ov.get("bits", self.q.get("bits", 4)), ov.get("group_size", self.q.get("group_size", 64))

    def shape(self, base):
        """Shape of what get() returns, from the headers alone."""
        ck = self.ck
        if ck.has(base + ".scales"):
            bits, _ = self._bits_group(base)
            s = ck.index[base + ".weight"][2]
            return s[:-1] + (s[-1] * 32 // bits,)
        name = base if ck.has(base) else base + ".weight"
        return ck.index[name][2]

    def get(self, base):
        """Float32 array for module `base` (without `.weight`) or a plain tensor name."""
        ck = self.ck
        if ck.has(base + ".scales"):
            bits, group = self._bits_group(base)
            return dequant_mlx(ck, base, bits, group)
        name = base if ck.has(base) else base + ".weight"
        return ck.float(name)


class T:
    """One output tensor: its shape from the headers, its data on demand."""

    def __init__(self, ld, base):
        self.ld, self.base = ld, base

    def shape(self):
        return self.ld.shape(self.base)

    def __call__(self):
        return self.ld.get(self.base)


class Stack:
    """HF layout: per-expert 2-D tensors stacked into one 3-D tensor."""

    def __init__(self, ld, bases):
        self.ld, self.bases = ld, bases

    def shape(self):
        return (len(self.bases),) + tuple(self.ld.shape(self.bases[0]))

    def __call__(self):
        return np.stack([self.ld.get(b) for b in self.bases])


class Rows:
    """Some rows of module `base`, in the order of `idx` (a fused projection split)."""

    def __init__(self, ld, base, idx):
        self.ld, self.base, self.idx = ld, base, np.asarray(idx)

    def shape(self):
        return (len(self.idx),) + tuple(self.ld.shape(self.base)[1:])

    def __call__(self):
        return self.ld.get(self.base)[self.idx]


class Fn:
    """A derived tensor: a shape and a function of the checkpoint."""

    def __init__(self, shape, fn):
        self._shape, self.fn = tuple(shape), fn

    def shape(self):
        return self._shape

    def __call__(self):
        return self.fn()


def next_plan(ck, ld, cfg, n_layer, nk, nv, dk, dv):
    """qwen3_next, as llama.cpp's qwen3next wants it (learned from conversion/qwen.py and
    src/models/qwen3next.cpp). mlx-lm stores the decoder norms already shifted (plain
    multipliers, what the GGUF holds after the converter's +1) and keeps the fused
    projections in the transformers order, grouped per key head."""
    h = cfg["hidden_size"]
    r = nv // nk
    plan = [("token_embd.weight", T(ld, "model.embed_tokens"), False)]
    for l in range(n_layer):
        p = f"model.layers.{l}"
        b = f"blk.{l}"
        plan += [
            (f"{b}.attn_norm.weight", T(ld, f"{p}.input_layernorm.weight"), True),
            (f"{b}.post_attention_norm.weight", T(ld, f"{p}.post_attention_layernorm.weight"), True),
        ]
        if ck.has(f"{p}.self_attn.q_proj.weight"):
            a_ = f"{p}.self_attn"
            plan += [
                (f"{b}.attn_q.weight", T(ld, f"{a_}.q_proj"), False),  # per head [query, gate], as transformers
                (f"{b}.attn_k.weight", T(ld, f"{a_}.k_proj"), False),
                (f"{b}.attn_v.weight", T(ld, f"{a_}.v_proj"), False),
                (f"{b}.attn_output.weight", T(ld, f"{a_}.o_proj"), False),
                (f"{b}.attn_q_norm.weight", T(ld, f"{a_}.q_norm.weight"), True),
                (f"{b}.attn_k_norm.weight", T(ld, f"{a_}.k_norm.weight"), True),
            ]
        else:
            la = f"{p}.linear_attn"
            per = [dk, dk, r * dv, r * dv]

            # rows grouped per key head [q k v z] -> [all q | all k | all v] and [all z]
            rows = np.arange(nk * sum(per)).reshape(nk, sum(per))
            q, k, v, z = np.split(rows, np.cumsum(per)[:-1], axis=1)
            qkv_rows = np.concatenate([x.reshape(-1) for x in (q, k, v)])

            conv_dim = 2 * nk * dk + nv * dv
            kk = cfg["linear_conv_kernel_dim"]
            plan += [
                (f"{b}.attn_qkv.weight", Rows(ld, f"{la}.in_proj_qkvz", qkv_rows), False),
                (f"{b}.attn_gate.weight", Rows(ld, f"{la}.in_proj_qkvz", z.reshape(-1)), False),
                (f"{b}.ssm_ba.weight", T(ld, f"{la}.in_proj_ba"), False),
                (f"{b}.ssm_conv1d.weight", Fn((conv_dim, kk), lambda la=la: ld.get(f"{la}.conv1d.weight").reshape(conv_dim, kk)), True),
                (f"{b}.ssm_dt.bias", T(ld, f"{la}.dt_bias"), True),
                (f"{b}.ssm_a", Fn((nv,), lambda la=la: -np.exp(ld.get(f"{la}.A_log"))), True),
                (f"{b}.ssm_norm.weight", T(ld, f"{la}.norm.weight"), True),
                (f"{b}.ssm_out.weight", T(ld, f"{la}.out_proj"), False),
            ]
        m = f"{p}.mlp"
        plan.append((f"{b}.ffn_gate_inp.weight", T(ld, f"{m}.gate"), True))
        for proj, gname in [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")]:
            plan.append((f"{b}.{gname}.weight", T(ld, f"{m}.switch_mlp.{proj}"), False))
        plan.append((f"{b}.ffn_gate_inp_shexp.weight", Fn((h,), lambda m=m: ld.get(f"{m}.shared_expert_gate").reshape(h)), True))
        for proj, gname in [("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")]:
            plan.append((f"{b}.{gname}.weight", T(ld, f"{m}.shared_expert.{proj}"), False))
    plan.append(("output_norm.weight", T(ld, "model.norm.weight"), True))
    if ck.has("lm_head.weight"):
        plan.append(("output.weight", T(ld, "lm_head"), False))
    return plan


# ---------------------------------------------------------------- tokenizer

def add_tokenizer(gguf, w, model_dir, n_vocab, config, pad_type=None):
    tj = json.load(open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8"))
    model = tj["model"]
    if model["type"] != "BPE":
        sys.exit(f"tokenizer model {model['type']} not handled (byte-level BPE only)")
    tokens = [None] * n_vocab
    types = [pad_type or gguf.TokenType.UNUSED] * n_vocab
    for tok, i in model["vocab"].items():
        if i < n_vocab:
            tokens[i] = tok
            types[i] = gguf.TokenType.NORMAL
    for at in tj.get("added_tokens", []):
        i = at["id"]
        if i < n_vocab:
            tokens[i] = at["content"]
            types[i] = gguf.TokenType.CONTROL if at.get("special") else gguf.TokenType.USER_DEFINED
    for i in range(n_vocab):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"
    merges = []
    for m in model.get("merges", []):
        merges.append(" ".join(m) if isinstance(m, list) else m)
    if not merges:
        sys.exit("a BPE vocabulary without merges cannot be loaded by llama.cpp")
    w.add_tokenizer_model("gpt2")
    # The synthetic/fixture tokenizer is not one llama.cpp recognises by hash;
    # qwen2's pre-tokenizer regex is the one Qwen3 checkpoints use.
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    by_content = {t: i for i, t in enumerate(tokens)}
    eos = by_content.get("<|im_end|>", by_content.get("<|endoftext|>"))
    if eos is None:
        eos = config.get("eos_token_id", 0)
        eos = eos[0] if isinstance(eos, list) else eos
    w.add_eos_token_id(int(eos))
    if "<|endoftext|>" in by_content:
        w.add_pad_token_id(by_content["<|endoftext|>"])
    w.add_add_bos_token(False)


# ---------------------------------------------------------------- model

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--outtype", choices=["f16", "f32", "q4_0"], default="f16")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes repacking Q4_0 tensors")
    ap.add_argument("--gguf-py", default=None, help="path of llama.cpp's gguf-py (default: $GGUF_PY or /tmp/slotstream-peer/llama.cpp/gguf-py)")
    ap.add_argument("--visible-pad", action="store_true",
                    help="mark the [PADn] tokens NORMAL so generated text shows them (for comparing greedy ids)")
    a = ap.parse_args()
    gguf = import_gguf(a.gguf_py)

    cfg = json.load(open(os.path.join(a.model, "config.json")))
    family = cfg.get("model_type")
    if family not in ("qwen3_moe", "qwen3_next"):
        sys.exit(f"model_type {family!r}: only qwen3_moe and qwen3_next are written")
    nxt = family == "qwen3_next"
    ck = Checkpoint(a.model)
    ld = Loader(ck, cfg)
    wdt = np.float16 if a.outtype == "f16" else np.float32
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "f32": gguf.LlamaFileType.ALL_F32,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[a.outtype]

    n_layer = cfg["num_hidden_layers"]
    h = cfg["hidden_size"]
    head_dim = cfg.get("head_dim", h // cfg["num_attention_heads"])
    n_vocab = ck.index["model.embed_tokens.weight"][2][0]

    w = gguf.GGUFWriter(a.out, "qwen3next" if nxt else "qwen3moe")
    w.add_name(os.path.basename(os.path.normpath(a.model)))
    w.add_block_count(n_layer)
    w.add_context_length(cfg.get("max_position_embeddings", 32768))
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg.get("intermediate_size", cfg["moe_intermediate_size"]))
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(ftype)
    add_tokenizer(gguf, w, a.model, n_vocab, cfg, gguf.TokenType.NORMAL if a.visible_pad else None)
    if nxt:
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        if dk != dv:
            sys.exit("llama.cpp's qwen3next takes one head size for keys and values")
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(dv * nv)
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 0.25)))
        plan = next_plan(ck, ld, cfg, n_layer, nk, nv, dk, dv)
        return write_q4_0(w, a, plan, gguf, ck, ld) if a.outtype == "q4_0" else write_tensors(w, a, plan, wdt)

    # (gguf name, producer, keep f32)
    plan = [("token_embd.weight", T(ld, "model.embed_tokens"), False)]
    for l in range(n_layer):
        p = f"model.layers.{l}"
        b = f"blk.{l}"
        plan += [
            (f"{b}.attn_norm.weight", T(ld, f"{p}.input_layernorm.weight"), True),
            (f"{b}.attn_q.weight", T(ld, f"{p}.self_attn.q_proj"), False),
            (f"{b}.attn_k.weight", T(ld, f"{p}.self_attn.k_proj"), False),
            (f"{b}.attn_v.weight", T(ld, f"{p}.self_attn.v_proj"), False),
            (f"{b}.attn_output.weight", T(ld, f"{p}.self_attn.o_proj"), False),
            (f"{b}.attn_q_norm.weight", T(ld, f"{p}.self_attn.q_norm.weight"), True),
            (f"{b}.attn_k_norm.weight", T(ld, f"{p}.self_attn.k_norm.weight"), True),
            (f"{b}.ffn_norm.weight", T(ld, f"{p}.post_attention_layernorm.weight"), True),
            (f"{b}.ffn_gate_inp.weight", T(ld, f"{p}.mlp.gate"), True),
        ]
        for proj, gname in [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")]:
            if ck.has(f"{p}.mlp.switch_mlp.{proj}.weight"):
                plan.append((f"{b}.{gname}.weight", T(ld, f"{p}.mlp.switch_mlp.{proj}"), False))
            else:  # HF layout: one tensor per expert, stacked here
                n_exp = cfg["num_experts"]
                plan.append((f"{b}.{gname}.weight", Stack(ld, [f"{p}.mlp.experts.{e}.{proj}" for e in range(n_exp)]), False))
    plan.append(("output_norm.weight", T(ld, "model.norm.weight"), True))
    if ck.has("lm_head.weight"):
        plan.append(("output.weight", T(ld, "lm_head"), False))

    if a.outtype == "q4_0":
        return write_q4_0(w, a, plan, gguf, ck, ld)
    write_tensors(w, a, plan, wdt)


# ---------------------------------------------------------------- Q4_0, written directly

Q4_BLOCK, Q4_BYTES = 32, 18  # values per block; bytes per block (fp16 d + 16 bytes of nibbles)


def q4_source(ck, ld, fn):
    """(base, row index or None) when `fn` is a 4-bit MLX tensor (or some of its rows)
    with group 64 and biases == -8 * scales, whose bits can be repacked; else None."""
    if isinstance(fn, T):
        base, idx = fn.base, None
    elif isinstance(fn, Rows):
        base, idx = fn.base, fn.idx
    else:
        return None
    if not ck.has(base + ".scales") or ld._bits_group(base) != (4, 64):
        return None
    s, _ = ck.raw(base + ".scales")
    bb, _ = ck.raw(base + ".biases")
    # bf16 bits: -8 * s is s with the sign set and 3 added to the exponent (s normal, non-zero).
    s = s.reshape(-1)
    bb = bb.reshape(-1)
    step = 1 << 24
    for i in range(0, len(s), step):
        si = s[i:i + step].astype(np.uint32)
        want = (si + (3 << 7)) | 0x8000
        if not np.array_equal(want.astype(np.uint16), bb[i:i + step]):
            return None
    return base, idx


def repack_rows(ck, base, rows):
    """Q4_0 blocks (uint8 [n, cols / 32 * 18]) of the given rows of an exact-Q4_0 MLX tensor."""
    w, _ = ck.raw(base + ".weight")
    sc, _ = ck.raw(base + ".scales")
    w2 = w.reshape(-1, w.shape[-1])
    s2 = sc.reshape(-1, sc.shape[-1])
    wb = np.ascontiguousarray(w2[rows]).view(np.uint8)           # [n, cols / 2]: byte k = values 2k (low), 2k+1 (high)
    n, half = wb.shape
    nblk = half // 16
    blk = wb.reshape(n, nblk, 16)
    lo, hi = blk[:, :, :8], blk[:, :, 8:]                          # values 0..15 and 16..31 of each block
    out = np.empty((n, nblk, Q4_BYTES), dtype=np.uint8)
    qs = np.empty((n, nblk, 8, 2), dtype=np.uint8)
    qs[..., 0] = (lo & 0x0F) | (hi << 4)                           # Q4_0 byte j: value j (low), value j + 16 (high)
    qs[..., 1] = (lo >> 4) | (hi & 0xF0)
    out[:, :, 2:] = qs.reshape(n, nblk, 16)
    d = (s2[rows].astype(np.uint32) << 16).view(np.float32).astype(np.float16)   # one scale per 64 = two blocks
    out[:, :, :2] = np.repeat(d, 2, axis=1).reshape(n, nblk, 1).view(np.uint8)
    return out.reshape(n, nblk * Q4_BYTES)


_Q4 = {}


def _q4_task(task):
    path, off, base, rows, src_dir = task
    ck = _Q4.get(src_dir)
    if ck is None:
        ck = _Q4[src_dir] = Checkpoint(src_dir)
    blocks = repack_rows(ck, base, rows)
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(blocks.tobytes())
    return blocks.nbytes


def write_q4_0(w, a, plan, gguf, ck, ld):
    """Header through gguf-py; data laid out at the writer's offsets and filled in place,
    exact-Q4_0 tensors repacked by a process pool."""
    import multiprocessing
    Q = gguf.GGMLQuantizationType.Q4_0
    items = []  # (name, fn, kind, shape, nbytes, source)
    for name, fn, keep32 in plan:
        shape = tuple(fn.shape())
        quant = not keep32 and len(shape) >= 2 and shape[-1] % Q4_BLOCK == 0
        if quant:
            nbytes = int(np.prod(shape[:-1])) * shape[-1] // Q4_BLOCK * Q4_BYTES
            w.add_tensor_info(name, shape[:-1] + (shape[-1] // Q4_BLOCK * Q4_BYTES,), np.dtype(np.uint8), nbytes, raw_dtype=Q)
            items.append((name, fn, "q4", shape, nbytes, q4_source(ck, ld, fn)))
        else:
            nbytes = int(np.prod(shape)) * 4
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
            items.append((name, fn, "f32", shape, nbytes, None))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    fout.flush()
    align = w.data_alignment
    pad = lambda n: (n + align - 1) // align * align
    start = pad(fout.tell())
    w.close()
    offsets, off = [], start
    for it in items:
        offsets.append(off)
        off += pad(it[4])
    with open(a.out, "r+b") as f:
        f.truncate(off)
    tasks, slow, n_params = [], [], 0
    with open(a.out, "r+b") as f:
        for (name, fn, kind, shape, nbytes, src), o in zip(items, offsets):
            n_params += int(np.prod(shape))
            if kind == "f32":
                f.seek(o)
                f.write(np.ascontiguousarray(fn().astype(np.float32, copy=False)).reshape(shape).tobytes())
            elif src is not None:
                base, idx = src
                nrows = int(np.prod(shape[:-1]))
                row_bytes = shape[-1] // Q4_BLOCK * Q4_BYTES
                step = max(1, (8 << 20) // row_bytes)  # ~8 MB of output per task
                for r in range(0, nrows, step):
                    rows = np.arange(r, min(nrows, r + step)) if idx is None else idx[r:r + step]
                    if idx is None:
                        rows = slice(r, min(nrows, r + step))
                    tasks.append((a.out, o + r * row_bytes, base, rows, a.model))
            else:
                slow.append(name)
                arr = fn().astype(np.float32, copy=False).reshape(-1, shape[-1])
                f.seek(o)
                f.write(gguf.quants.quantize(arr, Q).tobytes())
    if slow:
        print(f"requantized with numpy (not exact Q4_0 in the checkpoint): {', '.join(slow[:6])}"
              f"{' ...' if len(slow) > 6 else ''} ({len(slow)} tensors)", file=sys.stderr)
    tasks.sort(key=lambda t: -(t[3].stop - t[3].start if isinstance(t[3], slice) else len(t[3])))
    if a.jobs > 1 and len(tasks) > 1:
        with multiprocessing.get_context("fork").Pool(a.jobs) as pool:
            for _ in pool.imap_unordered(_q4_task, tasks, chunksize=4):
                pass
    else:
        for t in tasks:
            _q4_task(t)
    print(json.dumps({"out": a.out, "bytes": os.path.getsize(a.out), "params": n_params,
                      "repacked_tensors": sum(1 for it in items if it[5] is not None), "requantized_tensors": len(slow)}))


def write_tensors(w, a, plan, wdt):
    # Tensor infos precede the data: shapes from the headers, then one tensor at a time.
    infos = []
    for name, fn, keep32 in plan:
        shape = tuple(fn.shape())
        dt = np.float32 if (keep32 or len(shape) <= 1) else wdt
        infos.append((name, shape, dt))
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    n_params = 0
    for (name, fn, _), (_, shape, dt) in zip(plan, infos):
        arr = np.ascontiguousarray(fn().astype(dt, copy=False))
        assert arr.shape == shape, (name, arr.shape, shape)
        n_params += arr.size
        w.write_tensor_data(arr)
        del arr
    w.close()
    print(json.dumps({"out": a.out, "bytes": os.path.getsize(a.out), "params": n_params}))


if __name__ == "__main__":
    main()
