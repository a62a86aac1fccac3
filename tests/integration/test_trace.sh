#!/usr/bin/env bash
# Flight-recorder dumps end to end (issue 29), on a cluster this script starts itself (a
# coordinator, 3 shard servers with --trace-dir and a short --coll-timeout-ms, 3 pshard-mlp
# trainers): `pshardctl trace dump` on the live cluster writes one trace file per rank; then
# trainer 2 is stopped (SIGSTOP), so its shard server never starts the next collective, the
# others time out and write their traces, and ask (through the coordinator's store) rank 2's
# server for its own; `pshardctl trace analyze` must name rank 2 as the rank that never started
# the operation.
# usage: test_trace.sh COORDINATOR SERVER PSHARDCTL PSHARD-MLP
set -euo pipefail
coord_bin="$1"
server_bin="$2"
ctl="$3"
mlp="$4"
N=3
COLL_TIMEOUT_MS=3000
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
pids=()
fails=0

# shellcheck source=harness.sh
. "$(dirname "$0")/harness.sh"
cleanup() {
  stop_started
  if [ "$fails" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$coord_bin" --listen 127.0.0.1:0 --port-file "$work/coord.port" --world-size "$N" \
  --lease-ms 4000 --heartbeat-ms 200 > "$work/coord.log" 2>&1 &
pids+=("$!")
wait_for 20 test -s "$work/coord.port"
caddr="127.0.0.1:$(cat "$work/coord.port")"
for ((r = 0; r < N; r++)); do
  "$server_bin" --coordinator "$caddr" --listen 127.0.0.1:0 --port-file "$work/s$r.port" \
    --name "pshard-server-$r" --trace-dir "$work/traces" --coll-timeout-ms "$COLL_TIMEOUT_MS" \
    > "$work/s$r.log" 2>&1 &
  pids+=("$!")
done
for ((r = 0; r < N; r++)); do wait_for 20 test -s "$work/s$r.port"; done
tpid=()
for ((r = 0; r < N; r++)); do
  RANK=$r WORLD_SIZE=$N PSHARD_SERVER="127.0.0.1:$(cat "$work/s$r.port")" \
    "$mlp" --steps 100000 --widths 32,32 --input 16 --output 4 --batch 4 --print-every 1 \
    > "$work/t$r.out" 2> "$work/t$r.err" &
  tpid[$r]=$!
  pids+=("${tpid[$r]}")
done
wait_for 60 steps_printed "$work/t0.out" 3

# 1. trace dump on the live cluster: one file per rank, each the rank's own, with records.
if ! "$ctl" --coordinator "$caddr" trace dump --dir "$work/dump" > "$work/dump.out" 2>&1; then
  fail "trace dump exited non-zero:"; cat "$work/dump.out"
fi
for ((r = 0; r < N; r++)); do
  f="$work/dump/pshard-trace-rank-$r.json"
  if [ ! -s "$f" ]; then fail "trace dump wrote no $f"; cat "$work/dump.out"; continue; fi
  grep -q "\"rank\":$r," "$f" || fail "$f is not rank $r's: $(head -c 300 "$f")"
  grep -q '"flight_records":\[{' "$f" || fail "$f has no flight records: $(head -c 300 "$f")"
  grep -q '"reason":"pshardctl trace dump"' "$f" || fail "$f does not say why it was written"
done
if ! "$ctl" trace analyze "$work/dump" > "$work/analyze-live.out" 2>&1; then
  fail "trace analyze of the live dump exited non-zero:"; cat "$work/analyze-live.out"
fi
[ -e "$work/traces" ] && fail "a server wrote a trace while nothing failed: $(ls "$work/traces")"

# 2. Trainer 2 stops: its server never starts the next collective, ranks 0 and 1 time out.
kill -STOP "${tpid[2]}"
t0=$(now_ms)
# Ranks 0 and 1 on their timeout; rank 2, whose ring never failed, because they ask for it.
have_traces() {
  for ((r = 0; r < N; r++)); do test -s "$work/traces/pshard-trace-rank-$r.json" || return 1; done
}
if ! wait_for $(( COLL_TIMEOUT_MS / 1000 + 15 )) have_traces; then
  fail "not every rank wrote its trace within $(( $(now_ms) - t0 )) ms of the stop"
  ls -l "$work/traces" 2>/dev/null || true
  tail -5 "$work"/s*.log
else
  echo "ok: traces written $(( $(now_ms) - t0 )) ms after trainer 2 stopped: $(ls "$work/traces" | tr '\n' ' ')"
fi
for r in 0 1; do
  f="$work/traces/pshard-trace-rank-$r.json"
  [ -s "$f" ] || continue
  grep -q '"reason":"TIMEOUT' "$f" || grep -q '"reason":"[A-Z_]*:' "$f" ||
    fail "$f gives no reason: $(head -c 400 "$f")"
  grep -q '"state":"failed"' "$f" || fail "$f has no failed record: $(head -c 600 "$f")"
  for key in op seq label dtype count tag start_time end_time waiting_on state error; do
    grep -q "\"$key\":" "$f" || fail "$f lacks the record field $key"
  done
done
grep -q '"reason":"asked: ' "$work/traces/pshard-trace-rank-2.json" 2>/dev/null ||
  fail "rank 2's trace does not say it was asked for: $(head -c 300 "$work/traces/pshard-trace-rank-2.json" 2>/dev/null)"
if "$ctl" trace analyze "$work/traces" > "$work/analyze.out" 2>&1; then
  if grep -q "^rank 2 never started" "$work/analyze.out"; then
    echo "ok: $(grep "^rank 2 never started" "$work/analyze.out")"
  else
    fail "trace analyze does not name rank 2 as the one that never started:"
    cat "$work/analyze.out"
  fi
  grep -q "waited for it" "$work/analyze.out" || fail "trace analyze says nothing of the wait"
else
  fail "trace analyze exited non-zero:"; cat "$work/analyze.out"
fi
[ "$fails" -eq 0 ] && cat "$work/analyze.out"
echo "$fails failure(s)"
[ "$fails" -eq 0 ]
