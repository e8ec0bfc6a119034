#!/usr/bin/env bash
# The memory promise: with --memory-gb G, peak RSS (VmHWM: anonymous memory plus
# mapped file pages; the page cache is not counted) stays under G, on a model
# several times larger than G.
#
#   tools/memory_promise.sh [LIMIT_GB] [MODEL_DIR]
#
# Writes a ~4.3 GB synthetic qwen3_next model (tools/synth.py) if MODEL_DIR does
# not exist, runs a 300-token prompt and 32 generated tokens under the limit,
# and fails unless peak RSS < LIMIT_GB. Where this machine has a writable cgroup
# v1 memory controller, it also runs the same command inside a cgroup limited
# to LIMIT_GB (that limit counts page cache too, which the kernel reclaims).
set -euo pipefail
cd "$(dirname "$0")/.."
limit="${1:-1.5}"
dir="${2:-/tmp/slotstream-synth-next4g}"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python

cargo build --release --quiet
if [ ! -f "$dir/config.json" ]; then
  "$py" tools/synth.py --family qwen3_next --out "$dir" --hidden 2048 --layers 24 --experts 64 --top-k 8 --moe-inter 768 >&2
fi
model_gb=$(du -sb "$dir" | awk '{printf "%.2f", $1/1e9}')
prompt=$("$py" -c 'print(" ".join(["the sea and the ship"] * 60))')
cmd=(./target/release/slotstream run --model "$dir" --raw --ignore-eos --max-tokens 32 --prompt "$prompt" --json --memory-gb "$limit")

check() {
  local out="$1" where="$2"
  "$py" - "$out" "$limit" "$model_gb" "$where" <<'PY'
import json, sys
o = json.loads(sys.argv[1]); limit = float(sys.argv[2]); model = float(sys.argv[3]); where = sys.argv[4]
rss = o["peak_rss_bytes"] / 1e9
e = o["experts"]["total"]
print(f"[{where}] model {model:.2f} GB, --memory-gb {limit}: peak RSS {rss:.3f} GB; "
      f"{o['experts']['slots']} slots, {e['misses']} misses, {e['bytes_read']/1e9:.2f} GB read; "
      f"decode {o['stats']['decode_tokens_per_second']:.2f} tok/s")
sys.exit(0 if rss < limit else 1)
PY
}

out=$("${cmd[@]}" 2>/dev/null)
check "$out" "process"

cg=/sys/fs/cgroup/memory
if [ -w "$cg" ] && [ -d "$cg" ]; then
  name="$cg/slotstream-promise-$$"
  mkdir "$name"
  trap 'rmdir "$name" 2>/dev/null || true' EXIT
  echo "$(awk "BEGIN{printf \"%d\", $limit * 1e9}")" > "$name/memory.limit_in_bytes"
  out=$(sh -c "echo \$\$ > $name/cgroup.procs && exec \"\$@\"" sh "${cmd[@]}" 2>/tmp/memory_promise_cgroup.log) || { echo "the run inside the cgroup failed:"; tail -5 /tmp/memory_promise_cgroup.log; cat "$name/memory.failcnt"; exit 1; }
  check "$out" "cgroup v1 limit ${limit} GB"
else
  echo "(no writable cgroup v1 memory controller here: skipped the cgroup run)"
fi
