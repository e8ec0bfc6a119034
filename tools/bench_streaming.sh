#!/usr/bin/env bash
# Expert streaming: decode tok/s against pool size on a synthetic model larger
# than the pool, and expert-read GB/s against the disk's raw read GB/s (fio) at
# the same request size and queue depth.
#
#   tools/bench_streaming.sh [MODEL_DIR]
#
# Uses the ~4.3 GB synthetic qwen3_next model of tools/memory_promise.sh (24 MoE
# layers x 64 experts, top-8, 2.65 MB per expert), writing it if missing.
# Needs fio (apt-get install fio).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-/tmp/slotstream-synth-next4g}"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
cargo build --release --quiet
if [ ! -f "$dir/config.json" ]; then
  "$py" tools/synth.py --family qwen3_next --out "$dir" --hidden 2048 --layers 24 --experts 64 --top-k 8 --moe-inter 768 >&2
fi
shard=$(ls "$dir"/*.safetensors | head -1)
echo "== raw disk (fio, O_DIRECT random reads of $shard)"
for bs in 768k 2592k; do
  for jobs in 8 16; do
    fio --name=raw --filename="$shard" --readonly --rw=randread --bs=$bs --direct=1 --ioengine=psync \
      --numjobs=$jobs --group_reporting --time_based --runtime=5 2>/dev/null |
      awk -v bs=$bs -v j=$jobs '/READ:/ { sub(/.*\(/, "", $2); sub(/\).*/, "", $2); print "  request " bs ", " j " in flight: " $2 }'
  done
done
echo "== slotstream decode vs pool size (prompt 64 tokens, 32 generated, cold start)"
prompt=$("$py" -c 'print(" ".join(["the sea and the ship"] * 13))')
for epl in 8 16 32 64; do
  printf '  %2d experts/layer: ' "$epl"
  ./target/release/slotstream run --model "$dir" --raw --ignore-eos --max-tokens 32 --prompt "$prompt" \
    --experts-per-layer "$epl" --json 2>/dev/null | "$py" tools/summarize_run.py
done
