#!/usr/bin/env bash
# The one prepared check for a machine with a GPU: builds pshard with the NCCL backend (Release,
# PSHARD_WITH_CUDA=ON) in a fresh directory, runs the tests labelled gpu, prints an nvidia-smi
# summary, and exits with ctest's status. It installs build dependencies (scripts/install-deps.sh,
# which needs a Debian mirror) only when cmake or libgrpc-dev is missing, and says so.
# Warnings are not errors here: a compiler's new warning must not cost a GPU run.
# Environment: PSHARD_GPU_BUILD_DIR (default: a new directory under $TMPDIR or /tmp),
# NCCL_DEBUG (default WARN, so NCCL says why it failed).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "gpu-check: $*"; }

# --- dependencies, only when missing -----------------------------------------------------------
missing=()
command -v cmake > /dev/null 2>&1 || missing+=(cmake)
if command -v dpkg-query > /dev/null 2>&1; then
  dpkg-query -W -f='${Status}' libgrpc-dev 2> /dev/null | grep -q "install ok installed" ||
    missing+=(libgrpc-dev)
elif ! pkg-config --exists grpc 2> /dev/null; then
  missing+=(libgrpc-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "missing ${missing[*]}: running scripts/install-deps.sh (needs a Debian mirror)"
  if ! "$root/scripts/install-deps.sh"; then
    say "installing dependencies failed; cannot build"
    exit 2
  fi
else
  say "cmake and libgrpc-dev present: installing nothing"
fi

# --- the machine ------------------------------------------------------------------------------
gpu_summary() {
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total,utilization.gpu \
      --format=csv || say "nvidia-smi failed"
  else
    say "nvidia-smi not found"
  fi
}
echo "=== GPU before the tests ==="
gpu_summary
ls /usr/local/cuda/lib64/libnccl.so* /usr/local/cuda/lib64/libcudart.so* 2> /dev/null

# --- build ------------------------------------------------------------------------------------
build_dir=${PSHARD_GPU_BUILD_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/pshard-gpu-check.XXXXXX")}
if [ -n "$(ls -A "$build_dir" 2> /dev/null)" ]; then
  if [ ! -f "$build_dir/CMakeCache.txt" ]; then
    say "$build_dir is not empty and not a build directory; refusing to clear it"
    exit 2
  fi
  rm -rf "$build_dir"
fi
mkdir -p "$build_dir"
say "building in $build_dir"
if ! cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DPSHARD_WITH_CUDA=ON \
  > "$build_dir/configure.log" 2>&1; then
  cat "$build_dir/configure.log"
  say "RESULT: configure FAILED"
  exit 3
fi
grep -E "NCCL backend|CUDA kernels" "$build_dir/configure.log"
if ! cmake --build "$build_dir" -j "$(nproc)" > "$build_dir/build.log" 2>&1; then
  tail -n 60 "$build_dir/build.log"
  say "RESULT: build FAILED"
  exit 4
fi
say "build done"

# --- tests ------------------------------------------------------------------------------------
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
(cd "$build_dir" && ctest -L gpu --output-on-failure --no-tests=error) 2>&1 | tee "$build_dir/ctest.log"
status=${PIPESTATUS[0]}

echo "=== GPU after the tests ==="
gpu_summary

# CTest counts a skipped test (exit 77: no usable device) as passed; say so plainly.
if grep -q "(Skipped)" "$build_dir/ctest.log"; then
  (cd "$build_dir" && ctest -L gpu -V 2>&1 | grep -E "no CUDA device|skipping")
  say "RESULT: SKIPPED - a gpu test found no usable CUDA device, so it verified nothing" \
    "(ctest status $status)"
elif [ "$status" -eq 0 ]; then
  say "RESULT: PASSED (ctest status 0)"
else
  say "RESULT: FAILED (ctest status $status)"
fi
exit "$status"
