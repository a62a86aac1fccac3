#!/usr/bin/env bash
# Failure detection time: how long from a fault until every surviving trainer has its error,
# over TRIALS (20) runs of each fault of tests/integration/test_failures.sh (a fresh 3-rank
# cluster each time, lease 2000 ms, heartbeat 500 ms): kill -9 of a trainer (found through the
# coordinator's lease), SIGSTOP of a shard server (lease), kill -9 of a shard server (the ring's
# sockets). Prints p50 / p90 / max of the slowest trainer per trial, per fault.
# usage: tests/bench/run-failure-bench.sh [BUILD_DIR]   (env TRIALS)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-$ROOT/build}"
TRIALS="${TRIALS:-20}"
for fault in trainer-kill server-stop server-kill; do
  times=()
  for ((t = 0; t < TRIALS; t++)); do
    out=$(FAILURE_CASES="$fault" bash "$ROOT/tests/integration/test_failures.sh" \
          "$BUILD/coordinator/pshard-coordinator" "$BUILD/shard_server/pshard-server" \
          "$BUILD/tools/pshardctl" "$BUILD/examples/pshard-mlp" 2>&1) || { echo "$out"; exit 1; }
    # The slowest trainer of the trial: every trainer has its error by then.
    worst=$(echo "$out" | sed -n 's/.*failed after \([0-9]*\) ms.*/\1/p' | sort -n | tail -1)
    times+=("$worst")
  done
  printf '%s\n' "${times[@]}" | sort -n | awk -v fault="$fault" -v n="$TRIALS" '
    { v[NR] = $1 }
    END { p50 = v[int((n + 1) / 2)]; p90 = v[int((n * 9 + 9) / 10)]
          printf "%-13s %d trials: every trainer had its error after p50 %d ms, p90 %d ms, max %d ms\n",
                 fault, n, p50, p90, v[n] }'
done
