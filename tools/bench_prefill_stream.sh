#!/usr/bin/env bash
# Streamed prefill against resident prefill (issue 46, item 4): the 64-expert
# synthetic qwen3_moe with a pool of 16 of 64 experts per layer beside one that
# holds every expert, on one long prompt, the arms alternating each round.
#
#   tools/bench_prefill_stream.sh [PROMPT_TOKENS] [ROUNDS] [EXPERTS_PER_LAYER]
#
# Defaults: 8096 tokens, 2 rounds, 16 experts per layer. Each run generates 8
# greedy tokens (checked equal across the arms). Per run: prefill tok/s, the
# bytes the prompt read from disk, the passes over its missed experts (bytes
# read / bytes of the distinct experts that missed; from `run --json`'s
# `stats.prefill_experts`, or, for a binary from before it reported them,
# over every routed expert) and the prefill's hit rate. SLOTSTREAM_BIN names
# another binary (a baseline build); BACKEND (default cpu) the backend.
set -euo pipefail
cd "$(dirname "$0")/.."
tokens="${1:-8096}"
rounds="${2:-2}"
epl="${3:-16}"
dir="${SYNTH_DIR:-/tmp/slotstream-synth-a64-prefill}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
bin="${SLOTSTREAM_BIN:-./target/release/slotstream}"
backend="${BACKEND:-cpu}"

if [ -z "${SLOTSTREAM_BIN:-}" ]; then
  cargo build --release --quiet --bin slotstream
fi
if [ ! -f "$dir/config.json" ]; then
  "$py" tools/synth.py --family qwen3_moe --out "$dir" --hidden 512 --layers 8 --experts 64 --top-k 8 \
    --moe-inter 512 --router-skew 0.4 --mixer-out-scale 0.1 >&2
fi
# A prompt of exactly $tokens tokens: characters no merge of the synthetic
# byte-level tokenizer joins are one token each (a seeded mix, so that the
# routing varies as real text's does).
prompt=$("$py" - "$dir/tokenizer.json" "$tokens" <<'EOF'
import json, random, sys
tok = json.load(open(sys.argv[1]))
merged = {c for pair in tok["model"]["merges"] for side in (pair.split(" ") if isinstance(pair, str) else pair) for c in side}
alphabet = [c for c in map(chr, range(33, 127)) if c not in merged and c in tok["model"]["vocab"]]
rng = random.Random(46)
print("".join(rng.choice(alphabet) for _ in range(int(sys.argv[2]))), end="")
EOF
)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "== $("$bin" --version 2>/dev/null || echo "$bin"), backend $backend, $(nproc) cores, prompt $tokens tokens, $rounds rounds"
for round in $(seq 1 "$rounds"); do
  for arm in resident streamed; do
    n=$([ "$arm" = resident ] && echo 64 || echo "$epl")
    "$bin" run --model "$dir" --backend "$backend" --raw --ignore-eos --max-tokens 8 --plan-context $((tokens + 64)) \
      --experts-per-layer "$n" --prompt "$prompt" --json 2>/dev/null >"$out/$arm-$round.json"
  done
done
"$py" - "$out" "$rounds" "$tokens" <<'EOF'
import json, os, sys
out, rounds, want = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows, ids = {}, set()
for arm in ("resident", "streamed"):
    for r in range(1, rounds + 1):
        o = json.load(open(os.path.join(out, f"{arm}-{r}.json")))
        s, e = o["stats"], o["experts"]
        if s["prompt_tokens"] != want:
            sys.exit(f"the prompt came to {s['prompt_tokens']} tokens, not {want}")
        ids.add(tuple(o["generated_ids"]))
        p = s.get("prefill_experts")
        if p is None:  # a binary from before the prefill's own counters: all reads are the prompt's but 7 tokens'
            t = e["total"]
            read, hits, misses = t["bytes_read"] - s["decode_experts"]["bytes_read"], t["hits"], t["misses"]
            # Over every routed expert: with a long prompt nearly all of them miss.
            record = o["plan"]["pool_bytes"] / max(1, o["plan"]["slots"])
            passes = read / (record * o["plan"]["total_experts"]) if arm == "streamed" else None
        else:
            read, hits, misses, passes = p["bytes_read"], p["hits"], p["misses"], p["passes"]
        rows.setdefault(arm, []).append((s["prefill_tokens_per_second"], read, passes, hits, misses, e["slots"], s["prefill_seconds"]))
print("| arm | slots | prefill tok/s (each round) | prefill s | read GB | passes over missed experts | prefill hit rate |")
print("|---|---:|---:|---:|---:|---:|---:|")
for arm, rs in rows.items():
    tps = ", ".join(f"{r[0]:.1f}" for r in rs)
    p = rs[-1][2]
    hit = rs[-1][3] / max(1, rs[-1][3] + rs[-1][4])
    print(f"| {arm} | {rs[-1][5]} | {tps} | {rs[-1][6]:.1f} | {rs[-1][1] / 1e9:.3f} | {'-' if p is None else f'{p:.2f}'} | {100 * hit:.1f}% |")
best = {arm: max(r[0] for r in rs) for arm, rs in rows.items()}
mean = {arm: sum(r[0] for r in rs) / len(rs) for arm, rs in rows.items()}
print(f"streamed / resident prefill: {mean['streamed'] / mean['resident']:.3f}x (means), {best['streamed'] / best['resident']:.3f}x (best of each)")
print("greedy ids equal across arms and rounds:", "yes" if len(ids) == 1 else f"NO ({len(ids)} different)")
EOF
