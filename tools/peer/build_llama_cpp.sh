#!/usr/bin/env bash
# Build llama.cpp (the peer engine for issue 8's comparisons) from the PyPI source
# package llama-cpp-python==0.3.36, which vendors llama.cpp (commit 0c1e57098, gguf-py 0.19.0).
# Everything lands under $PEER_DIR (default /tmp/slotstream-peer); nothing is written
# into the repository. ~6-7 minutes on 2 cores.
#
#   tools/peer/build_llama_cpp.sh            # -> $PEER_DIR/llama.cpp/build/bin/{llama-bench,llama-completion,llama-quantize}
set -euo pipefail
PEER_DIR=${PEER_DIR:-/tmp/slotstream-peer}
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
JOBS=${JOBS:-$(nproc)}
mkdir -p "$PEER_DIR"
cd "$PEER_DIR"

SDIST=llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
    # --no-binary for this package only: ':all:' would compile cmake from source first.
    python3 -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$PEER_DIR"
fi
echo "$SHA256  $SDIST" | sha256sum -c -

if [ ! -d llama.cpp ]; then
    rm -rf "llama_cpp_python-$VERSION"
    tar xzf "$SDIST"
    mv "llama_cpp_python-$VERSION/vendor/llama.cpp" llama.cpp
fi

if ! command -v cmake >/dev/null; then
    apt-get install -y cmake || { apt-get update && apt-get install -y cmake; }
fi

# Without AMX: on this VM's Sapphire Rapids CPU, -march=native compiles
# llama.cpp's AMX matmuls, and they crash (SIGSEGV in ggml_backend_amx_mul_mat)
# on any prompt of this model (llama-bench -p 64). Everything else -march=native
# gives (AVX-512, VNNI, its Q4_0 repacking) stays. An explicit -mno-* wins over
# -march=native's implied flags in GCC.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
cmake --build llama.cpp/build --config Release -j "$JOBS" \
    --target llama-bench llama-completion llama-quantize
ls -l llama.cpp/build/bin/llama-bench llama.cpp/build/bin/llama-completion llama.cpp/build/bin/llama-quantize
echo "gguf-py: $PEER_DIR/llama.cpp/gguf-py"
