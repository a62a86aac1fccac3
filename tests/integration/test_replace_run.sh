#!/usr/bin/env bash
# pshardrun --max-restarts replaces a lost trainer alone (issue 29 §1): a trainer that fails
# while the coordinator and the shard servers run gets a new process for its rank only, with
# PSHARD_RESTART_COUNT counting the restarts; the other trainers, the servers and the
# coordinator keep their processes. Also: without restarts left the failure stands naming the
# rank, --replace-timeout-ms 0 keeps the full restart, and a lost shard server still restarts
# everything. The trainers are shell scripts that never attach to a server.
# Usage: test_replace_run.sh PATH/TO/pshardrun
set -euo pipefail

run="$1"

work=$(mktemp -d "${TMPDIR:-/tmp}/test_replace_run.XXXXXX")
export TMPDIR="$work/tmp"
mkdir -p "$TMPDIR"
unset PSHARD_COORDINATOR PSHARD_NPROC PSHARD_LOG PSHARD_TOKEN_FILE PSHARD_MAX_RESTARTS \
    PSHARD_REPLACE_TIMEOUT_MS MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK || true

# shellcheck source=harness.sh
. "$(dirname "$0")/harness.sh"

bg_pid=""
failed=0
cleanup() {
    # Only what this script started: the pshardrun under test, by its PID (its children get
    # SIGTERM from the kernel when it dies).
    if [ -n "$bg_pid" ] && kill -0 "$bg_pid" 2>/dev/null; then
        kill -KILL "$bg_pid" 2>/dev/null || true
        wait "$bg_pid" 2>/dev/null || true
    fi
    if [ "$failed" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work" >&2; fi
}
trap cleanup EXIT

fail() {
    failed=1
    echo "FAIL: $*" >&2
    for f in "$work"/*.out "$work"/*.err; do
        [ -f "$f" ] || continue
        echo "---- $f" >&2
        tail -n 40 "$f" >&2
    done
    exit 1
}

# The trainer of every case. It records its start in $CASE.started.RANK.RESTARTS (its PID and
# both restart counts); then, by REPLACE_MODE, rank 1 exits 3 (once: on its first start only;
# always: every time), and every other trainer waits for the file $CASE.go and exits 0.
cat >"$work/trainer.sh" <<'EOF'
#!/bin/sh
dir=$REPLACE_DIR
echo "$$ $PSHARD_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT" \
    >"$dir/$REPLACE_CASE.started.$RANK.$PSHARD_RESTART_COUNT"
echo "rank $RANK restart $PSHARD_RESTART_COUNT pid $$"
fail=0
if [ "$RANK" = 1 ]; then
    case "$REPLACE_MODE" in
    once) [ "$PSHARD_RESTART_COUNT" = 0 ] && fail=1 ;;
    always) fail=1 ;;
    esac
fi
if [ "$fail" = 1 ]; then
    sleep 0.2
    echo "rank $RANK failing on purpose"
    exit 3
fi
end=$(($(date +%s) + 120))
while [ ! -e "$dir/$REPLACE_CASE.go" ]; do
    if [ "$(date +%s)" -gt "$end" ]; then
        echo "rank $RANK: no $REPLACE_CASE.go within 120 s"
        exit 9
    fi
    sleep 0.05
done
exit 0
EOF

# start_case NAME MODE PSHARDRUN-OPTIONS...: a 3-rank job in the background, output in
# $work/NAME.{out,err}; sets bg_pid.
start_case() {
    local name="$1" mode="$2"
    shift 2
    REPLACE_DIR="$work" REPLACE_CASE="$name" REPLACE_MODE="$mode" \
        "$run" --nproc 3 --log info "$@" -- sh "$work/trainer.sh" \
        >"$work/$name.out" 2>"$work/$name.err" &
    bg_pid=$!
}

# True when PID $1 is a live (not zombie) process.
alive() {
    [ -e "/proc/$1" ] || return 1
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}
ended() { ! alive "$1"; }

# wait_case SECONDS: waits for bg_pid to end, at most SECONDS; sets rc.
wait_case() {
    wait_for "$1" ended "$bg_pid" || fail "pshardrun did not exit within $1 s"
    rc=0
    wait "$bg_pid" || rc=$?
    bg_pid=""
}

# count FILE REGEX: how many lines of FILE match REGEX.
count() {
    local n
    n=$(grep -cE -- "$2" "$1" 2>/dev/null || true)
    echo "${n:-0}"
}

# pids_of NAME ROLE RANK: the PIDs pshardrun logged as "started ROLE RANK (pid N)", in order.
pids_of() {
    grep -oE "started $2 $3 \(pid [0-9]+\)" "$work/$1.err" | grep -oE '[0-9]+\)$' | tr -d ')' ||
        true
}

# started_pid NAME RANK RESTARTS: the PID that trainer recorded, or nothing.
started_pid() {
    local f="$work/$1.started.$2.$3"
    [ -f "$f" ] && cut -d' ' -f1 "$f"
}

# has_arg PID ARG VALUE: PID's command line holds ARG followed by VALUE.
has_arg() {
    local args
    args=$(tr '\0' '\n' <"/proc/$1/cmdline")
    grep -A1 -xF -- "$2" <<< "$args" | tail -n1 | grep -qxF -- "$3"
}

# check_nothing_left NAME: every PID pshardrun NAME logged as started has ended.
check_nothing_left() {
    local p
    for p in $(grep -oE 'started [a-z]+( [0-9]+)? \(pid [0-9]+\)' "$work/$1.err" |
        grep -oE '[0-9]+\)$' | tr -d ')'); do
        wait_for 20 ended "$p" || fail "$1: pid $p ($(tr '\0' ' ' <"/proc/$p/cmdline")) left running"
    done
}

all_started() { # all_started NAME RESTARTS RANK...: each RANK's trainer of that count started
    local name="$1" restarts="$2" r
    shift 2
    for r in "$@"; do [ -f "$work/$name.started.$r.$restarts" ] || return 1; done
}

# ---- (1) --max-restarts 0: trainer 1's exit 3 stops the job naming rank 1, as before.
start_case norestart once --max-restarts 0
wait_case 90
[ "$rc" -eq 3 ] || fail "(1) pshardrun exited $rc, want trainer 1's status 3"
t1=$(pids_of norestart trainer 1)
[ "$(echo "$t1" | wc -w)" -eq 1 ] || fail "(1) trainer 1 was started $(echo "$t1" | wc -w) times"
grep -qE "^pshardrun: first failure: trainer 1 \(pid $t1\) exited with status 3$" \
    "$work/norestart.err" || fail "(1) no first-failure line naming trainer 1 (pid $t1)"
[ "$(count "$work/norestart.err" 'replacing it')" -eq 0 ] || fail "(1) a trainer was replaced"
check_nothing_left norestart
echo "PASS (1) --max-restarts 0: trainer 1's failure ended the job with exit 3, naming it"

# ---- (2) --replace-timeout-ms 0: no replacement; the whole job restarts as before, and the
# servers get no --trainer-replace-ms.
start_case full once --max-restarts 1 --replace-timeout-ms 0
wait_for 90 all_started full 1 0 1 2 || fail "(2) the trainers of restart 1 did not all start"
grep -qE '^pshardrun: restart 1 of 1: starting the coordinator, shard servers and trainers again' \
    "$work/full.err" || fail "(2) no full restart line"
for r in 0 1 2; do
    p=$(pids_of full server "$r" | tail -n1)
    if [ -z "$p" ] || ! alive "$p"; then fail "(2) server $r of restart 1 is not running"; fi
    if grep -qxF -- --trainer-replace-ms <<< "$(tr '\0' '\n' <"/proc/$p/cmdline")"; then
        fail "(2) server $r got --trainer-replace-ms with --replace-timeout-ms 0"
    fi
done
touch "$work/full.go"
wait_case 90
[ "$rc" -eq 0 ] || fail "(2) pshardrun exited $rc, want 0"
for r in 0 1 2; do
    [ "$(count "$work/full.err" "started server $r \(pid")" -eq 2 ] ||
        fail "(2) server $r was not started once per attempt"
    [ "$(count "$work/full.err" "started trainer $r \(pid")" -eq 2 ] ||
        fail "(2) trainer $r was not started once per attempt"
done
[ "$(count "$work/full.err" 'replacing it')" -eq 0 ] || fail "(2) a trainer was replaced"
check_nothing_left full
echo "PASS (2) --replace-timeout-ms 0: a failed trainer restarted the whole job"


# ---- (3) trainer 1 exits 3 once: only rank 1 gets a new trainer (with PSHARD_RESTART_COUNT=1);
# ranks 0 and 2, the servers and the coordinator keep their processes; the job succeeds.
start_case replace once --max-restarts 3 --replace-timeout-ms 30000
wait_for 90 all_started replace 0 0 2 || fail "(3) trainers 0 and 2 did not start"
wait_for 90 all_started replace 1 1 || fail "(3) no replacement trainer for rank 1"
grep -qxF "pshardrun: trainer 1 exited with status 3; replacing it (restart 1 of 3); the other ranks and the shard servers keep running" \
    "$work/replace.err" || fail "(3) no line saying trainer 1 is replaced"
# While the replacement runs: the first processes of everything else still do.
for r in 0 1 2; do
    p=$(pids_of replace server "$r")
    [ "$(echo "$p" | wc -w)" -eq 1 ] || fail "(3) server $r was started $(echo "$p" | wc -w) times"
    alive "$p" || fail "(3) server $r (pid $p) is not running after the replacement"
    has_arg "$p" --trainer-replace-ms 30000 ||
        fail "(3) server $r did not get --trainer-replace-ms 30000"
done
coord=$(grep -oE 'started coordinator \(pid [0-9]+\)' "$work/replace.err" | grep -oE '[0-9]+')
alive "$coord" || fail "(3) the coordinator (pid $coord) is not running after the replacement"
for r in 0 2; do
    p=$(pids_of replace trainer "$r")
    [ "$p" = "$(started_pid replace "$r" 0)" ] || fail "(3) trainer $r: pid $p, recorded otherwise"
    alive "$p" || fail "(3) trainer $r (pid $p) did not keep running"
done
touch "$work/replace.go"
wait_case 90
[ "$rc" -eq 0 ] || fail "(3) pshardrun exited $rc, want 0"
t1=$(pids_of replace trainer 1)
[ "$(echo "$t1" | wc -w)" -eq 2 ] || fail "(3) trainer 1 was started $(echo "$t1" | wc -w) times, want 2"
if [ "$(echo "$t1" | head -n1)" != "$(started_pid replace 1 0)" ] ||
    [ "$(echo "$t1" | tail -n1)" != "$(started_pid replace 1 1)" ]; then
    fail "(3) trainer 1's PIDs $(echo "$t1" | tr '\n' ' ')are not the ones its two starts recorded"
fi
[ "$(cut -d' ' -f2- "$work/replace.started.1.1")" = "1 1" ] ||
    fail "(3) the replacement's PSHARD_RESTART_COUNT TORCHELASTIC_RESTART_COUNT are not 1 1"
for r in 0 2; do
    [ "$(count "$work/replace.err" "started trainer $r \(pid")" -eq 1 ] ||
        fail "(3) trainer $r was started more than once"
done
[ "$(count "$work/replace.err" 'started coordinator')" -eq 1 ] || fail "(3) coordinator restarted"
[ "$(count "$work/replace.err" '^pshardrun: restart ')" -eq 0 ] || fail "(3) a full restart"
[ "$(count "$work/replace.err" 'first failure:')" -eq 0 ] || fail "(3) a first-failure line"
grep -qxF "[trainer 1] rank 1 failing on purpose" "$work/replace.out" ||
    fail "(3) the failed trainer's output was not forwarded"
check_nothing_left replace
echo "PASS (3) trainer 1 was replaced alone (restart 1 of 3); nothing else restarted; exit 0"

# ---- (4) trainer 1 fails every time, --max-restarts 2: two replacements, then the failure
# stands, naming rank 1, with its status.
start_case always always --max-restarts 2
wait_case 90
[ "$rc" -eq 3 ] || fail "(4) pshardrun exited $rc, want trainer 1's status 3"
for k in 1 2; do
    grep -qxF "pshardrun: trainer 1 exited with status 3; replacing it (restart $k of 2); the other ranks and the shard servers keep running" \
        "$work/always.err" || fail "(4) no line for replacement $k"
    [ "$(cut -d' ' -f2- "$work/always.started.1.$k")" = "$k $k" ] ||
        fail "(4) replacement $k did not see restart count $k"
done
[ "$(count "$work/always.err" 'replacing it')" -eq 2 ] || fail "(4) not exactly two replacements"
t1=$(pids_of always trainer 1)
[ "$(echo "$t1" | wc -w)" -eq 3 ] || fail "(4) trainer 1 was started $(echo "$t1" | wc -w) times, want 3"
last=$(echo "$t1" | tail -n1)
grep -qxE "pshardrun: first failure: trainer 1 \(pid $last\) exited with status 3" \
    "$work/always.err" || fail "(4) no failure line naming trainer 1 (pid $last)"
[ "$(count "$work/always.err" 'first failure:')" -eq 1 ] || fail "(4) not one failure line"
for r in 0 2; do
    [ "$(count "$work/always.err" "started trainer $r \(pid")" -eq 1 ] ||
        fail "(4) trainer $r was started more than once"
done
for r in 0 1 2; do
    [ "$(count "$work/always.err" "started server $r \(pid")" -eq 1 ] ||
        fail "(4) server $r was started more than once"
done
[ "$(count "$work/always.err" '^pshardrun: restart ')" -eq 0 ] || fail "(4) a full restart"
check_nothing_left always
echo "PASS (4) two replacements, then exit 3 naming trainer 1"

# ---- (5) a shard server killed while replacement is on: the whole job restarts, as before.
start_case server none --max-restarts 2
wait_for 90 all_started server 0 0 1 2 || fail "(5) the trainers did not start"
victim=$(pids_of server server 1)
kill -KILL "$victim"
wait_for 90 all_started server 1 0 1 2 || fail "(5) the trainers of restart 1 did not start"
touch "$work/server.go"
wait_case 90
[ "$rc" -eq 0 ] || fail "(5) pshardrun exited $rc, want 0"
grep -qE "^pshardrun: first failure: shard server 1 \(pid $victim\) killed by signal 9$" \
    "$work/server.err" || fail "(5) no failure line naming shard server 1"
grep -qE '^pshardrun: restart 1 of 2: starting the coordinator, shard servers and trainers again' \
    "$work/server.err" || fail "(5) no full restart"
[ "$(count "$work/server.err" 'replacing it')" -eq 0 ] || fail "(5) a trainer was replaced"
for r in 0 1 2; do
    [ "$(count "$work/server.err" "started trainer $r \(pid")" -eq 2 ] ||
        fail "(5) trainer $r was not started once per attempt"
done
check_nothing_left server
echo "PASS (5) a lost shard server restarted the whole job"

echo "PASS test_replace_run"
