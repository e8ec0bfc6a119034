#!/usr/bin/env bash
# slotstream's wgpu backend vs llama.cpp's Vulkan backend on the same weights, in one run on
# one GPU machine (issue 14, item 5). Phases, because the GPU machine has no network and
# receives only the repository plus at most 64 MiB of carried, git-ignored files:
#
#   tools/bench_gpu_peer.sh prepare     # here (dev machine): build and pack what travels
#   tools/bench_gpu_peer.sh run         # there (GPU machine): synthesize, convert, run both
#   tools/bench_gpu_peer.sh stream      # there: streamed decode, several arms alternating
#   tools/bench_gpu_peer.sh disk        # there, after stream: the disk's rate with idle gaps
#   tools/bench_gpu_peer.sh long        # there: long prompts and contexts (tools/peer/bench_long.py)
#   tools/bench_gpu_peer.sh stream-prefill  # there: streamed prefill of long prompts (tools/peer/bench_stream_prefill.py)
#   tools/bench_gpu_peer.sh flagship    # there: the flagship slice at 16/24/48 GB shares (tools/bench_flagship.sh;
#                                       #   NO_PEER=1 prepare skips llama.cpp; SHARES=16 then SHARES=24,48 fit 10-minute calls)
#
# prepare (minutes; ~7 min for llama.cpp on 2 cores, more with our release build beside it):
#   - our release binary, stripped, xz-compressed without the demo model it embeds (the
#     working tree holds that file; tools/peer/pack_binary.py splices it back, sha256-checked);
#     LONG=1 adds the bench_gpu example to the same xz stream -> .devbin/gpu-peer/slotstream.xz(.json)
#   - llama.cpp's Vulkan backend from the llama-cpp-python 0.3.36 sdist (PEERS.md), shared
#     libraries, only llama-bench and llama-quantize, stripped, with gguf-py, xz tarball
#     (tools/peer/build_llama_cpp_vulkan.sh; drops the VK_EXT_layer_settings block that
#     Debian 12's 1.3.239 headers lack)                -> .devbin/gpu-peer/llama-vulkan.tar.xz
#   - the commit measured                              -> .devbin/gpu-peer/COMMIT
#   - the Vulkan loader and libglvnd .debs (NVIDIA's Vulkan driver needs libGLdispatch), for a
#     GPU machine without them                        -> .gl/
#   then prints the sizes against the 64 MiB budget (the working tree counts too).
#   Carry: .devbin/gpu-peer and .gl (both git-ignored).
#
# run (on the GPU machine, from the repository root; `run` never builds anything):
#   unpacks the two artifacts under $WORK, installs the loader from .gl/*.deb when
#   `ldconfig -p` has no libvulkan (root only), points VK_DRIVER_FILES at NVIDIA's ICD where the
#   machine keeps it outside the loader's search path, then tools/peer/bench_gpu_peer.py: for
#   each model in $MODELS it writes the model (tools/synth.py --symmetric --jobs $(nproc)), the
#   Q4_0 GGUF (tools/peer/to_gguf.py --outtype q4_0: the same bits repacked, as
#   `llama-quantize --pure Q4_0` lays them out), runs llama-bench and ours, deletes both files,
#   and at the end prints one markdown table for BENCHMARKS.md (also $RESULTS/table.md, with
#   results.json and every log).
#
# Models (full size; SMALL=1: hidden 256, 4 layers, vocab 4096, same expert counts, for tests):
#   A    Qwen3-30B-A3B's trunk: qwen3_moe, hidden 2048, 48 layers, top-8 of 16 experts 768 wide,
#        32/4 heads of 128, vocab 151936 (MLX 4-bit g64 ~2.9 GB, Q4_0 GGUF the same)
#   B    Qwen3-Next-80B-A3B's trunk: qwen3_next, top-10 of 16 experts 512 wide + shared expert
#        512 wide, 16/2 heads of 256 (~2.2 GB)
#   A64, B64  the same trunks with 64 experts per layer (~9.0 / ~6.0 GB), our pool holding 16 per
#        layer (25%); our GPU and CPU backends only (PEER_STREAMING=1 adds llama.cpp with all 64
#        resident).
#   Routing (all models; see tools/synth.py): random weights send nearly every token to the same
#   few experts (attention adds the context's mean to every position); --mixer-out-scale 0.1
#   keeps router inputs token-specific (near-uniform choice) and --router-skew $ROUTER_SKEW
#   (default 0.4) makes some experts busier, as in trained models: ~28% decode hits for a
#   16-of-64 pool, instead of ~90% with plain random weights.
#
# env (run): MODELS (default A,B,A64,B64), SMALL=1, ROUNDS (ours, default 3), PEER_REPS (3), PEER_ROUNDS
#   (llama-bench runs per resident model, alternating with ours, default 1; its speed moves with how long the
#   machine has been busy: 3 compares like with like),
#   CPU=all|streaming|none (our CPU backend on which models, default all), PEER_STREAMING=1,
#   ROUTER_SKEW, MIXER_OUT_SCALE (0.1), GPU_BACKEND (default wgpu; e.g. wgpu:software for lavapipe), KEEP=1 (keep
#   models), WORK (models and unpacked binaries, default /tmp/gpu-peer), RESULTS (default
#   $WORK/results; where $OUT is set, table.md, results.json and gpu-peer-logs.tar.gz are
#   copied there too), JOBS (default nproc), FIRST_ROUNDS (first-prompt runs of each engine per
#   resident model, default 2; 0 skips them), IDLE (seconds the GPU idles before each, 10),
#   DECODE (decode passes of both engines, default 64; fewer fit more alternating streamed pairs in one call:
#   the disk's rate drifts, so the streamed GPU/CPU comparison needs many, e.g.
#   MODELS=A64 ROUNDS=8 DECODE=32).
# env (prepare): CARGO_BUILD_JOBS (default 1), JOBS/NICE for llama.cpp (2/10), FORCE=1 (rebuild
#   llama.cpp), VK_PEER_DIR (its source and build tree, default /tmp/slotstream-peer-vk).
#
# stream (on the GPU machine, after the same setup as run; llama.cpp not needed): the streamed
#   trunk $MODEL (A or B, with 64 experts per layer and a pool of 16) decoded by each arm of
#   $ARMS in turn, $ROUNDS rounds (default 4), the arms' order rotated each round, a short prompt
#   and $DECODE passes (default 32): tools/peer/stream_pairs.py. An arm is NAME=BACKEND[:VAR=VALUE...],
#   e.g. ARMS="gpu=wgpu cpu=cpu exact=wgpu:SLOTSTREAM_WGPU_MATMUL=exact" (the default: gpu, cpu).
#   BESIDE=gpu in an arm keeps the GPU busy from another process while it runs (cpuG=cpu:BESIDE=gpu:
#   does a GPU in use slow the reads of a process that does not touch it?); BESIDE=pcie copies host
#   memory to the GPU at the streamed rate instead (PyTorch). CPUS=LIST runs the arm under taskset;
#   CPUS=away on every CPU but those taking the model disk's interrupts.
#   Prints and keeps (table.md, results.json, in $OUT too) each run's decode, read rate while in
#   flight, lead and tail between layers' reads, and per arm against the first: the geometric mean
#   of the rounds' ratios and the rounds won, MB read per token, and whether it decoded the same
#   tokens. The default int8 arms decode different tokens and so read different experts; exact
#   arms (ARMS="gpu=wgpu:exact cpu=cpu:exact") read the same ones.
#   WORK=/dev/shm/gpu-peer puts the model on tmpfs (where it is large enough): reads at memory
#   speed, which shows what each backend costs beside the disk (BENCHMARKS.md, "from a fast
#   file system").
#
# long (there, after the same setup as run): prefill of N-token prompts and decode at depth N
#   (LENGTHS, default 8192,32768) of A and B resident against llama-bench's ppN and tg64 @ dN,
#   peak GPU memory of both, ours with SLOTSTREAM_WGPU_FLASH=0 too (FLASH_OFF=1), and per-kernel
#   times of both at the first length where prepare packed the bench_gpu example (LONG=1 prepare;
#   KERNELS=decode: decode at depth by kernel alone, with and without flash_decode, and the peer's;
#   KERNELS_EVERY_LENGTH=1: at every length, not only the first);
#   first, the fixed share of our GPU memory (the demo model: nvidia-smi against the ledger);
#   PERPLEXITY=1: the demo model's perplexity one token at a time on the GPU against cpu:exact;
#   VARIANT_WGSL=DIR also runs ours with another commit's kernel files (SLOTSTREAM_WGPU_WGSL_DIR);
#   LIMIT=SECONDS stops it there and still copies out what it measured; PARITY=L also gives the
#   longest prompt 8 greedy tokens on cpu:exact, wgpu:exact, wgpu and cpu with each model cut to
#   its first L layers, and says which backends give cpu:exact's ids.
#
# stream-prefill (there, after the same setup as run; llama.cpp not needed): streamed prefill of
#   prompts of exactly N tokens (LENGTHS, default 2048,8192; a prefix of the docs, as long's) on
#   MODELS (default A64; A64,B64 both) with a pool of 16 of 64 experts per layer, beside the same
#   prompts with every expert resident (--experts-per-layer 64) and the disk-bound limit: per
#   prompt the chunks, bytes read, passes over the missed experts (`run --json`'s
#   stats.prefill_experts), reads per chunk, prefill tok/s, hit rate; the disk's rate is the
#   model's files read with O_DIRECT (page cache bypassed, so cold whatever was read before),
#   before and after the runs; the disk-bound limit is N x that rate / the bytes of the distinct
#   experts that missed (each read once; also shown: once per chunk). Prints the acceptance
#   ratios of issue 46 (chunks <= 4, reads per chunk / missed bytes <= 1.25, streamed /
#   min(resident, disk-bound) >= 0.8). ROUNDS (default 2, arms alternating), GPU_BACKEND,
#   SMALL=1, KEEP=1, DISK_GIB (read per disk measurement, 4); LIMIT=SECONDS starts no run that
#   cannot end by then and still writes the table (table.md, results.json,
#   stream-prefill-logs.tar.gz, in $OUT too). One device call: LIMIT=400 tools/bench_gpu_peer.sh
#   stream-prefill, carrying $CARRY (NO_PEER=1 prepare is enough) and .gl. Without a GPU:
#   SMALL=1 ROUNDS=1 GPU_BACKEND=wgpu:software VK_DRIVER_FILES=... (about 7 minutes on 2 cores).
#
# batch (there, after the same setup as run): N concurrent greedy streams (STREAMS, default 1,4,8;
#   TOKENS each, default 128; ROUNDS, default 2) of model A resident, ours `serve --parallel N`
#   (tools/bench_batch.py: in a row, then at once, texts compared) against llama-batched-bench's
#   S_TG at the same counts (the batched decode of llama-server's parallel slots).
#
# cuda-build (there, carrying .devbin/cuda-src alone): builds llama.cpp's CUDA llama-bench and
#   leaves it in $OUT in parts; copied to .devbin/gpu-peer-cuda and carried, `long` adds its rows.
#
# disk (there, after stream, which builds the A64 or B64 model: MODEL, or DIR for any
#   directory): tools/peer/disk_pace.py reads that model's files in bursts of expert-sized
#   O_DIRECT reads (16 MB, 16 in flight, as a decoded layer's misses) with idle gaps between
#   them (GAPS_MS, default 0,1,2,5; GAP_SECONDS per gap per round, default 6; ROUNDS, default
#   3). Whether the disk's average rate stays the same whatever idle time it is left: the
#   streamed GPU and CPU backends read at the same average rate while the GPU leaves the disk
#   idle less. Keeps table.md and results.json (in $OUT too).
#
# Local test without a GPU (lavapipe; both engines, tiny models, ~10 minutes on 2 cores):
#   SMALL=1 ROUNDS=1 PEER_REPS=1 GPU_BACKEND=wgpu:software \
#     VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json tools/bench_gpu_peer.sh run
#
# Budget on the GPU machine (30 min of device time per session): with 16 cores, synthesis and
# GGUF repacking run at disk speed (a few GB/s); the runs themselves take seconds each (model
# loads dominate). MODELS=A,B is the resident comparison alone.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.devbin/gpu-peer
phase=${1:-}

prepare() {
    mkdir -p "$CARRY"
    export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1}
    local target=${CARGO_TARGET_DIR:-target}
    nice -n 5 cargo build --release --bin slotstream
    strip -o "$CARRY/slotstream" "$target/release/slotstream"
    local beside=()
    rm -f "$CARRY"/bench_gpu.xz*
    if [ -n "${LONG:-}" ]; then
        # The per-kernel timer of the long phase, in the binary's xz stream (most of its code is
        # the binary's: 2.4 MB less than packed apart, which keeps LONG=1 within the budget).
        nice -n 5 cargo build --release --example bench_gpu
        strip -o "$CARRY/bench_gpu" "$target/release/examples/bench_gpu"
        beside=(--beside "$CARRY/bench_gpu")
    fi
    # The binary embeds the demo model, which the working tree carries anyway: cut it out here,
    # splice it back there (sha256-checked).
    python3 tools/peer/pack_binary.py pack "$CARRY/slotstream" "$CARRY/slotstream.xz" tools/demo/model/model.safetensors "${beside[@]}"
    rm -f "$CARRY/slotstream" "$CARRY/bench_gpu"
    # The flagship phase's config and tensor shapes (the device has no ../shared).
    mkdir -p "$CARRY/flagship-reference"
    cp ../shared/reference/qwen3.8-flash-next/config.json ../shared/reference/qwen3.8-flash-next/tensor_shapes.json \
        "$CARRY/flagship-reference/" 2>/dev/null || echo "warning: no ../shared/reference/qwen3.8-flash-next (the flagship phase needs it)" >&2
    if [ -n "${NO_PEER:-}" ]; then
        echo "NO_PEER=1: llama.cpp not built (the flagship and stream phases do not need it)"
    elif [ -n "${FORCE:-}" ] || [ ! -f "$CARRY/llama-vulkan.tar.xz" ]; then
        tools/peer/build_llama_cpp_vulkan.sh "$CARRY/llama-vulkan.tar.xz"
    fi
    {
        git rev-parse --short=9 HEAD
        git status --porcelain --untracked-files=no | grep -q . && echo dirty || echo clean
        date -u +%Y-%m-%dT%H:%MZ
    } > "$CARRY/COMMIT"
    if ! ls .gl/libvulkan1_*.deb .gl/libglvnd0_*.deb >/dev/null 2>&1; then
        # The Vulkan loader, and the GL dispatch libraries NVIDIA's Vulkan driver
        # (libGLX_nvidia) needs to create an instance.
        mkdir -p .gl /tmp/amd64/partial
        local o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
        # shellcheck disable=SC2086
        apt-get $o update >/dev/null && (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2) \
            || echo "warning: could not download the Vulkan loader and GL dispatch libraries into .gl/" >&2
    fi
    local tree carry gl
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    carry=$(du -cb "$CARRY" | tail -1 | cut -f1)
    gl=$(du -cb .gl | tail -1 | cut -f1)
    ls -l "$CARRY" .gl
    printf 'working tree %.1f MiB + %s %.1f MiB + .gl %.1f MiB = %.1f MiB of the 64 MiB budget\n' \
        "$(echo "$tree / 1048576" | bc -l)" "$CARRY" "$(echo "$carry / 1048576" | bc -l)" \
        "$(echo "$gl / 1048576" | bc -l)" "$(echo "($tree + $carry + $gl) / 1048576" | bc -l)"
    if [ $((tree + carry + gl)) -gt $((64 << 20)) ]; then
        echo "over the 64 MiB budget" >&2
        exit 1
    fi
    echo "carry: $CARRY .gl; on the GPU machine: tools/bench_gpu_peer.sh run"
}

setup_machine() {
    work=${WORK:-/tmp/gpu-peer}
    results=${RESULTS:-$work/${2:-results}}
    mkdir -p "$work/bin" "$work/llama" "$results"
    # llama.cpp runs on every resident model, and on streamed ones with PEER_STREAMING=1
    # (never in the stream phase: $1 = 0).
    local peer=0 m
    [ "${1:-1}" = 0 ] || for m in $(echo "${MODELS:-A,B,A64,B64}" | tr ',' ' '); do
        case "$m" in *64) [ -n "${PEER_STREAMING:-}" ] && peer=1 ;; *) peer=1 ;; esac
    done
    [ -f "$CARRY/slotstream.xz" ] && { [ "$peer" = 0 ] || [ -f "$CARRY/llama-vulkan.tar.xz" ]; } || {
        echo "missing $CARRY/slotstream.xz or llama-vulkan.tar.xz: run 'tools/bench_gpu_peer.sh prepare' first and carry $CARRY" >&2
        exit 1
    }
    rm -rf "$work/llama"
    # Python's lzma and tarfile: no xz tool needed there.
    python3 - "$CARRY" "$work" <<'PY'
import os, sys, tarfile
sys.path.insert(0, "tools/peer")
import pack_binary
carry, work = sys.argv[1:]
bench_gpu = os.path.join(work, "bin", "bench_gpu")
if os.path.exists(bench_gpu):
    os.remove(bench_gpu)
# With LONG=1 prepare, bench_gpu comes out of the same stream, beside slotstream.
pack_binary.unpack(os.path.join(carry, "slotstream.xz"), os.path.join(work, "bin", "slotstream"), ".")
if os.path.exists(os.path.join(carry, "llama-vulkan.tar.xz")):
    with tarfile.open(os.path.join(carry, "llama-vulkan.tar.xz"), "r:xz") as t:
        t.extractall(os.path.join(work, "llama"))
PY
    # llama.cpp's CUDA build (cuda-build phase), where it was brought back and carried.
    rm -rf "$work/llama-cuda"
    if [ -f .devbin/gpu-peer-cuda/llama-cuda.tar.xz.part00 ]; then
        tools/peer/build_llama_cpp_cuda.sh unpack .devbin/gpu-peer-cuda/llama-cuda.tar.xz.part00 "$work/llama-cuda"
    fi
    # NVIDIA's Vulkan driver needs libglvnd's dispatch library beside the loader.
    if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1 ' || ! ldconfig -p 2>/dev/null | grep -q 'libGLdispatch.so.0 '; then
        if [ "$(id -u)" = 0 ] && ls .gl/*.deb >/dev/null 2>&1; then
            for f in .gl/*.deb; do dpkg -x "$f" /; done
            ldconfig
        else
            echo "warning: no libvulkan.so.1 or libGLdispatch.so.0, and no .gl/*.deb to install them from" >&2
        fi
    fi
    if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] \
        && ! ls /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json >/dev/null 2>&1; then
        export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    fi
    export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
    # llama.cpp skips CPU-type Vulkan devices (lavapipe) unless told which device to use.
    case "${GPU_BACKEND:-wgpu}" in *software*) export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0} ;; esac
    commit=$(head -1 "$CARRY/COMMIT" 2>/dev/null || git rev-parse --short=9 HEAD 2>/dev/null || echo unknown)
    [ "$(sed -n 2p "$CARRY/COMMIT" 2>/dev/null)" = dirty ] && commit="$commit (+ uncommitted changes)"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$results/nvidia-smi.csv"
    fi
    echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GB RAM, $(df -h "$work" | awk 'NR==2{print $4}') free under $work"
}

# The device tool brings back at most 8 files from $OUT: the table, the JSON, and every
# log in one tarball named $1.
copy_out() {
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        cp "$results"/table.md "$results"/results.json "$OUT"/ 2>/dev/null || true
        tar -C "$results" -czf "$OUT/$1" . || true
    fi
}

run_phase() {
    setup_machine 1
    local args=(--slotstream "$work/bin/slotstream" --llama "$work/llama" --work "$work" --results "$results"
        --models "${MODELS:-A,B,A64,B64}" --rounds "${ROUNDS:-3}" --peer-reps "${PEER_REPS:-3}" --peer-rounds "${PEER_ROUNDS:-1}" --cpu "${CPU:-all}"
        --router-skew "${ROUTER_SKEW:-0.4}" --mixer-out-scale "${MIXER_OUT_SCALE:-0.1}" --gpu-backend "${GPU_BACKEND:-wgpu}" --jobs "${JOBS:-$(nproc)}"
        --commit "$commit")
    [ -n "${SMALL:-}" ] && args+=(--small)
    [ -n "${KEEP:-}" ] && args+=(--keep)
    args+=(--first-rounds "${FIRST_ROUNDS:-2}" --idle "${IDLE:-10}")
    [ -n "${PEER_STREAMING:-}" ] && args+=(--peer-streaming)
    [ -n "${DECODE:-}" ] && args+=(--decode "$DECODE")
    local rc=0
    PYTHONUNBUFFERED=1 python3 tools/peer/bench_gpu_peer.py "${args[@]}" || rc=$?
    copy_out gpu-peer-logs.tar.gz
    return $rc
}

stream_phase() {
    setup_machine 0 stream-results
    local arms
    read -r -a arms <<< "${ARMS:-gpu=wgpu cpu=cpu}"
    local args=(--slotstream "$work/bin/slotstream" --work "$work" --results "$results" --model "${MODEL:-A}"
        --arms "${arms[@]}" --rounds "${ROUNDS:-4}" --decode "${DECODE:-32}" --router-skew "${ROUTER_SKEW:-0.4}"
        --mixer-out-scale "${MIXER_OUT_SCALE:-0.1}" --jobs "${JOBS:-$(nproc)}" --commit "$commit")
    [ -n "${SMALL:-}" ] && args+=(--small)
    local rc=0
    PYTHONUNBUFFERED=1 python3 tools/peer/stream_pairs.py "${args[@]}" || rc=$?
    copy_out stream-logs.tar.gz
    return $rc
}

long_phase() {
    setup_machine 1 long-results
    local args=(--slotstream "$work/bin/slotstream" --llama "$work/llama" --work "$work" --results "$results"
        --models "${MODELS:-A,B}" --lengths "${LENGTHS:-8192,32768}" --peer-reps "${PEER_REPS:-2}"
        --router-skew "${ROUTER_SKEW:-0.4}" --mixer-out-scale "${MIXER_OUT_SCALE:-0.1}" --gpu-backend "${GPU_BACKEND:-wgpu}"
        --jobs "${JOBS:-$(nproc)}" --commit "$commit")
    [ -n "${SMALL:-}" ] && args+=(--small)
    [ -n "${KEEP:-}" ] && args+=(--keep)
    [ -n "${FLASH_OFF:-}" ] && args+=(--flash-off)
    [ -n "${VARIANT_WGSL:-}" ] && args+=(--variant-wgsl "$VARIANT_WGSL")
    [ -n "${PARITY:-}" ] && args+=(--parity "$PARITY")
    [ -n "${PERPLEXITY:-}" ] && args+=(--perplexity)
    [ -x "$work/llama-cuda/bin/llama-bench" ] && args+=(--llama-cuda "$work/llama-cuda")
    [ -x "$work/bin/bench_gpu" ] && args+=(--bench-gpu "$work/bin/bench_gpu" --kernels "${KERNELS:-all}")
    [ -n "${KERNELS_EVERY_LENGTH:-}" ] && args+=(--kernels-every-length)
    local rc=0
    # LIMIT (seconds): stop there and still bring back what was measured.
    PYTHONUNBUFFERED=1 timeout "${LIMIT:-86400}" python3 tools/peer/bench_long.py "${args[@]}" || rc=$?
    copy_out long-logs.tar.gz
    return $rc
}

stream_prefill_phase() {
    setup_machine 0 stream-prefill-results
    local args=(--slotstream "$work/bin/slotstream" --work "$work" --results "$results" --models "${MODELS:-A64}"
        --lengths "${LENGTHS:-2048,8192}" --rounds "${ROUNDS:-2}" --gpu-backend "${GPU_BACKEND:-wgpu}"
        --router-skew "${ROUTER_SKEW:-0.4}" --mixer-out-scale "${MIXER_OUT_SCALE:-0.1}" --jobs "${JOBS:-$(nproc)}"
        --disk-gib "${DISK_GIB:-4}" --limit "${LIMIT:-0}" --commit "$commit")
    [ -n "${SMALL:-}" ] && args+=(--small)
    [ -n "${KEEP:-}" ] && args+=(--keep)
    local rc=0 backstop=86400
    # The script keeps to LIMIT itself (the table is written); the timeout only backs it up.
    [ "${LIMIT:-0}" -gt 0 ] && backstop=$((LIMIT + 60))
    PYTHONUNBUFFERED=1 timeout "$backstop" python3 tools/peer/bench_stream_prefill.py "${args[@]}" || rc=$?
    copy_out stream-prefill-logs.tar.gz
    return $rc
}

disk_phase() {
    work=${WORK:-/tmp/gpu-peer}
    results=${RESULTS:-$work/disk-results}
    mkdir -p "$results"
    local dir=${DIR:-$work/${MODEL:-A}64}
    python3 tools/peer/disk_pace.py --dir "$dir" --gaps-ms "${GAPS_MS:-0,1,2,5}" --seconds "${GAP_SECONDS:-6}" \
        --rounds "${ROUNDS:-3}" --out "$results/results.json" | tee "$results/table.md"
    copy_out disk-logs.tar.gz
}

# Concurrent greedy streams (issue 48): ours serving --parallel N against llama-batched-bench,
# model A resident (tools/peer/bench_batch_gpu.py).
batch_phase() {
    setup_machine 1 batch-results
    local args=(--slotstream "$work/bin/slotstream" --llama "$work/llama" --work "$work" --results "$results"
        --streams "${STREAMS:-1,4,8}" --tokens "${TOKENS:-128}" --rounds "${ROUNDS:-2}" --gpu-backend "${GPU_BACKEND:-wgpu}"
        --router-skew "${ROUTER_SKEW:-0.4}" --mixer-out-scale "${MIXER_OUT_SCALE:-0.1}" --jobs "${JOBS:-$(nproc)}" --commit "$commit")
    [ -n "${SMALL:-}" ] && args+=(--small)
    local rc=0
    PYTHONUNBUFFERED=1 timeout "${LIMIT:-86400}" python3 tools/peer/bench_batch_gpu.py "${args[@]}" || rc=$?
    copy_out batch-logs.tar.gz
    return $rc
}

# llama.cpp's CUDA backend built here (issue 46 item 6): carry .devbin/cuda-src (tools/peer/
# build_llama_cpp_cuda.sh pack-source .devbin/cuda-src) alone; the build comes back in $OUT as
# llama-cuda.tar.xz.partNN: copy those to .devbin/gpu-peer-cuda and carry that beside $CARRY, and
# the long phase adds llama.cpp CUDA's rows.
cuda_build_phase() {
    local out=${OUT:-/tmp/gpu-peer/cuda-build}
    tools/peer/build_llama_cpp_cuda.sh build .devbin/cuda-src/llama-src.tar.xz "$out"
}

# The flagship slice (issue 50; tools/bench_flagship.sh) with the GPU backend: the slice is written
# under $WORK (26 GB, kept for the next call while the machine stays warm), then each share of
# $SHARES; rows of earlier calls stay in the table.
flagship_phase() {
    setup_machine 0 flagship-results
    DIR=${DIR:-$work/flagship-slice12} RESULTS=$results SLOTSTREAM=$work/bin/slotstream \
        REFERENCE=$CARRY/flagship-reference BACKEND=${GPU_BACKEND:-wgpu} COMMIT=$commit \
        MACHINE="$(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GB RAM, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" \
        tools/bench_flagship.sh
}

case "$phase" in
    prepare) prepare ;;
    flagship) flagship_phase ;;
    run) run_phase ;;
    stream) stream_phase ;;
    disk) disk_phase ;;
    long) long_phase ;;
    stream-prefill) stream_prefill_phase ;;
    cuda-build) cuda_build_phase ;;
    batch) batch_phase ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
