#!/usr/bin/env bash
# NCCL and the CUDA runtime are loaded at run time, only for --backend nccl: no pshard program
# or library names them (or the driver) as DT_NEEDED, the tcp backend starts where neither can
# be found, and --backend nccl refuses to start with a message naming the missing library and
# its package. Runs on CPU machines: every failure here comes before any GPU is touched.
# PSHARD_NCCL_LIBRARY / PSHARD_CUDART_LIBRARY stand for a machine without the library (this
# one may have it in ld.so.cache, and the build's own CUDA directory is a fallback).
# usage: test_cuda_dlopen.sh HAVE_NCCL NCCL_SONAME CUDART_SONAME SERVER [BINARY_OR_LIBRARY...]
set -u
have_nccl=$1 nccl_soname=$2 cudart_soname=$3 server=$4
shift 4
if [ "$have_nccl" != 1 ]; then
  echo "this build has no nccl backend: nothing is loaded at run time; skipping"
  exit 77
fi
fail=0
work=$(mktemp -d)
server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/empty"

# 1. No DT_NEEDED on NCCL, the CUDA runtime or the driver, in the server and what else was given.
if command -v readelf >/dev/null; then
  for f in "$server" "$@"; do
    needed=$(readelf -d "$f" | grep NEEDED)
    if echo "$needed" | grep -E 'libnccl|libcudart|libcuda\.'; then
      echo "FAIL: $f needs the libraries above at load time"
      fail=1
    fi
  done
else
  echo "no readelf: the DT_NEEDED check is skipped"
fi

# Runs pshard-server --backend nccl with one library made unfindable and checks its start error.
expect_refusal() { # ENV_VAR MISSING_PATH EXPECTED_TEXT...
  local var=$1 missing=$2
  shift 2
  local out rc bad=0
  out=$(env LD_LIBRARY_PATH="$work/empty" "$var=$missing" timeout 60 "$server" \
        --backend nccl --name cuda-dlopen --coordinator 127.0.0.1:1 2>&1)
  rc=$?
  if [ "$rc" = 0 ] || [ "$rc" = 124 ]; then
    echo "FAIL: pshard-server --backend nccl with $var=$missing exited $rc: $out"
    fail=1
    return
  fi
  for want in "$@"; do
    case "$out" in
      *"$want"*) ;;
      *) echo "FAIL: with $var=$missing the error lacks '$want': $out"; bad=1 ;;
    esac
  done
  if [ "$bad" = 1 ]; then
    fail=1
  else
    echo "ok: $var=$missing: $out"
  fi
}

# 2. NCCL missing: the library, a package that provides it, and the way to point at it.
expect_refusal PSHARD_NCCL_LIBRARY "$work/empty/$nccl_soname" \
  "$nccl_soname not found: install NCCL" "libnccl2" "pip install nvidia-nccl-cu" \
  "LD_LIBRARY_PATH"
# 3. The CUDA runtime missing, likewise.
expect_refusal PSHARD_CUDART_LIBRARY "$work/empty/$cudart_soname" \
  "$cudart_soname not found: install the CUDA" "cuda-cudart-" "pip install nvidia-cuda-runtime" \
  "LD_LIBRARY_PATH"

# 4. The tcp backend starts with neither to be found.
env LD_LIBRARY_PATH="$work/empty" PSHARD_NCCL_LIBRARY="$work/empty/$nccl_soname" \
  PSHARD_CUDART_LIBRARY="$work/empty/$cudart_soname" PSHARD_LOG=error \
  "$server" --backend tcp --name cuda-dlopen-tcp --coordinator 127.0.0.1:1 \
  --port-file "$work/port" > "$work/tcp.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 300); do
  [ -s "$work/port" ] && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done
if [ -s "$work/port" ]; then
  echo "ok: --backend tcp serves on port $(cat "$work/port") without NCCL or the CUDA runtime"
else
  echo "FAIL: --backend tcp did not start without NCCL: $(cat "$work/tcp.log")"
  fail=1
fi
exit "$fail"
