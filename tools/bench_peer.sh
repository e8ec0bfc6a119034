#!/usr/bin/env bash
# slotstream vs llama.cpp, side by side in one run (issue 8, items 3-5). Prints one table.
#
#   tools/bench_peer.sh                 # (a) resident + (b) under a cgroup memory limit
#   SKIP=b tools/bench_peer.sh          # only (a) and the qwen3_next resident run; SKIP=a,next: only (b)
#   DEPTH=8192 SKIP=a,next,b tools/bench_peer.sh   # only (depth): model a's decode after a
#                                       # ~8192-token prompt (and its prefill) against llama-bench
#                                       # -p 0 -n 32 -d P and -p P, the same threads (issue 46)
#
# Needs root (cgroup v1 memory controller at /sys/fs/cgroup/memory) for (b).
# Builds: slotstream release binary ($CARGO_TARGET_DIR, default ./target),
# llama.cpp via tools/peer/build_llama_cpp.sh under $PEER_DIR (default /tmp/slotstream-peer).
# Models (written once under $PEER_DIR/models):
#   a: synthetic qwen3_moe hidden 1024, 8 layers, 32 experts top-4, moe_inter 512,
#      16/4 heads, head_dim 64, vocab 4096 (432M params; MLX 4-bit g64)
#   b: synthetic qwen3_moe hidden 2048, 14 layers, 64 experts top-8, moe_inter 768,
#      vocab 32768 (4.3B params; MLX 4-bit g64, 2.55 GB), run under a $LIMIT_MIB (768) MiB
#      limit: 3.2x smaller than the model
#   next-a: synthetic qwen3_next, as a but 6 Gated DeltaNet + 2 attention layers and a
#      512-wide shared expert (resident comparison only)
# The GGUFs are the same weights: tools/peer/to_gguf.py dequantizes the MLX tensors
# to F16, then llama-quantize --pure Q4_0 (4.5 bits per weight, as MLX 4-bit g64).
set -euo pipefail
cd "$(dirname "$0")/.."
PEER_DIR=${PEER_DIR:-/tmp/slotstream-peer}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
LIMIT_MIB=${LIMIT_MIB:-768}
ROUNDS=${ROUNDS:-2}
QTYPE=${QTYPE:-Q4_0}
py=${PYTHON:-python3}
LB=$PEER_DIR/llama.cpp/build/bin
M=$PEER_DIR/models

cargo build --release --quiet
[ -x "$LB/llama-bench" ] || tools/peer/build_llama_cpp.sh
mkdir -p "$M"
make_model() {  # family, name, synth args...
  local family=$1 name=$2; shift 2
  if [ ! -f "$M/$name/config.json" ]; then
    "$py" tools/synth.py --family "$family" --out "$M/$name" "$@" >&2
  fi
  if [ ! -f "$M/$name-$QTYPE.gguf" ]; then
    "$py" tools/peer/to_gguf.py --model "$M/$name" --out "$M/$name-f16.gguf" >&2
    "$LB/llama-quantize" --pure "$M/$name-f16.gguf" "$M/$name-$QTYPE.gguf" "$QTYPE" > "$M/$name-quantize.log" 2>&1
    tail -2 "$M/$name-quantize.log" >&2
    rm -f "$M/$name-f16.gguf"
  fi
}
make_model qwen3_moe moe-a --hidden 1024 --layers 8 --experts 32 --top-k 4 --moe-inter 512 \
  --heads 16 --kv-heads 4 --head-dim 64 --vocab 4096 --seed 1
skipping() { [[ ",${SKIP:-}," == *",$1,"* ]]; }
skipping b || make_model qwen3_moe moe-b14 --hidden 2048 --layers 14 --experts 64 --top-k 8 --moe-inter 768 \
  --vocab 32768 --seed 2
skipping next || make_model qwen3_next next-a --hidden 1024 --layers 8 --experts 32 --top-k 4 --moe-inter 512 \
  --shared-inter 512 --heads 16 --kv-heads 4 --head-dim 64 --vocab 4096 --seed 4
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(free -g | awk '/Mem:/{print $2}') GB RAM; load: $(cut -d' ' -f1-3 /proc/loadavg)"
du -sh "$M"/moe-a "$M"/moe-a-$QTYPE.gguf
skipping b || du -sh "$M"/moe-b14 "$M"/moe-b14-$QTYPE.gguf
prompt_file=../shared/corpus/shakespeare.txt
[ -f "$prompt_file" ] || prompt_file=/work/shared/corpus/shakespeare.txt
exec "$py" tools/peer/bench_peer.py --slotstream "$CARGO_TARGET_DIR/release/slotstream" --llama-bin "$LB" \
  --model-a "$M/moe-a" --gguf-a "$M/moe-a-$QTYPE.gguf" --experts-a 32 \
  --model-next "$M/next-a" --gguf-next "$M/next-a-$QTYPE.gguf" --experts-next 32 \
  --model-b "$M/moe-b14" --gguf-b "$M/moe-b14-$QTYPE.gguf" \
  --b-experts-per-layer "${B_EXPERTS_PER_LAYER:-11}" --limit-mib "$LIMIT_MIB" --rounds "$ROUNDS" --prompt-file "$prompt_file" --skip "${SKIP:-}" \
  --depth "${DEPTH:-0}" --depth-tokens "${DEPTH_TOKENS:-32}"
