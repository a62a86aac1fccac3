#!/usr/bin/env bash
# A lost trainer is replaced and nobody else restarts (issue 29 §1), on a real cluster this
# script starts itself: a coordinator with a short lease, 3 shard servers with
# --trainer-replace-ms, 3 pshard-mlp trainers. Trainer 1 is killed with -9 at whatever step it
# is in, and a replacement started for rank 1 alone; later trainer 2 likewise, after a first
# replacement that defines another model is refused. Expected: the survivors report the
# aborted steps and go on, each replacement resumes where they go on, no server restarts, no
# checkpoint exists to be read, the job ends with every trainer exiting 0, and the final
# weights equal, bit for bit, a fresh run of the same data that leaves the aborted steps out
# (pshard-mlp --skip-steps). Then: a lost trainer whose replacement never comes ends the job
# once --trainer-replace-ms has passed, every survivor naming the rank.
# usage: test_replace.sh COORDINATOR SERVER PSHARD-MLP
set -euo pipefail
coord_bin="$1"
server_bin="$2"
mlp="$3"
LEASE_MS=2000
HB_MS=500
STEPS=40
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
pids=()
fails=0
cw="$work"
# shellcheck source=harness.sh
. "$(dirname "$0")/harness.sh"
cleanup() {
  local code=$?
  [ "$code" -ne 0 ] && fails=$((fails + 1))
  stop_started
  if [ "$fails" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

MODEL=(--widths 32,32 --input 16 --output 4 --batch 4 --print-every 1 --steps "$STEPS")

# start_cluster DIR REPLACE_MS: a coordinator and 3 servers; sets caddr, spid.
start_cluster() {
  cw="$1"
  mkdir -p "$cw"
  "$coord_bin" --listen 127.0.0.1:0 --port-file "$cw/coord.port" --world-size 3 \
    --lease-ms "$LEASE_MS" --heartbeat-ms "$HB_MS" > "$cw/coord.log" 2>&1 &
  pids+=("$!")
  wait_for 20 test -s "$cw/coord.port"
  caddr="127.0.0.1:$(cat "$cw/coord.port")"
  spid=()
  for r in 0 1 2; do
    "$server_bin" --coordinator "$caddr" --listen 127.0.0.1:0 --port-file "$cw/s$r.port" \
      --name "pshard-server-$r" --trainer-replace-ms "$2" --log info > "$cw/s$r.log" 2>&1 &
    spid[$r]=$!
    pids+=("${spid[$r]}")
  done
  for r in 0 1 2; do wait_for 20 test -s "$cw/s$r.port"; done
}

# start_trainer RANK TAG [ARGS...]: pshard-mlp for RANK (output in $cw/t<TAG>.out/.err); sets
# tpid[RANK] (its last start). A TAG other than the rank is a replacement (restart count 1).
start_trainer() {
  local r=$1 tag=$2; shift 2
  local restarts=0
  [ "$tag" != "$r" ] && restarts=1
  RANK=$r WORLD_SIZE=3 PSHARD_SERVER="127.0.0.1:$(cat "$cw/s$r.port")" \
    PSHARD_RESTART_COUNT=$restarts \
    "$mlp" "${MODEL[@]}" "$@" > "$cw/t$tag.out" 2> "$cw/t$tag.err" &
  tpid[$r]=$!
  pids+=("${tpid[$r]}")
}

# exited_ok PID NAME: waits for PID (60 s at most) and checks it exited 0.
exited_ok() {
  if ! wait_for 60 gone "$1"; then fail "$2 still runs"; return; fi
  local code=0
  wait "$1" || code=$?
  [ "$code" -eq 0 ] || { fail "$2 exited $code:"; tail -5 "$cw/t$3.err"; }
}

echo "== kill -9 of trainer 1, then of trainer 2, each replaced alone (lease ${LEASE_MS} ms)"
start_cluster "$work/replace" 60000
tpid=()
for r in 0 1 2; do start_trainer "$r" "$r" --sleep-ms-per-step 100 --dump-weights "$cw/w.bin"; done
# Whatever step they are in: after a random number of steps, mid-step as it happens.
first=$((3 + RANDOM % 6))
second=$((3 + RANDOM % 6))
echo "killing trainer 1 after $first printed steps, trainer 2 $second steps after the first replacement"
wait_for 60 steps_printed "$cw/t0.out" "$first" || fail "the job did not train"
t0=$(now_ms)
kill -9 "${tpid[1]}"
start_trainer 1 1b --sleep-ms-per-step 100 --dump-weights "$cw/w.bin"
wait_for 60 grep -q "aborted" "$cw/t0.err" || fail "rank 0 never heard of an aborted step"
wait_for 60 grep -q "resuming at step" "$cw/t1b.err" || fail "the replacement of rank 1 never resumed"
echo "ok: rank 1 replaced; training again $(( $(now_ms) - t0 )) ms after the kill"
before=$(grep -c '^step' "$cw/t0.out")
wait_for 60 steps_printed "$cw/t0.out" $((before + second)) || fail "no progress after rank 1's replacement"
kill -9 "${tpid[2]}"
# A replacement that defines another model is refused, and the rank still waits.
start_trainer 2 2x --sleep-ms-per-step 100 --widths 64,32
if wait_for 60 gone "${tpid[2]}"; then
  code=0; wait "${tpid[2]}" || code=$?
  if [ "$code" -ne 0 ] && grep -q "defines another model" "$cw/t2x.err"; then
    echo "ok: $(grep -m1 -o "rank 2's replacement trainer defines another model[^:]*" "$cw/t2x.err")"
  else
    fail "a replacement with another model was not refused (exit $code):"; cat "$cw/t2x.err"
  fi
else
  fail "a replacement with another model still runs"
fi
start_trainer 2 2b --sleep-ms-per-step 100 --dump-weights "$cw/w.bin"
for r in 0 1 2; do
  tag=$r; [ "$r" = 1 ] && tag=1b; [ "$r" = 2 ] && tag=2b
  exited_ok "${tpid[$r]}" "trainer $r" "$tag"
done
for r in 0 1 2; do gone "${spid[$r]}" && fail "shard server $r died"; done
grep -q "took over the model" "$cw/s1.log" || fail "server 1 does not log the take-over"
grep -q "took over the model" "$cw/s2.log" || fail "server 2 does not log the take-over"
# The aborted steps, as the survivors reported them, and where the replacements resumed.
aborted=$(cat "$cw"/t*.err | grep -o 'step [0-9]* aborted' | awk '{print $2}' | sort -nu | paste -sd, -)
resumed=$(cat "$cw"/t1b.err "$cw"/t2b.err | grep -o 'resuming at step [0-9]*' | awk '{print $4}' | paste -sd, -)
going=$(cat "$cw"/t*.err | grep -o 'going on at step [0-9]*' | awk '{print $5}' | sort -nu | paste -sd, -)
echo "aborted steps: ${aborted:-none}; replacements resumed at: ${resumed:-?}; survivors went on at: ${going:-?}"
[ -n "$aborted" ] || fail "no step was reported aborted"
[ "$(echo "$aborted" | tr , '\n' | wc -l)" -eq 2 ] || fail "two kills aborted steps $aborted"
[ "$resumed" = "$going" ] || fail "the replacements resumed at $resumed, the survivors went on at $going"
[ -s "$cw/w.bin" ] || fail "no final weights were written"
ls "$cw" | grep -qi ckpt && fail "a checkpoint appeared"
stop_started
pids=()

echo "== the same data without the aborted steps, on a fresh cluster"
start_cluster "$work/reference" 0
for r in 0 1 2; do start_trainer "$r" "$r" --skip-steps "$aborted" --dump-weights "$cw/w.bin"; done
for r in 0 1 2; do exited_ok "${tpid[$r]}" "reference trainer $r" "$r"; done
if cmp -s "$work/replace/w.bin" "$work/reference/w.bin"; then
  echo "ok: the final weights equal the reference's bit for bit ($(stat -c %s "$cw/w.bin") bytes)"
else
  fail "the final weights differ from the run that left steps $aborted out"
fi
# Rank 0 survived both kills: its loss lines are the reference's, step for step.
if diff <(grep '^step' "$work/replace/t0.out") <(grep '^step' "$work/reference/t0.out") > /dev/null; then
  echo "ok: rank 0's loss lines equal the reference's"
else
  fail "rank 0's loss lines differ from the reference's"
fi
stop_started
pids=()

echo "== a lost trainer whose replacement never comes ends the job (--trainer-replace-ms 3000)"
start_cluster "$work/deadline" 3000
for r in 0 1 2; do start_trainer "$r" "$r" --sleep-ms-per-step 50; done
wait_for 60 steps_printed "$cw/t0.out" 3 || fail "the job did not train"
t0=$(now_ms)
kill -9 "${tpid[1]}"
for r in 0 2; do
  if ! wait_for 60 gone "${tpid[$r]}"; then fail "trainer $r still runs"; continue; fi
  code=0; wait "${tpid[$r]}" || code=$?
  if [ "$code" -ne 0 ] && grep -q "rank 1's trainer was lost and no replacement" "$cw/t$r.err"; then
    echo "ok: trainer $r failed $(( $(now_ms) - t0 )) ms after the kill: $(grep -m1 -o "rank 1's trainer was lost and no replacement[^:]*" "$cw/t$r.err")"
  else
    fail "trainer $r exited $code without naming rank 1:"; tail -3 "$cw/t$r.err"
  fi
done

[ "$fails" -eq 0 ] && echo "all replacement cases passed"
exit $(( fails > 0 ))
