#!/usr/bin/env bash
# Several jobs on one coordinator (issue #13): pshardrun --coordinator gives every run a job of
# its own (torchrun's --rdzv-id), so 10 2-rank jobs in a row and 2 at once all train, each
# forming ranks 0 and 1 from scratch; the store is per job (a key set in one job is not seen by
# another), StoreDelete works, and a finished job ends with its keys after --job-linger-ms.
# Before jobs existed, 5 of 8 consecutive jobs failed with "trainer rank 0 attached to the
# shard server of rank 1": the second job's servers took the first job's vacant ranks in
# registration order.
# usage: test_shared_coordinator.sh COORDINATOR PSHARDRUN PSHARD-MLP PSHARDCTL
set -euo pipefail
coord_bin="$1"
run="$2"
mlp="$3"
ctl="$4"
export OPENBLAS_NUM_THREADS=1
unset PSHARD_JOB PSHARD_COORDINATOR MASTER_ADDR MASTER_PORT RANK WORLD_SIZE || true
work=$(mktemp -d)
pids=()
failed=0
# shellcheck source=harness.sh
. "$(dirname "$0")/harness.sh"
cleanup() {
  stop_started
  if [ "$failed" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work"; fi
}
trap cleanup EXIT
fail() { failed=1; echo "FAIL: $*" >&2; exit 1; }

LINGER_MS=3000
"$coord_bin" --listen 127.0.0.1:0 --port-file "$work/coord.port" --world-size 2 \
  --lease-ms 3000 --heartbeat-ms 500 --job-linger-ms "$LINGER_MS" > "$work/coord.log" 2>&1 &
cpid=$!
pids+=("$cpid")
wait_for 20 test -s "$work/coord.port" || fail "the coordinator wrote no port"
caddr="127.0.0.1:$(cat "$work/coord.port")"
wait_for 20 "$ctl" --coordinator "$caddr" health pshard.Coordinator > /dev/null ||
  fail "the coordinator never became healthy"

train() { # train NAME [pshardrun options...]: one 2-rank job on the shared coordinator
  local name="$1"; shift
  "$run" --nproc 2 --coordinator "$caddr" "$@" -- "$mlp" --steps 4 --widths 16,16 --input 8 \
    --output 4 --batch 4 --print-every 1 > "$work/$name.out" 2> "$work/$name.err"
}

ok=0
for i in $(seq 1 10); do
  if train "seq$i"; then
    ok=$((ok + 1))
  else
    echo "job $i of 10 failed:" >&2
    tail -n 20 "$work/seq$i.err" >&2
  fi
done
echo "consecutive 2-rank jobs on one coordinator: $ok of 10 succeeded"
[ "$ok" -eq 10 ] || fail "only $ok of 10 consecutive jobs succeeded"

# Two at once; one with an id of its own choosing, as torchrun's --rdzv-id.
train par1 --rdzv-id concurrent-a &
p1=$!
train par2 &
p2=$!
pids+=("$p1" "$p2")
r1=0; r2=0
wait "$p1" || r1=$?
wait "$p2" || r2=$?
echo "concurrent 2-rank jobs on one coordinator: exit codes $r1 and $r2"
[ "$r1" -eq 0 ] && [ "$r2" -eq 0 ] || {
  tail -n 20 "$work/par1.err" "$work/par2.err" >&2; fail "concurrent jobs failed"; }
grep -q '] step 4 loss' "$work/par1.out" && grep -q '] step 4 loss' "$work/par2.out" ||
  fail "a concurrent job did not print its last step"

# The store is per job; delete_key works; a bad job id is refused with a message.
"$ctl" --coordinator "$caddr" --job alpha store set shared-key from-alpha > /dev/null
"$ctl" --coordinator "$caddr" --job beta store set shared-key from-beta > /dev/null
[ "$("$ctl" --coordinator "$caddr" --job alpha store get shared-key)" = from-alpha ] ||
  fail "job alpha does not read its own key"
[ "$("$ctl" --coordinator "$caddr" store get shared-key 2>/dev/null || true)" = "" ] ||
  fail "the default job sees another job's key"
[ "$("$ctl" --coordinator "$caddr" --job beta store delete shared-key)" = deleted ] ||
  fail "store delete did not delete"
[ "$("$ctl" --coordinator "$caddr" --job beta store delete shared-key)" = "not set" ] ||
  fail "a second delete found the key"
[ "$("$ctl" --coordinator "$caddr" --job alpha store get shared-key)" = from-alpha ] ||
  fail "deleting in job beta touched job alpha"
if "$ctl" --coordinator "$caddr" --job 'bad job!' status > "$work/bad.out" 2>&1; then
  fail "a malformed job id was accepted"
fi
grep -q "job id" "$work/bad.out" || fail "the refusal does not say what was wrong: $(cat "$work/bad.out")"

# Status lists the jobs; finished ones end (with their keys) once unused for the linger.
"$ctl" --coordinator "$caddr" --json status > "$work/status.json"
python3 - "$work/status.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
names = [j["job"] for j in d["jobs"]]
assert d["job"] == "default" and names[0] == "default", names
assert "alpha" in names and "concurrent-a" in names, names
EOF
jobs_left() {
  "$ctl" --coordinator "$caddr" --json status |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin)["jobs"]))'
}
only_default() { [ "$(jobs_left)" = 1 ]; }
wait_for $(( LINGER_MS / 1000 + 10 )) only_default || fail "finished jobs did not end: $(jobs_left) left"
[ "$("$ctl" --coordinator "$caddr" --job alpha store get shared-key 2>/dev/null || true)" = "" ] ||
  fail "an ended job's key survived"
echo "jobs ended after ${LINGER_MS} ms unused; their keys went with them"
kill -0 "$cpid" || fail "the coordinator died"
echo PASS
