"""Build tests/fixtures/qwen3_moe_yarn: qwen3_moe_hf's seeded weights under a YaRN config,
with goldens from the float64 numpy forward (reference_numpy.py, YaRN written from the paper).

    .venv/bin/python tools/oracle/yarn_fixture.py            # (re)write tests/fixtures/qwen3_moe_yarn
    .venv/bin/python tools/oracle/yarn_fixture.py --check    # rebuild in a temp dir, compare
    .venv/bin/python tools/oracle/yarn_fixture.py --out DIR

The config asks for `rope_scaling: {rope_type: yarn, factor: 32, original_max_position_embeddings:
256}` with max_position_embeddings 8192 (256 x 32), so the model's context is 8192 tokens. With
head_dim 32 and theta 1e6, pair 0 keeps its frequency, pairs 5-15 are slowed 32 times and pairs
1-4 blend; cos and sin carry the attention factor 0.1 ln 32 + 1. Three cases: the short and long
prompts of qwen3_moe_hf (41 and 315 tokens) and one of 675 tokens, the last two past the trained
256. (factor 16 over 512 put two router logits 4e-4 apart; `--scaling JSON` tries another.) Each has its last-position logits and 32 greedy ids
(cache-free forwards over prompt + generated). The build fails when a greedy margin falls
below 1e-2 or two router logits at the top-k boundary come within 1e-3 (float32 noise could
flip them).
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True

import reference_numpy as ref  # noqa: E402

REPO = HERE.parents[1]
SOURCE = REPO / "tests" / "fixtures" / "qwen3_moe_hf"
NAME = "qwen3_moe_yarn"
ROPE_SCALING = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 256}
COPIED = ("model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
N_GREEDY = 32
MIN_GREEDY_MARGIN = 1e-2
MIN_ROUTER_GAP = 1e-3


def f32_list(a) -> list:
    return [float(str(x)) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def recording_router_gaps(gaps: list):
    """reference_numpy.moe, also recording each token's gap between the k-th and (k+1)-th router logit."""
    plain = ref.moe

    def moe(x, w, p, cfg):
        logits = ref.linear(x, w[f"{p}.gate.weight"])
        k = cfg["num_experts_per_tok"]
        top = -np.sort(-logits, axis=-1)
        gaps.append(float(np.min(top[:, k - 1] - top[:, k])))
        return plain(x, w, p, cfg)

    return moe


def greedy(w, cfg, prompt):
    """N_GREEDY argmax tokens, each from a cache-free forward over prompt + generated."""
    ids, margins, first = list(prompt), [], None
    for _ in range(N_GREEDY):
        logits, layers = ref.forward(w, cfg, ids)
        last = logits[-1]
        if first is None:
            first = (last, layers)
        top = np.sort(last)
        margins.append(float(top[-1] - top[-2]))
        ids.append(int(np.argmax(last)))
    return first, ids[len(prompt):], min(margins)


def build(out: Path, scaling: dict) -> None:
    source_golden = json.loads((SOURCE / "golden.json").read_text())
    cases = {c["name"]: c for c in source_golden["cases"]}
    tokenizer = Tokenizer.from_file(str(SOURCE / "tokenizer.json"))
    beyond_text = cases["long"]["prompt_text"] + "\n\n" + cases["long"]["prompt_text"] + "\n\n" + cases["short"]["prompt_text"]
    prompts = [
        ("short", cases["short"]["prompt_text"], cases["short"]["prompt_ids"]),
        ("long", cases["long"]["prompt_text"], cases["long"]["prompt_ids"]),
        ("beyond", beyond_text, tokenizer.encode(beyond_text, add_special_tokens=False).ids),
    ]

    config = json.loads((SOURCE / "config.json").read_text())
    config["rope_scaling"] = scaling
    config["max_position_embeddings"] = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    w = ref.load_weights(SOURCE, config)

    plain_moe, smallest_gap = ref.moe, float("inf")
    golden = {"oracle": "tools/oracle/reference_numpy.py (float64 numpy, YaRN from the paper)", "model": NAME, "cases": []}
    for name, text, ids in prompts:
        (last, layers), generated, margin = greedy(w, config, ids)
        # One forward over everything the engine computes routes for (causal: the same logits).
        gaps: list = []
        ref.moe = recording_router_gaps(gaps)
        ref.forward(w, config, list(ids) + generated[:-1])
        ref.moe = plain_moe
        router_gap = min(gaps)
        if name == "short":
            golden["debug"] = {"short_layer_outputs": [f32_list(h) for h in layers]}
        golden["cases"].append({
            "name": name,
            "prompt_text": text,
            "prompt_ids": [int(i) for i in ids],
            "last_logits": f32_list(last),
            "greedy_ids": generated,
            "min_greedy_margin": float(np.float32(margin)),
        })
        smallest_gap = min(smallest_gap, router_gap)
        print(f"[yarn] {name}: {len(ids)} prompt tokens, greedy margin {margin:.4f}, router gap {router_gap:.5f}")
    if min(c["min_greedy_margin"] for c in golden["cases"]) < MIN_GREEDY_MARGIN or smallest_gap < MIN_ROUTER_GAP:
        raise SystemExit("a greedy margin or router gap is too small for float32 noise; pick another config")
    if len(prompts[2][2]) <= scaling["original_max_position_embeddings"]:
        raise SystemExit("the 'beyond' prompt does not pass the trained context")

    out.mkdir(parents=True, exist_ok=True)
    for f in COPIED:
        shutil.copy(SOURCE / f, out / f)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"[yarn] wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / NAME)
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    ap.add_argument("--scaling", type=json.loads, default=ROPE_SCALING, help="another rope_scaling (JSON) to try")
    args = ap.parse_args()
    if not args.check:
        build(args.out, args.scaling)
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp) / NAME, args.scaling)
        import compare_fixtures
        errs = compare_fixtures.compare_dirs(args.out.parent, Path(tmp), 1e-6)
        errs = [e for e in errs if not e.startswith("fixture directories differ")]
        for e in errs:
            print(f"[compare] {e}")
        if errs:
            raise SystemExit(1)
        print(f"[yarn] {args.out} matches its rebuild")


if __name__ == "__main__":
    main()
