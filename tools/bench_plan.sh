#!/usr/bin/env bash
# The automatic memory plan against explicit pool sizes, and its decode-speed
# estimate against the measured speed (issue 16, item 1):
#   (a) the demo model under the default plan vs --experts-per-layer 32 (all),
#       alternating, ROUNDS times each, and streaming from 14 per layer (the
#       old default);
#   (b) a 1.5 GB synthetic qwen3_moe (8 MoE layers x 64 experts, top-8, 2.65 MB
#       per expert, trained-like routing) resident (default plan) and streaming
#       from pools of 16, 26 and 48 experts per layer.
# First `doctor --measure` measures this machine's rates for each model (the
# backend, expert reads from the model's files, and what a missed expert costs
# the model's own decode from a pool of the knee's share, whose hit rate it
# keeps), so the estimates come from them; then each line: the plan's estimate
# (banner), the measured decode tok/s, the decode hit rate, and where the
# estimate's hit rate came from (each streaming run keeps its own in hits.json;
# the plan takes the exponent of each share the model ran at, or assumes
# share^0.6 for a model that has neither streamed nor been measured here).
# The demo runs from tools/demo/model, the folder measured (the bundled copy
# unpacked in the cache folder has other file times: another model to hits.json).
#
#   tools/bench_plan.sh [ROUNDS]      (default 3; the CPU backend, all cores)
# MEASURE=0 keeps the rates already measured (rates.json in slotstream's cache folder).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
cargo build --release --quiet --bin slotstream
bin="${CARGO_TARGET_DIR:-target}/release/slotstream"
synth="${SYNTH_DIR:-/tmp/slotstream-synth-plan}"
if [ ! -f "$synth/config.json" ]; then
  "$py" tools/synth.py --family qwen3_moe --out "$synth" --hidden 2048 --layers 8 --experts 64 --top-k 8 \
    --moe-inter 768 --mixer-out-scale 0.1 --router-skew 0.4 >&2
fi

if [ "${MEASURE:-1}" != 0 ]; then
  echo "== rates measured on this machine (doctor --measure)"
  for model in tools/demo/model "$synth"; do
    "$bin" doctor --backend cpu --measure --model "$model" 2>/dev/null | sed -n '/^measured:/,/^slotstream memory plan/p' | sed '$d'
    echo "  $(uptime)"
  done
fi

# One run: "<estimate> <measured>" decode tok/s, and the expert-cache line.
measure() {
  local err out
  err=$(mktemp)
  out=$("$bin" run --backend cpu --json --ignore-eos "$@" 2>"$err") || { cat "$err" >&2; rm -f "$err"; return 1; }
  local estimate hits
  estimate=$(sed -n 's/.*decode ~\([0-9.]*\) tok\/s (estimate).*/\1/p' "$err")
  hits=$(sed -n 's/^ *hits: .*\(assumed\|measured from [0-9]* runs\?\).*/\1/p' "$err")
  rm -f "$err"
  echo "$out" | "$py" -c '
import json, sys
o = json.load(sys.stdin); s = o["stats"]; e = s["decode_experts"]
est = float(sys.argv[1]); got = s["decode_tokens_per_second"]; slots = o["experts"]["slots"]
hit = 100.0 * e["hits"] / max(1, e["hits"] + e["misses"])
source = f"; estimated hits {sys.argv[2]}" if sys.argv[2] else ""
print(f"estimate {est:7.1f}  measured {got:7.1f} tok/s  (measured/estimate {got / est:.2f}; {slots} slots, decode hit {hit:.1f}%{source})")
' "$estimate" "$hits"
}

demo=(--model tools/demo/model --prompt "The sea was calm, and the ship" --max-tokens 256)
echo "== (a) demo model, 256 tokens, default plan vs every expert (--experts-per-layer 32)"
for r in $(seq "$rounds"); do
  printf '  default plan:            '; measure "${demo[@]}"
  printf '  --experts-per-layer 32:  '; measure "${demo[@]}" --experts-per-layer 32
  printf '  --experts-per-layer 14:  '; measure "${demo[@]}" --experts-per-layer 14
done
echo "  $(uptime)"

echo "== (b) synthetic qwen3_moe $(du -sh "$synth" | cut -f1), 48 tokens after a 5-token prompt"
for r in $(seq "$rounds"); do
  for epl in default 16 26 48; do
    printf '  %-24s ' "$epl:"
    if [ "$epl" = default ]; then
      measure --model "$synth" --raw --prompt "the sea and the ship" --max-tokens 48
    else
      measure --model "$synth" --raw --prompt "the sea and the ship" --max-tokens 48 --experts-per-layer "$epl"
    fi
  done
  echo "  $(uptime)"
done
