#!/usr/bin/env bash
# Continuous batching on the CPU: N concurrent greedy streams against the same
# N run one after another, on a resident synthetic 64-expert qwen3_moe model
# (tools/bench_batch.py prints the table and checks each stream's text).
#
#   tools/bench_batch.sh [MODEL_DIR] [STREAMS] [BACKEND]
#
# Defaults: /tmp/slotstream-synth-batch (written if missing), 4 streams,
# --backend cpu. The server runs with --parallel STREAMS. BENCH_NO_BUILD=1 uses
# the release binary as it is. BENCH_TTFT=1 runs examples/bench_ttft.rs instead
# (no server; BENCH_ARGS="ROUNDS LONG_WORDS"): a short request's time to first
# token alone and while three long prompts are fed, on one engine with
# --parallel STREAMS. BENCH_BIN=PATH serves with another build, BENCH_TTFT_BIN=PATH
# runs another bench_ttft (for before/after runs).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-/tmp/slotstream-synth-batch}"
streams="${2:-4}"
backend="${3:-cpu}"
port="${BENCH_PORT:-11499}"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
[ -n "${BENCH_NO_BUILD:-}" ] || cargo build --release --quiet
if [ ! -f "$dir/config.json" ]; then
  "$py" tools/synth.py --family qwen3_moe --out "$dir" --hidden 512 --layers 8 --experts 64 --top-k 8 \
    --moe-inter 512 --router-skew 0.4 --mixer-out-scale 0.1 >&2
fi
load() { echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"; }
if [ -n "${BENCH_TTFT:-}" ]; then
  [ -n "${BENCH_NO_BUILD:-}" ] || cargo build --release --quiet --example bench_ttft
  echo "commit $(git rev-parse --short HEAD), $(nproc) cores, $(load)"
  # shellcheck disable=SC2086
  PARALLEL="$streams" "${BENCH_TTFT_BIN:-./target/release/examples/bench_ttft}" "$dir" ${BENCH_ARGS:-}
  load
  exit
fi
"${BENCH_BIN:-./target/release/slotstream}" serve --model "$dir" --name synth --backend "$backend" --port "$port" \
  --parallel "$streams" --no-prefix-cache ${SERVE_ARGS:-} 2>/tmp/bench_batch_server.log &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/api/tags" >/dev/null && break
  sleep 0.5
done
echo "commit $(git rev-parse --short HEAD), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(load)"
"$py" tools/bench_batch.py --url "http://127.0.0.1:$port" --model synth --streams "$streams" ${BENCH_ARGS:-}
load
