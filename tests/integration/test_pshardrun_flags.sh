#!/usr/bin/env bash
# pshardrun's flag table against torchrun's (issue 30 §3): every torchrun flag, in both of its
# spellings where torchrun has two, is fed to the real pshardrun (with the real coordinator and
# shard servers) and its effect is checked in what the trainers see or print: the process count
# (a number, gpu, cpu, auto), the rendezvous flags (endpoint, id, backend, conf, standalone,
# an elastic --nnodes MIN:MAX on one host), restarts, the monitor interval, -m, --no-python, a
# bare script under "the current Python", --log-dir with --redirects and --tee (per-rank maps
# too), --local-ranks-filter, --role, the torch.distributed.launch flags, PET_* variables, the
# flags pshardrun refuses with a reason, an unknown flag naming the nearest known one, and the
# grouped --help.
# With a Python that has torch (the optional 4th argument), every flag of that torchrun's own
# parser must be known to pshardrun, listed by its --help, and either exercised here or refused
# with a reason: none is left silently ignored.
# Usage: test_pshardrun_flags.sh PATH/TO/pshardrun PATH/TO/pshard-coordinator PATH/TO/pshard-server
#        [PATH/TO/python-with-torch]
# shellcheck disable=SC2016
set -euo pipefail

run="$1"
coord_bin="$2"
server_bin="$3"
torch_python="${4:-}"
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"

work=$(mktemp -d "${TMPDIR:-/tmp}/test_pshardrun_flags.XXXXXX")
export TMPDIR="$work/tmp"
mkdir -p "$TMPDIR"
unset PSHARD_COORDINATOR PSHARD_NPROC PSHARD_LOG PSHARD_TOKEN_FILE MASTER_ADDR MASTER_PORT \
    RANK WORLD_SIZE LOCAL_RANK PYTHON_EXEC CUDA_VISIBLE_DEVICES TORCH_ELASTIC_SHUTDOWN_TIMEOUT \
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE || true
for v in $(env | sed -n 's/^\(PET_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done

bg_pid=""
cleanup() {
    if [ -n "$bg_pid" ] && kill -0 "$bg_pid" 2>/dev/null; then
        kill -KILL "$bg_pid" 2>/dev/null || true
        wait "$bg_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    for f in "$work"/last.out "$work"/last.err; do
        [ -f "$f" ] || continue
        echo "---- $f" >&2
        tail -n 40 "$f" >&2
    done
    exit 1
}

# Runs pshardrun with the arguments (at most 60 s); its output in $work/last.{out,err}, its exit
# status in rc.
runp() {
    rc=0
    timeout 60 "$run" "$@" >"$work/last.out" 2>"$work/last.err" || rc=$?
}
# Like runp, and fails the test unless it exited with status $1.
want_rc() {
    local want="$1"
    shift
    runp "$@"
    [ "$rc" -eq "$want" ] || fail "pshardrun $* exited $rc, want $want"
}
has_out() { grep -qE -- "$1" <<<"$(cat "$work/last.out")"; }
has_err() { grep -qE -- "$1" <<<"$(cat "$work/last.err")"; }
count_out() { grep -cE -- "$1" <<<"$(cat "$work/last.out")" || true; }

# A trainer that is a program: prints what torchrun's environment told it.
cat >"$work/dump.sh" <<'EOF'
#!/bin/sh
echo "ENV rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lworld=$LOCAL_WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE role=$ROLE_NAME run=$TORCHELASTIC_RUN_ID restarts=$TORCHELASTIC_RESTART_COUNT args=$*"
echo "STDERR rank=$RANK" >&2
EOF
chmod +x "$work/dump.sh"
svc=(--coordinator-bin "$coord_bin" --server-bin "$server_bin")

# ---- (1) --nproc-per-node: a number, gpu, cpu, auto; both spellings; PET_NPROC_PER_NODE.
for spelling in "--nproc-per-node 2" "--nproc_per_node=2" "--nproc-per-node=2" "--nproc_per_node 2"; do
    # shellcheck disable=SC2086
    want_rc 0 "${svc[@]}" $spelling --no-python "$work/dump.sh"
    [ "$(count_out 'ENV rank=[01] local=[01] world=2 lworld=2')" -eq 2 ] ||
        fail "(1) $spelling did not start 2 trainers of world 2"
done
CUDA_VISIBLE_DEVICES=0,1,2 want_rc 0 "${svc[@]}" --nproc-per-node gpu --no-python "$work/dump.sh"
[ "$(count_out 'world=3 lworld=3')" -eq 3 ] || fail "(1) gpu with 3 visible devices is not 3"
CUDA_VISIBLE_DEVICES=1 want_rc 0 "${svc[@]}" --nproc-per-node auto --no-python "$work/dump.sh"
[ "$(count_out 'world=1 lworld=1')" -eq 1 ] || fail "(1) auto with 1 visible GPU is not 1"
CUDA_VISIBLE_DEVICES='' want_rc 2 "${svc[@]}" --nproc-per-node gpu --no-python "$work/dump.sh"
has_err "no GPU" || fail "(1) gpu without GPUs is not explained"
cpus=$(getconf _NPROCESSORS_ONLN)
if [ "$cpus" -le 8 ]; then
    want_rc 0 "${svc[@]}" --nproc-per-node cpu --no-python "$work/dump.sh"
    [ "$(count_out "world=$cpus lworld=$cpus")" -eq "$cpus" ] || fail "(1) cpu is not $cpus"
    CUDA_VISIBLE_DEVICES='' want_rc 0 "${svc[@]}" --nproc_per_node=auto --no-python "$work/dump.sh"
    [ "$(count_out "world=$cpus")" -eq "$cpus" ] || fail "(1) auto without GPUs is not $cpus CPUs"
fi
want_rc 2 --nproc-per-node xpu -- true
has_err "not a number from 1 to [0-9]+, gpu, cpu or auto" || fail "(1) xpu not refused clearly"
PET_NPROC_PER_NODE=2 want_rc 0 "${svc[@]}" --no-python "$work/dump.sh"
[ "$(count_out 'world=2')" -eq 2 ] || fail "(1) PET_NPROC_PER_NODE=2 not taken"
echo "PASS (1) --nproc-per-node N|gpu|cpu|auto, both spellings, PET_NPROC_PER_NODE"

# ---- (2) rendezvous: --rdzv-endpoint, --rdzv-id, --rdzv-backend, --rdzv-conf, --standalone.
want_rc 0 "${svc[@]}" --rdzv_endpoint 127.0.0.1:0 --rdzv_id flags-1 --rdzv_backend pshard \
    --no-python "$work/dump.sh"
has_err "coordinator for 1 nodes on 127\.0\.0\.1:[1-9]" || fail "(2) --rdzv_endpoint not listened on"
has_out "run=flags-1 " || fail "(2) --rdzv_id is not TORCHELASTIC_RUN_ID"
want_rc 0 "${svc[@]}" --rdzv-endpoint=127.0.0.1:0 --rdzv-id=flags-2 --rdzv-backend static \
    --rdzv-conf join_timeout=30,last_call_timeout=1 --no-python "$work/dump.sh"
has_out "run=flags-2 " || fail "(2) --rdzv-id is not TORCHELASTIC_RUN_ID"
for backend in c10d etcd etcd-v2; do
    want_rc 2 --rdzv-backend "$backend" -- true
    has_err "give --rdzv-backend pshard" || fail "(2) --rdzv-backend $backend not refused clearly"
done
want_rc 2 --rdzv_conf timeout=5 -- true
has_err "join_timeout, last_call_timeout, is_host" || fail "(2) an unknown rdzv-conf key"
want_rc 2 --rdzv-conf join_timeout=soon -- true
want_rc 0 "${svc[@]}" --standalone --rdzv-id ignored --rdzv-backend c10d --nproc-per-node 2 \
    --no-python "$work/dump.sh"
has_err "standalone: ignoring --rdzv-backend c10d --rdzv-id ignored" ||
    fail "(2) --standalone does not say what it ignores"
[ "$(count_out 'world=2 .* run=none ')" -eq 2 ] || fail "(2) --standalone did not run on its own"
want_rc 2 --standalone --nnodes 2 -- true
echo "PASS (2) --rdzv-endpoint/-id/-backend/-conf and --standalone, both spellings"

# ---- (3) --nnodes: N, MIN:MAX on one host (elastic: the job forms with the nodes that came),
# --node-rank, and --max-restarts across nodes (a failed trainer replaced alone).
want_rc 0 "${svc[@]}" --nnodes 1:1 --node_rank 0 --no-python "$work/dump.sh"
want_rc 0 "${svc[@]}" --nnodes=1 --node-rank=0 --no-python "$work/dump.sh"
want_rc 0 "${svc[@]}" --nnodes 1:2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:0 \
    --rdzv-conf last_call_timeout=0.5 --no-python "$work/dump.sh"
has_err "node 0 joined the job as ranks 0\.\.1 of 2" || fail "(3) 1:2 with one node did not form"
[ "$(count_out 'world=2 lworld=2 group=0/1')" -eq 2 ] || fail "(3) 1:2 with one node: world not 2"
# Two nodes on this host: node 0 hosts the coordinator on a free port, node 1 joins through it.
"$run" "${svc[@]}" --nnodes 1:2 --nproc-per-node 1 --node-rank 0 --rdzv-endpoint 127.0.0.1:0 \
    --rdzv-id elastic --rdzv-conf last_call_timeout=30 --local-addr 127.0.0.1 --no-python \
    "$work/dump.sh" >"$work/node0.out" 2>"$work/node0.err" &
bg_pid=$!
endpoint=""
for _ in $(seq 1 300); do
    endpoint=$(sed -n 's/.*coordinator for 1:2 nodes on \(127\.0\.0\.1:[0-9]*\).*/\1/p' \
        "$work/node0.err" 2>/dev/null || true)
    [ -n "$endpoint" ] && break
    kill -0 "$bg_pid" 2>/dev/null || break
    sleep 0.1
done
[ -n "$endpoint" ] || { cp "$work/node0.err" "$work/last.err"; fail "(3) node 0 printed no endpoint"; }
# Node 1's trainer fails once and is replaced alone (--max-restarts across nodes).
printf '#!/bin/sh\nif [ ! -e "%s/flaky1.once" ]; then : >"%s/flaky1.once"; exit 5; fi\nexec "%s/dump.sh"\n' \
    "$work" "$work" "$work" >"$work/flaky1.sh"
chmod +x "$work/flaky1.sh"
want_rc 0 "${svc[@]}" --nnodes 1:2 --nproc-per-node 1 --node-rank 1 --rdzv-endpoint "$endpoint" \
    --rdzv-id elastic --local-addr 127.0.0.1 --max-restarts 1 --no-python "$work/flaky1.sh"
has_out "rank=1 local=0 world=2 lworld=1 group=1/2 .* restarts=1 " ||
    fail "(3) node 1 is not rank 1 of 2, or its trainer was not replaced"
has_err "trainer 1 exited with status 5; replacing it" || fail "(3) no replacement on node 1"
node0_rc=0
wait "$bg_pid" || node0_rc=$?
bg_pid=""
[ "$node0_rc" -eq 0 ] || { cp "$work/node0.err" "$work/last.err"; fail "(3) node 0 exited $node0_rc"; }
grep -q "rank=0 local=0 world=2 lworld=1 group=0/2" "$work/node0.out" ||
    fail "(3) node 0 is not rank 0 of 2"
want_rc 2 --nnodes 2:1 --rdzv-endpoint 127.0.0.1:0 -- true
has_err "MIN:MAX" || fail "(3) --nnodes 2:1 not refused"
want_rc 2 --nnodes 2 --rdzv-endpoint 127.0.0.1:1 --max-restarts 1 --replace-timeout-ms 0 -- true
has_err "not coordinated across nodes" || fail "(3) a full restart across nodes not refused"
echo "PASS (3) --nnodes N and MIN:MAX (one node, and two joining), --node-rank, a replacement"

# ---- (4) --max-restarts, --monitor-interval.
cat >"$work/flaky.sh" <<EOF
#!/bin/sh
if [ ! -e "$work/flaky.once" ]; then : >"$work/flaky.once"; exit 3; fi
exec "$work/dump.sh"
EOF
chmod +x "$work/flaky.sh"
want_rc 0 "${svc[@]}" --max_restarts=1 --monitor_interval 0.05 --no-python "$work/flaky.sh"
has_out "restarts=1" || fail "(4) --max_restarts: the replacement did not see restart 1"
rm -f "$work/flaky.once"
want_rc 3 "${svc[@]}" --max-restarts 0 --monitor-interval=1 --no-python "$work/flaky.sh"
for bad in 0 -1 abc 1e9 nan; do
    want_rc 2 --monitor-interval "$bad" -- true
done
echo "PASS (4) --max-restarts and --monitor-interval, both spellings"

# ---- (5) -m MODULE, --no-python, a bare script with "the current Python".
mkdir -p "$work/pymod"
cat >"$work/pymod/dumpmod.py" <<'EOF'
import os, sys
print("PY exe=%s rank=%s argv=%s" % (sys.executable, os.environ["RANK"], " ".join(sys.argv[1:])))
EOF
cp "$work/pymod/dumpmod.py" "$work/train.py"
if command -v python3 >/dev/null 2>&1; then
    PYTHONPATH="$work/pymod" want_rc 0 "${svc[@]}" -m dumpmod --lr 1
    has_out "PY exe=.* rank=0 argv=--lr 1" || fail "(5) -m did not run the module with its arguments"
    PYTHONPATH="$work/pymod" want_rc 0 "${svc[@]}" --module -- dumpmod x
    has_out "PY .* argv=x" || fail "(5) --module -- MODULE did not run the module"
    want_rc 0 "${svc[@]}" --nproc_per_node 2 "$work/train.py" --epochs 2
    [ "$(count_out 'PY exe=.* argv=--epochs 2')" -eq 2 ] || fail "(5) a bare train.py did not run"
    # "The current Python": the python3 beside pshardrun's own executable comes first.
    mkdir -p "$work/venv/bin"
    cp "$run" "$work/venv/bin/pshardrun"
    real_py=$(command -v python3)
    printf '#!/bin/sh\necho "BESIDE $*"\nexec %s "$@"\n' "$real_py" >"$work/venv/bin/python3"
    chmod +x "$work/venv/bin/python3"
    rc=0
    timeout 60 "$work/venv/bin/pshardrun" "${svc[@]}" "$work/train.py" \
        >"$work/last.out" 2>"$work/last.err" || rc=$?
    [ "$rc" -eq 0 ] || fail "(5) pshardrun in a venv's bin/ exited $rc"
    has_out "BESIDE -u $work/train.py" || fail "(5) the python3 beside pshardrun was not used"
    PYTHON_EXEC="$real_py" want_rc 0 "${svc[@]}" "$work/train.py"
    has_out "PY exe=" || fail "(5) PYTHON_EXEC was not used"
fi
want_rc 0 "${svc[@]}" --no_python "$work/dump.sh" a b
has_out "args=a b" || fail "(5) --no_python did not run the program with its arguments"
want_rc 2 -m --no-python mod
has_err "not both" || fail "(5) -m with --no-python not refused"
want_rc 2 --run-path "$work/train.py"
has_err "run-path" || fail "(5) --run-path not refused clearly"
echo "PASS (5) -m/--module, --no-python/--no_python, a bare script with the current Python"

# ---- (6) --log-dir, --redirects, --tee (0-3 and per-rank maps), --local-ranks-filter.
want_rc 0 "${svc[@]}" --nproc-per-node 2 --log-dir "$work/logs" -r 3 --no-python "$work/dump.sh"
[ "$(count_out 'ENV')" -eq 0 ] || fail "(6) -r 3 still printed stdout on the console"
! has_err "STDERR" || fail "(6) -r 3 still printed stderr on the console"
rundir=$(sed -n 's/.*trainers. log files in \(.*\)$/\1/p' "$work/last.err")
case "$rundir" in "$work/logs/none_"*) ;; *) fail "(6) the run's log directory is '$rundir'" ;; esac
for r in 0 1; do
    grep -q "^ENV rank=$r " "$rundir/attempt_0/$r/stdout.log" || fail "(6) rank $r stdout.log"
    grep -q "^STDERR rank=$r" "$rundir/attempt_0/$r/stderr.log" || fail "(6) rank $r stderr.log"
done
want_rc 0 "${svc[@]}" --nproc-per-node 2 --rdzv-id logs --log_dir "$work/logs" \
    --redirects 0:1,1:2 --no-python "$work/dump.sh"
rundir=$(sed -n 's/.*trainers. log files in \(.*\)$/\1/p' "$work/last.err")
case "$rundir" in "$work/logs/logs_"*) ;; *) fail "(6) the run id is not in '$rundir'" ;; esac
has_out "\[trainer 1\] ENV rank=1" || fail "(6) rank 1's stdout is not on the console"
! has_out "ENV rank=0" || fail "(6) rank 0's stdout is on the console"
has_err "\[trainer 0\] STDERR rank=0" || fail "(6) rank 0's stderr is not on the console"
[ -f "$rundir/attempt_0/0/stdout.log" ] && [ ! -e "$rundir/attempt_0/0/stderr.log" ] &&
    [ -f "$rundir/attempt_0/1/stderr.log" ] && [ ! -e "$rundir/attempt_0/1/stdout.log" ] ||
    fail "(6) --redirects 0:1,1:2 wrote the wrong files"
want_rc 0 "${svc[@]}" --nproc-per-node 2 --log-dir "$work/logs" -t1 --no-python "$work/dump.sh"
[ "$(count_out 'ENV')" -eq 2 ] || fail "(6) -t1 did not keep stdout on the console"
rundir=$(sed -n 's/.*trainers. log files in \(.*\)$/\1/p' "$work/last.err")
grep -q "^ENV rank=1 " "$rundir/attempt_0/1/stdout.log" || fail "(6) -t1 wrote no stdout.log"
want_rc 0 "${svc[@]}" --nproc-per-node 2 --tee=3 --no-python "$work/dump.sh"
has_err "trainers. log files in $TMPDIR/pshardrun_logs_" || fail "(6) --tee without --log-dir"
want_rc 0 "${svc[@]}" --nproc-per-node 2 --local-ranks-filter 1 --no-python "$work/dump.sh"
has_out "\[trainer 1\] ENV" && ! has_out "\[trainer 0\]" ||
    fail "(6) --local-ranks-filter 1 did not show rank 1 alone"
want_rc 0 "${svc[@]}" --nproc-per-node 2 --local_ranks_filter=0,1 --no-python "$work/dump.sh"
[ "$(count_out 'ENV')" -eq 2 ] || fail "(6) --local_ranks_filter=0,1 hid a rank"
want_rc 2 --nproc-per-node 2 --redirects 4 -- true
want_rc 2 --nproc-per-node 2 --tee 2:1 -- true
has_err "local rank 2 is not below" || fail "(6) --tee past the local ranks"
want_rc 2 --nproc-per-node 2 --local-ranks-filter 0,x -- true
want_rc 0 "${svc[@]}" --nproc-per-node 2 \
    --log-line-prefix-template '${role_name}${local_rank}@$rank $$ ' --no-python "$work/dump.sh"
has_out '^default1@1 \$ ENV rank=1 ' && has_err '^default0@0 \$ STDERR rank=0' ||
    fail "(6) --log-line-prefix-template is not the trainers' prefix"
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='<${rank}> ' want_rc 0 "${svc[@]}" --no-python "$work/dump.sh"
has_out '^<0> ENV rank=0 ' || fail "(6) TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE not taken"
want_rc 0 "${svc[@]}" --log_line_prefix_template= --no-python "$work/dump.sh"
has_out '^\[trainer 0\] ENV' || fail "(6) an empty template is not the usual prefix"
want_rc 2 --log-line-prefix-template '${node}' -- true
has_err 'node\}. is not one of' || fail "(6) an unknown template name not refused clearly"
# 30 ${rank}: short with rank 0, too long with the widest ranks.
want_rc 2 --log-line-prefix-template "$(printf '${rank}%.0s' $(seq 1 30))" -- true
has_err "more than 255 bytes" || fail "(6) a template too long not refused"
echo "PASS (6) --log-dir, -r/--redirects, -t/--tee (maps too), --local-ranks-filter, prefix template"

# ---- (7) --role; torch.distributed.launch's --master-addr/--master-port, --local-addr; the
# rest of torchrun's table.
want_rc 0 "${svc[@]}" --role worker --no-python "$work/dump.sh"
has_out "^\[worker 0\] ENV .*role=worker " || fail "(7) --role is not the prefix and ROLE_NAME"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null || echo 0)
if [ "$port" != 0 ]; then
    want_rc 0 "${svc[@]}" --master_addr 127.0.0.1 --master_port "$port" --local_addr 127.0.0.1 \
        --no-python "$work/dump.sh"
    has_err "coordinator for 1 nodes on 127\.0\.0\.1:$port" ||
        fail "(7) --master-addr/--master-port is not the endpoint"
fi
want_rc 0 "${svc[@]}" --start-method fork --start_method=forkserver --event_log_handler null \
    --signals_to_handle SIGTERM,SIGINT --no-python "$work/dump.sh"
want_rc 2 --rdzv-endpoint 127.0.0.1:1 --master-port 29501 -- true
has_err "give one of them" || fail "(7) --master-port beside --rdzv-endpoint not refused"
want_rc 2 --local-addr 'fe80::1 x' -- true
has_err "not a host name or address" || fail "(7) a bad --local-addr not refused"
want_rc 2 --start-method thread -- true
want_rc 2 --event-log-handler console -- true
want_rc 2 --logs_specs custom -- true
has_err "--log-dir" || fail "(7) --logs-specs not refused with what to use"
want_rc 2 --numa_binding node -- true
has_err "numactl" || fail "(7) --numa-binding not refused with what to use"
want_rc 2 --signals-to-handle SIGKILL -- true
# A signal of --signals-to-handle stops the run and is forwarded: 128 + SIGUSR1.
"$run" "${svc[@]}" --signals-to-handle SIGUSR1 -- sh -c 'echo up; exec sleep 60' \
    >"$work/sig.out" 2>"$work/sig.err" &
bg_pid=$!
for _ in $(seq 1 300); do
    grep -q "up" "$work/sig.out" 2>/dev/null && break
    sleep 0.1
done
kill -USR1 "$bg_pid"
sig_rc=0
wait "$bg_pid" || sig_rc=$?
bg_pid=""
[ "$sig_rc" -eq $((128 + 10)) ] || fail "(7) SIGUSR1 with --signals-to-handle gave $sig_rc"
grep -q "got SIGUSR1" "$work/sig.err" || fail "(7) SIGUSR1 not named"
# --shutdown-timeout: a trainer that ignores SIGTERM is killed that long after it.
# Rank 1 ignores SIGTERM (inherited by sleep); rank 0 fails once rank 1 says so (within 10 s).
cat >"$work/stubborn.sh" <<EOF
#!/bin/sh
if [ "\$LOCAL_RANK" = 1 ]; then trap "" TERM; : >"$work/stubborn.up"; exec sleep 50; fi
for _ in \$(seq 1 200); do [ -e "$work/stubborn.up" ] && exit 3; sleep 0.05; done
exit 4
EOF
chmod +x "$work/stubborn.sh"
want_rc 3 "${svc[@]}" --nproc-per-node 2 --shutdown_timeout 1 --no-python "$work/stubborn.sh"
has_err "trainer 1 \(pid [0-9]+\) still running 1000 ms after SIGTERM; sending SIGKILL" ||
    fail "(7) --shutdown-timeout 1 is not the grace before SIGKILL"
for bad in -1 abc 1e9; do
    want_rc 2 --shutdown-timeout "$bad" -- true
done
want_rc 2 --shutdown-timeout 2 --stop-grace-ms 100 -- true
has_err "differ: give one" || fail "(7) --shutdown-timeout against --stop-grace-ms"
want_rc 2 --duplicate-stdout-filters apple,orange -- true
has_err "grep the files" || fail "(7) --duplicate-stdout-filters not refused with what to do"
want_rc 2 --duplicate_stderr_filters apple -- true
has_err "duplicate-stderr-filters" || fail "(7) --duplicate-stderr-filters not refused"
want_rc 0 "${svc[@]}" --duplicate-stdout-filters '' --no-python "$work/dump.sh"
want_rc 2 --virtual-local-rank -- true
has_err "torch.cuda.set_device" || fail "(7) --virtual-local-rank not refused with what to do"
PET_VIRTUAL_LOCAL_RANK=1 want_rc 2 -- true
want_rc 2 --print-completion bash -- true
has_err "no shell completion" || fail "(7) --print-completion not refused clearly"
# pshard's own placement flag, in pshardrun and in the server it passes it to.
want_rc 2 --shard-memory disk -- true
has_err "not auto, host or gpu" || fail "(7) --shard-memory disk not refused clearly"
want_rc 2 --shard-memory gpu --offload cpu -- true
has_err "give one" || fail "(7) --shard-memory gpu with --offload cpu not refused"
src=0
"$server_bin" --coordinator 127.0.0.1:1 --listen 127.0.0.1:0 --name x --shard-memory disk \
    >"$work/last.out" 2>"$work/last.err" || src=$?
[ "$src" -ne 0 ] && has_err "must be auto, host or gpu, not 'disk'" ||
    fail "(7) pshard-server --shard-memory disk not refused clearly"
if [ ! -e /dev/nvidiactl ]; then
    # No GPU here: GPU shards on tcp are refused at start, naming the flag.
    src=0
    timeout 30 "$server_bin" --coordinator 127.0.0.1:1 --listen 127.0.0.1:0 --name x \
        --shard-memory gpu >"$work/last.out" 2>"$work/last.err" || src=$?
    [ "$src" -ne 0 ] && has_err "shard-memory gpu (needs a GPU|keeps shards)" ||
        fail "(7) pshard-server --shard-memory gpu without a GPU not refused naming the flag"
fi
echo "PASS (7) --role, --master-addr/--master-port, --local-addr, --start-method, --shutdown-timeout, the refused rest"

# ---- (8) an unknown flag names the nearest known one; --help is grouped as torchrun's.
want_rc 2 --nproc_per_nod 2 -- true
has_err "unknown flag --nproc_per_nod; did you mean --nproc-per-node\?" || fail "(8) near miss"
want_rc 2 --rdzv-endpiont 127.0.0.1:1 -- true
has_err "did you mean --rdzv-endpoint\?" || fail "(8) transposed letters"
want_rc 2 --max-restart 1 -- true
has_err "did you mean --max-restarts\?" || fail "(8) a missing letter"
want_rc 2 -nnodes 2 -- true
has_err "did you mean --nnodes\?" || fail "(8) one dash"
want_rc 2 -x -- true
has_err "unknown flag -x" || fail "(8) an unknown short flag"
want_rc 0 --help
prev=0
for group in "worker/node size:" "rendezvous:" "user-code launch:" \
    "backwards compatible with torch.distributed.launch"; do
    line=$(grep -n -- "^$group" "$work/last.out" | head -1 | cut -d: -f1)
    [ -n "$line" ] && [ "$line" -gt "$prev" ] || fail "(8) --help lacks group '$group' in order"
    prev=$line
done
for flag in nnodes nproc-per-node rdzv-backend rdzv-endpoint rdzv-id rdzv-conf standalone \
    max-restarts monitor-interval start-method event-log-handler role module no-python \
    run-path log-dir redirects tee local-ranks-filter node-rank master-addr master-port \
    local-addr logs-specs numa-binding signals-to-handle log-line-prefix-template \
    duplicate-stdout-filters duplicate-stderr-filters shutdown-timeout virtual-local-rank \
    print-completion; do
    has_out "^  (-[a-z], )?--$flag\b" || fail "(8) --help does not list --$flag"
    case "$flag" in *-*) has_out "--$flag, --${flag//-/_}\b" || fail "(8) --help lacks --${flag//-/_}" ;; esac
done
echo "PASS (8) unknown flags name the nearest one; --help has torchrun's groups and spellings"

# ---- (9) torchrun's own parser: each of its flags, in each spelling, is known to pshardrun
# (no "unknown flag") and in its --help; one it takes is exercised in this script, one it
# refuses is refused with a reason naming the flag.
if [ -n "$torch_python" ] && [ -x "$torch_python" ] &&
    "$torch_python" -c 'import torch.distributed.run' 2>/dev/null; then
    "$torch_python" - >"$work/torch_flags" <<'EOF'
import torch
from torch.distributed.run import get_args_parser
print("version", torch.__version__)
for a in get_args_parser()._actions:
    if a.option_strings and "--help" not in a.option_strings:
        value = "-" if a.nargs == 0 else (list(a.choices)[0] if a.choices else "1")
        print(value, " ".join(a.option_strings))
EOF
    want_rc 0 --help
    cp "$work/last.out" "$work/help.out"
    torch_version=$(sed -n 's/^version //p' "$work/torch_flags")
    taken=0 refused=0
    while read -r value spellings; do
        [ "$value" != version ] || continue
        for flag in $spellings; do
            args=("$flag")
            [ "$value" = - ] || args+=("$value")
            want_rc 0 "${args[@]}" --help
            grep -qE -- "(^|[ ,])$flag( |,|$)" "$work/help.out" ||
                fail "(9) torchrun $torch_version's $flag is not in pshardrun --help"
        done
        main=${spellings%% *}
        [ "${#main}" -gt 2 ] || main=$(awk '{print $2}' <<<"$spellings") # -m: --module
        name=${main#--}
        # The flag's --help entry: from its line to the next flag's.
        entry=$(awk -v f="--$name" '
            /^  -/ { on = 0; for (i = 1; i <= NF; i++) { w = $i; sub(/,$/, "", w); if (w == f) on = 1 } }
            on' "$work/help.out")
        [ -n "$entry" ] || fail "(9) no --help entry for $main"
        if grep -q "refused:" <<<"$entry"; then
            args=("$main")
            [ "$value" = - ] || args+=("$value")
            want_rc 2 "${args[@]}" -- true
            ! has_err "unknown flag" && has_err "$name" ||
                fail "(9) torchrun's $main is not refused with a reason naming it"
            refused=$((refused + 1))
        else
            # Taken: exercised by this script (sections 1-8), not only listed.
            grep -qE -- "(^|[ \"])(${spellings// /|})([ =\"]|$)" <(grep -v '^ *#' "$self") ||
                fail "(9) torchrun's $main is taken but this test never runs it"
            taken=$((taken + 1))
        fi
    done <"$work/torch_flags"
    echo "PASS (9) torchrun $torch_version's flags: $taken taken and exercised, $refused refused with a reason"
else
    echo "SKIP (9) no Python with torch given: pshardrun not compared with torchrun's own parser"
fi

[ -z "$(find "$TMPDIR" -maxdepth 1 -name 'pshardrun-*')" ] || fail "runs left files in TMPDIR"
echo "PASS test_pshardrun_flags"
