#!/usr/bin/env bash
# Configures and builds pshard into a build directory (default build/). Extra arguments go to
# CMake's configure step, e.g. -DPSHARD_SANITIZE=ON.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${PSHARD_BUILD_DIR:-$root/build}
mkdir -p "$build_dir"
cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=${PSHARD_BUILD_TYPE:-RelWithDebInfo} \
  -DPSHARD_WERROR=ON "$@" > "$build_dir/configure.log" 2>&1 || {
  cat "$build_dir/configure.log"; exit 1; }
cmake --build "$build_dir" -j "$(nproc)"
