#!/usr/bin/env bash
# The flagship at scale (issue 50): a Qwen3.8-Flash-Next slice (12 of its 48 layers, real
# shapes, 512 experts, routers calibrated: tools/synth.py --help) streamed at the memory shares
# of 16, 24 and 48 GB machines, each against its disk-bound limit (tools/peer/bench_flagship.py
# says what is measured and how the 48-layer figure is extrapolated).
#
#   tools/bench_flagship.sh            # here: the CPU backend (writes the slice first if missing)
#
# On the device the same measurements run with the GPU backend: `tools/bench_gpu_peer.sh
# prepare` here (NO_PEER=1 skips llama.cpp), carry .devbin/gpu-peer and .gl, then there
# `tools/bench_gpu_peer.sh flagship` (BENCHMARKS.md, "The flagship at scale", has the command).
#
# env: DIR (the slice, default /work/f50-models/slice12), LAYERS (12), NGRAM_GB (8: the published
#   32 GB scaled to 12/48), ROUTER_SKEW (0.45), JOBS (nproc), BACKEND (cpu), SHARES (16,24,48),
#   PHASES (decode,prefill: either alone, to split a run over calls), DECODE (64), PREFILL (8192), RESULTS (default $DIR-results), SLOTSTREAM (the binary; default
#   target/release/slotstream, built here), REFERENCE (the published config and tensor shapes),
#   KEEP=0 deletes the slice afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${DIR:-/work/f50-models/slice12}
layers=${LAYERS:-12}
results=${RESULTS:-$dir-results}
bin=${SLOTSTREAM:-}
if [ -z "$bin" ]; then
    nice -n 10 cargo build --release --quiet --bin slotstream
    bin=target/release/slotstream
fi
synth_args=(--family qwen4_exp --layers "$layers" --ngram-gb "${NGRAM_GB:-8}" --jobs "${JOBS:-$(nproc)}"
    --router-skew "${ROUTER_SKEW:-0.45}" --out "$dir")
[ -n "${REFERENCE:-}" ] && synth_args+=(--reference "$REFERENCE")
if [ ! -f "$dir/synth.json" ]; then
    echo "writing the slice: tools/synth.py ${synth_args[*]}"
    start=$(date +%s)
    nice -n 10 python3 tools/synth.py "${synth_args[@]}" 2>/dev/null
    echo "slice written in $(( $(date +%s) - start )) s"
fi
commit=${COMMIT:-$(git rev-parse --short=9 HEAD 2>/dev/null || echo unknown)}
machine=${MACHINE:-"$(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GB RAM, $(uname -r)"}
rc=0
PYTHONUNBUFFERED=1 python3 tools/peer/bench_flagship.py --slotstream "$bin" --model "$dir" --backend "${BACKEND:-cpu}" \
    --shares "${SHARES:-16,24,48}" --phases "${PHASES:-decode,prefill}" --decode "${DECODE:-64}" --prefill-tokens "${PREFILL:-8192}" --results "$results" \
    --commit "$commit" --machine "$machine" || rc=$?
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$results"/table.md "$results"/results.json "$OUT"/ 2>/dev/null || true
    tar -C "$results" --exclude="view*" --exclude=cache -czf "$OUT/flagship-logs.tar.gz" . || true
fi
[ "${KEEP:-1}" = 0 ] && rm -rf "$dir"
exit $rc
