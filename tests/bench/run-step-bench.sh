#!/usr/bin/env bash
# The three shard-server benchmarks side by side, with one summary table of ratios and targets:
#   1. local gather bandwidth: pshard-gather-bench (16 MiB and 128 MiB fp32 parameters) on 1 and
#      2 ranks against memcpy in the same process (target: 1 rank >= 0.7x memcpy);
#   2. step time of the example MLP (4x1024 hidden, input 256, output 64, batch 32 per rank,
#      fp32, SGD momentum, MSE, one thread per rank): pshard-mlp --local and on 2 ranks, against
#      PyTorch local, DDP and FSDP2 (torch_mlp.py) (targets: pshard 2-rank step / torch FSDP2
#      step (DDP if FSDP2 cannot run) <= 1.0; pshard's distributed overhead <= torch's);
#   3. peak RSS (VmHWM) of each shard server on 2 ranks, 4x1024 and 8x4096 MLPs, SGD momentum and
#      Adam, each also with --optimizer-in-backward (tag _inbw: no gradient accumulator),
#      against ideal = fp32 params / N x (1 + optimizer states) + 64 MiB (target <= 1.1).
# Builds (Release) into build-bench/ and makes a virtual environment with PyPI's torch in it
# (the torch wheel without its CUDA dependencies plus the few CUDA libraries that /usr/local/cuda
# lacks, about 1 GiB; the full wheel set, several GiB, only if that does not import).
#
# Environment: BUILD_DIR (<repo>/build-bench), VENV (BUILD_DIR/torch-venv), TORCH=0 (skip the
# PyTorch runs), TORCH_VERSION (2.15.0), REPEAT (3: step-time runs per configuration, the
# median is reported), STEPS (200 timed steps per run), GATHER_ITERS (100), OUT (a directory for
# the raw outputs; default a fresh temporary one, kept), SUMMARY_ONLY=1 (with OUT: only print
# the summary of an earlier run). The machine should be otherwise idle: the load is printed.
set -euo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"

# Hidden mode, used as the trainer command under pshardrun for benchmark 3: runs the trainer,
# then rank 0 waits until every rank's trainer is done and prints the VmHWM of the shard servers
# its pshardrun started (its parent's children named pshard-server), which are still up.
if [ "${1:-}" = "--rss-trainer" ]; then
    shift
    rc=0
    "$@" || rc=$?
    : >"$RSS_DIR/done.${RANK:-0}"
    if [ "${RANK:-0}" = 0 ]; then
        for _ in $(seq 600); do
            [ "$(find "$RSS_DIR" -name 'done.*' | wc -l)" -ge "${WORLD_SIZE:-1}" ] && break
            sleep 0.1
        done
        launcher=$PPID
        for st in /proc/[0-9]*/status; do
            awk -v want="$launcher" '
                $1 == "Name:" { name = $2 } $1 == "PPid:" { ppid = $2 } $1 == "Pid:" { pid = $2 }
                $1 ~ /^(VmHWM|VmRSS|RssAnon|RssFile|RssShmem):$/ { v[substr($1, 1, length($1) - 1)] = $2 }
                END { if (name == "pshard-server" && ppid == want)
                        printf "rss-server pid %s VmHWM_kB %s VmRSS_kB %s RssAnon_kB %s RssFile_kB %s RssShmem_kB %s\n",
                               pid, v["VmHWM"], v["VmRSS"], v["RssAnon"], v["RssFile"], v["RssShmem"] }
            ' "$st" 2>/dev/null || true
        done
    fi
    exit "$rc"
fi

ROOT="$(cd "$(dirname "$SELF")/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-bench}"
VENV="${VENV:-$BUILD_DIR/torch-venv}"
TORCH="${TORCH:-1}"
TORCH_VERSION="${TORCH_VERSION:-2.15.0}"
REPEAT="${REPEAT:-3}"
STEPS="${STEPS:-200}"
GATHER_ITERS="${GATHER_ITERS:-100}"
OUT="${OUT:-$(mktemp -d /tmp/pshard-step-bench.XXXXXX)}"
mkdir -p "$OUT"
NCPU=$(getconf _NPROCESSORS_ONLN) # before OMP_NUM_THREADS=1, which nproc obeys
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

log() { printf '== %s\n' "$*" >&2; }

RUN="$BUILD_DIR/tools/pshardrun"
MLP="$BUILD_DIR/examples/pshard-mlp"
GATHER="$BUILD_DIR/tests/bench/pshard-gather-bench"
PY="$VENV/bin/python"
# The MLP of benchmark 2 and its optimizer, as pshard-mlp flags.
MLP_SHAPE=(--widths "1024,1024,1024,1024" --input 256 --output 64 --batch 32)
MLP_SGD=(--optimizer sgd --lr 0.01 --momentum 0.9)

# ---- 1. build -------------------------------------------------------------------------------
build() {
    log "building (Release) in $BUILD_DIR"
    # A cache that once failed the cblas_sgemm check (OpenBLAS installed later) keeps failing it:
    # configure again without that cached result.
    if ! cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1; then
        cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -U PSHARD_HAVE_CBLAS_SGEMM \
            >"$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log" >&2; exit 1; }
    fi
    cmake --build "$BUILD_DIR" -j "$NCPU" --target pshardrun pshard-coordinator pshard-server \
        pshard-mlp pshard-gather-bench >"$OUT/build.log" 2>&1 ||
        { tail -40 "$OUT/build.log" >&2; exit 1; }
    for b in "$RUN" "$MLP" "$GATHER"; do
        [ -x "$b" ] || { echo "missing $b (see $OUT/build.log)" >&2; exit 1; }
    done
}

# ---- 2. PyTorch in a virtual environment ----------------------------------------------------
torch_ok() { [ -x "$PY" ] && "$PY" -c "import torch, torch.distributed" >/dev/null 2>&1; }

setup_venv() {
    torch_ok && return 0
    log "setting up $VENV with torch $TORCH_VERSION (log: $OUT/venv.log)"
    rm -rf "$VENV"
    /usr/bin/python3 -m venv "$VENV" >"$OUT/venv.log" 2>&1 || { cat "$OUT/venv.log" >&2; return 1; }
    local pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
    "${pip[@]}" "setuptools>=77.0.3" filelock "typing-extensions>=4.13.0" "sympy>=1.13.3" \
        "networkx>=2.5.1" jinja2 "fsspec>=0.8.5" numpy >>"$OUT/venv.log" 2>&1 || return 1
    # The light route: the wheel alone (540 MB) finds CUDA 13 in /usr/local/cuda through the
    # loader's cache, except for these four libraries (about 520 MB), pinned as torch 2.15.0 pins
    # them (another TORCH_VERSION may need others: then the full install below runs).
    if "${pip[@]}" --no-deps "torch==$TORCH_VERSION" >>"$OUT/venv.log" 2>&1 &&
        "${pip[@]}" --no-deps "nvidia-cufile==1.17.1.22.*" "nvidia-cusparselt-cu13==0.8.1" \
            "nvidia-nvshmem-cu13==3.7.2" "nvidia-nccl-cu13==2.30.7" >>"$OUT/venv.log" 2>&1 &&
        torch_ok; then
        return 0
    fi
    log "torch without its CUDA packages does not import here; installing the full wheel set"
    "${pip[@]}" "torch==$TORCH_VERSION" >>"$OUT/venv.log" 2>&1 && torch_ok
}

# ---- helpers -------------------------------------------------------------------------------
# The number before "ms/step" in a pshard-mlp output ("throughput ..., 29.50 ms/step" or, with
# --local --log info, "local: 200 steps in 2626.1 ms (13.131 ms/step)"); empty if none.
ms_per_step() {
    awk '{ for (i = 2; i <= NF; i++) if ($i ~ /^ms\/step/) { v = $(i - 1); gsub(/[(]/, "", v); print v; exit } }' "$1"
}
torch_ms() { awk -v m="$2" '$1 == "torch" && $2 == m && $5 == "step_ms" { print $6 }' "$1"; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print ""; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
diff_ms() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "") printf "%.2f", a - b; else printf "n/a" }'; }
# fp32 parameter count of an MLP: input, comma-separated hidden widths, output.
mlp_params() {
    awk -v i="$1" -v h="$2" -v o="$3" 'BEGIN { n = split(h, w, ","); prev = i; p = 0
        for (k = 1; k <= n; k++) { p += prev * w[k] + w[k]; prev = w[k] }
        p += prev * o + o; printf "%d\n", p }'
}

# Runs one step-time configuration once; appends its ms/step to $OUT/step_<name>.ms.
run_step() {
    local name=$1 rep=$2
    shift 2
    local f="$OUT/step_${name}_r${rep}.txt"
    if ! timeout 900 "$@" >"$f" 2>&1; then
        echo "($name run $rep failed: see $f)" >&2
        return 0
    fi
    local v
    case "$name" in
    torch_*) v=$(torch_ms "$f" "${name#torch_}") ;;
    *) v=$(ms_per_step "$f") ;;
    esac
    [ -n "$v" ] && echo "$v" >>"$OUT/step_${name}.ms"
    return 0
}

# Benchmark 3: one pshardrun --nproc 2 of pshard-mlp under the --rss-trainer wrapper.
run_rss() {
    local tag=$1
    shift
    local dir="$OUT/rss_$tag.d"
    rm -rf "$dir"
    mkdir -p "$dir"
    RSS_DIR="$dir" timeout 1800 "$RUN" --nproc 2 -- bash "$SELF" --rss-trainer "$MLP" "$@" \
        >"$OUT/rss_$tag.txt" 2>&1 || echo "(rss run $tag failed: see $OUT/rss_$tag.txt)" >&2
}

if [ "${SUMMARY_ONLY:-0}" != 1 ]; then
build
HAVE_TORCH=0
if [ "$TORCH" = 1 ]; then
    if setup_venv; then
        HAVE_TORCH=1
    else
        log "PyTorch could not be installed (see $OUT/venv.log); its columns stay n/a"
    fi
fi
echo "$HAVE_TORCH" >"$OUT/have_torch"

echo "# $(date -u +%FT%TZ) $(uname -srm), $NCPU CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# raw outputs in $OUT"

# 1. Gather bandwidth.
for n in 1 2; do
    log "gather bandwidth, $n rank(s)"
    "$RUN" --nproc "$n" -- "$GATHER" --sizes 4K,16M,128M --warmup 5 --iters "$GATHER_ITERS" \
        >"$OUT/gather_n$n.txt" 2>&1 || { cat "$OUT/gather_n$n.txt" >&2; exit 1; }
    grep -v 'listening on' "$OUT/gather_n$n.txt" | sed 's/^\[trainer 0\] //'
done

# 2. Step time, configurations interleaved per repetition so drifting load hits all alike.
rm -f "$OUT"/step_*.ms
for rep in $(seq "$REPEAT"); do
    log "step time, repetition $rep of $REPEAT"
    run_step pshard_local "$rep" "$MLP" --local --world 1 "${MLP_SHAPE[@]}" "${MLP_SGD[@]}" \
        --steps "$STEPS" --print-every 0 --log info
    run_step pshard_n1 "$rep" "$RUN" --nproc 1 -- "$MLP" "${MLP_SHAPE[@]}" "${MLP_SGD[@]}" \
        --steps "$((STEPS + 1))" --print-every 0
    run_step pshard_n2 "$rep" "$RUN" --nproc 2 -- "$MLP" "${MLP_SHAPE[@]}" "${MLP_SGD[@]}" \
        --steps "$((STEPS + 1))" --print-every 0
    if [ "$HAVE_TORCH" = 1 ]; then
        for mode in local ddp fsdp2; do
            run_step "torch_$mode" "$rep" "$PY" "$(dirname "$SELF")/torch_mlp.py" --mode "$mode" \
                --world 2 --steps "$STEPS" --warmup 10 --batch 32 --lr 0.01 --momentum 0.9
        done
    fi
done
if [ "$HAVE_TORCH" = 1 ]; then
    grep -h '^# torch\|unsupported' "$OUT"/step_torch_*_r1.txt || true
fi

# 3. Shard-server memory. Few steps: the peak is reached in the first one.
log "shard-server peak RSS"
run_rss base --widths "" --input 1 --output 1 --optimizer sgd --steps 2 --print-every 0
for m in "4x1024 1024,1024,1024,1024 20" "8x4096 4096,4096,4096,4096,4096,4096,4096,4096 3"; do
    read -r tag widths steps <<<"$m"
    run_rss "${tag}_sgdm" --widths "$widths" --input 256 --output 64 --optimizer sgd \
        --momentum 0.9 --lr 0.01 --steps "$steps" --print-every 0
    run_rss "${tag}_adam" --widths "$widths" --input 256 --output 64 --optimizer adam \
        --lr 0.001 --steps "$steps" --print-every 0
    # optimizer_in_backward: no gradient accumulator on the servers.
    run_rss "${tag}_sgdm_inbw" --widths "$widths" --input 256 --output 64 --optimizer sgd \
        --momentum 0.9 --lr 0.01 --steps "$steps" --print-every 0 --optimizer-in-backward
    run_rss "${tag}_adam_inbw" --widths "$widths" --input 256 --output 64 --optimizer adam \
        --lr 0.001 --steps "$steps" --print-every 0 --optimizer-in-backward
done
echo "# load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
fi

# ---- summary ------------------------------------------------------------------------------
HAVE_TORCH=$(cat "$OUT/have_torch" 2>/dev/null || echo 0)
row() { printf '%-44s %12s %12s %8s %-14s %s\n' "$@"; }
verdict() { # value op target -> yes/no/n/a
    awk -v v="$1" -v op="$2" -v t="$3" 'BEGIN { if (v == "n/a" || v == "") { print "n/a"; exit }
        ok = (op == "<=") ? (v + 0 <= t + 0) : (v + 0 >= t + 0); print ok ? "yes" : "NO" }'
}
echo
echo "# Summary (GB/s = 1e9 B/s; ms = milliseconds per training step; MiB = 2^20 B)"
row "measure" "pshard" "reference" "ratio" "target" "met"

# 1. gather / memcpy.
for n in 1 2; do
    f="$OUT/gather_n$n.txt"
    [ -f "$f" ] || continue
    sed 's/^\[trainer 0\] //' "$f" | awk '$1 ~ /^[0-9]+$/ && $2 >= 16777216 { print $2, $4, $6, $7 }' |
        while read -r size g m r; do
            if [ "$n" = 1 ]; then tgt=">= 0.70"; met=$(verdict "$r" ">=" 0.70); else tgt="(report)"; met="-"; fi
            row "gather $((size >> 20)) MiB, N=$n: GB/s vs memcpy" "$g" "$m" "$r" "$tgt" "$met"
        done
done

# 2. step time.
med() { [ -f "$OUT/step_$1.ms" ] && median <"$OUT/step_$1.ms" || echo ""; }
p_local=$(med pshard_local)
p_n1=$(med pshard_n1)
p_n2=$(med pshard_n2)
t_local=$(med torch_local)
t_ddp=$(med torch_ddp)
t_fsdp=$(med torch_fsdp2)
if [ -n "$t_fsdp" ]; then t_ref=$t_fsdp; t_name="FSDP2"; else t_ref=$t_ddp; t_name="DDP"; fi
row "step ms, local (1 process)" "${p_local:-n/a}" "${t_local:-n/a}" "$(ratio "$p_local" "$t_local")" "(report)" "-"
row "step ms, pshard N=1 vs pshard local" "${p_n1:-n/a}" "${p_local:-n/a}" "$(ratio "$p_n1" "$p_local")" "(report)" "-"
row "step ms, N=2: pshard vs torch DDP" "${p_n2:-n/a}" "${t_ddp:-n/a}" "$(ratio "$p_n2" "$t_ddp")" "(report)" "-"
row "step ms, N=2: pshard vs torch FSDP2" "${p_n2:-n/a}" "${t_fsdp:-n/a}" "$(ratio "$p_n2" "$t_fsdp")" "(report)" "-"
r=$(ratio "$p_n2" "$t_ref")
row "step ms, N=2: pshard vs torch $t_name (target)" "${p_n2:-n/a}" "${t_ref:-n/a}" "$r" "<= 1.00" "$(verdict "$r" "<=" 1.0)"
po=$(diff_ms "$p_n2" "$p_local")
to=$(diff_ms "$t_ref" "$t_local")
row "overhead ms (N=2 - local), vs torch $t_name" "$po" "$to" "$(ratio "$po" "$to")" "<= 1.00" "$(verdict "$(ratio "$po" "$to")" "<=" 1.0)"
tdo=$(diff_ms "$t_ddp" "$t_local")
row "overhead ms (N=2 - local), vs torch DDP" "$po" "$tdo" "$(ratio "$po" "$tdo")" "(report)" "-"
[ "$HAVE_TORCH" = 1 ] || echo "# (PyTorch was not run: TORCH=0 or it could not be installed)"
grep -h 'unsupported' "$OUT"/step_torch_fsdp2_r*.txt 2>/dev/null | head -1 | sed 's/^/# /' || true

# 3. peak RSS vs ideal, per server.
for f in "$OUT"/rss_*.txt; do
    [ -f "$f" ] || continue
    tag=$(basename "$f" .txt)
    tag=${tag#rss_}
    case "$tag" in
    base) p=0; states=1 ;;
    4x1024_*) p=$(mlp_params 256 1024,1024,1024,1024 64) ;;
    8x4096_*) p=$(mlp_params 256 4096,4096,4096,4096,4096,4096,4096,4096 64) ;;
    *) continue ;;
    esac
    case "$tag" in *_adam | *_adam_*) states=2 ;; *) states=1 ;; esac
    sed 's/^\[trainer 0\] //' "$f" | awk '$1 == "rss-server"' | sort -k3n | awk -v p="$p" -v s="$states" -v tag="$tag" '
        { hwm = $5 / 1024; anon = $9 / 1024; shm = $13 / 1024
          ideal = p * 4 / 2 * (1 + s) / 1048576 + 64
          printf "%s %d %.1f %.1f %.1f %.1f %.2f %.1f %.2f\n", tag, NR - 1, hwm, ideal, anon, shm,
                 hwm / ideal, hwm - shm, (hwm - shm) / ideal }' |
        while read -r t i hwm ideal anon shm r priv rpriv; do
            if [ "$t" = base ]; then
                row "server $i VmHWM MiB, no model (baseline)" "$hwm" "64" "$r" "(report)" "-"
            else
                row "server $i VmHWM MiB, $t N=2 vs ideal" "$hwm" "$ideal" "$r" "<= 1.10" "$(verdict "$r" "<=" 1.10)"
                row "  without shm ($shm MiB; anon $anon)" "$priv" "$ideal" "$rpriv" "(report)" "-"
            fi
        done
done
echo "# ideal = fp32 params / N x (1 + optimizer states: SGD momentum 1, Adam 2) + 64 MiB;"
echo "# shm and anon: RssShmem (pages of the trainer's model region, mapped and touched by the server"
echo "# too) and RssAnon when the trainers were done; 'without shm' = VmHWM - RssShmem."
