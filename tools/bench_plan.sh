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
# the model's own decode from a pool of the knee's share, whose hit rate and
# time it keeps), so the estimates come from them; then each line: the plan's
# estimate (banner), the measured decode tok/s, the decode hit rate, where the
# estimate's hit rate came from (each streaming run keeps its own in hits.json;
# the plan takes the exponent of each share the model ran at, or assumes
# share^0.6 for a model that has neither streamed nor been measured here) and,
# for builds whose banner has a `speed:` line, where its speed came from (each
# streaming run keeps its decode's time too: `runs` at this pool's size,
# `between` two sizes, `nearest` size, or `rates`). Last, per case, how many
# rounds were within 30% of the estimate and the median measured / estimate.
# The demo runs from tools/demo/model, the folder measured (the bundled copy
# unpacked in the cache folder has other file times: another model to hits.json).
#
#   tools/bench_plan.sh [ROUNDS] [BINARY...]   (default 3; the CPU backend, all cores)
# With no BINARY: builds and runs this tree's release binary, keeping what it
# measures in slotstream's cache folder (MEASURE=0 keeps the rates already
# measured there). With BINARY...: runs each in turn (name them alternately,
# `old new old new`, on a noisy machine), each with a fresh cache folder of its
# own, so one build never plans with another's runs.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
shift || true
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
synth="${SYNTH_DIR:-/tmp/slotstream-synth-plan}"
if [ ! -f "$synth/config.json" ]; then
  "$py" tools/synth.py --family qwen3_moe --out "$synth" --hidden 2048 --layers 8 --experts 64 --top-k 8 \
    --moe-inter 768 --mixer-out-scale 0.1 --router-skew 0.4 >&2
fi
ratios=$(mktemp)
trap 'rm -f "$ratios"' EXIT

# One run as "<case>" (-v: the banner, resident or not): the estimate, the measured decode tok/s, the expert-cache
# line and where the estimate came from; its ratio is kept for the summary.
measure() {
  local case=$1 err out estimate hits speed
  shift
  err=$(mktemp)
  out=$("$bin" run -v --backend cpu --json --ignore-eos "$@" 2>"$err") || { cat "$err" >&2; rm -f "$err"; return 1; }
  estimate=$(sed -n 's/.*decode ~\([0-9.]*\) tok\/s (estimate).*/\1/p' "$err")
  hits=$(sed -n 's/^ *hits: .*\(assumed\|measured from [0-9]* runs\?\).*/\1/p' "$err")
  speed=$(sed -n 's/^ *speed: *//p' "$err")
  rm -f "$err"
  printf '  %-24s ' "$case:"
  echo "$out" | "$py" -c '
import json, sys
o = json.load(sys.stdin); s = o["stats"]; e = s["decode_experts"]
est = float(sys.argv[1]); got = s["decode_tokens_per_second"]; slots = o["experts"]["slots"]
hit = 100.0 * e["hits"] / max(1, e["hits"] + e["misses"])
source = f"; estimated hits {sys.argv[2]}" if sys.argv[2] else ""
speed = sys.argv[3]
if speed:
    how = ("rates" if speed.startswith("from the rates") else "between" if " between " in speed
           else "nearest" if "at this pool\x27s misses" in speed else "runs")
    source += f"; speed from {how}"
print(f"estimate {est:7.1f}  measured {got:7.1f} tok/s  (measured/estimate {got / est:.2f}; {slots} slots, decode hit {hit:.1f}%{source})")
with open(sys.argv[4], "a") as f:
    f.write(f"{sys.argv[5]}\t{sys.argv[6]}\t{got / est}\n")
' "$estimate" "$hits" "$speed" "$ratios" "$label" "$case"
}

bench() {
  if [ "${MEASURE:-1}" != 0 ]; then
    echo "== rates measured on this machine (doctor --measure)"
    for model in tools/demo/model "$synth"; do
      "$bin" doctor --backend cpu --measure --model "$model" 2>/dev/null | sed -n '/^measured:/,/^slotstream memory plan/p' | sed '$d'
      echo "  $(uptime)"
    done
  fi
  local demo=(--model tools/demo/model --prompt "The sea was calm, and the ship" --max-tokens 256)
  echo "== (a) demo model, 256 tokens, default plan vs every expert (--experts-per-layer 32)"
  for r in $(seq "$rounds"); do
    measure "demo default plan" "${demo[@]}"
    measure "demo 32 per layer" "${demo[@]}" --experts-per-layer 32
    measure "demo 14 per layer" "${demo[@]}" --experts-per-layer 14
  done
  echo "  $(uptime)"
  echo "== (b) synthetic qwen3_moe $(du -sh "$synth" | cut -f1), 48 tokens after a 5-token prompt"
  for r in $(seq "$rounds"); do
    measure "synthetic default plan" --model "$synth" --raw --prompt "the sea and the ship" --max-tokens 48
    for epl in 16 26 48; do
      measure "synthetic $epl per layer" --model "$synth" --raw --prompt "the sea and the ship" --max-tokens 48 --experts-per-layer "$epl"
    done
    echo "  $(uptime)"
  done
}

if [ $# -eq 0 ]; then
  cargo build --release --quiet --bin slotstream
  bin="${CARGO_TARGET_DIR:-target}/release/slotstream"
  label=$(git rev-parse --short HEAD)
  bench
else
  for bin in "$@"; do
    label="$bin #$((${run_number:-0} + 1))"
    run_number=$((${run_number:-0} + 1))
    echo "=== run $run_number: $bin ($(date -u +%H:%M:%S) UTC)"
    cache=$(mktemp -d)
    XDG_CACHE_HOME="$cache" bench
    rm -rf "$cache"
  done
fi

echo "== measured / estimate within 30% (rounds), median"
"$py" - "$ratios" <<'EOF'
import statistics, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
groups = {}
for label, case, ratio in rows:
    label = label.split(" #")[0]
    size = case.split()[1]
    kind = "demo streaming" if case.startswith("demo 14") else "synthetic streaming" if size in ("16", "26", "48") else "resident"
    for key in (case, kind + " (all)"):
        groups.setdefault(label, {}).setdefault(key, []).append(float(ratio))
for label, cases in groups.items():
    for case in sorted(cases, key=lambda c: (c.endswith("(all)"), c)):
        values = cases[case]
        within = sum(1 for v in values if 1 / 1.3 <= v <= 1.3)
        print(f"  {label}  {case:28s} {within:3d} of {len(values):3d}   median {statistics.median(values):.2f}")
EOF
