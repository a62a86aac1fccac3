#!/usr/bin/env bash
# Sharded training with the shard servers' collectives on GPUs (--backend nccl --offload cpu:
# slices and optimizer state in pinned host memory, NCCL on device buffers staged from them)
# must print the same `step N loss X` lines as the single-process reference, as the tcp
# backend does (test_mlp_equivalence.sh). One server per GPU, up to 4. Exits 77 (skipped)
# without a CUDA device.
# usage: test_shard_nccl.sh GPU_COUNT PSHARDRUN PSHARD-MLP
set -euo pipefail
ngpu=$("$1" 2>/dev/null || echo 0)
run="$2"
mlp="$3"
if [ "${ngpu:-0}" -lt 1 ]; then
  echo "no CUDA device: skipping the shard servers' NCCL test"
  exit 77
fi
nproc=$((ngpu < 4 ? ngpu : 4))
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0

# shellcheck source=../integration/losses.sh
. "$(dirname "$0")/../integration/losses.sh"

case_() {
  local tol="$1"; shift
  local args=(--steps 8 --batch 6 --widths 37,50 --input 19 --output 1 --seed 3 "$@")
  echo "== nproc $nproc on GPUs: ${args[*]}"
  "$mlp" --local --world "$nproc" "${args[@]}" > "$work/local.txt"
  if ! timeout 300 "$run" --nproc "$nproc" --backend nccl --offload cpu -- "$mlp" "${args[@]}" \
      > "$work/dist.txt" 2>&1; then
    echo "FAIL: pshardrun exited non-zero"; cat "$work/dist.txt"; fails=$((fails + 1)); return
  fi
  sed -n 's/^\[trainer 0\] //p' "$work/dist.txt" > "$work/dist0.txt"
  if compare_losses "$work/local.txt" "$work/dist0.txt" "$tol" all; then
    echo "ok: $(grep -c '^step' "$work/dist0.txt") steps match within $tol"
  else
    echo "FAIL"; paste "$work/local.txt" "$work/dist0.txt"; fails=$((fails + 1))
  fi
}

case_ 1e-4 --optimizer adam --max-grad-norm 1.0
case_ 1e-4 --optimizer sgd --lr 0.05 --momentum 0.9 --layout fsdp1
case_ 1e-4 --optimizer adam --optimizer-in-backward
PSHARD_REMOTE=1 case_ 1e-4 --optimizer adamw
# NCCL reduces bf16 in bf16 at every ring step (the tcp backend accumulates in fp32), so the
# tolerance is the bf16 one of test_mlp_equivalence.sh.
case_ 2e-2 --optimizer adamw --param-dtype bf16 --reduce-dtype bf16
echo "== --backend nccl without --offload cpu is refused with the reason"
if timeout 60 "$run" --nproc 1 --backend nccl -- "$mlp" --steps 1 > "$work/refused.txt" 2>&1; then
  echo "FAIL: GPU-resident shards were accepted"; fails=$((fails + 1))
elif ! grep -q -- "--offload cpu" "$work/refused.txt"; then
  echo "FAIL: the refusal does not say what to run:"; cat "$work/refused.txt"; fails=$((fails + 1))
else
  echo "ok: refused"
fi
[ "$fails" -eq 0 ] || { echo "$fails case(s) failed"; exit 1; }
echo "all cases passed"
