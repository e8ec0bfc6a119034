#!/usr/bin/env python3
"""Write a synthetic MoE model in the real mlx-lm 4/8-bit on-disk layout.

Random weights, real tensor names, shapes, dtypes and sharding, so it loads and
runs exactly like a converted checkpoint of the same family. Used for speed and
streaming benchmarks, where the output text does not matter. Only numpy is
needed; safetensors files are written directly (header + raw little-endian
data), streaming one tensor at a time so multi-GB models need little memory.

    python3 tools/synth.py --family qwen3_moe --out /tmp/synth-moe \
        --hidden 2048 --layers 8 --experts 64 --top-k 8 --moe-inter 768

Options for the GPU peer benchmark (tools/bench_gpu_peer.sh):
  --jobs N         write tensors from N processes (each tensor then draws from its own
                   generator, seeded by (seed, tensor index): different weights than
                   --jobs 1, the same for every N > 1). Files are laid out first, then
                   filled in place, so multi-GB models take seconds on many cores.
  --symmetric      biases = -2^(bits-1) * scales, i.e. w = scale * (q - 8) at 4 bits, and
                   level 0 replaced by 8 so that the weights have mean zero (levels 1-15,
                   8 twice as often): every 4-bit g64 tensor is then exactly a llama.cpp Q4_0 tensor (one
                   fp16 scale per 32 values, no offset), so tools/peer/to_gguf.py
                   --outtype q4_0 repacks the bits instead of requantizing (the same
                   weights on both engines, bit for bit).
  --mixer-out-scale F, --router-skew S: routing like a trained model's. With random weights,
                   attention is nearly uniform, so each attention layer adds about the same
                   vector (the context's mean) to every position; over the layers this common
                   part outgrows the token-specific one, every router sees nearly the same
                   input, and a few experts take most tokens (measured with the numpy
                   reference forward, hidden 256, 12 layers, 64 experts top-8: by layer 5 the
                   busiest quarter of the experts takes 91% of the routed tokens and a
                   16-expert LRU pool hits 93%; greedy decoding repeats one token).
                   --mixer-out-scale 0.1 scales the attention (and Gated DeltaNet) output
                   projections by F, so the residual stream stays token-specific: the
                   common/specific ratio of the router input stays ~0.1 through 48 layers,
                   the busiest quarter takes ~33% (uniform: 25%), the LRU pool hits ~21%,
                   and greedy tokens vary. --router-skew S then scales each router row by
                   exp(S * z), z ~ N(0, 1) per expert and layer: the choice stays
                   input-dependent, but larger rows win more often, as some experts are
                   busier in trained models. S = 0.4 (top-8 of 64, simulated and measured):
                   the busiest quarter takes ~47%, a 16-of-64 LRU pool hits ~28-29% in
                   decode. Neither models the token-to-token locality of real text, so hit
                   rates stay a lower bound of a trained model's.

qwen4_exp (Qwen3.8-Flash-Next slices; tools/synth_qwen4.py, tools/bench_flagship.sh):
    python3 tools/synth.py --family qwen4_exp --layers 12 --ngram-gb 8 --jobs 2 \
        --router-skew 0.45 --out /work/f50-models/slice12        # ~26 GB, 12 of the 48 layers
  --layers N       the first N of the 48 layers with their real shapes (512 experts top-10, every
                   4th layer QSA, PLE and the n-gram table at layer 1), trunk and lm_head
  --ngram-gb G     the n-gram table scaled to G GB (the published one is 32 GB): a smaller base
                   table size, the same hash, rows of 100 bytes, 128 shards
  --tiny           the same structure at toy sizes (tests/fixtures/qwen4_exp_slice_tiny)
  --rewrite-routers  rewrite only the routers of an existing slice (same options, --jobs > 1):
                   recalibrating a 26 GB slice takes seconds
  --router-skew for qwen4_exp, calibrated against published hit-rate curves of trained MoE
                   models (FreeToken: 36.6% of Qwen3.8's experts resident -> 92.2-94.5% hits;
                   Qwen3.6-35B-A3B: a 2 GB pool (~11% of its experts) -> 60%, 8 GB (~44%) -> 91%).
                   The routers are unquantized bf16 as published, so no --mixer-out-scale is needed:
                   with S = 0 a 12-layer slice already routes token by token (decode hits 23.6% /
                   53.6% with 12% / 36.6% of the experts resident, a uniform router's ~12% / ~37%
                   plus the hidden state's drift). Measured on the 12-layer slice: 96 tokens
                   decoded after a 288-token prompt (Shakespeare), SLOTSTREAM_ROUTING_TRACE replayed
                   by tools/peer/eviction_sim.py with the product's eviction (tokens:64):
                     resident share     11%    12%    25%    36.6%   44%    50%
                     S = 0              -      23.6   -      53.6    -      -
                     S = 0.4            -      57.3   80.0   90.0    -      96.0
                     S = 0.45           59.7   61.9   84.4   93.0    96.1   97.9
                   S = 0.45 is the calibration: FreeToken's point (93.0% in 92.2-94.5%) and
                   Qwen3.6's small-pool point (59.7% vs 60%); above ~40% it hits more than
                   Qwen3.6's 91% at 44% (a popularity skew alone has a thinner tail of rare
                   experts than a trained router), so large-pool figures are optimistic there.
                   Streaming measurements name the skew they used (the slice's synth.json).
"""

import argparse
import json
import multiprocessing
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE_TOKENIZER = os.path.join(HERE, "..", "tests", "fixtures", "qwen3_moe_mlx4")
FIXTURE_NEXT = os.path.join(HERE, "..", "tests", "fixtures", "qwen3_next_mlx4")
REFERENCE = os.path.join(HERE, "..", "..", "shared", "reference", "qwen3.8-flash-next")


def bf16_round(a):
    """float32 values rounded to the nearest bf16 (as float32)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def bf16_bytes(a):
    """float32 array -> bf16 little-endian bytes (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


class ShardWriter:
    """Collects (name, dtype, shape, producer) and writes safetensors shards."""

    def __init__(self, out_dir, shard_bytes, rng, seed=0, jobs=1, prefix=""):
        self.out_dir, self.prefix = out_dir, prefix
        self.shard_bytes = shard_bytes
        self.pending = []  # (name, dtype, shape, nbytes, producer(rng) -> bytes)
        self.rng, self.seed, self.jobs = rng, seed, jobs
        self.only = None  # name -> bool: rewrite only these tensors in place (--rewrite-routers)

    def add(self, name, dtype, shape, nbytes, producer):
        self.pending.append((self.prefix + name, dtype, list(shape), nbytes, producer))

    def finish(self):
        shards, cur, size = [], [], 0
        for t in self.pending:
            if cur and size + t[3] > self.shard_bytes:
                shards.append(cur)
                cur, size = [], 0
            cur.append(t)
            size += t[3]
        if cur:
            shards.append(cur)
        weight_map, total = {}, 0
        n = len(shards)
        tasks = []  # (index in pending, file, absolute offset)
        index = {t[0]: i for i, t in enumerate(self.pending)}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            header, off = {}, 0
            for name, dtype, shape, nbytes, _ in shard:
                header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
                off += nbytes
                weight_map[name] = fname
            header["__metadata__"] = {"format": "mlx"}
            hb = json.dumps(header, separators=(",", ":")).encode()
            hb += b" " * ((8 - len(hb) % 8) % 8)
            path = os.path.join(self.out_dir, fname)
            if self.only:
                # Rewrite some tensors of an existing model written with the same layout.
                if not os.path.exists(path):
                    sys.exit(f"{path} is missing: not the layout these options write (--rewrite-routers needs "
                             "the options the model was written with)")
                with open(path, "rb") as f:
                    if f.read(8 + len(hb)) != struct.pack("<Q", len(hb)) + hb:
                        sys.exit(f"{path}: not the layout these options write (--rewrite-routers needs the "
                                 "options the model was written with)")
                pos = 8 + len(hb)
                for name, _, _, nbytes, _ in shard:
                    if self.only(name):
                        tasks.append((index[name], path, pos))
                    pos += nbytes
                total += off
                continue
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(hb)))
                f.write(hb)
                if self.jobs <= 1:
                    # One generator, drawn from in file order (the original stream).
                    for name, _, _, nbytes, producer in shard:
                        data = producer(self.rng)
                        assert len(data) == nbytes, (name, len(data), nbytes)
                        f.write(data)
                else:
                    base = 8 + len(hb)
                    f.truncate(base + off)
                    pos = base
                    for name, _, _, nbytes, _ in shard:
                        tasks.append((index[name], path, pos))
                        pos += nbytes
            total += off
            print(f"  laid out {fname} ({off / 1e9:.2f} GB)", file=sys.stderr)
        if tasks:
            global _WRITER
            _WRITER = self
            # Biggest first, so the pool does not end on one long tensor.
            tasks.sort(key=lambda t: -self.pending[t[0]][3])
            with multiprocessing.get_context("fork").Pool(max(1, self.jobs)) as pool:
                for _ in pool.imap_unordered(_write_one, tasks):
                    pass
        if self.only:
            return total
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        return total


_WRITER = None


def _write_one(task):
    """Pool worker: tensor `i` from its own generator, written in place."""
    i, path, pos = task
    w = _WRITER
    name, _, _, nbytes, producer = w.pending[i]
    data = producer(np.random.default_rng([w.seed, i]))
    assert len(data) == nbytes, (name, len(data), nbytes)
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(data)
    return i


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen4_exp"], default="qwen3_moe")
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-inter", type=int, default=768)
    p.add_argument("--shared-inter", type=int, default=512, help="qwen3_next, qwen3_5_moe shared expert")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--bits", type=int, default=4, choices=[4, 8])
    p.add_argument("--group", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--jobs", type=int, default=1, help="processes writing tensors (see above)")
    p.add_argument("--symmetric", action="store_true", help="biases = -2^(bits-1) * scales (exact Q4_0, see above)")
    p.add_argument("--router-skew", type=float, default=0.0, help="log-normal spread of router row norms; qwen4_exp: 0.45 matches published hit-rate curves (see above)")
    p.add_argument("--mixer-out-scale", type=float, default=1.0, help="attention/DeltaNet output projections x this (see above)")
    p.add_argument("--reference", default=REFERENCE, help="qwen4_exp: the published config.json and tensor_shapes.json")
    p.add_argument("--ngram-gb", type=float, default=None, help="qwen4_exp: n-gram table size (default: the published 32 GB)")
    p.add_argument("--router-gain", type=float, default=1.0, help="qwen4_exp: router rows x this (softmax sharpness only)")
    p.add_argument("--tiny", action="store_true", help="qwen4_exp: toy sizes, same structure (the tests' fixture)")
    p.add_argument("--rewrite-routers", action="store_true",
                   help="qwen4_exp: rewrite only the routers of the model at --out (written with the same options and --jobs > 1), e.g. to recalibrate")
    p.add_argument("--plan-only", action="store_true", help="qwen4_exp: check the tensor list against --reference, write nothing")
    a = p.parse_args()

    if a.family == "qwen4_exp":
        import synth_qwen4
        rng = np.random.default_rng(a.seed)
        if not a.plan_only:
            os.makedirs(a.out, exist_ok=True)
        w = ShardWriter(a.out, int(a.shard_gb * 1e9), rng, a.seed, a.jobs)
        if a.rewrite_routers:
            if a.jobs < 2:
                sys.exit("--rewrite-routers needs --jobs > 1 (each tensor then has its own generator), as the model was written")
            w.only = lambda name: name.endswith(".mlp.gate.weight")
        print(json.dumps(synth_qwen4.write(a, w, bf16_bytes, FIXTURE_NEXT)))
        return

    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)
    # mlx-lm names a vision-language checkpoint's language model `language_model.model...`.
    prefix = "language_model." if a.family == "qwen3_5_moe" else ""
    w = ShardWriter(a.out, int(a.shard_gb * 1e9), rng, a.seed, a.jobs, prefix)
    h, bits, group = a.hidden, a.bits, a.group
    counter = [0]

    def quantized(name, lead, rows, cols, bits=bits, group=group, row_scale=None):
        if cols % group:
            sys.exit(f"{name}: {cols} columns are not a multiple of group size {group}")
        n = int(np.prod(lead or [1])) * rows
        amp = np.sqrt(3.0 / cols)  # uniform(-amp, amp) has variance 1/cols
        wcols = cols * bits // 32
        w.add(f"{name}.weight", "U32", lead + [rows, wcols], n * wcols * 4,
              lambda r: words(r, n * wcols, bits))
        g = n * (cols // group)
        levels = 2**bits - 1
        # Per-row factors (router skew), repeated over each row's groups.
        rs = 1.0 if row_scale is None else np.tile(np.repeat(row_scale, cols // group), n // rows)
        if a.symmetric:
            # Scales from a generator of their own, so the biases producer sees the same ones.
            counter[0] += 1
            seed = [a.seed, 7, counter[0]]
            sc = lambda: bf16_round(np.full(g, 2 * amp / levels) * np.random.default_rng(seed).uniform(0.8, 1.2, g) * rs)
            w.add(f"{name}.scales", "BF16", lead + [rows, cols // group], g * 2, lambda r: bf16_bytes(sc()))
            w.add(f"{name}.biases", "BF16", lead + [rows, cols // group], g * 2,
                  lambda r: bf16_bytes(-float(2 ** (bits - 1)) * sc()))
            return
        w.add(f"{name}.scales", "BF16", lead + [rows, cols // group], g * 2,
              lambda r: bf16_bytes(np.full(g, 2 * amp / levels) * r.uniform(0.8, 1.2, g) * rs))
        w.add(f"{name}.biases", "BF16", lead + [rows, cols // group], g * 2,
              lambda r: bf16_bytes(np.full(g, -amp) * r.uniform(0.8, 1.2, g) * rs))

    def words(r, count, bits):
        x = r.integers(0, 2**32, size=count, dtype=np.uint32)
        if a.symmetric:
            # w = s * (q - 2^(bits-1)) with q uniform would have mean -s/2: every row a common
            # offset along the all-ones input direction, which pulls all hidden states (and the
            # routers' choices, and greedy tokens) the same way. Level 0 becomes the middle level
            # (zero): q then has mean exactly 2^(bits-1), w mean 0.
            t = x.copy()
            for j in range(1, bits):
                t |= x >> j
            lows = sum(1 << (bits * k) for k in range(32 // bits))
            x |= (~t & lows) << (bits - 1)
        return x.astype("<u4").tobytes()

    def vector(name, n, value=1.0, jitter=0.1):
        w.add(name, "BF16", [n], n * 2, lambda r: bf16_bytes(value + jitter * r.standard_normal(n)))

    hd, heads, kvh = a.head_dim, a.heads, a.kv_heads
    quantized("model.embed_tokens", [], a.vocab, h)
    config = {
        "model_type": a.family,
        "hidden_size": h,
        "num_hidden_layers": a.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kvh,
        "head_dim": hd,
        "vocab_size": a.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "moe_intermediate_size": a.moe_inter,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "intermediate_size": a.moe_inter * 4,
        "max_position_embeddings": 32768,
        "eos_token_id": 0,
        "quantization": {"group_size": group, "bits": bits, "mode": "affine"},
    }
    hybrid = a.family in ("qwen3_next", "qwen3_5_moe")
    if hybrid:
        nk, nv, dk, dv = 4, 8, 128, 128
        config.update({
            "linear_num_key_heads": nk, "linear_num_value_heads": nv,
            "linear_key_head_dim": dk, "linear_value_head_dim": dv,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "partial_rotary_factor": 0.25, "shared_expert_intermediate_size": a.shared_inter,
        })
    mix = np.full(h, a.mixer_out_scale) if a.mixer_out_scale != 1 else None
    for l in range(a.layers):
        p_ = f"model.layers.{l}"
        vector(f"{p_}.input_layernorm.weight", h)
        vector(f"{p_}.post_attention_layernorm.weight", h)
        full = a.family == "qwen3_moe" or (l + 1) % 4 == 0
        if full:
            qrows = heads * hd * (2 if hybrid else 1)
            quantized(f"{p_}.self_attn.q_proj", [], qrows, h)
            quantized(f"{p_}.self_attn.k_proj", [], kvh * hd, h)
            quantized(f"{p_}.self_attn.v_proj", [], kvh * hd, h)
            quantized(f"{p_}.self_attn.o_proj", [], h, heads * hd, row_scale=mix)
            vector(f"{p_}.self_attn.q_norm.weight", hd)
            vector(f"{p_}.self_attn.k_norm.weight", hd)
        else:
            la = f"{p_}.linear_attn"
            conv = 2 * nk * dk + nv * dv
            if a.family == "qwen3_5_moe":  # its projections apart
                quantized(f"{la}.in_proj_qkv", [], conv, h)
                quantized(f"{la}.in_proj_z", [], nv * dv, h)
                quantized(f"{la}.in_proj_b", [], nv, h)
                quantized(f"{la}.in_proj_a", [], nv, h)
            else:
                quantized(f"{la}.in_proj_qkvz", [], 2 * nk * dk + 2 * nv * dv, h)
                quantized(f"{la}.in_proj_ba", [], 2 * nv, h)
            w.add(f"{la}.conv1d.weight", "BF16", [conv, 4, 1], conv * 8,
                  lambda r: bf16_bytes(0.5 * r.standard_normal(conv * 4)))
            vector(f"{la}.A_log", nv, 0.0, 0.5)
            vector(f"{la}.dt_bias", nv, 1.0, 0.1)
            vector(f"{la}.norm.weight", dv)
            quantized(f"{la}.out_proj", [], h, nv * dv, row_scale=mix)
        m = f"{p_}.mlp"
        # Routers stay at 8 bits, as mlx-lm's converters leave them.
        config["quantization"][f"{m}.gate"] = {"group_size": 64, "bits": 8}
        skew = None
        if a.router_skew:
            skew = np.exp(a.router_skew * np.random.default_rng([a.seed, 11, l]).standard_normal(a.experts))
        quantized(f"{m}.gate", [], a.experts, h, bits=8, group=64, row_scale=skew)
        if hybrid:
            config["quantization"][f"{m}.shared_expert_gate"] = {"group_size": 64, "bits": 8}
            quantized(f"{m}.shared_expert_gate", [], 1, h, bits=8, group=64)
        for proj, rows, cols in [("gate_proj", a.moe_inter, h), ("up_proj", a.moe_inter, h), ("down_proj", h, a.moe_inter)]:
            quantized(f"{m}.switch_mlp.{proj}", [a.experts], rows, cols)
        if hybrid:
            for proj, rows, cols in [("gate_proj", a.shared_inter, h), ("up_proj", a.shared_inter, h), ("down_proj", h, a.shared_inter)]:
                quantized(f"{m}.shared_expert.{proj}", [], rows, cols)
    vector("model.norm.weight", h)
    quantized("lm_head", [], a.vocab, h)

    total = w.finish()
    if a.family == "qwen3_5_moe":
        # A vision-language checkpoint as mlx-lm writes it: the language
        # model's settings under text_config, its tensors (and quantization
        # overrides) under language_model.
        quant = config.pop("quantization")
        config = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
                  "text_config": config | {"model_type": "qwen3_5_moe_text"},
                  "quantization": {k if not isinstance(v, dict) else f"language_model.{k}": v for k, v in quant.items()}}
    config["quantization_config"] = config["quantization"]
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        src = os.path.join(FIXTURE_TOKENIZER, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(a.out, name))
    expert_bytes = 3 * a.moe_inter * h * (bits / 8 + 4 / group)
    print(json.dumps({
        "out": a.out, "total_bytes": total,
        "routed_expert_bytes": expert_bytes * a.experts * a.layers,
        "bytes_per_expert": expert_bytes,
    }))


if __name__ == "__main__":
    main()
