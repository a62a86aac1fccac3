#!/usr/bin/env bash
# pshardrun --max-restarts replaces a lost shard server alone, with its trainer, when the
# model's servers say they can heal (the store key pshard/heal/capable): only pshardrun's part
# (the line, a new server of the same --name, a new trainer with the restart count, nobody
# else restarted), not the heal itself, which is the servers'. Also: with the key but
# --replace-timeout-ms 0, a lost server still restarts everything. The trainers are shell
# scripts that never attach to a server; rank 1 sets the key with pshardctl.
# Usage: test_heal_run.sh PATH/TO/pshardrun PATH/TO/pshardctl
set -euo pipefail

run="$1"
ctl="$2"

work=$(mktemp -d "${TMPDIR:-/tmp}/test_heal_run.XXXXXX")
export TMPDIR="$work/tmp"
mkdir -p "$TMPDIR"
unset PSHARD_COORDINATOR PSHARD_NPROC PSHARD_LOG PSHARD_TOKEN_FILE PSHARD_MAX_RESTARTS \
    PSHARD_REPLACE_TIMEOUT_MS PSHARD_JOB MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK || true

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

# Every trainer records its start in $CASE.started.RANK.RESTARTS (PID, restart count, its
# PSHARD_SERVER); rank 1's first one then sets the key in the job's store (pshardctl reads
# PSHARD_COORDINATOR and PSHARD_JOB as pshardrun set them) and says so in $CASE.keyset. Then
# each waits for $CASE.go and exits 0.
cat >"$work/trainer.sh" <<'EOF'
#!/bin/sh
dir=$HEAL_DIR
echo "$$ $PSHARD_RESTART_COUNT $PSHARD_SERVER" >"$dir/$HEAL_CASE.started.$RANK.$PSHARD_RESTART_COUNT"
echo "rank $RANK restart $PSHARD_RESTART_COUNT pid $$"
if [ "$RANK" = 1 ] && [ "$PSHARD_RESTART_COUNT" = 0 ]; then
    "$HEAL_CTL" store set pshard/heal/capable 1 || exit 8
    touch "$dir/$HEAL_CASE.keyset"
fi
end=$(($(date +%s) + 120))
while [ ! -e "$dir/$HEAL_CASE.go" ]; do
    if [ "$(date +%s)" -gt "$end" ]; then
        echo "rank $RANK: no $HEAL_CASE.go within 120 s"
        exit 9
    fi
    sleep 0.05
done
exit 0
EOF

# start_case NAME PSHARDRUN-OPTIONS...: a 3-rank job in the background, output in
# $work/NAME.{out,err}; sets bg_pid.
start_case() {
    local name="$1"
    shift
    HEAL_DIR="$work" HEAL_CASE="$name" HEAL_CTL="$ctl" \
        "$run" --nproc 3 --log info "$@" -- sh "$work/trainer.sh" \
        >"$work/$name.out" 2>"$work/$name.err" &
    bg_pid=$!
}

alive() { # alive PID: a live (not zombie) process
    [ -e "/proc/$1" ] || return 1
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}
ended() { ! alive "$1"; }

wait_case() { # wait_case SECONDS: waits for bg_pid to end; sets rc
    wait_for "$1" ended "$bg_pid" || fail "pshardrun did not exit within $1 s"
    rc=0
    wait "$bg_pid" || rc=$?
    bg_pid=""
}

count() { # count FILE REGEX: how many lines of FILE match REGEX
    local n
    n=$(grep -cE -- "$2" "$1" 2>/dev/null || true)
    echo "${n:-0}"
}

pids_of() { # pids_of NAME ROLE RANK: the PIDs pshardrun logged as started, in order
    grep -oE "started $2 $3 \(pid [0-9]+\)" "$work/$1.err" | grep -oE '[0-9]+\)$' | tr -d ')' ||
        true
}

arg_of() { # arg_of PID ARG: the value after ARG on PID's command line
    tr '\0' '\n' <"/proc/$1/cmdline" | grep -A1 -xF -- "$2" | tail -n1
}

check_nothing_left() { # every PID pshardrun NAME logged as started has ended
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

# ---- (1) the key set, shard server 1 killed: it and trainer 1 are replaced (restart 1 of 2);
# the new server has the old one's --name; everything else keeps its process.
start_case heal --max-restarts 2 --replace-timeout-ms 30000
wait_for 90 all_started heal 0 0 1 2 || fail "(1) the trainers did not start"
wait_for 30 test -e "$work/heal.keyset" || fail "(1) rank 1 did not set the key"
victim=$(pids_of heal server 1)
name=$(arg_of "$victim" --name)
old_trainer=$(pids_of heal trainer 1)
kill -KILL "$victim"
wait_for 90 all_started heal 1 1 || fail "(1) no new trainer for rank 1"
grep -qxF "pshardrun: shard server of rank 1 killed by signal 9; replacing it and its trainer (restart 1 of 2): a replica heals its state, the other ranks keep running" \
    "$work/heal.err" || fail "(1) no line saying shard server 1 is replaced"
s1=$(pids_of heal server 1)
[ "$(echo "$s1" | wc -w)" -eq 2 ] || fail "(1) server 1 was started $(echo "$s1" | wc -w) times, want 2"
new_server=$(echo "$s1" | tail -n1)
alive "$new_server" || fail "(1) the new server 1 (pid $new_server) is not running"
[ "$(arg_of "$new_server" --name)" = "$name" ] || fail "(1) the new server 1 is not named $name"
port=$(cut -d' ' -f3 "$work/heal.started.1.1")
[ "$port" = "127.0.0.1:$(cat "$(arg_of "$new_server" --port-file)")" ] ||
    fail "(1) the new trainer 1 got PSHARD_SERVER $port, not the new server's port"
wait_for 20 ended "$old_trainer" || fail "(1) the old trainer 1 (pid $old_trainer) still runs"
for r in 0 2; do
    for role in server trainer; do
        p=$(pids_of heal "$role" "$r")
        [ "$(echo "$p" | wc -w)" -eq 1 ] || fail "(1) $role $r was started more than once"
        alive "$p" || fail "(1) $role $r (pid $p) did not keep running"
    done
done
[ "$(count "$work/heal.err" 'started coordinator')" -eq 1 ] || fail "(1) coordinator restarted"
[ "$(count "$work/heal.err" '^pshardrun: restart ')" -eq 0 ] || fail "(1) a full restart"
[ "$(count "$work/heal.err" 'first failure:')" -eq 0 ] || fail "(1) a first-failure line"
[ "$(count "$work/heal.err" 'replacing it \(restart')" -eq 0 ] ||
    fail "(1) the stopped trainer 1 was taken for a failed one"
touch "$work/heal.go"
wait_case 90
[ "$rc" -eq 0 ] || fail "(1) pshardrun exited $rc, want 0"
check_nothing_left heal
echo "PASS (1) shard server 1 and trainer 1 were replaced alone (restart 1 of 2); exit 0"

# ---- (2) the key set but --replace-timeout-ms 0: a lost server restarts everything, as before.
start_case full --max-restarts 1 --replace-timeout-ms 0
wait_for 90 all_started full 0 0 1 2 || fail "(2) the trainers did not start"
wait_for 30 test -e "$work/full.keyset" || fail "(2) rank 1 did not set the key"
victim=$(pids_of full server 1)
kill -KILL "$victim"
wait_for 90 all_started full 1 0 1 2 || fail "(2) the trainers of restart 1 did not start"
touch "$work/full.go"
wait_case 90
[ "$rc" -eq 0 ] || fail "(2) pshardrun exited $rc, want 0"
grep -qE "^pshardrun: first failure: shard server 1 \(pid $victim\) killed by signal 9$" \
    "$work/full.err" || fail "(2) no failure line naming shard server 1"
grep -qE '^pshardrun: restart 1 of 1: starting the coordinator, shard servers and trainers again' \
    "$work/full.err" || fail "(2) no full restart"
[ "$(count "$work/full.err" 'replacing it')" -eq 0 ] || fail "(2) something was replaced alone"
check_nothing_left full
echo "PASS (2) with --replace-timeout-ms 0 a lost shard server restarted the whole job"

echo "PASS test_heal_run"
