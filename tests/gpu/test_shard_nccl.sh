#!/usr/bin/env bash
# Sharded training with the shard servers on GPUs must print the same `step N loss X` lines as
# the single-process reference, as the tcp backend does (test_mlp_equivalence.sh), with the
# shards in GPU memory (--backend nccl, the kernels of shard_cuda.cu) and in pinned host
# memory (--offload cpu: NCCL on device buffers staged from host memory). One server per GPU,
# up to 4. Exits 77 (skipped) without a CUDA device.
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
  local offload="$1" tol="$2"; shift 2
  mlp_case "$nproc" "$tol" --backend nccl --offload "$offload" -- "$@"
}

for offload in none cpu; do
  case_ "$offload" 1e-4 --optimizer adam --max-grad-norm 1.0
  case_ "$offload" 1e-4 --optimizer sgd --lr 0.05 --momentum 0.9 --layout fsdp1
  case_ "$offload" 1e-4 --optimizer adam --optimizer-in-backward
  PSHARD_REMOTE=1 case_ "$offload" 1e-4 --optimizer adamw
  # NCCL reduces bf16 in bf16 at every ring step (the tcp backend accumulates in fp32), so the
  # tolerance is the bf16 one of test_mlp_equivalence.sh.
  case_ "$offload" 2e-2 --optimizer adamw --param-dtype bf16 --reduce-dtype bf16
  case_ "$offload" 2e-2 --optimizer sgd --param-dtype fp16 --optimizer-in-backward \
    --reduce-dtype bf16
done
# Checkpoint and resume with the shards in GPU memory: 4 steps, then 4 more from the
# checkpoint, end with the weights of 8 uninterrupted steps, bit for bit.
echo "== checkpoint and resume, shards in GPU memory"
args=(--batch 6 --widths 37,50 --input 19 --output 1 --seed 3 --optimizer adam)
if timeout 300 "$run" --nproc "$nproc" --backend nccl -- "$mlp" "${args[@]}" --steps 8 \
     --dump-weights "$work/ref.bin" > "$work/ref.txt" 2>&1 &&
   timeout 300 "$run" --nproc "$nproc" --backend nccl --checkpoint-dir "$work/ck" \
     --checkpoint-every 4 -- "$mlp" "${args[@]}" --steps 4 > "$work/first.txt" 2>&1 &&
   timeout 300 "$run" --nproc "$nproc" --backend nccl --resume "$work/ck" -- "$mlp" \
     "${args[@]}" --steps 8 --dump-weights "$work/resumed.bin" > "$work/second.txt" 2>&1; then
  if ! grep -q "resumed at step 4" "$work/second.txt"; then
    echo "FAIL: did not resume at step 4"; cat "$work/second.txt"; fails=$((fails + 1))
  elif ! cmp -s "$work/ref.bin" "$work/resumed.bin"; then
    echo "FAIL: weights after resume differ from the uninterrupted run"; fails=$((fails + 1))
  else
    echo "ok: resumed at step 4; final weights equal the uninterrupted run bit for bit"
  fi
else
  echo "FAIL: a checkpoint run failed"
  cat "$work/ref.txt" "$work/first.txt" "$work/second.txt" 2>/dev/null
  fails=$((fails + 1))
fi
[ "$fails" -eq 0 ] || { echo "$fails case(s) failed"; exit 1; }
echo "all cases passed"
