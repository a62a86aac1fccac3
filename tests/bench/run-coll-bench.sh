#!/usr/bin/env bash
# Runs pshard's collectives side by side with OpenMPI, each over both of its same-host paths:
# pshard through the sockets (PSHARD_TRANSPORT=tcp) and by reading the other ranks' memory
# (PSHARD_TRANSPORT=shm), OpenMPI over TCP (--mca btl tcp,self) and over shared memory (--mca
# btl vader,self, single copy by CMA), plus a raw loopback TCP stream; then prints the ratios.
# Installs OpenMPI if it is missing, builds (Release) into build-bench/, runs pshard-tcp-ref,
# then for each n in RANKS and op in OPS the four configurations interleaved, then an 8-byte
# all_reduce latency for each (blocking calls back to back, pshard-coll-bench -z 1 as MPI's),
# then a summary table.
#
# Environment: BUILD_DIR (default <repo>/build-bench), ITERS (20), WARMUP (5), SIZES (size
# ranges run one after another, ";"-separated: "-b 1M -e 1M;-b 16M -e 128M -f 8" is 1 MiB,
# 16 MiB and 128 MiB), RANKS ("2 4"), OPS ("all_gather
# reduce_scatter all_reduce"), LAT_ITERS (2000), OUT (a directory for the raw outputs; default a
# fresh temporary one, kept), SUMMARY_ONLY=1 (with OUT: only print the summary of an earlier
# run's outputs), BLOCKING (1: pshard's operations are timed as blocking calls, pshard-coll-bench
# -z 1, as OpenMPI's reference times its MPI_Allgather & co. and as the shard servers call
# them; 0: all of a size queued before the first wait, nccl-tests' default). Extra arguments go
# to pshard-coll-bench (e.g. --timeout-ms). The machine should be otherwise idle: the load is
# printed before and after.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-bench}"
ITERS="${ITERS:-20}"
WARMUP="${WARMUP:-5}"
SIZES="${SIZES:--b 1M -e 1M;-b 16M -e 128M -f 8}"
RANKS="${RANKS:-2 4}"
OPS="${OPS:-all_gather reduce_scatter all_reduce}"
LAT_ITERS="${LAT_ITERS:-2000}"
BLOCKING="${BLOCKING:-1}"
OUT="${OUT:-$(mktemp -d /tmp/pshard-coll-bench-run.XXXXXX)}"
mkdir -p "$OUT"

log() { printf '== %s\n' "$*" >&2; }

if [ "${SUMMARY_ONLY:-0}" != 1 ]; then
# 1. OpenMPI.
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    log "installing openmpi-bin libopenmpi-dev"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        openmpi-bin libopenmpi-dev >/dev/null
fi

# 2. Build.
log "building (Release) in $BUILD_DIR"
cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 ||
    { cat "$OUT/cmake.log" >&2; exit 1; }
cmake --build "$BUILD_DIR" -j "$(nproc)" --target pshard-coordinator pshard-coll-bench \
    pshard-tcp-ref pshard-mpi-ref >"$OUT/build.log" 2>&1 ||
    { tail -40 "$OUT/build.log" >&2; exit 1; }
BENCH="$BUILD_DIR/tests/bench/pshard-coll-bench"
MPIREF="$BUILD_DIR/tests/bench/pshard-mpi-ref"
TCPREF="$BUILD_DIR/tests/bench/pshard-tcp-ref"
for b in "$BENCH" "$MPIREF" "$TCPREF"; do
    [ -x "$b" ] || { echo "missing $b (see $OUT/build.log)" >&2; exit 1; }
done

echo "# $(date -u +%FT%TZ) $(uname -srm), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# raw outputs in $OUT"

# 3. Loopback TCP limit: one stream, then two at once (what an n=2 ring runs).
log "loopback TCP reference"
"$TCPREF" --total 1G --pairs 1 | tee "$OUT/tcp_ref_1.txt"
"$TCPREF" --total 1G --pairs 2 --repeat 1 | tee "$OUT/tcp_ref_2.txt"

# 4. pshard and OpenMPI, each over both paths, interleaved per n and op so drifting machine load
# hits all alike.
ompi() { # BTL N ARGS...: OpenMPI's reference on this host
    local btl=$1 n=$2
    shift 2
    mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl "$btl" \
        --mca btl_tcp_if_include lo -np "$n" "$MPIREF" "$@"
}
IFS=';' read -r -a ranges <<<"$SIZES"
for n in $RANKS; do
    for op in $OPS; do
        for tr in tcp shm; do
            log "n=$n $op: pshard $tr"
            : >"$OUT/pshard-${tr}_${op}_n${n}.txt"
            for range in "${ranges[@]}"; do
                # shellcheck disable=SC2086
                PSHARD_TRANSPORT=$tr "$BENCH" -n "$n" $range -o "$op" -d fp32 -w "$WARMUP" \
                    -i "$ITERS" -z "$BLOCKING" "$@" | tee -a "$OUT/pshard-${tr}_${op}_n${n}.txt"
            done
        done
        for btl in tcp shm; do
            log "n=$n $op: OpenMPI $btl"
            : >"$OUT/mpi-${btl}_${op}_n${n}.txt"
            for range in "${ranges[@]}"; do
                # shellcheck disable=SC2086
                ompi "$([ "$btl" = tcp ] && echo tcp,self || echo vader,self)" "$n" $range \
                    -o "$op" -d fp32 -w "$WARMUP" -i "$ITERS" | tee -a "$OUT/mpi-${btl}_${op}_n${n}.txt"
            done
        done
    done
    log "n=$n: 8-byte all_reduce latency"
    for tr in tcp shm; do
        # -z 1: each call waited for before the next, as OpenMPI's reference times its calls
        PSHARD_TRANSPORT=$tr "$BENCH" -n "$n" -b 8 -e 8 -o all_reduce -d fp32 -w 100 \
            -i "$LAT_ITERS" -c 0 -z 1 "$@" | tee "$OUT/lat_pshard-${tr}_n${n}.txt"
    done
    ompi tcp,self "$n" -b 8 -e 8 -o all_reduce -d fp32 -w 100 -i "$LAT_ITERS" |
        tee "$OUT/lat_mpi-tcp_n${n}.txt"
    ompi vader,self "$n" -b 8 -e 8 -o all_reduce -d fp32 -w 100 -i "$LAT_ITERS" |
        tee "$OUT/lat_mpi-shm_n${n}.txt"
done

echo "# load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
fi

# 5. Summary. busbw (nccl-tests' bus bandwidth: what each rank's link carries) compared per path:
# pshard shm with OpenMPI's shared memory, pshard tcp with OpenMPI's TCP, and pshard's tcp busbw
# with one loopback stream's best rate.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
rows() { awk '!/^#/ && NF >= 7 {print $1, $7}' "$1" | sort; } # size busbw
tcp1=$(awk '$3 == "best" {print $5}' "$OUT/tcp_ref_1.txt")
tcp2=$(awk '$3 == "best" {print $4}' "$OUT/tcp_ref_2.txt")
echo
echo "# Summary (busbw in GB/s = 1e9 B/s). Loopback TCP: 1 stream $tcp1 GB/s; 2 concurrent" \
     "streams $tcp2 GB/s each."
printf '%-3s %-15s %10s %9s %9s %8s %9s %9s %8s %9s\n' "n" "op" "size(B)" "ps-shm" "ompi-shm" \
    "ps/ompi" "ps-tcp" "ompi-tcp" "ps/ompi" "tcp/lo"
for n in $RANKS; do
    for op in $OPS; do
        join <(rows "$OUT/pshard-shm_${op}_n${n}.txt") <(rows "$OUT/mpi-shm_${op}_n${n}.txt") |
            join - <(rows "$OUT/pshard-tcp_${op}_n${n}.txt") |
            join - <(rows "$OUT/mpi-tcp_${op}_n${n}.txt") |
            sort -n | while read -r size pshm mshm ptcp mtcp; do
                printf '%-3s %-15s %10s %9s %9s %8s %9s %9s %8s %9s\n' "$n" "$op" "$size" \
                    "$pshm" "$mshm" "$(ratio "$pshm" "$mshm")" "$ptcp" "$mtcp" \
                    "$(ratio "$ptcp" "$mtcp")" "$(ratio "$ptcp" "$tcp1")"
            done
    done
done
echo
echo "# 8-byte all_reduce latency (us per operation, back to back)"
printf '%-3s %9s %9s %8s %9s %9s %8s\n' "n" "ps-shm" "ompi-shm" "ps/ompi" "ps-tcp" "ompi-tcp" \
    "ps/ompi"
lat() { awk '!/^#/ && NF >= 7 {print $5; exit}' "$1"; }
for n in $RANKS; do
    ps=$(lat "$OUT/lat_pshard-shm_n${n}.txt") ms=$(lat "$OUT/lat_mpi-shm_n${n}.txt")
    pt=$(lat "$OUT/lat_pshard-tcp_n${n}.txt") mt=$(lat "$OUT/lat_mpi-tcp_n${n}.txt")
    printf '%-3s %9s %9s %8s %9s %9s %8s\n' "$n" "$ps" "$ms" "$(ratio "$ps" "$ms")" "$pt" "$mt" \
        "$(ratio "$pt" "$mt")"
done
echo "# targets (issue #16): ps-shm/ompi-shm busbw >= 1.0 at 16 MiB and above; 8-byte latency" \
     "ps-shm <= ompi-shm; tcp unchanged or better"
