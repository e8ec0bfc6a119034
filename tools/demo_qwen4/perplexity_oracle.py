#!/usr/bin/env python3
"""Perplexity of tools/demo_qwen4/model computed by the float64 numpy oracle
(tools/oracle/qwen4_exp/model.py), on the same windows as `slotstream perplexity`: the text is
tokenized without special tokens and cut into consecutive windows of --window tokens, each scored
from an empty state; the mean negative log-likelihood of every token given the ones before it in
its window.

    .venv/bin/python tools/demo_qwen4/perplexity_oracle.py --model tools/demo_qwen4/model \
        --file tools/demo/heldout_sample.txt --out tools/demo_qwen4/oracle_perplexity.json
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors)
import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracle", "qwen4_exp"))
from model import Qwen4Exp  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--file", required=True)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=0, help="0: all")
    p.add_argument("--out")
    a = p.parse_args()
    m = Qwen4Exp(Path(a.model))
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    ids = tok.encode(open(a.file, encoding="utf-8").read(), add_special_tokens=False).ids
    nll, n, windows, per_window = 0.0, 0, 0, []
    for start in range(0, len(ids) - a.window + 1, a.window):
        if a.max_windows and windows == a.max_windows:
            break
        w = ids[start:start + a.window]
        logits, _, _ = m.forward(w)  # fresh state: one window from empty
        mx = logits.max(-1, keepdims=True)
        logp = logits - mx - np.log(np.exp(logits - mx).sum(-1, keepdims=True))
        wn = -float(sum(logp[i, w[i + 1]] for i in range(a.window - 1)))
        nll += wn
        n += a.window - 1
        windows += 1
        per_window.append(wn / (a.window - 1))
    mean = nll / n
    out = {"oracle": "tools/oracle/qwen4_exp/model.py float64", "window": a.window, "windows": windows,
           "predicted_tokens": n, "mean_nll": mean, "perplexity": math.exp(mean),
           "per_window_mean_nll": per_window}
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
