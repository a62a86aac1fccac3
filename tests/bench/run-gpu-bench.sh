#!/usr/bin/env bash
# pshard.torch on one GPU against torch's own FSDP2 on NCCL on the same GPU (issue 31's
# benchmark): the example LM (tests/bench/torch_lm_bench.py --device cuda, GPT-2 small config:
# 4 layers, d_model 256, seq 128, batch 8), world 1 (NCCL takes one rank per GPU), modes
# interleaved per repetition:
#   local        plain torch on the GPU, no communication (the floor)
#   fsdp2        torch fully_shard per block and on the root, NCCL, under torchrun
#   pshard       pshard.torch.fully_shard, shards and AdamW on the shard server's GPU
#                (pshardrun --backend nccl)
#   pshard_topt  the same with torch.optim.AdamW stepping the DTensor shards, which are the
#                server's GPU memory opened through CUDA IPC
# Prints per mode the median step time over REPEAT runs and pshard's ratios to fsdp2 and local;
# then the gather bandwidth of a GATHER_MIB (256) MiB parameter from the server's GPU memory
# against the GPU's own copy bandwidth (tests/bench/gather_bw_bench.py).
# Exits 77 when PYTHON has no torch that sees a CUDA device.
# Environment: PYTHON (default build/torch-venv's), PSHARDRUN (beside PYTHON), TORCHRUN (beside
# PYTHON), REPEAT (3), STEPS (30), WARMUP (5), MODES (all four), OUT (raw outputs; default a
# fresh temporary directory, kept).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/build/torch-venv/bin/python}"
BIN="$(dirname "$PY")"
PSHARDRUN="${PSHARDRUN:-$BIN/pshardrun}"
TORCHRUN="${TORCHRUN:-$BIN/torchrun}"
REPEAT="${REPEAT:-3}"
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-5}"
MODES="${MODES:-local fsdp2 pshard pshard_topt}"
OUT="${OUT:-$(mktemp -d /tmp/pshard-gpu-bench.XXXXXX)}"
BENCH="$ROOT/tests/bench/torch_lm_bench.py"
mkdir -p "$OUT"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  > /dev/null 2>&1; then
  echo "gpu-bench: no torch seeing a CUDA device at $PY: skipping"
  exit 77
fi
flags=(--device cuda --layers 4 --d-model 256 --heads 4 --seq 128 --batch 8 --steps "$STEPS"
  --warmup "$WARMUP")
echo "# $(date -u +%FT%TZ) $("$PY" -c 'import torch; print("torch", torch.__version__,
  torch.cuda.get_device_name(0))'), raw outputs in $OUT"
for rep in $(seq "$REPEAT"); do
  for mode in $MODES; do
    f="$OUT/${mode}_r$rep.txt"
    case "$mode" in
      local) cmd=("$PY" "$BENCH" --mode local "${flags[@]}") ;;
      fsdp2) cmd=("$TORCHRUN" --standalone --nproc-per-node 1 "$BENCH" --mode fsdp2 "${flags[@]}") ;;
      pshard | pshard_topt)
        cmd=("$PSHARDRUN" --nproc 1 --backend nccl -- "$PY" "$BENCH" --mode "$mode" "${flags[@]}") ;;
      *)
        echo "gpu-bench: unknown mode '$mode'" >&2
        exit 2
        ;;
    esac
    timeout 600 "${cmd[@]}" > "$f" 2>&1 || echo "gpu-bench: $mode run $rep failed: see $f" >&2
  done
done
# The step time of a run: its rank 0 line's step_ms.
step_ms() { sed 's/^\[trainer [0-9]*\] //' "$1" | awk '$1 == "bench" && $4 == 0 {
  for (i = 2; i < NF; i++) if ($i == "step_ms") print $(i + 1) }'; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print ""; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
declare -A ms
for mode in $MODES; do
  ms[$mode]=$(for f in "$OUT/${mode}"_r*.txt; do step_ms "$f"; done | median)
  printf 'gpu-bench: %-12s %10s ms/step (median of %s)\n' "$mode" "${ms[$mode]:-n/a}" "$REPEAT"
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
for mode in pshard pshard_topt; do
  [ -n "${ms[$mode]:-}" ] || continue
  echo "gpu-bench: $mode / fsdp2 (NCCL) = $(ratio "${ms[$mode]}" "${ms[fsdp2]:-}")," \
    "$mode / local = $(ratio "${ms[$mode]}" "${ms[local]:-}")"
done
# The gather bandwidth from the server's GPU memory into the trainer's parameter, against the
# GPU's own copy bandwidth (tests/bench/gather_bw_bench.py, a GATHER_MIB MiB parameter).
gf="$OUT/gather_bw.txt"
timeout 300 "$PSHARDRUN" --nproc 1 --backend nccl -- "$PY" "$ROOT/tests/bench/gather_bw_bench.py" \
  --device cuda --mib "${GATHER_MIB:-256}" --iters 10 > "$gf" 2>&1 ||
  echo "gpu-bench: the gather bandwidth run failed: see $gf" >&2
gline=$(sed 's/^\[trainer [0-9]*\] //' "$gf" | grep '^gather_bw ' | tail -n 1)
echo "gpu-bench: ${gline:-gather_bw: no figure}"
# A mode without a figure failed: say so in the status.
for mode in $MODES; do [ -n "${ms[$mode]:-}" ] || exit 1; done
[ -n "$gline" ] || exit 1
exit 0
