#!/usr/bin/env bash
# The one prepared check for a machine with a GPU: builds pshard with the NCCL backend (Release,
# PSHARD_WITH_CUDA=ON) in a fresh directory, runs the tests labelled gpu, prints an nvidia-smi
# summary, times pshard.torch against torch's FSDP2 on NCCL on this GPU
# (tests/bench/run-gpu-bench.sh), and exits non-zero when a test or the bench failed. The build
# dependencies come from PSHARD_GPU_DEBS (scripts/gpu-debs.sh's packages, unpacked into a folder
# of their own: for a machine without a network), else from the machine, installed by
# scripts/install-deps.sh (which needs a Debian mirror) only when cmake or libgrpc-dev is
# missing. Warnings are not errors here: a compiler's new warning must not cost a GPU run.
# Environment: PSHARD_GPU_BUILD_DIR (default: a new directory under $TMPDIR or /tmp),
# NCCL_DEBUG (default WARN, so NCCL says why it failed), PSHARD_GPU_PYTHON (the python of the
# pshard.torch proof and the bench; default build/torch-venv's, else python3), PSHARD_GPU_DEBS,
# PSHARD_GPU_CHECK_S (the whole check's time, 480 s), PSHARD_GPU_TEST_S (the tests' time;
# default what the build leaves of it less 150 s for the bench), PSHARD_GPU_BENCH_REPEAT (runs
# of each bench mode, 1; 0: no bench).
# Prints one "PROOF name (what): PASSED|FAILED|SKIPPED|NOT RUN" line per proof.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The whole check fits PSHARD_GPU_CHECK_S seconds (default 480: a short device lease).
start=$SECONDS
budget=${PSHARD_GPU_CHECK_S:-480}
say() { echo "gpu-check: $*"; }
# The pshard.torch proof and the bench need a python with torch (CUDA) and transformers:
# PSHARD_GPU_PYTHON, else the repository's venv (scripts/pshard-venv.sh) when there is one, else
# python3. pshard itself is installed for it below when it lacks it.
gpu_python=${PSHARD_GPU_PYTHON:-$root/build/torch-venv/bin/python}
if [ -z "${PSHARD_GPU_PYTHON:-}" ] && [ ! -x "$gpu_python" ]; then
  gpu_python=$(command -v python3 || echo python3)
fi

# --- dependencies -----------------------------------------------------------------------------
# PSHARD_GPU_DEBS=DIR (scripts/gpu-debs.sh's .deb files, carried to a machine without a network):
# unpacked into a folder of their own and used from there (headers, pkg-config files, protoc,
# libraries), installing nothing. Else the machine's packages, installed when missing
# (scripts/install-deps.sh, which needs a Debian mirror).
cmake_extra=()
use_debs() {
  local debs=$1 prefix f l name sys
  prefix=${TMPDIR:-/tmp}/pshard-gpu-deps
  rm -rf "$prefix" && mkdir -p "$prefix" || return 1
  for f in "$debs"/*.deb; do
    [ -f "$f" ] || { say "no .deb files in $debs"; return 1; }
    dpkg-deb -x "$f" "$prefix" || { say "cannot unpack $f"; return 1; }
  done
  local lib=$prefix/usr/lib/x86_64-linux-gnu
  # Their pkg-config files name /usr: point them at the folder.
  find "$prefix" -name '*.pc' -exec sed -i -E \
    "s#^(prefix|exec_prefix|libdir|includedir)=/usr#\\1=$prefix/usr#" {} +
  # Development links to libraries left out (OpenSSL's, zlib's): the machine's own.
  for l in "$lib"/lib*.so; do
    [ -e "$l" ] && continue
    name=$(basename "$l")
    sys=$({ ldconfig -p || /sbin/ldconfig -p; } 2> /dev/null |
      awk -v n="$name." 'index($1, n) == 1 && /x86-64/ { print $NF; exit }')
    if [ -n "$sys" ]; then
      ln -sf "$sys" "$l"
    else
      say "$name: not on this machine, and not among the packages"
    fi
  done
  export PATH="$prefix/usr/bin:$PATH"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$lib/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig"
  export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  cmake_extra+=(-DPKG_CONFIG_EXECUTABLE="$prefix/usr/bin/pkgconf")
  say "using the packages of $debs, unpacked in $prefix"
}
if [ -n "${PSHARD_GPU_DEBS:-}" ]; then
  use_debs "$PSHARD_GPU_DEBS" || {
    say "cannot use the packages in $PSHARD_GPU_DEBS; cannot build"
    exit 2
  }
  command -v cmake > /dev/null 2>&1 || { say "no cmake on this machine; cannot build"; exit 2; }
else
  missing=()
  command -v cmake > /dev/null 2>&1 || missing+=(cmake)
  if command -v dpkg-query > /dev/null 2>&1; then
    dpkg-query -W -f='${Status}' libgrpc-dev 2> /dev/null | grep -q "install ok installed" ||
      missing+=(libgrpc-dev)
  elif ! pkg-config --exists grpc 2> /dev/null; then
    missing+=(libgrpc-dev)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    say "missing ${missing[*]}: running scripts/install-deps.sh (needs a Debian mirror; on a" \
      "machine without one, carry scripts/gpu-debs.sh's packages and set PSHARD_GPU_DEBS)"
    if ! "$root/scripts/install-deps.sh"; then
      say "installing dependencies failed; cannot build"
      exit 2
    fi
  else
    say "cmake and libgrpc-dev present: installing nothing"
  fi
fi
# make, or ninja where there is no make
command -v make > /dev/null 2>&1 || ! command -v ninja > /dev/null 2>&1 || cmake_extra+=(-G Ninja)
# NCCL: /usr/local/cuda's, else the one pip installed beside torch (nvidia-nccl-cu*).
if [ ! -f /usr/local/cuda/include/nccl.h ]; then
  nccl_dir=$("$gpu_python" -c \
    'import nvidia.nccl as n, os; print(list(n.__path__)[0])' 2> /dev/null || true)
  if [ -n "$nccl_dir" ] && [ -f "$nccl_dir/include/nccl.h" ]; then
    nccl_lib=$(ls "$nccl_dir"/lib/libnccl.so* 2> /dev/null | head -n 1)
    say "NCCL from $nccl_dir"
    cmake_extra+=(-DPSHARD_NCCL_INCLUDE="$nccl_dir/include" -DPSHARD_NCCL_LIB="$nccl_lib")
    export LD_LIBRARY_PATH="$nccl_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
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
  -DPSHARD_GPU_PYTHON="$gpu_python" "${cmake_extra[@]}" > "$build_dir/configure.log" 2>&1; then
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
# pshard for the python of the torch proofs, where it has torch but not pshard: built from this
# tree (pip, no index, no build isolation: scikit-build-core must be there) into the build folder.
if "$gpu_python" -c "import torch" > /dev/null 2>&1 &&
  ! "$gpu_python" -c "import pshard" > /dev/null 2>&1; then
  say "installing pshard for $gpu_python into $build_dir/site"
  if "$gpu_python" -m pip install -q --no-deps --no-build-isolation --no-index \
    --target "$build_dir/site" "$root/client/python" > "$build_dir/pip.log" 2>&1; then
    export PYTHONPATH="$build_dir/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    tail -n 30 "$build_dir/pip.log"
    say "pshard does not build for $gpu_python: the pshard.torch proofs will skip"
  fi
fi

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
proof gpu_shard_ipc "a GPU-resident shard and the model region opened by the trainer through CUDA IPC"
proof gpu_llama_cuda "a tiny Llama on cuda with pshard.torch against the CPU: host shards, GPU shards and region with no host copy, two ranks sharing the GPU"

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
