#!/usr/bin/env bash
# llama.cpp's CUDA backend as a second GPU peer (issue 46, item 6): the same llama.cpp as the
# Vulkan peer (PyPI llama-cpp-python==0.3.36, vendoring llama.cpp 0c1e57098), built on the GPU
# machine, where nvcc is, and brought back, so that later calls carry the build instead of
# spending device time on it.
#
#   here:       tools/peer/build_llama_cpp_cuda.sh pack-source DIR   (tools/bench_gpu_peer.sh uses .devbin/cuda-src)
#                 DIR/llama-src.tar.xz: the sources llama-bench needs (~6 MB; the sdist is 77 MB)
#   GPU host:   tools/peer/build_llama_cpp_cuda.sh build SRC.tar.xz OUTDIR
#                 builds llama-bench and llama-batched-bench with -DGGML_CUDA=ON for CMAKE_CUDA_ARCHITECTURES (default 90),
#                 shared libraries, and writes OUTDIR/llama-cuda.tar.xz.partNN (15 MiB each: the
#                 device tool brings back files of at most 16 MiB) with bin/ (llama-bench and its
#                 .so files; CUDA's own runtime libraries stay the GPU host's)
#   either:     tools/peer/build_llama_cpp_cuda.sh unpack DIR/llama-cuda.tar.xz.part00 DEST
#                 DEST/bin/llama-bench (run it with LD_LIBRARY_PATH=DEST/bin)
#
# tools/bench_gpu_peer.sh cuda-build runs `build` there; its `long` phase runs the CUDA rows
# when .devbin/gpu-peer-cuda/llama-cuda.tar.xz.part00 is carried (copy the parts there).
#
# env: CUDA_PEER_DIR (default /tmp/slotstream-peer-cuda; sources and build tree), JOBS (default
#      nproc), CUDA_ARCH (default 90).
set -euo pipefail
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
DIR=${CUDA_PEER_DIR:-/tmp/slotstream-peer-cuda}
verb=${1:-}

abs() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }

case "$verb" in
pack-source)
    out=$(abs "${2:?usage: build_llama_cpp_cuda.sh pack-source DIR}")
    mkdir -p "$DIR" "$out"
    cd "$DIR"
    sdist=llama_cpp_python-$VERSION.tar.gz
    if [ ! -f "$sdist" ]; then
        python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR"
    fi
    echo "$SHA256  $sdist" | sha256sum -c -
    rm -rf src "llama_cpp_python-$VERSION"
    tar xzf "$sdist"
    mv "llama_cpp_python-$VERSION/vendor/llama.cpp" src
    rm -rf "llama_cpp_python-$VERSION"
    # What a CUDA build of llama-bench does not read: models, docs, tests, the other
    # backends, the server and its web UI.
    tar -C src -cf - \
        --exclude=./models --exclude=./docs --exclude=./build --exclude=./tests --exclude=./benches \
        --exclude=./media --exclude=./examples --exclude=./conversion --exclude=./gguf-py \
        --exclude=./tools/ui --exclude=./tools/server \
        --exclude=./ggml/src/ggml-et --exclude=./ggml/src/ggml-metal --exclude=./ggml/src/ggml-hexagon \
        --exclude=./ggml/src/ggml-sycl --exclude=./ggml/src/ggml-vulkan --exclude=./ggml/src/ggml-opencl \
        --exclude=./ggml/src/ggml-cann --exclude=./ggml/src/ggml-zdnn --exclude=./ggml/src/ggml-webgpu \
        --exclude=./ggml/src/ggml-openvino --exclude=./ggml/src/ggml-virtgpu --exclude=./ggml/src/ggml-zendnn \
        . | xz -9 -T"$(nproc)" > "$out/llama-src.tar.xz"
    ls -l "$out/llama-src.tar.xz"
    ;;
build)
    src=$(abs "${2:?usage: build_llama_cpp_cuda.sh build SRC.tar.xz OUTDIR}")
    out=$(abs "${3:?usage: build_llama_cpp_cuda.sh build SRC.tar.xz OUTDIR}")
    command -v nvcc >/dev/null || { echo "nvcc is not on PATH: this runs on the GPU machine" >&2; exit 1; }
    mkdir -p "$DIR" "$out"
    rm -rf "$DIR/src" "$DIR/build" "$DIR/stage"
    mkdir -p "$DIR/src"
    tar -C "$DIR/src" -xJf "$src"
    start=$(date +%s)
    cmake -S "$DIR/src" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        > "$out/cmake-configure.log" 2>&1 || { tail -40 "$out/cmake-configure.log"; exit 1; }
    cmake --build "$DIR/build" -j "${JOBS:-$(nproc)}" --target llama-bench llama-batched-bench > "$out/cmake-build.log" 2>&1 \
        || { tail -60 "$out/cmake-build.log"; exit 1; }
    echo "built in $(( $(date +%s) - start )) s"
    mkdir -p "$DIR/stage/bin"
    cp "$DIR/build/bin/llama-bench" "$DIR/build/bin/llama-batched-bench" "$DIR/stage/bin/"
    cp -P "$DIR"/build/bin/*.so* "$DIR/stage/bin/"
    strip --strip-unneeded "$DIR"/stage/bin/* 2>/dev/null || true
    nvcc --version | tail -1 > "$DIR/stage/nvcc-version.txt"
    tar -C "$DIR/stage" -cf - . | xz -6 -T"$(nproc)" | split -b 15M -d - "$out/llama-cuda.tar.xz.part"
    ls -l "$out"/llama-cuda.tar.xz.part*
    ;;
unpack)
    first=$(abs "${2:?usage: build_llama_cpp_cuda.sh unpack PART00 DEST}")
    dest=$(abs "${3:?usage: build_llama_cpp_cuda.sh unpack PART00 DEST}")
    mkdir -p "$dest"
    cat "${first%00}"[0-9][0-9] | tar -C "$dest" -xJf -
    ;;
*)
    sed -n '2,21p' "$0" >&2
    exit 2
    ;;
esac
