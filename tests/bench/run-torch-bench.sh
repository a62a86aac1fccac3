#!/usr/bin/env bash
# pshard.torch against torch FSDP2 and DDP on the example LM (examples/torch/train_lm.py's
# Hugging Face GPT-2, byte-level on the standard library's sources, AdamW with two param groups),
# 2 ranks, one torch thread each, side by side in one run (configurations interleaved per
# repetition so drifting load hits all alike):
#   small: 4 layers, d_model 256, 4 heads, seq 128, batch 8 per rank
#   large: 8 layers, d_model 512, 8 heads, seq 128, batch 8 per rank
# Modes (tests/bench/torch_lm_bench.py): local (one process, no communication), local2 (two
# independent local processes at once: the floor that two ranks sharing this machine's CPUs and
# memory bandwidth cannot go below without any communication), torch DDP and torch FSDP2
# (fully_shard per block + root) on gloo under torchrun, pshard (pshard.torch fully_shard per
# block + root, the optimizer on the shard servers) under pshardrun, pshard_topt (the same with
# torch.optim.AdamW in the trainer), pshard_topt_keep (pshard_topt under pshardrun
# --max-restarts 1: the servers allow a replacement trainer, so pshard.torch keeps the
# optimizer's state in shared memory and copies shard and state aside before each step),
# fsdp2_pshard (torch's own FSDP2 as above on backend "pshard", under pshardrun).
# Reports, per model: step time (median over repetitions of the slowest rank's mean), each
# distributed mode's overhead over local and over local2, and peak memory per rank: the
# trainer's VmHWM; under pshardrun also trainer + its own shard server, counted twice (plain
# sum of the two VmHWMs) and with the model region's shared pages, mapped by both, counted once
# (minus the trainer's RssShmem, the part of the region it touched). Targets (issue 27): pshard
# step <= 1.0x DDP's and its overhead over local2 <= DDP's, in both optimizer modes; per-rank
# memory (trainer + server) <= FSDP2's; torch FSDP2 on backend pshard <= 1.0x FSDP2 on gloo.
#
# Environment: VENV (<repo>/build/torch-venv, made by scripts/pshard-venv.sh, which also builds
# and installs pshard into it), REPEAT (3), SMALL_STEPS (20), LARGE_STEPS (8), WARMUP (3),
# MODELS ("small large"), MODES (every mode above, in that order), OUT (a directory for the raw outputs; default a fresh temporary one,
# kept), SUMMARY_ONLY=1 (with OUT: only print the summary of an earlier run). The machine should
# be otherwise idle: the load is printed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/build/torch-venv}"
REPEAT="${REPEAT:-3}"
SMALL_STEPS="${SMALL_STEPS:-20}"
LARGE_STEPS="${LARGE_STEPS:-8}"
WARMUP="${WARMUP:-3}"
MODELS="${MODELS:-small large}"
MODES="${MODES:-local local2 ddp fsdp2 pshard pshard_topt pshard_topt_keep fsdp2_pshard}"
OUT="${OUT:-$(mktemp -d /tmp/pshard-torch-bench.XXXXXX)}"
mkdir -p "$OUT"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
BENCH="$ROOT/tests/bench/torch_lm_bench.py"
PY="$VENV/bin/python"

log() { printf '== %s\n' "$*" >&2; }

model_flags() {
    case "$1" in
    small) echo "--layers 4 --d-model 256 --heads 4 --seq 128 --batch 8 --steps $SMALL_STEPS" ;;
    large) echo "--layers 8 --d-model 512 --heads 8 --seq 128 --batch 8 --steps $LARGE_STEPS" ;;
    *) echo "unknown model '$1' in MODELS (small, large)" >&2; exit 2 ;;
    esac
}

# Runs one mode of one model once; its output goes to $OUT/<model>_<mode>_r<rep>.txt.
run_one() {
    local model=$1 mode=$2 rep=$3
    local f="$OUT/${model}_${mode}_r${rep}.txt"
    # shellcheck disable=SC2046
    local flags=($(model_flags "$model") --warmup "$WARMUP")
    local cmd
    case "$mode" in
    local) cmd=("$PY" "$BENCH" --mode local "${flags[@]}") ;;
    local2) # two at once; both outputs in one file, the slowest counts
        local pid
        timeout 1800 "$PY" "$BENCH" --mode local "${flags[@]}" >"$f.a" 2>&1 &
        pid=$!
        timeout 1800 "$PY" "$BENCH" --mode local "${flags[@]}" >"$f.b" 2>&1 ||
            echo "($model $mode run $rep failed: see $f.b)" >&2
        wait "$pid" || echo "($model $mode run $rep failed: see $f.a)" >&2
        cat "$f.a" "$f.b" >"$f" && rm -f "$f.a" "$f.b"
        return ;;
    ddp | fsdp2) cmd=("$VENV/bin/torchrun" --standalone --nproc-per-node 2 "$BENCH" --mode "$mode" "${flags[@]}") ;;
    pshard | pshard_topt | fsdp2_pshard)
        cmd=("$VENV/bin/pshardrun" --nproc 2 -- "$PY" "$BENCH" --mode "$mode" "${flags[@]}") ;;
    pshard_topt_keep)
        cmd=("$VENV/bin/pshardrun" --nproc 2 --max-restarts 1 -- "$PY" "$BENCH" --mode pshard_topt "${flags[@]}") ;;
    *) echo "unknown mode '$mode' in MODES" >&2; exit 2 ;;
    esac
    timeout 1800 "${cmd[@]}" >"$f" 2>&1 || echo "($model $mode run $rep failed: see $f)" >&2
}

if [ "${SUMMARY_ONLY:-0}" != 1 ]; then
    log "making the virtual environment with torch and pshard ($VENV)"
    "$ROOT/scripts/pshard-venv.sh" "$VENV" >"$OUT/venv.log" 2>&1 ||
        { tail -30 "$OUT/venv.log" >&2; exit 1; }
    echo "# $(date -u +%FT%TZ) $(uname -srm), $(getconf _NPROCESSORS_ONLN) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# torch $("$PY" -c 'import torch; print(torch.__version__)'), raw outputs in $OUT"
    for rep in $(seq "$REPEAT"); do
        for model in $MODELS; do
            for mode in $MODES; do
                log "$model $mode, repetition $rep of $REPEAT"
                run_one "$model" "$mode" "$rep"
            done
        done
    done
    echo "# load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
fi

# ---- summary ------------------------------------------------------------------------------
# Per run file: the slowest rank's step_ms; the largest per-rank trainer VmHWM; for pshard the
# largest per-rank trainer+server sum and the same minus the shared pages both count.
per_run() { # file field -> value (kB or ms), empty if none
    sed 's/^\[trainer [0-9]*\] //' "$1" | awk -v want="$2" '
        $1 == "bench" { for (i = 2; i < NF; i++) v[$i] = $(i + 1)
            x = ""
            if (want == "step_ms") x = v["step_ms"]
            else if (want == "trainer") x = v["vmhwm_kb"]
            else if (want == "sum" && ("server_vmhwm_kb" in v)) x = v["vmhwm_kb"] + v["server_vmhwm_kb"]
            else if (want == "dedup" && ("server_vmhwm_kb" in v)) {
                both = v["shmem_kb"] + 0 < v["server_shmem_kb"] + 0 ? v["shmem_kb"] : v["server_shmem_kb"]
                x = v["vmhwm_kb"] + v["server_vmhwm_kb"] - both }
            else if (want == "pss" && ("server_pss_kb" in v)) x = v["vmhwm_kb"] + v["server_pss_kb"] - v["server_pss_shmem_kb"]
            else if (want == "pool_peak" && ("pool_peak_kb" in v)) x = v["pool_peak_kb"]
            else if (want == "pool_touched" && ("pool_touched_kb" in v)) x = v["pool_touched_kb"]
            if (x != "" && (best == "" || x + 0 > best + 0)) best = x
            delete v }
        END { if (best != "") print best }'
}
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print ""; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
stat() { # model mode field -> median over repetitions
    local f
    for f in "$OUT/${1}_${2}"_r*.txt; do
        [ -f "$f" ] || continue # a mode left out of MODES
        per_run "$f" "$3"
    done | median
}
mib() { awk -v k="$1" 'BEGIN { if (k == "") print "n/a"; else printf "%.1f", k / 1024 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && a != "n/a" && b != "" && b != "n/a" && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
diff_ms() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "") printf "%.1f", a - b; else printf "n/a" }'; }
verdict() {
    awk -v v="$1" -v t="$2" 'BEGIN { if (v == "n/a" || v == "") print "n/a"; else print (v + 0 <= t + 0) ? "yes" : "NO" }'
}
row() { printf '%-50s %11s %11s %7s %-9s %s\n' "$@"; }

echo
echo "# Summary (ms = milliseconds per training step, slowest rank, median of repetitions; MiB = 2^20 B)"
grep -h 'unsupported' "$OUT"/*_r1.txt 2>/dev/null | sed 's/^/# /' | head -4 || true
row "measure" "pshard" "reference" "ratio" "target" "met"
for model in $MODELS; do
    l=$(stat "$model" local step_ms)
    l2=$(stat "$model" local2 step_ms)
    d=$(stat "$model" ddp step_ms)
    f=$(stat "$model" fsdp2 step_ms)
    p=$(stat "$model" pshard step_ms)
    pto=$(stat "$model" pshard_topt step_ms)
    fp=$(stat "$model" fsdp2_pshard step_ms)
    row "$model: step ms, local (no communication)" "-" "${l:-n/a}" "-" "(report)" "-"
    row "$model: step ms, local2 (2 processes, no comm.)" "-" "${l2:-n/a}" "-" "(report)" "-"
    r=$(ratio "$l2" "$f")
    row "$model:   local2 vs torch FSDP2 (the floor)" "${l2:-n/a}" "${f:-n/a}" "$r" "(report)" "-"
    r=$(ratio "$p" "$f")
    row "$model: step ms, pshard vs torch FSDP2" "${p:-n/a}" "${f:-n/a}" "$r" "(report)" "-"
    r=$(ratio "$p" "$d")
    row "$model: step ms, pshard vs torch DDP" "${p:-n/a}" "${d:-n/a}" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    r=$(ratio "$pto" "$d")
    row "$model: step ms, pshard+torch.optim vs DDP" "${pto:-n/a}" "${d:-n/a}" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    r=$(ratio "$fp" "$f")
    row "$model: step ms, FSDP2 on pshard vs on gloo" "${fp:-n/a}" "${f:-n/a}" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    po=$(diff_ms "$p" "$l")
    fo=$(diff_ms "$f" "$l")
    dd=$(diff_ms "$d" "$l")
    r=$(ratio "$po" "$fo")
    row "$model: overhead ms over local, pshard vs FSDP2" "$po" "$fo" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    row "$model: overhead ms over local, pshard vs DDP" "$po" "$dd" "$(ratio "$po" "$dd")" "(report)" "-"
    po2=$(diff_ms "$p" "$l2")
    fo2=$(diff_ms "$f" "$l2")
    dd2=$(diff_ms "$d" "$l2")
    row "$model: overhead ms over local2, pshard vs FSDP2" "$po2" "$fo2" "$(ratio "$po2" "$fo2")" "(report)" "-"
    r=$(ratio "$po2" "$dd2")
    row "$model: overhead ms over local2, pshard vs DDP" "$po2" "$dd2" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    pt2=$(diff_ms "$pto" "$l2")
    r=$(ratio "$pt2" "$dd2")
    row "$model: overhead over local2, pshard+torch.optim/DDP" "$pt2" "$dd2" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    ft=$(stat "$model" fsdp2 trainer)
    dt=$(stat "$model" ddp trainer)
    lt=$(stat "$model" local trainer)
    pt=$(stat "$model" pshard trainer)
    ps=$(stat "$model" pshard sum)
    pd=$(stat "$model" pshard dedup)
    row "$model: peak MiB, local process" "-" "$(mib "$lt")" "-" "(report)" "-"
    row "$model: peak MiB/rank, pshard trainer vs FSDP2 rank" "$(mib "$pt")" "$(mib "$ft")" "$(ratio "$pt" "$ft")" "(report)" "-"
    r=$(ratio "$pd" "$ft")
    row "$model: peak MiB/rank, trainer+server vs FSDP2" "$(mib "$pd")" "$(mib "$ft")" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    row "$model:   same, shared pages counted twice" "$(mib "$ps")" "$(mib "$ft")" "$(ratio "$ps" "$ft")" "(report)" "-"
    pdt=$(stat "$model" pshard_topt dedup)
    r=$(ratio "$pdt" "$ft")
    row "$model: peak MiB/rank, +torch.optim trainer+server" "$(mib "$pdt")" "$(mib "$ft")" "$r" "<= 1.00" "$(verdict "$r" 1.00)"
    ptk=$(stat "$model" pshard_topt_keep step_ms)
    row "$model: step ms, torch.optim kept for a replacement/not" "${ptk:-n/a}" "${pto:-n/a}" "$(ratio "$ptk" "$pto")" "(report)" "-"
    pdk=$(stat "$model" pshard_topt_keep dedup)
    row "$model: peak MiB/rank, torch.optim kept/not" "$(mib "$pdk")" "$(mib "$pdt")" "$(ratio "$pdk" "$pdt")" "(report)" "-"
    fpd=$(stat "$model" fsdp2_pshard dedup)
    row "$model: peak MiB/rank, FSDP2 on pshard (+server)" "$(mib "$fpd")" "$(mib "$ft")" "$(ratio "$fpd" "$ft")" "(report)" "-"
    pp=$(stat "$model" pshard pss)
    row "$model:   same, server's share of shared libs" "$(mib "$pp")" "$(mib "$ft")" "$(ratio "$pp" "$ft")" "(report)" "-"
    row "$model: pshard pool MiB, peak held / high-water offset" "$(mib "$(stat "$model" pshard pool_peak)")" "$(mib "$(stat "$model" pshard pool_touched)")" "-" "(report)" "-"
    row "$model: peak MiB/rank, trainer+server vs DDP" "$(mib "$pd")" "$(mib "$dt")" "$(ratio "$pd" "$dt")" "(report)" "-"
done
echo "# trainer+server = the trainer's VmHWM + its shard server's VmHWM - the smaller RssShmem of"
echo "# the two (the model region's pages both touched; /proc counts them in each). \"server's share\":"
echo "# the trainer's VmHWM + the server's Pss - its Pss_Shmem at the end (its steady state): pages"
echo "# of libraries shared with other processes count in proportion, as smem(8) counts them"
