#!/usr/bin/env bash
# Failure detection time: how long from a fault until every surviving trainer has its error,
# over TRIALS (20) runs of each fault of tests/integration/test_failures.sh (a fresh 3-rank
# cluster each time, lease 2000 ms, heartbeat 500 ms): kill -9 of a trainer (found through the
# coordinator's lease), SIGSTOP of a shard server (lease), kill -9 of a shard server (the ring's
# sockets). Prints p50 / p90 / max of the slowest trainer per trial, per fault.
# Then the recovery comparison at the end of this file.
# usage: tests/bench/run-failure-bench.sh [BUILD_DIR]   (env TRIALS, RECOVERY_TRIALS, RECOVERY_JOBS,
# LEASE_MS, VENV; TRIALS=0 runs only the recovery part)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-$ROOT/build}"
TRIALS="${TRIALS:-20}"
for fault in trainer-kill server-stop server-kill; do
  [ "$TRIALS" -gt 0 ] || break
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

# Recovery: from a fault to the job training again (rank 0 finishing step 14), over
# RECOVERY_TRIALS (5) runs of a pshardrun job (--lease-ms LEASE_MS, 2000; before step 13,
# --fail-at-step, trainer 1 exits or, in lm_hsdp, kills its shard server), side by side, for
# each job of RECOVERY_JOBS:
#   mlp      pshard-mlp, 4 layers of 1024, 3 ranks
#   lm       examples/torch/train_lm.py (GPT-2 2x128, pshard.torch.optim.AdamW on the servers),
#            3 ranks; needs VENV, default <build>/torch-venv from scripts/pshard-venv.sh
#   lm_topt  the same with torch.optim.AdamW in the trainer, whose state pshard.torch keeps
#            (replace mode only: a full restart cannot bring a trainer's optimizer state back)
#   lm_hsdp  the lm job on 4 ranks as HSDP (--mesh 2x2: 2 replicas of 2 shard ranks); the fault
#            is shard server 1's death (SIGKILL, --fail-kind server), not its trainer's
# and each mode:
#   replace: --max-restarts 1 (trainer 1 alone is replaced; the others skip the aborted step)
#   heal:    (lm_hsdp's replace) --max-restarts 1 (server 1 and its trainer are replaced, the
#            new server gets its state from its replica, server 3; the others skip the aborted
#            step)
#   restart: --max-restarts 1 --replace-timeout-ms 0 (every process restarts, resuming from
#            the step-10 checkpoint: today's torchrun way)
# Prints p50 / max per job and mode and the ratio of the medians (replace or heal / restart).
RECOVERY_TRIALS="${RECOVERY_TRIALS:-5}"
RECOVERY_JOBS="${RECOVERY_JOBS:-mlp lm lm_topt lm_hsdp}"
LEASE_MS="${LEASE_MS:-2000}"
VENV="${VENV:-$BUILD/torch-venv}"
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
# recovery_ms JOB MODE: one run; prints the milliseconds from rank 1's fault (its trainer's
# exit, or for lm_hsdp its shard server's kill) to rank 0's next step.
recovery_ms() {
  local extra=() ck run
  ck=$(mktemp -d)
  [ "$2" = restart ] && extra=(--replace-timeout-ms 0 --checkpoint-dir "$ck" --checkpoint-every 5)
  case "$1" in
  mlp) run=("$BUILD/tools/pshardrun" --nproc 3 --lease-ms "$LEASE_MS" --max-restarts 1 "${extra[@]}" --
            "$BUILD/examples/pshard-mlp" --steps 24 --print-every 1 --fail-at-step 13 --fail-rank 1) ;;
  lm | lm_topt)
    run=("$VENV/bin/pshardrun" --nproc 3 --lease-ms "$LEASE_MS" --max-restarts 1 "${extra[@]}" --
         "$VENV/bin/python" "$ROOT/examples/torch/train_lm.py" --steps 20 --print-every 1
         --fail-at-step 13 --fail-rank 1 --layers 2 --d-model 128 --heads 2)
    [ "$1" = lm_topt ] && run+=(--optimizer torch) ;;
  lm_hsdp)
    run=("$VENV/bin/pshardrun" --nproc 4 --lease-ms "$LEASE_MS" --max-restarts 1 "${extra[@]}" --
         "$VENV/bin/python" "$ROOT/examples/torch/train_lm.py" --steps 20 --print-every 1
         --fail-at-step 13 --fail-rank 1 --layers 2 --d-model 128 --heads 2
         --mesh 2x2 --fail-kind server) ;;
  esac
  # The trainers flush each step line: they reach pshardrun (and the clock below) as printed.
  OMP_NUM_THREADS=1 "${run[@]}" 2>&1 | while IFS= read -r line; do echo "$(now_ms) $line"; done > "$ck/log"
  # Training again: rank 0 finishes a step past the one rank 1 failed before (13), the same
  # progress either way (the restart redoes steps 11-13 from the step-10 checkpoint). The
  # clock starts at the fault's line, which the trainer prints just before it.
  awk '/(exiting|killing its shard server) before step/ && !t { t = $1 }
       t && /\[trainer 0\] step [0-9]+ loss/ && $5 + 0 > 13 { print $1 - t; exit }' "$ck/log"
  rm -rf "$ck"
}
med() { printf '%s\n' $1 | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
declare -A rec
for job in $RECOVERY_JOBS; do
  modes="replace restart"
  [ "$job" = lm_topt ] && modes=replace
  [ "$job" = lm_hsdp ] && modes="heal restart"
  case "$job" in lm | lm_topt | lm_hsdp) [ -x "$VENV/bin/python" ] ||
    { echo "recovery $job: no $VENV (scripts/pshard-venv.sh makes it); skipped" >&2; continue; } ;; esac
  for mode in $modes; do rec[$job.$mode]=""; done
  for ((t = 0; t < RECOVERY_TRIALS; t++)); do
    for mode in $modes; do # interleaved: drifting load hits both alike
      ms=$(recovery_ms "$job" "$mode")
      [ -n "$ms" ] || { echo "recovery ($job $mode): the job did not train again" >&2; exit 1; }
      rec[$job.$mode]+="$ms "
    done
  done
  for mode in $modes; do
    printf '%s\n' ${rec[$job.$mode]} | sort -n | awk -v what="$job $mode" -v n="$RECOVERY_TRIALS" '
      { v[NR] = $1 } END { printf "recovery %-16s %d trials: training again after p50 %d ms, max %d ms\n",
                                  what, n, v[int((n + 1) / 2)], v[n] }'
  done
  [ "$job" = lm_topt ] && continue
  first=${modes%% *} # replace, or heal
  awk -v a="$(med "${rec[$job.$first]}")" -v b="$(med "${rec[$job.restart]}")" -v l="$LEASE_MS" -v j="$job" -v m="$first" \
    'BEGIN { printf "recovery %s: %s / restart %.2f (medians %d / %d ms; lease %d ms)\n", j, m, a / b, a, b, l }'
done
