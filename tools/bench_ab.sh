#!/usr/bin/env bash
# Two slotstream binaries side by side (before/after a change), alternating
# on the same models, CPU backend, experts resident unless EXTRA says otherwise.
#
#   EXTRA="--experts-per-layer 32" tools/bench_ab.sh OLD_BIN NEW_BIN MODEL_DIR...
#
# Prints prefill and decode tok/s, the expert hit rate and a fingerprint of the
# generated ids per run. For instruction counts (deterministic on a noisy
# machine) run each binary under `valgrind --tool=callgrind` (BENCHMARKS.md).
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 OLD_BIN NEW_BIN MODEL_DIR..." >&2; exit 2; }
OLD=$1 NEW=$2; shift 2
ROUNDS=${ROUNDS:-3}
prompt_file=${PROMPT_FILE:-$(dirname "$0")/../../shared/corpus/shakespeare.txt}
prompt=$(head -c 600 "$prompt_file")
for model in "$@"; do
  for round in $(seq "$ROUNDS"); do
    for which in old new; do
      bin=$OLD; [ "$which" = new ] && bin=$NEW
      # shellcheck disable=SC2086
      "$bin" run --model "$model" --backend cpu ${EXTRA:-} --raw --ignore-eos --max-tokens 64 \
        --prompt "$prompt" --json 2>/dev/null | python3 -c "
import json, sys, zlib
o = json.load(sys.stdin); s = o['stats']; e = o['experts']['total']
ids = zlib.crc32(json.dumps(o['generated_ids']).encode())
print('{} r{} {}: prompt {} tok prefill {:.1f} tok/s; decode {} tok {:.2f} tok/s; hit {:.1f}%; ids crc {:08x}'.format(
    sys.argv[1], sys.argv[2], sys.argv[3], s['prompt_tokens'], s['prefill_tokens_per_second'], s['generated_tokens'],
    s['decode_tokens_per_second'], 100 * e['hits'] / max(1, e['hits'] + e['misses']), ids))" "$(basename "$model")" "$round" "$which"
    done
  done
done
