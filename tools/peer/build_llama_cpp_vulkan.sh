#!/usr/bin/env bash
# Build llama.cpp's Vulkan backend (the peer of our wgpu backend, issue 14 item 5) from the
# PyPI source package llama-cpp-python==0.3.36 (vendors llama.cpp commit 0c1e57098, gguf-py
# 0.19.0), and pack what a GPU machine needs into one small xz tarball.
#
#   tools/peer/build_llama_cpp_vulkan.sh OUT.tar.xz
#
# Shared libraries, so the ~40 MB of embedded SPIR-V shaders exist once (in
# libggml-vulkan.so) rather than once per program; only llama-bench, llama-batched-bench (the
# batched decode of llama-server's parallel slots, for issue 48) and llama-quantize are built. The tarball holds bin/ (the two programs, the .so files, and any non-glibc runtime
# library they need that the GPU machine may lack, e.g. libgomp) and gguf-py/ (pure Python,
# used by tools/peer/to_gguf.py). Run the programs with LD_LIBRARY_PATH=<dir>/bin.
#
# Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings: where they do, the
# LayerSettingEXT block of ggml-vulkan.cpp (it enables best-practice checks of the
# validation layer, a debug aid with no effect on speed) is dropped before compiling.
#
# env: VK_PEER_DIR (default /tmp/slotstream-peer-vk; sources and build tree), JOBS (default 2),
#      NICE (default 10).
set -euo pipefail
OUT=${1:?usage: build_llama_cpp_vulkan.sh OUT.tar.xz}
case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac
DIR=${VK_PEER_DIR:-/tmp/slotstream-peer-vk}
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
JOBS=${JOBS:-2}
NICE=${NICE:-10}
mkdir -p "$DIR"
cd "$DIR"

SDIST=llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
    # --no-binary for this package only: ':all:' would compile cmake from source first.
    python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR"
fi
echo "$SHA256  $SDIST" | sha256sum -c -
if [ ! -d llama.cpp ]; then
    rm -rf "llama_cpp_python-$VERSION"
    tar xzf "$SDIST"
    mv "llama_cpp_python-$VERSION/vendor/llama.cpp" llama.cpp
    rm -rf "llama_cpp_python-$VERSION"
fi

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v glslc >/dev/null || need+=(glslc)
[ -f /usr/include/vulkan/vulkan.h ] || need+=(libvulkan-dev)
[ -d /usr/include/spirv ] || need+=(spirv-headers)
if [ ${#need[@]} -gt 0 ]; then
    apt-get install -y "${need[@]}" || { apt-get update && apt-get install -y "${need[@]}"; }
fi

VKCPP=llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp
if ! grep -q VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h && grep -q 'LayerSettingEXT' "$VKCPP"; then
    python3 - "$VKCPP" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
start = s.index("    VkBool32 enable_best_practice = layer_settings;")
end = s.index("vk::LayerSettingsCreateInfoEXT layer_setting_info(settings);")
end = s.index("\n", end) + 1
s = s[:start] + s[end:]
s = s.replace("layers, extensions, &layer_setting_info);", "layers, extensions, nullptr);")
assert "LayerSetting" not in s.replace("layer_settings", ""), "LayerSetting left in ggml-vulkan.cpp"
open(p, "w").write(s)
print("dropped the VK_EXT_layer_settings block of", p)
PY
fi

B=llama.cpp/build-vulkan
nice -n "$NICE" cmake -S llama.cpp -B "$B" -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF > "$DIR/cmake-configure.log"
nice -n "$NICE" cmake --build "$B" --config Release -j "$JOBS" --target llama-bench llama-batched-bench llama-quantize

STAGE=$DIR/stage
rm -rf "$STAGE"
mkdir -p "$STAGE/bin"
cp "$B/bin/llama-bench" "$B/bin/llama-batched-bench" "$B/bin/llama-quantize" "$STAGE/bin/"
cp -P "$B"/bin/*.so* "$STAGE/bin/" 2>/dev/null || true
find "$B" -name '*.so*' \( -type f -o -type l \) -exec cp -P {} "$STAGE/bin/" \; 2>/dev/null || true
strip --strip-unneeded "$STAGE"/bin/llama-bench "$STAGE"/bin/llama-batched-bench "$STAGE"/bin/llama-quantize
for f in "$STAGE"/bin/*.so*; do [ -L "$f" ] || strip --strip-unneeded "$f"; done
# Runtime libraries outside glibc and the Vulkan loader (the GPU machine brings its own loader
# from .gl/ or the system), e.g. libgomp.
for lib in $(LD_LIBRARY_PATH="$STAGE/bin" ldd "$STAGE/bin/llama-bench" "$STAGE/bin/llama-batched-bench" "$STAGE/bin/llama-quantize" | awk '/=> \//{print $3}' | sort -u); do
    base=$(basename "$lib")
    case "$base" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libvulkan.so*|libstdc++.so*|libgcc_s.so*) ;;
        *) [ -e "$STAGE/bin/$base" ] || cp -L "$lib" "$STAGE/bin/$base" ;;
    esac
done
mkdir -p "$STAGE/gguf-py"
cp -r llama.cpp/gguf-py/gguf "$STAGE/gguf-py/"
find "$STAGE/gguf-py" -name '__pycache__' -prune -exec rm -rf {} +
printf 'llama.cpp %s (llama-cpp-python %s sdist), Vulkan, shared libs\n' \
    "$(grep -m1 -o 'LLAMA_BUILD_COMMIT.*' "$B/common/build-info.cpp" 2>/dev/null || echo 0c1e57098)" "$VERSION" > "$STAGE/VERSION"
ls -l "$STAGE/bin"
mkdir -p "$(dirname "$OUT")"
tar -C "$STAGE" -cf - . | xz -T2 -9e > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
ls -l "$OUT"
