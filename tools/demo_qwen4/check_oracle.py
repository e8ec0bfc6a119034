#!/usr/bin/env python3
"""Check the exported checkpoint against the training code: the float64 numpy oracle
(tools/oracle/qwen4_exp/model.py) loads the files from disk and recomputes the float32 PyTorch
logits that train.py recorded in training_log.json["check"] (main last_logits and the MTP head's
last-entry draft logits). Agreement shows that the training math and the export layout match the
oracle's (and so the engine's) definition of qwen4_exp.

    .venv/bin/python tools/demo_qwen4/check_oracle.py --model tools/demo_qwen4/model
"""
import argparse
import json
import os
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors)
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracle", "qwen4_exp"))
from model import Qwen4Exp  # noqa: E402


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    a = p.parse_args()
    chk = json.loads((Path(a.model) / "training_log.json").read_text())["check"]
    m = Qwen4Exp(Path(a.model))
    ids = chk["ids"]
    logits, hidden, _ = m.forward(ids)
    mlog, _ = m.mtp_forward(ids[1:], hidden[:-1])
    out = dict(
        tokens=len(ids),
        main_last_logits_rel_l2=rel(logits[-1], np.array(chk["last_logits"])),
        main_last_logits_max_abs=float(np.abs(logits[-1] - np.array(chk["last_logits"])).max()),
        main_argmax_equal=int((logits.argmax(-1) == np.array(chk["argmax"])).sum()),
        mtp_last_logits_rel_l2=rel(mlog[-1], np.array(chk["mtp_last_logits"])),
        mtp_argmax_equal=int((mlog.argmax(-1) == np.array(chk["mtp_argmax"])).sum()),
        mtp_entries=len(ids) - 1,
    )
    print(json.dumps(out, indent=1))
    ok = out["main_last_logits_rel_l2"] < 1e-3 and out["mtp_last_logits_rel_l2"] < 1e-3
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
