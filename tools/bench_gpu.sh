#!/usr/bin/env bash
# GPU benchmarks of the wgpu backend (see examples/bench_gpu/main.rs):
#   (a) 4-/8-bit matvec bandwidth on a 65536 x 8192 matrix (288 MB at 4 bits,
#       far beyond any L2) as a fraction of the measured device copy bandwidth;
#   (b) decode tok/s of a synthetic qwen3_next-shaped model fully resident on
#       the GPU, against copy bandwidth / bytes read per token;
#   (c) GPU time per decoded token by kernel family (timestamp queries).
# (a) times 4-bit weights with f32 activations (exact mode, before) and int8
# ones (int8 mode, after; forced for matrices under INT8_MIN_BYTES);
# decode runs in int8 mode unless SLOTSTREAM_WGPU_MATMUL=exact;
# (b)/(c) run before (separate projection matmuls and slice copies:
# SLOTSTREAM_FUSED_PROJECTIONS=0 and the views off, in code) at the last flush
# interval, after (fused projections, one-row slices as views) with each
# flush interval (--flush, default 0,8,12,24,16), then both again without
# bounds checks.
#
# usage: tools/bench_gpu.sh [path/to/bench_gpu]   (default: builds it in release)
# env:   MODEL_DIR (default /tmp/synth-qwen3-next, written by tools/synth.py if absent),
#        ADAPTER (auto | software | part of an adapter name; default auto),
#        BENCH_ARGS (more flags for bench_gpu, e.g. "--flush 0,16"),
#        BENCH_SKIP_BEFORE=1 (skip the "before" decode runs)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-}
if [ -z "$BIN" ]; then
    cargo build --release --example bench_gpu
    BIN=${CARGO_TARGET_DIR:-target}/release/examples/bench_gpu
fi
MODEL=${MODEL_DIR:-/tmp/synth-qwen3-next}
if [ ! -f "$MODEL/config.json" ]; then
    # Qwen3-Next-80B-A3B's trunk (hidden 2048, 48 layers, top-10 of 512-wide
    # experts, 512-wide shared expert, 16 heads of 256, 2 KV heads, vocab
    # 151936) with 32 experts per layer instead of 512: with every expert
    # resident, bytes read per token do not depend on the expert count.
    python3 tools/synth.py --family qwen3_next --out "$MODEL" --hidden 2048 --layers 48 \
        --experts 32 --top-k 10 --moe-inter 512 --shared-inter 512 --heads 16 --kv-heads 2 \
        --head-dim 256 --vocab 151936 --bits 4 --group 64
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
    # SM/memory clocks every 200 ms during the run, summarised at the end.
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv,noheader,nounits -lms 200 > /tmp/clocks.csv &
    CLOCKS_PID=$!
    trap 'kill $CLOCKS_PID 2>/dev/null; cut -d, -f1 /tmp/clocks.csv | sort -n | uniq -c | sort -rn | head -3 | sed "s/^/SM clock samples (count, MHz): /"' EXIT
fi
# Reference copy bandwidth (read + write) from PyTorch where it is installed.
if [ -z "${REFERENCE_COPY_GBS:-}" ] && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    REFERENCE_COPY_GBS=$(python3 - <<'PY'
import torch
x = torch.empty(256 * 1024 * 1024, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20): y.copy_(x)
e.record(); torch.cuda.synchronize()
print(f"{2 * x.numel() * 4 * 20 / (s.elapsed_time(e) / 1e3) / 1e9:.0f}")
PY
)
    export REFERENCE_COPY_GBS
fi
"$BIN" --adapter "${ADAPTER:-auto}" --model "$MODEL" --copy-mib 1024 --rows 65536 --cols 8192 \
    --reps ${REPS:-1000} --prompt 256 --decode 64 ${BENCH_ARGS:-}
