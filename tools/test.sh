#!/usr/bin/env bash
# The test command: every crate's tests, the wgpu backend's included (on Mesa's
# software Vulkan driver, lavapipe, when there is no GPU). Installs lavapipe
# with apt when it is missing and we may; otherwise says what to do.
#
#   tools/test.sh [extra cargo test arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SLOTSTREAM_SKIP_GPU_TESTS:-0}" != 1 ] && ! ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing Mesa's software Vulkan driver (mesa-vulkan-drivers) for the wgpu tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers >/dev/null
  else
    echo "the wgpu tests need a Vulkan driver: sudo apt-get install -y mesa-vulkan-drivers" >&2
    echo "(or run with SLOTSTREAM_SKIP_GPU_TESTS=1 to skip them)" >&2
    exit 1
  fi
fi
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
if [ -z "${VK_DRIVER_FILES:-}" ] && ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1; then
  VK_DRIVER_FILES=$(ls /usr/share/vulkan/icd.d/lvp_icd.*.json | head -1)
  export VK_DRIVER_FILES
fi
exec cargo test --workspace "$@"
