#!/usr/bin/env python3
"""Routing statistics of a (small) synthetic qwen3_moe checkpoint, from the numpy reference
forward (tools/oracle/reference_numpy.py, float64; numpy only, no safetensors package).

Per MoE layer over T random token ids: how much of the router's input is common to all
positions (|mean| / RMS of the rest), the share of routed tokens taken by the busiest quarter
of the experts, and the hit rate of a 16-expert LRU pool over the positions in order. Used to
choose tools/synth.py's --mixer-out-scale and --router-skew (see there).

    python3 tools/peer/routing_stats.py MODEL_DIR [T]
"""
import json
import os
import sys
import types

import numpy as np

sys.modules["safetensors"] = types.ModuleType("safetensors"); m = types.ModuleType("safetensors.numpy"); m.load_file = None; sys.modules["safetensors.numpy"] = m
sys.modules["ml_dtypes"] = types.ModuleType("ml_dtypes")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracle")); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_numpy as R, to_gguf as G
d = sys.argv[1]; T = int(sys.argv[2]) if len(sys.argv) > 2 else 300
cfg = json.load(open(os.path.join(d, "config.json")))
ck = G.Checkpoint(d); ld = G.Loader(ck, cfg)
w = {}
for name in ck.index:
    if name.endswith(".scales") or name.endswith(".biases"): continue
    base = name[:-7] if name.endswith(".weight") else name
    w[name] = (ld.get(base) if ck.has(base + ".scales") else ck.float(name)).astype(np.float64)
sel = {}
orig = R.moe
def moe(x, w_, p, cfg_):
    logits = R.linear(x, w_[f"{p}.gate.weight"])
    k = cfg_["num_experts_per_tok"]
    sel[p] = np.argsort(-logits, 1)[:, :k]
    mean = x.mean(0); spec = x - mean
    sel[p + ".ratio"] = float(np.linalg.norm(mean) / np.sqrt((spec ** 2).sum(1).mean()))
    return orig(x, w_, p, cfg_)
R.moe = moe
ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], T)
R.forward(w, cfg, list(ids))
from collections import OrderedDict
E = cfg["num_experts"]
for p in sorted(k for k in sel if not k.endswith("ratio")):
    top = sel[p]; cnt = np.bincount(top.ravel(), minlength=E)
    c = OrderedDict(); h = mm = 0
    for t in range(len(top)):
        for e in top[t]:
            if e in c: h += 1; c.move_to_end(e)
            else:
                mm += 1; c[e] = 1
                if len(c) > 16: c.popitem(last=False)
    print(p, "|common|/|specific| of router input %.2f" % sel[p + ".ratio"], "top-quarter share %.2f" % (np.sort(cnt)[::-1][:E // 4].sum() / cnt.sum()), "LRU16 hit %.2f" % (h / (h + mm)))
