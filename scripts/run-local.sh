#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: install what is missing, build, make the Python
# virtual environment (PyPI's torch and the pshard package from this checkout; reused on
# re-runs), start a local coordinator, train the PyTorch example (a Hugging Face GPT-2 causal
# LM, built in code, byte-level on the Python standard library's sources) sharded over two
# shard servers with pshardrun (the loss must fall), print `pshardctl status`, then stop
# everything that was started. `--mlp` trains the C example MLP over four servers instead.
# The test suite runs it (CTest run_local_mlp) on its own build with PSHARD_RUN_LOCAL_BUILT=1
# and PSHARD_BUILD_DIR set: nothing installed or built, the binaries of that build used.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
example=lm
for a in "$@"; do
  case "$a" in
    --mlp) example=mlp ;;
    *) echo "usage: $0 [--mlp]" >&2; exit 2 ;;
  esac
done
bin="${PSHARD_BUILD_DIR:-$root/build}"
if [ "${PSHARD_RUN_LOCAL_BUILT:-}" != 1 ]; then
  "$root/scripts/install-deps.sh"
  PSHARD_BUILD_DIR="$bin" "$root/scripts/build.sh" > /dev/null
fi

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

if [ "$example" = lm ]; then
  world=${WORLD_SIZE:-2}
  venv=$("$root/scripts/pshard-venv.sh" "$root/build/torch-venv" | tail -1)
  run=("$venv/bin/pshardrun")
else
  world=${WORLD_SIZE:-4}
  run=("$bin/tools/pshardrun")
fi
"$bin/coordinator/pshard-coordinator" --listen 127.0.0.1:0 --port-file "$work/port" \
  --world-size "$world" > "$work/coordinator.out" 2> "$work/coordinator.log" &
pids+=($!)
wait_for "test -s '$work/port'" 10
coord="127.0.0.1:$(cat "$work/port")"
ctl=("$bin/tools/pshardctl" --coordinator "$coord")
wait_for "${ctl[*]} health pshard.Coordinator" 10
echo "coordinator: $(cat "$work/coordinator.out")"

# One thread per rank, like torchrun would launch it.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$example" = lm ]; then
  # GPT-2, 4 layers of d_model 256, sequences of 128 bytes, 8 per rank and step; FSDP2's
  # fully_shard per block and on the root, AdamW on the shard servers.
  job=("${run[@]}" --nproc "$world" --coordinator "$coord" -- \
    "$venv/bin/python" "$root/examples/torch/train_lm.py" --steps "${STEPS:-30}" --print-every 5)
else
  # The C example: an MLP with 4 hidden layers of 1024.
  job=("${run[@]}" --nproc "$world" --coordinator "$coord" -- \
    "$bin/examples/pshard-mlp" --steps "${STEPS:-30}" --batch 32 --widths 1024,1024,1024,1024 \
    --optimizer adam --print-every 5)
fi
"${job[@]}" &
job_pid=$!
pids+=("$job_pid")
# While it trains (a shard server has applied a few steps), show what the cluster looks like.
shown=0
while kill -0 "$job_pid" 2>/dev/null; do
  if "${ctl[@]}" status --json 2>/dev/null | grep -q '"step":\([3-9]\|[1-9][0-9]\)'; then
    echo; echo "== pshardctl status, while the job runs"
    "${ctl[@]}" status || true
    echo
    shown=1
    break
  fi
  sleep 0.2
done
rc=0
wait "$job_pid" || rc=$?
[ "$shown" = 1 ] || { echo; echo "(the job ended before a status was taken)"; }
exit "$rc"
