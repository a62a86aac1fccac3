#!/usr/bin/env bash
# Runs pshard's tcp collectives side by side with OpenMPI over TCP and a raw loopback TCP
# stream, and prints the ratios: installs OpenMPI if it is missing, builds (Release) into
# build-bench/, runs pshard-tcp-ref, then for n = 2 and 4 pshard-coll-bench and pshard-mpi-ref
# (all_gather and reduce_scatter, fp32, 16M and 128M), then a summary table.
#
# Environment: BUILD_DIR (default <repo>/build-bench), ITERS (20), WARMUP (5), SIZES
# ("-b 16M -e 128M -f 8"), RANKS ("2 4"), OPS ("all_gather reduce_scatter"), OUT (a directory
# for the raw outputs; default a fresh temporary one, kept), SUMMARY_ONLY=1 (with OUT: only
# print the summary of an earlier run's outputs). Extra arguments go to pshard-coll-bench (e.g.
# --timeout-ms). The machine should be otherwise idle: the load is printed before and after.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-bench}"
ITERS="${ITERS:-20}"
WARMUP="${WARMUP:-5}"
SIZES="${SIZES:--b 16M -e 128M -f 8}"
RANKS="${RANKS:-2 4}"
OPS="${OPS:-all_gather reduce_scatter}"
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

# 4. pshard and OpenMPI, interleaved per n and op so drifting machine load hits both alike.
for n in $RANKS; do
    for op in $OPS; do
        log "n=$n $op: pshard"
        # shellcheck disable=SC2086
        "$BENCH" -n "$n" $SIZES -o "$op" -d fp32 -w "$WARMUP" -i "$ITERS" "$@" |
            tee "$OUT/pshard_${op}_n${n}.txt"
        log "n=$n $op: OpenMPI"
        # shellcheck disable=SC2086
        mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl tcp,self \
            --mca btl_tcp_if_include lo -np "$n" "$MPIREF" $SIZES -o "$op" -d fp32 \
            -w "$WARMUP" -i "$ITERS" | tee "$OUT/mpi_${op}_n${n}.txt"
    done
done

echo "# load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
fi

# 5. Summary. Rows: n, op, size; pshard/OpenMPI compares algbw at n=2 and busbw at n=4 (for a
# given n the two ratios are the same number); pshard/TCP compares pshard's busbw, the rate
# each rank's link carries, with one loopback stream's best rate.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
tcp1=$(awk '$3 == "best" {print $5}' "$OUT/tcp_ref_1.txt")
tcp2=$(awk '$3 == "best" {print $4}' "$OUT/tcp_ref_2.txt")
echo
echo "# Summary (GB/s = 1e9 B/s). Loopback TCP: 1 stream $tcp1 GB/s; 2 concurrent streams" \
     "$tcp2 GB/s each."
printf '%-3s %-15s %10s %11s %11s %11s %11s %10s %11s\n' "n" "op" "size(B)" "pshard-alg" \
    "pshard-bus" "ompi-alg" "ompi-bus" "ps/ompi" "ps-bus/tcp"
for n in $RANKS; do
    for op in $OPS; do
        join <(awk '!/^#/ && NF >= 7 {print $1, $6, $7}' "$OUT/pshard_${op}_n${n}.txt" | sort) \
             <(awk '!/^#/ && NF >= 7 {print $1, $6, $7}' "$OUT/mpi_${op}_n${n}.txt" | sort) |
            sort -n | while read -r size palg pbus malg mbus; do
                if [ "$n" -ge 4 ]; then
                    vs_mpi="$(ratio "$pbus" "$mbus") bus"
                else
                    vs_mpi="$(ratio "$palg" "$malg") alg"
                fi
                printf '%-3s %-15s %10s %11s %11s %11s %11s %10s %11s\n' "$n" "$op" "$size" \
                    "$palg" "$pbus" "$malg" "$mbus" "$vs_mpi" "$(ratio "$pbus" "$tcp1")"
            done
    done
done
echo "# targets: n=2 pshard/OpenMPI algbw >= 1.0; n=4 pshard/OpenMPI busbw >= 1.2"
