#!/usr/bin/env bash
# CPU decode/prefill speed on a synthetic MoE model in the real mlx-lm 4-bit layout.
#
#   tools/bench_cpu.sh [qwen3_moe|qwen3_next] [extra synth.py args...]
#
# Builds the release binary, writes the model once under $SYNTH_DIR (default
# /tmp/slotstream-synth-<family>), runs a 128-token prompt + 64 generated tokens
# three times and prints the run summaries. Results go into BENCHMARKS.md by hand,
# with the machine they came from.
set -euo pipefail
cd "$(dirname "$0")/.."
family="${1:-qwen3_moe}"
shift || true
dir="${SYNTH_DIR:-/tmp/slotstream-synth-$family}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python

cargo build --release --quiet
if [ ! -f "$dir/config.json" ]; then
  "$py" tools/synth.py --family "$family" --out "$dir" "$@"
fi
du -sh "$dir"
prompt=$(head -c 600 ../shared/corpus/shakespeare.txt 2>/dev/null || head -c 600 tests/fixtures/qwen3_moe_mlx4/golden.json)
for i in 1 2 3; do
  ./target/release/slotstream run --model "$dir" --raw --ignore-eos --max-tokens 64 \
    --prompt "$prompt" --json | "$py" tools/summarize_run.py
done
