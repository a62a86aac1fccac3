#!/usr/bin/env bash
# Integration test of pshardrun, the process supervisor: it starts the real coordinator and
# shard servers, runs small shell trainers, and checks output forwarding, the trainers'
# environment, first-failure handling (exactly one "first failure:" line naming who failed
# first), signal forwarding, flag errors, and that no process it started (servers,
# coordinator, trainers and their children) is left behind.
# Usage: test_pshardrun.sh PATH/TO/pshardrun PATH/TO/pshard-coordinator PATH/TO/pshard-server
# The trainers' shell snippets expand $RANK and friends in the trainers, not here.
# shellcheck disable=SC2016
set -euo pipefail

run="$1"
coord_bin="$2"
server_bin="$3"

work=$(mktemp -d "${TMPDIR:-/tmp}/test_pshardrun.XXXXXX")
# pshardrun keeps its port files under TMPDIR; a private one shows whether it cleans up.
export TMPDIR="$work/tmp"
mkdir -p "$TMPDIR"
unset PSHARD_COORDINATOR PSHARD_NPROC PSHARD_LOG PSHARD_TOKEN_FILE MASTER_ADDR MASTER_PORT \
    RANK WORLD_SIZE LOCAL_RANK || true

bg_pid=""
cleanup() {
    # Only what this script started: the pshardrun under test, killed by PID.
    if [ -n "$bg_pid" ] && kill -0 "$bg_pid" 2>/dev/null; then
        kill -KILL "$bg_pid" 2>/dev/null || true
        wait "$bg_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    for f in "$work"/*.out "$work"/*.err; do
        [ -f "$f" ] || continue
        echo "---- $f" >&2
        tail -n 40 "$f" >&2
    done
    exit 1
}

# Starts pshardrun in the background with output in $work/NAME.{out,err}; sets bg_pid.
start_bg() {
    local name="$1"
    shift
    "$run" "$@" >"$work/$name.out" 2>"$work/$name.err" &
    bg_pid=$!
}

# Waits at most $1 seconds for bg_pid to exit; sets rc to its exit status. Kills it and fails
# the test if it does not exit in time.
wait_bg() {
    local limit="$1" waited=0
    while kill -0 "$bg_pid" 2>/dev/null; do
        # A zombie has exited; wait collects it below.
        if [ "$(sed 's/.*) //' "/proc/$bg_pid/stat" 2>/dev/null | cut -d' ' -f1)" = Z ]; then
            break
        fi
        if [ "$waited" -ge $((limit * 10)) ]; then
            kill -KILL "$bg_pid" 2>/dev/null || true
            wait "$bg_pid" 2>/dev/null || true
            bg_pid=""
            fail "pshardrun did not exit within ${limit}s"
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    rc=0
    wait "$bg_pid" || rc=$?
    bg_pid=""
}

# Waits at most $2 seconds until file $1 holds $3 lines matching regex $4.
wait_lines() {
    local file="$1" limit="$2" want="$3" regex="$4" waited=0 n
    while :; do
        # grep prints nothing while the file does not exist yet: that counts as 0.
        n=$(grep -cE "$regex" "$file" 2>/dev/null || true)
        [ "${n:-0}" -lt "$want" ] || break
        [ "$waited" -lt $((limit * 10)) ] || fail "no $want lines matching '$regex' in $file"
        sleep 0.1
        waited=$((waited + 1))
    done
}

# True when PID $1 is a live (not zombie) process.
alive() {
    [ -e "/proc/$1" ] || return 1
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# Checks that nothing pshardrun $1 started is still running: every PID its "started ... (pid N)"
# log lines name, every "sleeper N" a trainer printed, and every server named pshardrun-$1-R.
check_nothing_left() {
    local pshardrun_pid="$1" name="$2" pids p left=""
    pids=$(grep -hoE 'started [a-z]+( [0-9]+)? \(pid [0-9]+\)|sleeper [0-9]+' \
        "$work/$name.out" "$work/$name.err" | grep -oE '[0-9]+\)?$' | tr -d ')' || true)
    [ -n "$pids" ] || fail "$name: no child PIDs found in the output"
    # Give the kernel a moment to finish tearing down SIGKILLed processes.
    for _ in $(seq 1 30); do
        left=""
        for p in $pids; do
            if alive "$p"; then left="$left $p"; fi
        done
        [ -n "$left" ] || break
        sleep 0.1
    done
    [ -z "$left" ] || fail "$name: processes left behind:$left ($(ps -o pid=,args= -p "${left# }" 2>/dev/null | tr '\n' ';'))"
    if pgrep -f "pshardrun-$pshardrun_pid-" >/dev/null 2>&1; then
        fail "$name: a pshard-server named pshardrun-$pshardrun_pid-* is still running"
    fi
    if [ -n "$(ls -A "$TMPDIR")" ]; then
        fail "$name: pshardrun left files in TMPDIR: $(ls -A "$TMPDIR")"
    fi
}

# ---- (1) three trainers, binaries found beside pshardrun (build tree layout), exit 0.
start_bg ok --nproc 3 --log info -- sh -c '
    echo hello from $RANK of $WORLD_SIZE
    test -n "$PSHARD_SERVER"
    echo "env $RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $PSHARD_COORDINATOR $PSHARD_SERVER"
    echo "to stderr $RANK" >&2
    printf "no newline $RANK"'
ok_pid=$bg_pid
wait_bg 60
[ "$rc" -eq 0 ] || fail "(1) pshardrun exited $rc, want 0"
for r in 0 1 2; do
    grep -qx "\[trainer $r\] hello from $r of 3" "$work/ok.out" ||
        fail "(1) no '[trainer $r] hello from $r of 3' line on stdout"
    grep -qx "\[trainer $r\] to stderr $r" "$work/ok.err" ||
        fail "(1) trainer $r's stderr was not forwarded to stderr with its prefix"
    grep -qx "\[trainer $r\] no newline $r" "$work/ok.out" ||
        fail "(1) trainer $r's partial last line was not flushed"
    grep -qE "^\[server $r\] listening on 127\.0\.0\.1:[0-9]+$" "$work/ok.out" ||
        fail "(1) server $r's output was not forwarded"
    # RANK, LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR:MASTER_PORT is a loopback port for
    # torch's TCPStore (env://), the same for every rank and not the gRPC PSHARD_COORDINATOR;
    # and PSHARD_SERVER is the port server r printed.
    line=$(grep -E "^\[trainer $r\] env " "$work/ok.out") || fail "(1) no env line for rank $r"
    read -r _ _ _ e_rank e_local e_lws e_master e_coord e_server <<<"$line"
    [ "$e_rank $e_local $e_lws" = "$r $r 3" ] || fail "(1) rank $r env: $line"
    [[ "$e_master" =~ ^127\.0\.0\.1:[0-9]+$ ]] ||
        fail "(1) MASTER_ADDR:MASTER_PORT $e_master is not a loopback HOST:PORT"
    [ "$e_master" != "$e_coord" ] ||
        fail "(1) MASTER_ADDR:MASTER_PORT $e_master is the gRPC coordinator $e_coord"
    [ "$r" -eq 0 ] && first_master=$e_master
    [ "$e_master" = "$first_master" ] ||
        fail "(1) rank $r has MASTER_ADDR:MASTER_PORT $e_master, rank 0 $first_master"
    server_port=$(grep -E "^\[server $r\] listening on " "$work/ok.out" | sed 's/.*://')
    [ "$e_server" = "127.0.0.1:$server_port" ] ||
        fail "(1) trainer $r has PSHARD_SERVER=$e_server, server $r is on port $server_port"
done
grep -qE "^\[coordinator\] listening on 127\.0\.0\.1:[0-9]+$" "$work/ok.out" ||
    fail "(1) the coordinator's output was not forwarded"
check_nothing_left "$ok_pid" ok
echo "PASS (1) three trainers ran with their environment and pshardrun exited 0"

# ---- (2) trainer 1 exits 3 while the others sleep: pshardrun stops everything quickly.
start_bg fail --nproc 3 --log info --coordinator-bin "$coord_bin" --server-bin "$server_bin" \
    -- sh -c 'sleep 30 & echo "sleeper $!"; if [ "$RANK" = 1 ]; then exit 3; fi; wait'
fail_pid=$bg_pid
t0=$(date +%s)
wait_bg 25
elapsed=$(($(date +%s) - t0))
[ "$rc" -ne 0 ] || fail "(2) pshardrun exited 0 although trainer 1 exited 3"
[ "$rc" -eq 3 ] || fail "(2) pshardrun exited $rc, want the failing trainer's status 3"
[ "$elapsed" -lt 20 ] || fail "(2) pshardrun took ${elapsed}s to stop"
# Exactly one first-failure line, naming trainer 1 with the PID pshardrun started it as.
trainer1=$(grep -oE 'started trainer 1 \(pid [0-9]+\)' "$work/fail.err" | grep -oE '[0-9]+\)$' | tr -d ')')
[ -n "$trainer1" ] || fail "(2) no PID logged for trainer 1"
grep -qE "^pshardrun: first failure: trainer 1 \(pid $trainer1\) exited with status 3$" \
    "$work/fail.err" || fail "(2) no first-failure line naming trainer 1 (pid $trainer1)"
[ "$(grep -c 'first failure:' "$work/fail.err")" -eq 1 ] ||
    fail "(2) not exactly one first-failure line"
check_nothing_left "$fail_pid" fail
echo "PASS (2) trainer 1's exit 3 stopped the run in ${elapsed}s with exit 3 and nothing left"

# ---- (3) SIGTERM to pshardrun while the trainers sleep: forwarded, everything stops.
start_bg term --nproc 2 --log info --coordinator-bin "$coord_bin" --server-bin "$server_bin" \
    -- sh -c 'sleep 30 & echo "sleeper $!"; wait'
term_pid=$bg_pid
wait_lines "$work/term.out" 30 2 '^\[trainer [01]\] sleeper [0-9]+$'
kill -TERM "$term_pid"
t0=$(date +%s)
wait_bg 25
elapsed=$(($(date +%s) - t0))
[ "$rc" -eq 143 ] || fail "(3) pshardrun exited $rc after SIGTERM, want 143"
grep -q "^pshardrun: got SIGTERM" "$work/term.err" || fail "(3) no message about SIGTERM"
if grep -q 'first failure:' "$work/term.err"; then
    fail "(3) a SIGTERM to pshardrun was reported as a process failure"
fi
check_nothing_left "$term_pid" term
echo "PASS (3) SIGTERM stopped everything in ${elapsed}s with exit 143"

# ---- (4) a shard server that dies during the run stops it with exit 1.
start_bg died --nproc 2 --log info --coordinator-bin "$coord_bin" --server-bin "$server_bin" \
    -- sh -c 'sleep 30 & echo "sleeper $!"; wait'
died_pid=$bg_pid
wait_lines "$work/died.out" 30 2 '^\[trainer [01]\] sleeper [0-9]+$'
victim=$(grep -oE 'started server 1 \(pid [0-9]+\)' "$work/died.err" | grep -oE '[0-9]+\)$' | tr -d ')')
[ -n "$victim" ] || fail "(4) no PID logged for server 1"
kill -KILL "$victim"
wait_bg 25
[ "$rc" -eq 1 ] || fail "(4) pshardrun exited $rc after server 1 died, want 1"
grep -qE "^pshardrun: first failure: shard server 1 \(pid $victim\) killed by signal 9$" \
    "$work/died.err" || fail "(4) no first-failure line naming shard server 1"
[ "$(grep -c 'first failure:' "$work/died.err")" -eq 1 ] ||
    fail "(4) not exactly one first-failure line"
check_nothing_left "$died_pid" died
echo "PASS (4) a dead server stopped the run with exit 1"

# ---- (4b) a trainer killed by a signal while the others sleep: one line names it; SIGTERM
# to pshardrun is not a failure and prints no such line (checked in (3)).
start_bg sig --nproc 2 --log info --coordinator-bin "$coord_bin" --server-bin "$server_bin" \
    -- sh -c 'sleep 30 & echo "sleeper $!"; if [ "$RANK" = 0 ]; then kill -KILL $$; fi; wait'
sig_pid=$bg_pid
wait_bg 25
[ "$rc" -eq 137 ] || fail "(4b) pshardrun exited $rc after trainer 0 was killed, want 137"
grep -qE "^pshardrun: first failure: trainer 0 \(pid [0-9]+\) killed by signal 9$" \
    "$work/sig.err" || fail "(4b) no first-failure line naming trainer 0"
[ "$(grep -c 'first failure:' "$work/sig.err")" -eq 1 ] ||
    fail "(4b) not exactly one first-failure line"
check_nothing_left "$sig_pid" sig
echo "PASS (4b) a trainer killed by SIGKILL is named as the first failure"

# ---- (4c) --max-restarts 2 with a trainer that always fails: two restarts, each a fresh start
# with the attempt in PSHARD_RESTART_COUNT, then pshardrun gives up with the trainer's status.
start_bg restarts --nproc 2 --log info --max-restarts 2 --replace-timeout-ms 0 -- sh -c \
    'echo "attempt $PSHARD_RESTART_COUNT/$TORCHELASTIC_MAX_RESTARTS rank $RANK"; sleep 30 & echo "sleeper $!"; if [ "$RANK" = 0 ]; then exit 4; fi; wait'
restarts_pid=$bg_pid
wait_bg 60
[ "$rc" -eq 4 ] || fail "(4c) pshardrun exited $rc, want the failing trainer's status 4"
# Rank 0 prints before it exits; rank 1 may be stopped before it prints anything.
for a in 0 1 2; do
    [ "$(grep -c "attempt $a/2 rank 0" "$work/restarts.out")" -eq 1 ] ||
        fail "(4c) attempt $a did not run trainer 0 once"
done
for r in 0 1; do
    [ "$(grep -cE "started trainer $r \(pid [0-9]+\)" "$work/restarts.err")" -eq 3 ] ||
        fail "(4c) trainer $r was not started once per attempt"
done
grep -q "attempt 3/" "$work/restarts.out" && fail "(4c) a third restart happened"
[ "$(grep -c '^pshardrun: restart [12] of 2: ' "$work/restarts.err")" -eq 2 ] ||
    fail "(4c) not exactly two restart lines"
[ "$(grep -c 'first failure:' "$work/restarts.err")" -eq 3 ] ||
    fail "(4c) not one first-failure line per attempt"
check_nothing_left "$restarts_pid" restarts
echo "PASS (4c) --max-restarts 2 restarted twice, then exited 4 with nothing left"

# ---- (5) usage errors exit 2 without starting anything; --help and --version exit 0.
expect_rc() {
    local want="$1"
    shift
    local got=0
    timeout 20 "$run" "$@" >"$work/usage.out" 2>"$work/usage.err" || got=$?
    [ "$got" -eq "$want" ] || fail "(5) pshardrun $* exited $got, want $want"
}
expect_rc 2 --bogus -- true
expect_rc 2 --nproc 0 -- true
expect_rc 2 --nproc three -- true
expect_rc 2 --backend carrier-pigeon -- true
expect_rc 2 --offload disk -- true
expect_rc 2 --log loud -- true
expect_rc 2 --coordinator no-port -- true
expect_rc 2 --server-bin "$work/no-such-server" -- true
expect_rc 2 --nproc 2
grep -q "no trainer command" "$work/usage.err" || fail "(5) missing command not explained"
expect_rc 2 --nproc 2 --
# A bare command is torchrun's training script, run with Python (test_pshardrun_flags.sh):
# one that no Python can run is refused before anything starts.
PYTHON_EXEC="$work/no-such-python" expect_rc 2 --nproc 2 train.py
grep -q "PYTHON_EXEC" "$work/usage.err" || fail "(5) a missing Python is not named"
# Multi-node flags (test_multinode.sh runs two nodes): what cannot work is refused up front.
expect_rc 2 --nnodes 2 -- true
grep -q -- "--rdzv-endpoint" "$work/usage.err" || fail "(5) --nnodes without an endpoint"
expect_rc 2 --nnodes 2 --node-rank 2 --rdzv-endpoint 127.0.0.1:1 -- true
grep -q "not below --nnodes" "$work/usage.err" || fail "(5) --node-rank past --nnodes"
expect_rc 2 --nnodes 2 --node-rank 1 --rdzv-endpoint 127.0.0.1:0 -- true
grep -q "is not HOST:PORT" "$work/usage.err" || fail "(5) port 0 on node rank 1"
expect_rc 2 --nnodes 2 --rdzv-endpoint 127.0.0.1:1 --coordinator 127.0.0.1:2 -- true
expect_rc 2 --nproc 2 --nproc-per-node 3 -- true
expect_rc 2 --nnodes 2 --coordinator 127.0.0.1:1 -- true
grep -q -- "--rdzv-id" "$work/usage.err" || fail "(5) --nnodes with --coordinator and no job id"
expect_rc 2 --nnodes 2 --rdzv-endpoint 127.0.0.1:1 --max-restarts 1 --replace-timeout-ms 0 -- true
PSHARD_NPROC=zero expect_rc 2 -- true
grep -q "PSHARD_NPROC" "$work/usage.err" || fail "(5) bad PSHARD_NPROC not named"
expect_rc 0 --help
grep -q -- "--nproc" "$work/usage.out" || fail "(5) --help does not list --nproc"
expect_rc 0 --version
grep -q "^pshardrun " "$work/usage.out" || fail "(5) --version prints no version"
[ -z "$(ls -A "$TMPDIR")" ] || fail "(5) usage errors left files in TMPDIR"

# A pshardrun with no pshard-server beside it or on PATH names what is missing.
mkdir -p "$work/lonely"
cp "$run" "$work/lonely/pshardrun"
if ! PATH=/usr/bin:/bin command -v pshard-server >/dev/null 2>&1; then
    got=0
    PATH=/usr/bin:/bin timeout 20 "$work/lonely/pshardrun" -- true \
        >"$work/usage.out" 2>"$work/usage.err" || got=$?
    [ "$got" -eq 1 ] || fail "(5) pshardrun without pshard-server exited $got, want 1"
    grep -q "cannot find pshard-server" "$work/usage.err" ||
        fail "(5) the missing pshard-server is not named"
fi
echo "PASS (5) usage errors exit 2, --help/--version exit 0, a missing binary is named"

echo "PASS test_pshardrun"
