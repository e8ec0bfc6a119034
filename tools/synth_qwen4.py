"""qwen4_exp (Qwen3.8-Flash-Next) slices for tools/synth.py --family qwen4_exp.

The config starts from the published one (--reference DIR: config.json, and tensor_shapes.json
to check against), cut to --layers N (the real layer-type pattern: every 4th layer full
attention) with the n-gram table scaled to --ngram-gb by its base table size (the per-head
tables are the primes >= ngram_vocab_size_base, so a smaller base gives a smaller table with
the same hash, 16 rows of 100 bytes per token, 128 shards). Every tensor of those layers is
generated from the config by the rules below and, at full size, checked name by name
against the reference's shapes and dtypes: 4-bit affine g64 matrices (U32 words + BF16
scales/biases), BF16 routers, indexer projections, DeltaNet a/b, inject weights, norms and
convs, I64 n-gram buffers, g32 n-gram shards (the config's 128 quantization overrides).
The vision tower is left out (the text model never reads it); so is mtp.safetensors.

--tiny keeps the structure (names, dtypes, overrides, layer pattern, PLE at layer 1, QSA
indexer with a budget the tests pass) at toy sizes, for the tests' fixture.

Values: 4-bit words uniform (so w is uniform in +-amp with variance gain^2/cols), scales and
biases jittered +-20%, norms 1 +- 0.1, convs N(0, 0.5), routers N(0, 1/cols) per row times
the routing calibration (see synth.py's help, --router-skew and --router-temp).
"""

import json
import os
import sys

import numpy as np

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
LM = "language_model."

# --tiny: the flagship's structure at toy sizes (hidden 64, 64 experts top-10, 4 layers).
TINY = {
    "hidden_size": 64, "hc_lowrank": 64, "head_dim": 64, "num_attention_heads": 2,
    "num_key_value_heads": 1, "indexer_head_dim": 64, "indexer_n_heads": 2, "indexer_budget": 16,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "num_experts": 64, "num_experts_per_tok": 10, "ple_embed_dim": 1024, "split_ngram_parts": 16,
    "ngram_vocab_size_base": 1000, "vocab_size": 512, "bos_token_id": 509, "eos_token_id": 509,
    "max_position_embeddings": 4096,
}

# Gains (std x sqrt(cols)) where 1 would leave the forward pass too flat: the tiny oracle
# fixture's choices (tools/oracle/qwen4_exp/build.py GAINS).
GAINS = {"lm_head": 12.0, "indexer_norm": 2.0}


def splitmix64(v):
    v = (v + GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & MASK64
    return (v ^ (v >> 31)) & MASK64


def is_prime(v):
    if v < 2 or v % 2 == 0:
        return v == 2
    d = 3
    while d * d <= v:
        if v % d == 0:
            return False
        d += 2
    return True


def ngram_buffers(tc):
    """(multipliers, head sizes, head offsets, rows per shard) of PLE layer index 0, as the
    reference model derives them from the config (tools/oracle/qwen4_exp/README.md)."""
    n = tc["ngram_size"]
    heads = (n - 1) * tc["heads_per_ngram"]
    sizes, p = [], tc["ngram_vocab_size_base"] - 1
    while len(sizes) < heads:
        p += 1
        while not is_prime(p):
            p += 1
        sizes.append(p)
    offsets = [int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]])]
    div = tc["make_ngram_vocab_size_divisible_by"]
    padded = -(-sum(sizes) // div) * div
    rows = -(-padded // tc["split_ngram_parts"])
    half = max(1, (((1 << 63) - 1) // tc["vocab_size"]) // 2)
    mults = [2 * (splitmix64((1234 + GAMMA * (i + 1)) & MASK64) % half) + 1 for i in range(n)]
    return mults, sizes, offsets, rows


def row_bytes(tc):
    """Bytes of one n-gram row on disk (4-bit, the shards' group of 32)."""
    d = tc["ple_embed_dim"] // ((tc["ngram_size"] - 1) * tc["heads_per_ngram"])
    return d // 2 + 4 * (d // 32)


def slice_config(ref, layers, ngram_gb, tiny):
    """The published config.json cut to `layers` layers, its n-gram table scaled to `ngram_gb`."""
    cfg = json.loads(json.dumps(ref))
    tc = cfg["text_config"]
    if tiny:
        tc.update(TINY)
        cfg["vision_config"]["out_hidden_size"] = tc["hidden_size"]
    full = len(ref["text_config"]["layer_types"])
    if not 1 <= layers <= full:
        sys.exit(f"--layers {layers}: the model has 1 to {full} layers")
    if layers < 2:
        sys.exit("--layers must be >= 2: the n-gram table (PLE) sits at layer index 1")
    tc["num_hidden_layers"] = layers
    tc["layer_types"] = tc["layer_types"][:layers]
    if ngram_gb is not None:
        heads = (tc["ngram_size"] - 1) * tc["heads_per_ngram"]
        tc["ngram_vocab_size_base"] = max(1000, int(ngram_gb * 1e9 / row_bytes(tc) / heads))
    q = {"group_size": 64, "bits": 4}
    for k in range(tc["split_ngram_parts"]):
        q[f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{k}"] = {"group_size": 32, "bits": 4}
    cfg["quantization"] = q
    cfg["quantization_config"] = json.loads(json.dumps(q))
    return cfg


def tensor_plan(tc):
    """[(name, dtype, shape, kind, gain)] of the text model, in checkpoint order (layer by layer).
    kind: q4 (affine 4-bit; shape is the logical [..., rows, cols]), bf16-matrix, norm, conv,
    alog, dtbias, i64."""
    H, hc, E = tc["hidden_size"], tc["hc_count"], tc["num_experts"]
    out = []

    def q4(name, shape, gain=1.0, group=64):
        out.append((name, "q4", list(shape), group, gain))

    def bf16(name, shape, kind, gain=1.0):
        out.append((name, kind, list(shape), None, gain))

    def hyper(pre, inject=True):
        bf16(pre + ".hc_norm.weight", [hc * H], "norm")
        q4(pre + ".input_mix_weight_down", [tc["hc_lowrank"], hc * H])
        q4(pre + ".input_mix_weight_up", [hc * H, tc["hc_lowrank"]])
        if inject:
            bf16(pre + ".block_inject_weight.weight", [hc, hc * H], "matrix")

    m = "model"
    q4(f"{m}.embed_tokens", [tc["vocab_size"], H], gain=np.sqrt(H))
    q4("lm_head", [tc["vocab_size"], H], gain=GAINS["lm_head"])
    hyper(f"{m}.hyper_connection_mixer", inject=False)
    for i, lt in enumerate(tc["layer_types"]):
        p = f"{m}.layers.{i}"
        if i + 1 in tc["ple_layer_ids"]:
            if tc["ple_layer_ids"] != [2]:
                sys.exit("qwen4_exp synth: only ple_layer_ids [2] (the published model's) is supported")
            mults, sizes, offsets, rows = ngram_buffers(tc)
            e = f"{p}.ple.ple_embedding."
            for name, v in [("layer_multipliers", mults), ("ngram_heads_vocab_sizes", sizes), ("ngram_heads_offsets", offsets)]:
                out.append((e + name, "i64", [len(v)], v, 1.0))
            d = tc["ple_embed_dim"] // len(sizes)
            for k in range(tc["split_ngram_parts"]):
                q4(f"{e}ngram_embedding.shard_{k}", [rows, d], gain=np.sqrt(d), group=32)
            q4(f"{p}.ple.key_proj", [hc * H, tc["ple_embed_dim"]])
            q4(f"{p}.ple.value_proj", [H, tc["ple_embed_dim"]])
            for n in ["norm_key", "norm_query", "norm_conv"]:
                bf16(f"{p}.ple.{n}.weight", [hc * H], "norm")
            bf16(f"{p}.ple.conv1d.weight", [hc * H, tc["ple_conv_kernel_size"], 1], "conv")
        hyper(f"{p}.attn_hyper_connection")
        hyper(f"{p}.mlp_hyper_connection")
        if lt == "linear_attention":
            la = f"{p}.linear_attn"
            nk, nv, dk, dv = (tc["linear_num_key_heads"], tc["linear_num_value_heads"],
                              tc["linear_key_head_dim"], tc["linear_value_head_dim"])
            conv = 2 * nk * dk + nv * dv
            q4(f"{la}.in_proj_qkv", [conv, H])
            q4(f"{la}.in_proj_z", [nv * dv, H])
            bf16(f"{la}.in_proj_b.weight", [nv, H], "matrix")
            bf16(f"{la}.in_proj_a.weight", [nv, H], "matrix")
            bf16(f"{la}.conv1d.weight", [conv, tc["linear_conv_kernel_dim"], 1], "conv")
            bf16(f"{la}.A_log", [nv], "alog")
            bf16(f"{la}.dt_bias", [nv], "dtbias")
            bf16(f"{la}.norm.weight", [dv], "norm")
            q4(f"{la}.out_proj", [H, nv * dv])
        else:
            sa = f"{p}.self_attn"
            nh, nkv, hd, ihd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"], tc["indexer_head_dim"]
            q4(f"{sa}.q_proj", [nh * hd * 2, H])
            q4(f"{sa}.k_proj", [nkv * hd, H])
            q4(f"{sa}.v_proj", [nkv * hd, H])
            q4(f"{sa}.o_proj", [H, nh * hd])
            bf16(f"{sa}.q_norm.weight", [hd], "norm")
            bf16(f"{sa}.k_norm.weight", [hd], "norm")
            bf16(f"{sa}.indexer.index_qk_proj.weight", [(tc["indexer_n_heads"] + tc["indexer_kv_heads"]) * ihd, H], "matrix")
            bf16(f"{sa}.indexer.q_layernorm.weight", [ihd], "norm", GAINS["indexer_norm"])
            bf16(f"{sa}.indexer.k_layernorm.weight", [ihd], "norm", GAINS["indexer_norm"])
        mlp = f"{p}.mlp"
        bf16(f"{mlp}.gate.weight", [E, H], "router")
        I, Is = tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
        for proj, rows, cols in [("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)]:
            q4(f"{mlp}.switch_mlp.{proj}", [E, rows, cols])
        for proj, rows, cols in [("gate_proj", Is, H), ("up_proj", Is, H), ("down_proj", H, Is)]:
            q4(f"{mlp}.shared_expert.{proj}", [rows, cols])
        bf16(f"{mlp}.shared_expert_gate.weight", [1, H], "matrix")
    return out


def stored(plan):
    """[(checkpoint name, dtype, shape, nbytes, entry)]: q4 entries become weight/scales/biases."""
    rows = []
    for entry in plan:
        name, kind, shape, extra, _ = entry
        if kind == "q4":
            *lead, r, c = shape
            g = extra
            if c % g:
                sys.exit(f"{name}: {c} columns are not a multiple of group size {g}")
            n = int(np.prod(lead + [r]))
            rows.append((LM + name + ".weight", "U32", lead + [r, c // 8], n * c // 2, entry, "weight"))
            rows.append((LM + name + ".scales", "BF16", lead + [r, c // g], n * (c // g) * 2, entry, "scales"))
            rows.append((LM + name + ".biases", "BF16", lead + [r, c // g], n * (c // g) * 2, entry, "biases"))
        elif kind == "i64":
            rows.append((LM + name, "I64", shape, 8 * shape[0], entry, "i64"))
        else:
            rows.append((LM + name, "BF16", shape, 2 * int(np.prod(shape)), entry, kind))
    return rows


def check_reference(rows, shapes_path, layers):
    """Every tensor of the slice has the published name, shape and dtype, and none is missing."""
    ref = json.load(open(shapes_path))
    want = {}
    for k, v in ref.items():
        if not k.startswith(LM):
            continue  # the vision tower
        parts = k.split(".")
        if parts[2] == "layers" and int(parts[3]) >= layers:
            continue
        want[k] = (v["dtype"], v["shape"])
    got = {r[0]: (r[1], r[2]) for r in rows}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if missing or extra or wrong:
        sys.exit(f"synth qwen4_exp differs from {shapes_path}: missing {missing[:5]}, extra {extra[:5]}, "
                 f"wrong {[(k, got[k], want[k]) for k in wrong[:5]]}")
    return len(want)


def router_scales(tc, seed, layer, skew):
    """Per-expert router row factors exp(skew * z): the calibrated popularity (synth.py --help)."""
    z = np.random.default_rng([seed, 11, layer]).standard_normal(tc["num_experts"])
    return np.exp(skew * z)


def producer(entry, part, a, bf16_bytes, tc):
    """A function rng -> bytes for one stored tensor."""
    name, kind, shape, extra, gain = entry
    if part == "i64":
        return lambda r: np.asarray(extra, dtype="<i8").tobytes()
    if kind == "q4":
        *lead, rows, cols = shape
        n = int(np.prod(lead + [rows]))
        amp = gain * np.sqrt(3.0 / cols)  # uniform(-amp, amp): variance gain^2 / cols
        g = n * (cols // extra)
        if part == "weight":
            return lambda r: r.integers(0, 2**32, size=n * cols // 8, dtype=np.uint32).astype("<u4").tobytes()
        if part == "scales":
            return lambda r: bf16_bytes(np.full(g, 2 * amp / 15, np.float32) * r.uniform(0.8, 1.2, g).astype(np.float32))
        return lambda r: bf16_bytes(np.full(g, -amp, np.float32) * r.uniform(0.8, 1.2, g).astype(np.float32))
    count = int(np.prod(shape))
    if kind == "norm":
        return lambda r: bf16_bytes(gain * (1.0 + 0.1 * r.standard_normal(count)))
    if kind == "conv":
        return lambda r: bf16_bytes(0.5 * r.standard_normal(count))
    if kind == "alog":
        return lambda r: bf16_bytes(np.log(r.uniform(0.5, 4.0, count)))
    if kind == "dtbias":
        return lambda r: bf16_bytes(0.5 * r.standard_normal(count))
    rows, cols = shape[0], shape[-1]
    if kind == "router":
        layer = int(name.split(".")[2])
        scale = router_scales(tc, a.seed, layer, a.router_skew) * a.router_gain
        return lambda r: bf16_bytes((r.standard_normal((rows, cols)) / np.sqrt(cols) * scale[:, None]).ravel())
    return lambda r: bf16_bytes(gain * r.standard_normal(count) / np.sqrt(cols))


# The options that decide a qwen4_exp synthetic's bytes, kept in its synth.json.
RECORDED = ["family", "layers", "tiny", "ngram_gb", "seed", "jobs", "shard_gb", "router_skew", "router_gain"]


def write(a, writer, bf16_bytes, fixture_tokenizer):
    if a.symmetric or a.mixer_out_scale != 1.0:
        sys.exit("--symmetric and --mixer-out-scale are not supported for qwen4_exp")
    ref_dir = a.reference
    cfg_path = os.path.join(ref_dir, "config.json")
    if not os.path.exists(cfg_path):
        sys.exit(f"--reference {ref_dir}: no config.json (the published Qwen3.8-Flash-Next config)")
    cfg = slice_config(json.load(open(cfg_path)), a.layers, a.ngram_gb, a.tiny)
    tc = cfg["text_config"]
    rows = stored(tensor_plan(tc))
    shapes = os.path.join(ref_dir, "tensor_shapes.json")
    checked = 0
    if not a.tiny and a.ngram_gb is None and os.path.exists(shapes):
        checked = check_reference(rows, shapes, a.layers)
    elif not a.tiny and os.path.exists(shapes):
        # Scaled n-gram table: only the shards' row count (and the I64 buffers' values) differ.
        ref = json.load(open(shapes))
        same = [r if "ngram_embedding.shard_" not in r[0] else
                (r[0], ref[r[0]]["dtype"], ref[r[0]]["shape"]) + r[3:] for r in rows]
        checked = check_reference(same, shapes, a.layers)
    if a.plan_only:
        return {"tensors": len(rows), "checked_against_reference": checked, "bytes": sum(r[3] for r in rows),
                "ngram_vocab_size_base": tc["ngram_vocab_size_base"]}
    for name, dtype, shape, nbytes, entry, part in rows:
        writer.add(name, dtype, shape, nbytes, producer(entry, part, a, bf16_bytes, tc))
    total = writer.finish()
    # What made this model, so that a measurement can name the routing it used.
    with open(os.path.join(a.out, "synth.json"), "w") as f:
        json.dump({k: getattr(a, k) for k in RECORDED}, f, indent=1)
    if writer.only:
        return {"out": a.out, "rewrote": "routers", "router_skew": a.router_skew}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    eos = tc["eos_token_id"]
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tc["bos_token_id"], "eos_token_id": eos, "pad_token_id": eos, "do_sample": False}, f)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        src = os.path.join(fixture_tokenizer, name)
        if os.path.exists(src):
            with open(src, "rb") as s, open(os.path.join(a.out, name), "wb") as d:
                d.write(s.read())
    H, I = tc["hidden_size"], tc["moe_intermediate_size"]
    expert = 3 * I * H * (0.5 + 4 / 64)
    ngram = sum(r[3] for r in rows if "ngram_embedding.shard_" in r[0])
    return {
        "out": a.out, "total_bytes": total, "layers": a.layers,
        "routed_expert_bytes": expert * tc["num_experts"] * a.layers, "bytes_per_expert": expert,
        "ngram_bytes": ngram, "ngram_vocab_size_base": tc["ngram_vocab_size_base"],
        "resident_bytes": total - expert * tc["num_experts"] * a.layers - ngram,
        "checked_against_reference": checked,
    }

