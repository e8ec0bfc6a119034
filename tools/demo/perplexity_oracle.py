#!/usr/bin/env python3
"""Perplexity of the demo model computed by mlx-lm in float32 (the oracle).

Same windows as `slotstream perplexity`: the text is tokenized without special
tokens, cut into consecutive windows of --window tokens, each scored from an
empty state; the mean negative log-likelihood of every token given the ones
before it in its window.

    .venv/bin/python tools/demo/perplexity_oracle.py --model tools/demo/model \
        --file tools/demo/heldout_sample.txt --out tools/demo/oracle_perplexity.json
"""
import argparse
import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm.utils import load_model
from tokenizers import Tokenizer
from pathlib import Path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--file", required=True)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out")
    a = p.parse_args()
    mx.set_default_device(mx.cpu)
    model, _ = load_model(Path(a.model))
    # float32 everywhere (scales and biases of quantized layers included).
    model.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype in (mx.bfloat16, mx.float16) else x, model.parameters()))
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    ids = tok.encode(open(a.file, encoding="utf-8").read(), add_special_tokens=False).ids
    nll, n, windows = 0.0, 0, 0
    for start in range(0, len(ids) - a.window + 1, a.window):
        w = ids[start : start + a.window]
        logits = model(mx.array([w]))[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lp = np.array(logp)
        for i in range(a.window - 1):
            nll -= float(lp[i, w[i + 1]])
            n += 1
        windows += 1
    mean = nll / n
    out = {"oracle": "mlx-lm float32", "window": a.window, "windows": windows, "predicted_tokens": n,
           "mean_nll": mean, "perplexity": math.exp(mean)}
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
