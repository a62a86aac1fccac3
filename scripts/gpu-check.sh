#!/usr/bin/env bash
# The one prepared check for a machine with a GPU: builds pshard with the NCCL backend (Release,
# PSHARD_WITH_CUDA=ON) in a fresh directory, runs the tests labelled gpu, prints an nvidia-smi
# summary, times pshard.torch against torch's FSDP2 on NCCL on this GPU
# (tests/bench/run-gpu-bench.sh), and exits non-zero when a test or the bench failed. It installs build dependencies (scripts/install-deps.sh,
# which needs a Debian mirror) only when cmake or libgrpc-dev is missing, and says so.
# Warnings are not errors here: a compiler's new warning must not cost a GPU run.
# Environment: PSHARD_GPU_BUILD_DIR (default: a new directory under $TMPDIR or /tmp),
# NCCL_DEBUG (default WARN, so NCCL says why it failed), PSHARD_GPU_PYTHON (the python of the
# pshard.torch proof and the bench; default build/torch-venv's), PSHARD_GPU_CHECK_S (the whole
# check's time, 480 s), PSHARD_GPU_TEST_S (the tests' time; default what the build leaves of it
# less 150 s for the bench), PSHARD_GPU_BENCH_REPEAT (runs of each bench mode, 1; 0: no bench).
# Prints one "PROOF name (what): PASSED|FAILED|SKIPPED|NOT RUN" line per proof.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The whole check fits PSHARD_GPU_CHECK_S seconds (default 480: a short device lease).
start=$SECONDS
budget=${PSHARD_GPU_CHECK_S:-480}
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
# The pshard.torch proof needs a python with torch (CUDA), transformers and pshard: the
# repository's venv (scripts/pshard-venv.sh) when there is one, or PSHARD_GPU_PYTHON.
gpu_python=${PSHARD_GPU_PYTHON:-$root/build/torch-venv/bin/python}
if ! cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DPSHARD_WITH_CUDA=ON \
  -DPSHARD_GPU_PYTHON="$gpu_python" > "$build_dir/configure.log" 2>&1; then
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
# The whole check must fit a short lease: the tests get PSHARD_GPU_TEST_S seconds (default: what
# the budget leaves after the build, less 150 s for the bench, at least 120), then whatever still
# runs is stopped and counted as failed.
bench_reserve=$(( ${PSHARD_GPU_BENCH_REPEAT:-1} > 0 ? 150 : 0 ))
test_s=${PSHARD_GPU_TEST_S:-$((budget - (SECONDS - start) - bench_reserve))}
[ "$test_s" -lt 120 ] && test_s=120
say "the gpu tests get $test_s s"
(cd "$build_dir" && timeout --kill-after=20 "$test_s" \
  ctest -L gpu --output-on-failure --no-tests=error) 2>&1 | tee "$build_dir/ctest.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 124 ] && say "the gpu tests ran past $test_s s and were stopped"

echo "=== GPU after the tests ==="
gpu_summary

# One line per proof: each gpu test's outcome as CTest reported it.
proof() {
  local name=$1 what=$2 line
  line=$(grep -E "Test +#[0-9]+: $name " "$build_dir/ctest.log" | tail -n 1)
  if [ -z "$line" ]; then
    say "PROOF $name ($what): NOT RUN"
  elif [[ $line == *"Passed"* ]]; then
    say "PROOF $name ($what): PASSED"
  elif [[ $line == *"Skipped"* || $line == *"Not Run"* ]]; then
    say "PROOF $name ($what): SKIPPED"
  else
    say "PROOF $name ($what): FAILED"
  fi
}
proof gpu_nccl "NCCL collectives on the GPUs here, every op and dtype"
proof gpu_kernels "the shard server's CUDA kernels bit for bit against the CPU code"
proof gpu_shard_nccl "sharded MLP training on NCCL servers against the single-process reference"
proof gpu_shard_ipc "a GPU-resident shard opened by its trainer through CUDA IPC"
proof gpu_llama_cuda "a tiny Llama on cuda with pshard.torch against the CPU: host shards, GPU shards, two ranks sharing the GPU"

# The throughput figure: pshard.torch on this GPU against torch's FSDP2 on NCCL, side by side
# (tests/bench/run-gpu-bench.sh; PSHARD_GPU_BENCH_REPEAT runs of each, default 1; 0 skips it).
bench_status=0
bench_s=$((budget - (SECONDS - start) - 15))
if [ "${PSHARD_GPU_BENCH_REPEAT:-1}" -gt 0 ] && [ "$bench_s" -lt 60 ]; then
  say "PROOF gpu_bench (LM step time against FSDP2 on NCCL, same GPU): NOT RUN" \
    "(${bench_s} s left of the ${budget} s budget; raise PSHARD_GPU_CHECK_S)"
  bench_status=1
elif [ "${PSHARD_GPU_BENCH_REPEAT:-1}" -gt 0 ]; then
  echo "=== pshard.torch against FSDP2 on NCCL, one GPU ($bench_s s at most) ==="
  PYTHON="$gpu_python" PSHARDRUN="$build_dir/tools/pshardrun" REPEAT="${PSHARD_GPU_BENCH_REPEAT:-1}" \
    STEPS=20 WARMUP=5 OUT="$build_dir/gpu-bench" timeout --kill-after=10 "$bench_s" \
    bash "$root/tests/bench/run-gpu-bench.sh" 2>&1 | tee "$build_dir/gpu-bench.log"
  bench_status=${PIPESTATUS[0]}
  case $bench_status in
    0) say "PROOF gpu_bench (LM step time against FSDP2 on NCCL, same GPU): PASSED" ;;
    77) say "PROOF gpu_bench (LM step time against FSDP2 on NCCL, same GPU): SKIPPED" ;;
    *) say "PROOF gpu_bench (LM step time against FSDP2 on NCCL, same GPU): FAILED" \
      "(status $bench_status)" ;;
  esac
  [ "$bench_status" -eq 77 ] && bench_status=0
fi

# CTest counts a skipped test (exit 77: no usable device) as passed; say so plainly.
if grep -q "(Skipped)" "$build_dir/ctest.log"; then
  (cd "$build_dir" && ctest -L gpu -V 2>&1 | grep -E "no CUDA device|skipping")
  say "RESULT: SKIPPED - a gpu test found no usable CUDA device, so it verified nothing" \
    "(ctest status $status)"
elif [ "$status" -eq 0 ] && [ "$bench_status" -eq 0 ]; then
  say "RESULT: PASSED (ctest status 0)"
else
  say "RESULT: FAILED (ctest status $status, bench status $bench_status)"
  [ "$status" -eq 0 ] && status=$bench_status
fi
exit "$status"
