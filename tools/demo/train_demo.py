#!/usr/bin/env python3
"""Train slotstream's bundled demo model: a small qwen3_next MoE on public-domain text.

Runs on a CUDA GPU with PyTorch and transformers (their Qwen3NextForCausalLM is
the model definition). Seeded; stops after --minutes of training; logs train and
held-out loss; writes a transformers-4.x-layout checkpoint (one tensor per
expert, bf16 safetensors shards of at most 15 MB, zero-centred norms) that
mlx-lm and slotstream both load; the tokenizer files are added by the
conversion step (the device returns at most 8 files). Convert it to MLX 4-bit with
tools/demo/convert_demo.sh.

    python3 tools/demo/train_demo.py --corpus ../shared/corpus \
        --tokenizer tools/demo/tokenizer --out $OUT/demo --minutes 5
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

FILES = ["shakespeare.txt", "stdlib_mobydick.txt", "stdlib_sotu.txt"]

# 6 layers: two Gated DeltaNet layers then one full-attention layer, twice.
DIMS = dict(
    vocab_size=4160,
    hidden_size=256,
    num_hidden_layers=6,
    full_attention_interval=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    intermediate_size=512,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    router_aux_loss_coef=0.01,
    output_router_logits=True,
)


def load_tokens(corpus, tok):
    train, held = [], []
    for f in FILES:
        text = open(os.path.join(corpus, f), encoding="utf-8", errors="replace").read()
        ids = tok.encode(text).ids
        cut = int(len(ids) * 0.98)
        train.append(ids[:cut])
        held.append(ids[cut:])
    return np.concatenate(train).astype(np.int64), np.concatenate(held).astype(np.int64)


def batches(data, seq, batch, rng):
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        x = np.stack([data[s : s + seq + 1] for s in starts])
        yield torch.from_numpy(x)


@torch.no_grad()
def held_out_loss(model, held, seq, device, max_windows=64):
    model.eval()
    losses = []
    for i in range(0, min(len(held) - seq - 1, max_windows * seq), seq):
        x = torch.from_numpy(held[i : i + seq + 1][None]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        # transformers shifts labels itself: loss over positions 1..seq-1
        losses.append(out.loss.float().item())
    model.train()
    return float(np.mean(losses))


def export(model, config, out, log):
    """Writes the transformers 4.x layout: per-expert tensors, bf16 shards."""
    os.makedirs(out, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
    tensors = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                tensors[f"{p}{e}.gate_proj.weight"] = v[e, :inter].clone()
                tensors[f"{p}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                tensors[f"{p}{e}.down_proj.weight"] = v[e].clone()
        else:
            tensors[k] = v
    names = sorted(tensors)
    shards, cur, size = [], {}, 0
    for n in names:
        b = tensors[n].numel() * 2
        if cur and size + b > 15_000_000:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = tensors[n]
        size += b
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.numel() * 2
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg = dict(DIMS)
    cfg.update(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        layer_types=config.layer_types,
        torch_dtype="bfloat16",
        hidden_act="silu",
        attention_bias=False,
        rope_scaling=None,
        eos_token_id=4096,
        bos_token_id=None,
        output_router_logits=False,
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out, "training_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print("exported", len(names), "tensors in", len(shards), "shards", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    a = p.parse_args()

    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    device = "cuda"
    tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
    train, held = load_tokens(a.corpus, tok)
    print(f"tokens: train {len(train)}, held-out {len(held)}", flush=True)

    config = Qwen3NextConfig(**DIMS)
    model = Qwen3NextForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.1f}M; layer types {config.layer_types}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = a.minutes * 60
    warmup = 100
    log = {"dims": DIMS, "params": n_params, "seed": a.seed, "steps": []}
    start = time.time()
    step = 0
    tokens_seen = 0
    for x in batches(train, a.seq, a.batch, rng):
        elapsed = time.time() - start
        if elapsed > budget:
            break
        frac = elapsed / budget
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += x.numel()
        if step % 100 == 0:
            entry = {"step": step, "seconds": round(elapsed, 1), "tokens": tokens_seen, "lr": lr, "train_loss": out.loss.item()}
            if step % 500 == 0:
                entry["held_out_loss"] = held_out_loss(model, held, a.seq, device)
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
        step += 1
    final = held_out_loss(model, held, a.seq, device, max_windows=256)
    log["final_held_out_loss"] = final
    log["final_held_out_perplexity"] = math.exp(final)
    log["tokens_seen"] = tokens_seen
    print(json.dumps({"final_held_out_loss": final, "perplexity": math.exp(final), "steps": step, "tokens": tokens_seen}), flush=True)
    model.eval()
    prompt = tok.encode("The sea was calm, and the ship").ids
    x = torch.tensor([prompt], device=device)
    with torch.no_grad():
        for _ in range(40):
            logits = model(input_ids=x).logits[0, -1]
            x = torch.cat([x, logits.argmax().view(1, 1)], dim=1)
    sample = tok.decode(x[0].tolist())
    print("sample:", sample, flush=True)
    log["greedy_sample"] = sample
    export(model, config, a.out, log)


if __name__ == "__main__":
    main()
