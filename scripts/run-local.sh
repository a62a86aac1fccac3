#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: install what is missing, build, start a local
# coordinator, train the example MLP sharded over four shard servers with pshardrun (the loss
# must fall), print `pshardctl status`, then stop everything that was started.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
PSHARD_BUILD_DIR="$root/build" "$root/scripts/build.sh" > /dev/null

bin="$root/build"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# Waits (up to $2 seconds) for the command in $1 to succeed.
wait_for() {
  local deadline=$((SECONDS + $2))
  until eval "$1" > /dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then echo "run-local: timed out waiting for: $1" >&2; return 1; fi
    sleep 0.05
  done
}

world=${WORLD_SIZE:-4}
"$bin/coordinator/pshard-coordinator" --listen 127.0.0.1:0 --port-file "$work/port" \
  --world-size "$world" > "$work/coordinator.out" 2> "$work/coordinator.log" &
pids+=($!)
wait_for "test -s '$work/port'" 10
coord="127.0.0.1:$(cat "$work/port")"
ctl=("$bin/client/pshardctl" --coordinator "$coord")
wait_for "${ctl[*]} health" 10
echo "coordinator: $(cat "$work/coordinator.out")"

# Train the example MLP (4 hidden layers of 1024) sharded over $world shard servers, one thread
# per rank, like torchrun would launch it.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
"$bin/client/pshardrun" --nproc "$world" --coordinator "$coord" -- \
  "$bin/examples/pshard-mlp" --steps "${STEPS:-30}" --batch 32 --widths 1024,1024,1024,1024 \
  --optimizer adam --print-every 5
echo
"${ctl[@]}" status
