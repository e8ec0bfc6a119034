"""Check that freshly regenerated fixtures match the committed ones.

    compare_fixtures.py COMMITTED_DIR REGENERATED_DIR [--golden-tol 1e-6]

* the same fixture directories and the same files in each;
* safetensors: byte-identical, or else the same tensors (names, dtypes,
  shapes, values bit for bit) -- only header metadata may differ;
* golden.json: identical except floats, which must agree within
  golden_tol * max(1, |committed|);
* every other file (config, tokenizer, index): byte-identical.
Exits non-zero with one line per difference.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

import ml_dtypes  # noqa: F401  (bfloat16 for load_file)


def compare_safetensors(a: Path, b: Path) -> list:
    if a.read_bytes() == b.read_bytes():
        return []
    ta, tb = load_file(str(a)), load_file(str(b))
    if ta.keys() != tb.keys():
        return [f"{b}: tensor names differ: {sorted(ta.keys() ^ tb.keys())}"]
    errs = []
    for k in sorted(ta):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            errs.append(f"{b}: tensor {k} differs")
    return errs


def compare_json_values(a, b, tol: float, where: str, errs: list) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            errs.append(f"{where}: keys differ: {sorted(a.keys() ^ b.keys())}")
            return
        for k in a:
            compare_json_values(a[k], b[k], tol, f"{where}.{k}", errs)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            errs.append(f"{where}: length {len(b)} != committed {len(a)}")
            return
        if a and all(isinstance(v, float) for v in a) and all(isinstance(v, (int, float)) for v in b):
            x, y = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
            bad = np.abs(x - y) > tol * np.maximum(1.0, np.abs(x))
            if bad.any():
                i = int(np.argmax(np.abs(x - y)))
                errs.append(f"{where}: {int(bad.sum())} floats off, worst [{i}] {y[i]!r} vs committed {x[i]!r}")
            return
        for i, (u, v) in enumerate(zip(a, b)):
            compare_json_values(u, v, tol, f"{where}[{i}]", errs)
    elif isinstance(a, float) and isinstance(b, (int, float)):
        if abs(a - b) > tol * max(1.0, abs(a)):
            errs.append(f"{where}: {b!r} vs committed {a!r}")
    elif a != b or type(a) is not type(b):
        errs.append(f"{where}: {b!r} vs committed {a!r}")


# Built elsewhere: tools/oracle/qwen4_exp/build.py --check compares qwen4_exp_tiny, yarn_fixture.py --check
# qwen3_moe_yarn, tools/verify.sh
# rebuilds qwen4_exp_slice_tiny with tools/synth.py.
OTHER_ORACLES = {"qwen4_exp_tiny", "qwen4_exp_slice_tiny", "qwen3_moe_yarn"}


def compare_dirs(committed: Path, regenerated: Path, tol: float) -> list:
    errs = []
    names_a = sorted(p.name for p in committed.iterdir() if p.is_dir() and p.name not in OTHER_ORACLES)
    names_b = sorted(p.name for p in regenerated.iterdir() if p.is_dir())
    if names_a != names_b:
        errs.append(f"fixture directories differ: committed {names_a}, regenerated {names_b}")
    for name in sorted(set(names_a) & set(names_b)):
        da, db = committed / name, regenerated / name
        files_a = sorted(p.name for p in da.iterdir())
        files_b = sorted(p.name for p in db.iterdir())
        if files_a != files_b:
            errs.append(f"{name}: files differ: committed {files_a}, regenerated {files_b}")
        for f in sorted(set(files_a) & set(files_b)):
            fa, fb = da / f, db / f
            if f.endswith(".safetensors"):
                errs += compare_safetensors(fa, fb)
            elif f == "golden.json":
                compare_json_values(json.loads(fa.read_text()), json.loads(fb.read_text()), tol,
                                    f"{name}/golden.json", errs)
            elif fa.read_bytes() != fb.read_bytes():
                errs.append(f"{name}/{f}: contents differ")
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("committed", type=Path)
    ap.add_argument("regenerated", type=Path)
    ap.add_argument("--golden-tol", type=float, default=1e-6)
    args = ap.parse_args()
    errs = compare_dirs(args.committed, args.regenerated, args.golden_tol)
    for e in errs:
        print(f"[compare] {e}")
    if errs:
        sys.exit(1)
    print(f"[compare] {args.regenerated} matches {args.committed}")


if __name__ == "__main__":
    main()
