#!/usr/bin/env bash
# The core oracle of sharded training: `pshardrun --nproc N -- pshard-mlp ARGS` must print the
# same `step N loss X` lines as the single-process reference `pshard-mlp --local --world N ARGS`
# (1e-4 relative in fp32; bf16 parameters within 2e-2), for several world sizes, optimizers,
# both layouts, with clipping, on widths that do not divide by N and a 1-row output layer, and
# once over the remote (gRPC streaming) path.
# usage: test_mlp_equivalence.sh PSHARDRUN PSHARD-MLP
set -euo pipefail
run="$1"
mlp="$2"
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0

# shellcheck source=losses.sh
. "$(dirname "$0")/losses.sh"

case_() {
  local nproc="$1" tol="$2"; shift 2
  mlp_case "$nproc" "$tol" -- "$@"
}

case_ 1 1e-4 --optimizer adam
case_ 2 1e-4 --optimizer sgd --lr 0.05 --momentum 0.9 --max-grad-norm 0.5
case_ 3 1e-4 --optimizer adam --max-grad-norm 1.0
case_ 3 1e-4 --optimizer adamw --layout fsdp1
case_ 4 1e-4 --optimizer sgd --lr 0.05 --momentum 0.9 --layout fsdp1
case_ 2 2e-2 --optimizer adamw --param-dtype bf16 --reduce-dtype bf16
# SHARD_GRAD_OP: full parameters kept from forward to backward (backward's gathers skipped).
case_ 2 1e-4 --optimizer adam --reshard-after-forward=false
case_ 4 1e-4 --optimizer adamw --layout fsdp1 --reshard-after-forward=false --max-gathers-in-flight 1
# The remote path: trainers stream tensors over gRPC instead of sharing memory.
PSHARD_REMOTE=1 case_ 3 1e-4 --optimizer adam --max-grad-norm 1.0
PSHARD_REMOTE=1 case_ 2 1e-4 --optimizer sgd --reshard-after-forward=false
# optimizer_in_backward: updates at the reduce-scatters, no gradient accumulator (no clipping:
# without it both orders of work give the same weights).
case_ 3 1e-4 --optimizer adam --optimizer-in-backward
case_ 2 1e-4 --optimizer sgd --lr 0.05 --momentum 0.9 --layout fsdp1 --optimizer-in-backward
case_ 2 2e-2 --optimizer adamw --param-dtype bf16 --reduce-dtype bf16 --optimizer-in-backward
# GPU-resident shards, with the tests' host emulation of the device (PSHARD_TEST_EMULATE_DEVICE:
# the kernels' element functions on host memory): the server's device code paths, on a CPU.
PSHARD_TEST_EMULATE_DEVICE=1 case_ 3 1e-4 --optimizer adam --max-grad-norm 1.0
PSHARD_TEST_EMULATE_DEVICE=1 case_ 2 1e-4 --optimizer sgd --lr 0.05 --momentum 0.9 --layout fsdp1
PSHARD_TEST_EMULATE_DEVICE=1 case_ 2 1e-4 --optimizer adamw --optimizer-in-backward
PSHARD_TEST_EMULATE_DEVICE=1 PSHARD_REMOTE=1 case_ 2 1e-4 --optimizer adam
PSHARD_TEST_EMULATE_DEVICE=1 case_ 2 2e-2 --optimizer adamw --param-dtype bf16 --reduce-dtype bf16
echo "== optimizer_in_backward with clipping is refused"
if timeout 120 "$run" --nproc 2 -- "$mlp" --steps 2 --optimizer-in-backward --max-grad-norm 1 \
    > "$work/clip.txt" 2>&1; then
  echo "FAIL: optimizer_in_backward with --max-grad-norm 1 was accepted"; fails=$((fails + 1))
elif ! grep -q "it cannot clip" "$work/clip.txt"; then
  echo "FAIL: the refusal does not say why:"; cat "$work/clip.txt"; fails=$((fails + 1))
else
  echo "ok: $(grep -m1 -o 'optimizer_in_backward updates.*cannot clip' "$work/clip.txt")"
fi

# Memory: FULL_SHARD holds a few layers at a time, SHARD_GRAD_OP every parameter from forward
# to backward; only SHARD_GRAD_OP skips backward's gathers (2 per layer per step).
# memory_line RAF: rank 0's "memory:" line of a 6-layer run.
memory_line() {
  timeout 120 "$run" --nproc 2 -- "$mlp" --steps 3 --batch 4 --widths 64,64,64,64,64 --input 64 \
    --output 64 --print-every 0 --reshard-after-forward="$1" 2>&1 | sed -n 's/^\[trainer 0\] memory: //p'
}
full=$(memory_line true)
keep=$(memory_line false)
echo "FULL_SHARD: $full"
echo "SHARD_GRAD_OP: $keep"
# "at most X MiB ... (POLICY, K parameter gathers skipped)"
peak_full=$(echo "$full" | awk '{print $3}'); skip_full=$(echo "$full" | awk '{print $(NF-3)}')
peak_keep=$(echo "$keep" | awk '{print $3}'); skip_keep=$(echo "$keep" | awk '{print $(NF-3)}')
# Every parameter: 6 layers of 64x64 + 64, fp32 = 0.0947 MiB.
if ! awk -v f="$peak_full" -v k="$peak_keep" 'BEGIN { exit !(f > 0 && f < 0.09 && k >= 0.0947 && f < k) }'; then
  echo "FAIL: peak held memory FULL_SHARD $peak_full MiB, SHARD_GRAD_OP $peak_keep MiB"; fails=$((fails + 1))
elif [ "$skip_full" != 0 ] || [ "$skip_keep" != 36 ]; then
  echo "FAIL: gathers skipped: FULL_SHARD $skip_full (want 0), SHARD_GRAD_OP $skip_keep (want 36)"
  fails=$((fails + 1))
else
  echo "ok: FULL_SHARD holds $peak_full MiB at most, SHARD_GRAD_OP $peak_keep MiB"
fi

if [ "$fails" -ne 0 ]; then
  echo "$fails case(s) failed"
  exit 1
fi
echo "all cases match the single-process reference"
