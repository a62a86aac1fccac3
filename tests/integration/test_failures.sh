#!/usr/bin/env bash
# Failure handling end to end, on a real cluster this script starts itself (a coordinator with
# a short lease, N shard servers, N trainers running pshard-mlp): a trainer killed with -9, a
# shard server stopped with SIGSTOP (hung), a shard server killed with -9, and a restart of
# the coordinator. For each fault: every surviving trainer must fail (not hang) with an error
# that names the lost rank, within lease + 1 s (plus 2 s of slack for a loaded machine; the
# measured times are printed), and a coordinator restart must not disturb training at all.
# Also: a training whose loss stops being a number (here a huge learning rate; corrupt data
# does the same) stops every trainer with exit 1 instead of going on to exit 0.
# usage: test_failures.sh COORDINATOR SERVER PSHARDCTL PSHARD-MLP
set -euo pipefail
coord_bin="$1"
server_bin="$2"
ctl="$3"
mlp="$4"
LEASE_MS=2000
HB_MS=500
BOUND_MS=$((LEASE_MS + 1000 + 2000))
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
pids=()
fails=0
case_no=0
cw="$work"

# shellcheck source=harness.sh
. "$(dirname "$0")/harness.sh"
cleanup() {
  stop_started
  if [ "$fails" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work"; fi
}
trap cleanup EXIT

# wait_progressing SECONDS LOG CMD...: polls CMD until it succeeds; fails once LOG has printed
# no new step for SECONDS.
wait_progressing() {
  local idle=$1 log=$2; shift 2
  local seen=-1 since
  since=$(now_ms)
  until "$@"; do
    local n
    n=$(grep -c '^step' "$log" 2>/dev/null || true)
    if [ "$n" != "$seen" ]; then seen=$n; since=$(now_ms); fi
    if [ $(( $(now_ms) - since )) -gt $(( idle * 1000 )) ]; then return 1; fi
    sleep 0.05
  done
}


# start_coordinator [PORT]: on PORT or a free one; sets caddr and cpid.
start_coordinator() {
  rm -f "$cw/coord.port"
  "$coord_bin" --listen "127.0.0.1:${1:-0}" --port-file "$cw/coord.port" --world-size "$N" \
    --lease-ms "$LEASE_MS" --heartbeat-ms "$HB_MS" >> "$cw/coord.log" 2>&1 &
  cpid=$!
  pids+=("$cpid")
  wait_for 20 test -s "$cw/coord.port"
  caddr="127.0.0.1:$(cat "$cw/coord.port")"
}

# start_cluster N STEPS [STEPS_SEEN [TRAINER ARGS...]]: coordinator, N servers, N trainers
# (pshard-mlp with the extra ARGS); waits until rank 0 printed STEPS_SEEN (3) steps.
start_cluster() {
  N="$1"
  local steps="$2" seen="${3:-3}"
  shift 2; [ $# -gt 0 ] && shift
  local extra=("$@")
  case_no=$((case_no + 1))
  cw="$work/case$case_no" # each case's logs stay apart (kept when something fails)
  mkdir -p "$cw"
  start_coordinator
  spid=(); tpid=()
  for ((r = 0; r < N; r++)); do
    "$server_bin" --coordinator "$caddr" --listen 127.0.0.1:0 --port-file "$cw/s$r.port" \
      --name "pshard-server-$r" > "$cw/s$r.log" 2>&1 &
    spid[$r]=$!
    pids+=("${spid[$r]}")
  done
  for ((r = 0; r < N; r++)); do wait_for 20 test -s "$cw/s$r.port"; done
  for ((r = 0; r < N; r++)); do
    RANK=$r WORLD_SIZE=$N PSHARD_SERVER="127.0.0.1:$(cat "$cw/s$r.port")" \
      "$mlp" --steps "$steps" --widths 32,32 --input 16 --output 4 --batch 4 --print-every 1 \
      ${extra[@]+"${extra[@]}"} > "$cw/t$r.out" 2> "$cw/t$r.err" &
    tpid[$r]=$!
    pids+=("${tpid[$r]}")
  done
  wait_for 60 steps_printed "$cw/t0.out" "$seen"
}

stop_cluster() {
  stop_started
  pids=()
  rm -f "$cw"/*.port
}

# expect_failures T0 NAME_PATTERN RANKS...: each trainer RANK must exit non-zero within
# BOUND_MS of T0 with NAME_PATTERN in its error.
expect_failures() {
  local t0="$1" pattern="$2"; shift 2
  for r in "$@"; do
    if ! wait_for $(( (BOUND_MS + 999) / 1000 )) gone "${tpid[$r]}"; then
      echo "FAIL: trainer $r still runs $(( $(now_ms) - t0 )) ms after the fault"
      fails=$((fails + 1)); continue
    fi
    local took=$(( $(now_ms) - t0 ))
    local code=0
    wait "${tpid[$r]}" || code=$?
    if [ "$code" -eq 0 ]; then
      echo "FAIL: trainer $r exited 0"; fails=$((fails + 1))
    elif ! grep -q -- "$pattern" "$cw/t$r.err"; then
      echo "FAIL: trainer $r's error does not name the lost member ($pattern):"
      cat "$cw/t$r.err"; fails=$((fails + 1))
    elif [ "$took" -gt "$BOUND_MS" ]; then
      echo "FAIL: trainer $r took $took ms (bound $BOUND_MS)"; fails=$((fails + 1))
    else
      echo "ok: trainer $r failed after $took ms: $(grep -m1 -- "$pattern" "$cw/t$r.err" | cut -c1-200)"
    fi
  done
}

cases="${FAILURE_CASES:-trainer-kill server-stop server-kill diverged coordinator-restart}"
want() { [[ " $cases " == *" $1 "* ]]; }

if want trainer-kill; then
echo "== kill -9 of trainer 1 (lease ${LEASE_MS} ms, heartbeat ${HB_MS} ms)"
start_cluster 3 100000000
# While it trains, status shows each server's flight records labelled with step and tensor.
labelled() {
  "$ctl" --coordinator "$caddr" status > "$cw/status.txt" 2>&1 || true
  grep -Eq "rank [0-9] (finished|is running|is stuck in) [a-z_]+ seq [0-9]+ \(step [0-9]+, [^)]+\)" "$cw/status.txt"
}
if wait_for 10 labelled; then
  echo "ok: $(grep -Em1 "seq [0-9]+ \(step [0-9]+, " "$cw/status.txt" | sed 's/^ *//')"
else
  echo "FAIL: no flight record labelled 'step N, tensor' in pshardctl status:"; cat "$cw/status.txt"
  fails=$((fails + 1))
fi
# A trainer member that is not attached to this job's servers (a monitoring tool, a second
# job) lets its lease lapse: the job must not notice.
"$ctl" --coordinator "$caddr" register --role trainer --name stray-monitor > "$cw/stray.txt" 2>&1 ||
  { echo "FAIL: could not register a stray trainer:"; cat "$cw/stray.txt"; fails=$((fails + 1)); }
evicted() {
  local m
  m=$("$ctl" --coordinator "$caddr" members 2>/dev/null) || return 1
  grep -q stray-monitor <<< "$m" && return 1
  return 0
}
wait_for 20 evicted || { echo "FAIL: the stray trainer was never evicted"; fails=$((fails + 1)); }
before=$(grep -c '^step' "$cw/t0.out")
wait_for 20 steps_printed "$cw/t0.out" $((before + 3)) || true
alive=1
for r in 0 1 2; do gone "${tpid[$r]}" && alive=0; done
if [ "$alive" = 1 ] && [ "$(grep -c '^step' "$cw/t0.out")" -gt "$before" ]; then
  echo "ok: a stray trainer's lapsed lease left the job training"
else
  echo "FAIL: a stray trainer's lapsed lease stopped the job:"; tail -3 "$cw"/t*.err
  fails=$((fails + 1))
fi
t0=$(now_ms)
kill -9 "${tpid[1]}"
expect_failures "$t0" "trainer-1" 0 2
# Its shared memory was unlinked once mapped: nothing of it is left in /dev/shm.
left=$(find /dev/shm -maxdepth 1 -name "pshard-${tpid[1]}-*" 2>/dev/null | wc -l)
if [ "$left" -ne 0 ]; then
  echo "FAIL: the killed trainer left $left shared-memory objects in /dev/shm"; fails=$((fails + 1))
else
  echo "ok: the killed trainer left nothing in /dev/shm"
fi
for r in 0 1 2; do
  if gone "${spid[$r]}"; then echo "FAIL: shard server $r died"; fails=$((fails + 1)); fi
done
stop_cluster
fi

if want server-stop; then
echo "== SIGSTOP of shard server 2 (hung)"
start_cluster 3 100000000
t0=$(now_ms)
kill -STOP "${spid[2]}"
expect_failures "$t0" "rank 2" 0 1 2
stop_cluster
fi

if want server-kill; then
echo "== kill -9 of shard server 1"
start_cluster 3 100000000
t0=$(now_ms)
kill -9 "${spid[1]}"
expect_failures "$t0" "rank 1" 0 2
stop_cluster
fi

if want diverged; then
echo "== a loss that is no longer a number stops every trainer (exit 1), not exit 0"
start_cluster 2 200 1 --lr 1e30
for r in 0 1; do
  if ! wait_for 60 gone "${tpid[$r]}"; then echo "FAIL: trainer $r still trains"; fails=$((fails + 1)); continue; fi
  code=0; wait "${tpid[$r]}" || code=$?
  if [ "$code" -ne 1 ] || ! grep -q "the mean loss is .* at step" "$cw/t$r.err"; then
    echo "FAIL: trainer $r exited $code:"; cat "$cw/t$r.err"; fails=$((fails + 1))
  else
    echo "ok: trainer $r stopped: $(grep -m1 'the mean loss' "$cw/t$r.err" | cut -c1-160)"
  fi
done
stop_cluster
fi

if want coordinator-restart; then
echo "== coordinator restart (kill -9, then again on the same port)"
# This case measures no failure time: a longer lease keeps a loaded machine's late heartbeat
# from evicting a trainer, while the outage still outlasts the lease.
LEASE_MS=4000
HB_MS=1000
steps=4000
start_cluster 2 "$steps"
port=$(cat "$cw/coord.port")
kill -9 "$cpid"
wait "$cpid" 2>/dev/null || true
before=$(grep -c '^step' "$cw/t0.out" || true)
# Down for longer than the lease: nobody may be aborted for that alone.
sleep_until=$(( $(now_ms) + LEASE_MS + 500 ))
past() { [ "$(now_ms)" -gt "$1" ]; }
wait_for 10 past "$sleep_until"
start_coordinator "$port"
at_restart=$(grep -c '^step' "$cw/t0.out" || true)
ok=1
for r in 0 1; do
  # A loaded machine (a sanitizer build beside other tests) trains far slower: what fails is a
  # trainer that stops making progress, not one that is slow.
  if ! wait_progressing 60 "$cw/t0.out" gone "${tpid[$r]}"; then
    echo "FAIL: trainer $r did not finish (no new step for 60 s; $(grep -c '^step' "$cw/t0.out" || true) of $steps)"
    ok=0; continue
  fi
  code=0; wait "${tpid[$r]}" || code=$?
  if [ "$code" -ne 0 ]; then echo "FAIL: trainer $r exited $code:"; cat "$cw/t$r.err"; ok=0; fi
done
after=$(grep -c '^step' "$cw/t0.out" || true)
if [ "$ok" -eq 1 ] && [ "$after" -eq "$steps" ] && [ "$at_restart" -lt "$steps" ]; then
  echo "ok: training went on through the outage and after the restart (step $before of $steps when the coordinator died, $at_restart when it came back)"
  if ! wait_for 20 "$ctl" --coordinator "$caddr" health pshard.Cluster > /dev/null; then
    echo "FAIL: the restarted coordinator did not see the cluster form again"; fails=$((fails + 1))
  fi
else
  [ "$ok" -eq 1 ] && echo "FAIL: $after of $steps steps ($at_restart at the restart; must be below $steps)"
  fails=$((fails + 1))
fi
stop_cluster
fi

if [ "$fails" -ne 0 ]; then
  echo "$fails check(s) failed"
  exit 1
fi
echo "every fault was reported, naming the lost member, within lease + 1 s (+ slack)"
