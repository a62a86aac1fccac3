#!/usr/bin/env bash
# "Who is slow" end to end (issue 29): a coordinator, 3 shard servers with /metrics and 3
# pshard-mlp trainers, of which rank 2 sleeps 200 ms in every step (--sleep-ms-per-step, time
# outside pshard as a slow data loader's). `pshardctl status` must name rank 2 as the slowest,
# at a ratio well over 1, and as SLOW; the coordinator must log it once; and rank 2's /metrics
# must show more compute time than rank 0's and rank 0's more wait time than rank 2's, and the
# coordinator's /metrics name rank 2 as the slowest. Only
# orderings and a loose ratio are asserted: the machine may be busy.
# usage: test_straggler.sh COORDINATOR SERVER PSHARDCTL PSHARD-MLP
set -euo pipefail
coord_bin="$1"
server_bin="$2"
ctl="$3"
mlp="$4"
N=3
SLOW=2
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

# scrape PORT: the /metrics text of the listener on 127.0.0.1:PORT (bash's /dev/tcp, HTTP/1.0:
# the server closes the connection after its answer).
scrape() {
  exec 3<> "/dev/tcp/127.0.0.1/$1"
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  cat <&3
  exec 3<&-
}
# metric TEXTFILE NAME: the value of the unlabelled sample NAME.
metric() { awk -v n="$2" '$1 == n { print $2 }' "$1"; }

"$coord_bin" --listen 127.0.0.1:0 --port-file "$work/coord.port" --world-size "$N" \
  --lease-ms 4000 --heartbeat-ms 200 --straggler-ratio 1.3 --straggler-steps 5 \
  --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/mc.port" > "$work/coord.log" 2>&1 &
pids+=("$!")
wait_for 20 test -s "$work/coord.port"
wait_for 20 test -s "$work/mc.port"
caddr="127.0.0.1:$(cat "$work/coord.port")"
for ((r = 0; r < N; r++)); do
  "$server_bin" --coordinator "$caddr" --listen 127.0.0.1:0 --port-file "$work/s$r.port" \
    --name "pshard-server-$r" --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/m$r.port" \
    > "$work/s$r.log" 2>&1 &
  pids+=("$!")
done
for ((r = 0; r < N; r++)); do
  wait_for 20 test -s "$work/s$r.port"
  wait_for 20 test -s "$work/m$r.port"
done
for ((r = 0; r < N; r++)); do
  RANK=$r WORLD_SIZE=$N PSHARD_SERVER="127.0.0.1:$(cat "$work/s$r.port")" \
    "$mlp" --steps 100000 --widths 32,32 --input 16 --output 4 --batch 4 --print-every 1 \
    --sleep-ms-per-step 200 --sleep-rank "$SLOW" > "$work/t$r.out" 2> "$work/t$r.err" &
  pids+=("$!")
done

# 1. pshardctl status names rank 2, as SLOW, once the ranks' windows hold 5 steps.
named() {
  "$ctl" --coordinator "$caddr" status > "$work/status.out" 2>&1 || true
  grep -q "^slowest      rank $SLOW (pshard-server-$SLOW) is .*: SLOW" "$work/status.out"
}
if ! wait_for 90 named; then
  fail "pshardctl status did not name rank $SLOW as slow:"
  cat "$work/status.out"
  tail -3 "$work"/t*.err "$work"/s*.log "$work/coord.log"
else
  ratio=$(sed -n 's/^slowest      rank [0-9]* ([^)]*) is \([0-9.]*\)x.*/\1/p' "$work/status.out")
  awk -v r="$ratio" 'BEGIN { exit !(r > 1.3) }' || fail "ratio '$ratio' is not over 1.3"
  echo "status: $(grep '^slowest' "$work/status.out")"
  grep -E '^  rank [0-9]+ +step' "$work/status.out" || true
fi
"$ctl" --coordinator "$caddr" --json status > "$work/status.json" 2>&1 || true
grep -q "\"straggler\": *{[^}]*\"rank\": *$SLOW" "$work/status.json" ||
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['straggler']; sys.exit(s['rank'] != $SLOW)" \
    "$work/status.json" 2>/dev/null ||
  fail "pshardctl --json status does not name rank $SLOW: $(grep -o '"straggler".\{0,200\}' "$work/status.json")"

# 2. The coordinator logs it once (it stays slow).
wait_for 30 grep -q "slow rank: rank $SLOW " "$work/coord.log" ||
  fail "the coordinator did not log rank $SLOW as slow: $(tail -5 "$work/coord.log")"

# 3. /metrics: rank 2 computes longer per step than rank 0, rank 0 waits longer.
scrape "$(cat "$work/m$SLOW.port")" > "$work/metrics-slow.txt"
scrape "$(cat "$work/m0.port")" > "$work/metrics-0.txt"
for f in "$work/metrics-slow.txt" "$work/metrics-0.txt"; do
  for fam in pshard_step_seconds pshard_step_compute_seconds pshard_step_wait_seconds; do
    grep -q "^# TYPE $fam histogram" "$f" || fail "$f has no histogram $fam"
  done
done
slow_compute=$(metric "$work/metrics-slow.txt" pshard_step_compute_seconds_sum)
fast_compute=$(metric "$work/metrics-0.txt" pshard_step_compute_seconds_sum)
slow_wait=$(metric "$work/metrics-slow.txt" pshard_step_wait_seconds_sum)
fast_wait=$(metric "$work/metrics-0.txt" pshard_step_wait_seconds_sum)
steps=$(metric "$work/metrics-slow.txt" pshard_step_seconds_count)
echo "metrics: rank $SLOW compute ${slow_compute} s wait ${slow_wait} s; rank 0 compute" \
  "${fast_compute} s wait ${fast_wait} s (${steps} steps)"
awk -v a="${slow_compute:-0}" -v b="${fast_compute:-0}" 'BEGIN { exit !(a > b && a > 0) }' ||
  fail "rank $SLOW's compute sum ${slow_compute} is not above rank 0's ${fast_compute}"
awk -v a="${fast_wait:-0}" -v b="${slow_wait:-0}" 'BEGIN { exit !(a > b) }' ||
  fail "rank 0's wait sum ${fast_wait} is not above rank $SLOW's ${slow_wait}"

# 4. The coordinator's /metrics say the same.
scrape "$(cat "$work/mc.port")" > "$work/metrics-coord.txt"
grep -q "^pshard_coordinator_slowest_rank{job=\"default\"} $SLOW\$" "$work/metrics-coord.txt" ||
  fail "coordinator /metrics: $(grep slowest "$work/metrics-coord.txt")"
grep -q "^pshard_coordinator_step_compute_median_seconds{job=\"default\",rank=\"$SLOW\"} " \
  "$work/metrics-coord.txt" || fail "coordinator /metrics has no compute median of rank $SLOW"

n=$(grep -c "slow rank: rank $SLOW " "$work/coord.log" || true)
[ "$n" = 1 ] || fail "the coordinator logged rank $SLOW slow $n times, not once"

if [ "$fails" -ne 0 ]; then exit 1; fi
echo "PASS"
