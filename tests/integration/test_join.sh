#!/usr/bin/env bash
# Join for uneven inputs, end to end: `pshardrun --nproc N -- pshard-mlp --uneven` gives rank r
# steps + r batches; each rank joins when it runs out and its shard server shadows the others.
# Oracle: the single-process reference `pshard-mlp --local --world N --uneven`, which averages
# each step over the ranks that still have data. The last rank's `step N loss X` lines and the
# final weights (every element) must match it: fp32 within 1e-5 relative, bf16 within 2e-2.
# Also: a rank with zero batches, both layouts, SHARD_GRAD_OP, the remote path,
# throw_on_early_termination (the others stop at their next operation, no step half-applied:
# the weights equal an even run of `steps` steps) and enable=false (a clear error).
# usage: test_join.sh PSHARDRUN PSHARD-MLP
set -euo pipefail
run="$1"
mlp="$2"
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0

# shellcheck source=losses.sh
. "$(dirname "$0")/losses.sh"

# compare_weights REF DIST TOL: raw fp32 files, element by element, relative to max(|ref|, 1e-2);
# with low-precision parameters (a tolerance above 1e-3) the relative L2 distance of the whole
# model instead, as single elements near zero carry the rounding of bf16/fp16 copies.
compare_weights() {
  /usr/bin/python3 - "$1" "$2" "$3" <<'PY'
import math, struct, sys
a = open(sys.argv[1], 'rb').read(); b = open(sys.argv[2], 'rb').read(); tol = float(sys.argv[3])
if len(a) != len(b) or len(a) == 0:
    sys.exit(f"weights: {len(b)} bytes, the reference has {len(a)}")
ra = struct.unpack(f'<{len(a)//4}f', a); rb = struct.unpack(f'<{len(b)//4}f', b)
worst, at = 0.0, 0
for i, (x, y) in enumerate(zip(ra, rb)):
    e = abs(x - y) / max(abs(x), 1e-2)
    if e > worst: worst, at = e, i
l2 = math.sqrt(sum((x - y) ** 2 for x, y in zip(ra, rb)) / max(sum(x * x for x in ra), 1e-30))
print(f"weights: {len(ra)} elements, worst relative difference {worst:.3g} (element {at}), "
      f"relative L2 distance {l2:.3g}")
sys.exit(0 if (worst if tol <= 1e-3 else l2) <= tol else 1)
PY
}

# case_ NPROC TOL ARGS...: an uneven run against the reference.
case_() {
  local nproc="$1" tol="$2"; shift 2
  local args=(--steps 10 --batch 6 --widths 37,50 --input 19 --output 3 --seed 5 --uneven "$@")
  echo "== nproc $nproc: ${args[*]}"
  "$mlp" --local --world "$nproc" --dump-weights "$work/ref.bin" "${args[@]}" > "$work/local.txt"
  if ! timeout 120 "$run" --nproc "$nproc" -- "$mlp" --dump-weights "$work/dist.bin" "${args[@]}" \
      > "$work/dist.txt" 2>&1; then
    echo "FAIL: pshardrun exited non-zero"; cat "$work/dist.txt"; fails=$((fails + 1)); return
  fi
  # The last rank has the most batches: it prints the loss lines.
  sed -n "s/^\[trainer $((nproc - 1))\] //p" "$work/dist.txt" | grep '^step' > "$work/dist_last.txt" || true
  local joined
  joined=$(grep -c "joined after" "$work/dist.txt" || true)
  if [ "$joined" != "$nproc" ]; then
    echo "FAIL: $joined of $nproc trainers report their join"; cat "$work/dist.txt"; fails=$((fails + 1)); return
  fi
  if ! grep -q "^\[trainer $((nproc - 1))\] rank $((nproc - 1)) joined after .*: last joiner" "$work/dist.txt"; then
    echo "FAIL: rank $((nproc - 1)) should be the last joiner"; grep "joined after" "$work/dist.txt"
    fails=$((fails + 1)); return
  fi
  if compare_losses "$work/local.txt" "$work/dist_last.txt" "$tol" all &&
     compare_weights "$work/ref.bin" "$work/dist.bin" "$tol"; then
    echo "ok: $(wc -l < "$work/dist_last.txt") steps and the final weights match within $tol"
  else
    echo "FAIL"; cat "$work/dist.txt"; fails=$((fails + 1))
  fi
}

case_ 3 1e-5 --optimizer adam
case_ 2 1e-5 --optimizer sgd --lr 0.05 --momentum 0.9 --max-grad-norm 0.5 --layout fsdp1
case_ 4 1e-5 --optimizer adamw --reshard-after-forward=false
# Rank 0 has no batch at all: it defines the model and joins at once.
case_ 3 1e-5 --optimizer adam --steps 0
case_ 2 2e-2 --optimizer adamw --param-dtype bf16 --reduce-dtype bf16
case_ 3 2e-2 --optimizer adam --param-dtype fp16 --layout fsdp1
PSHARD_REMOTE=1 case_ 2 1e-5 --optimizer adam
# A join in the middle of a step: each rank that runs out begins one more step, gathers its
# first layer together with the others, and joins there; the rest of that step is averaged over
# the ranks still running, exactly as in the reference where it had no such step.
case_ 3 1e-5 --optimizer adam --join-mid-step
case_ 2 1e-5 --optimizer sgd --lr 0.05 --momentum 0.9 --layout fsdp1 --join-mid-step
# optimizer_in_backward: a joined rank's server applies the others' averaged update itself.
case_ 3 1e-5 --optimizer adam --optimizer-in-backward

# throw_on_early_termination: rank 0 runs out after 5 steps; the others' next operation fails
# with JOINED naming rank 0, they join, and the model has exactly 5 steps (even reference).
echo "== throw_on_early_termination"
targs=(--steps 5 --batch 6 --widths 37,50 --input 19 --output 3 --seed 5)
"$mlp" --local --world 3 --dump-weights "$work/ref5.bin" "${targs[@]}" > /dev/null
if ! timeout 120 "$run" --nproc 3 -- "$mlp" --uneven --join-throw --dump-weights "$work/throw.bin" \
    "${targs[@]}" > "$work/throw.txt" 2>&1; then
  echo "FAIL: pshardrun exited non-zero"; cat "$work/throw.txt"; fails=$((fails + 1))
elif [ "$(grep -c 'stopping at step 6: rank 0 joined at step 5' "$work/throw.txt")" != 2 ]; then
  echo "FAIL: ranks 1 and 2 should stop at step 6 naming rank 0"; cat "$work/throw.txt"; fails=$((fails + 1))
elif ! compare_weights "$work/ref5.bin" "$work/throw.bin" 1e-5; then
  echo "FAIL: weights after the throw differ from 5 even steps"; fails=$((fails + 1))
else
  echo "ok: ranks 1 and 2 stopped with JOINED naming rank 0; weights equal 5 even steps"
fi

# enable=false: the join is refused with a clear message and the run fails (no hang).
echo "== enable=false"
if timeout 120 "$run" --nproc 2 -- "$mlp" --uneven --join-enable=false "${targs[@]}" > "$work/off.txt" 2>&1; then
  echo "FAIL: the run succeeded"; fails=$((fails + 1))
elif ! grep -q "Join is disabled" "$work/off.txt"; then
  echo "FAIL: no clear message"; cat "$work/off.txt"; fails=$((fails + 1))
else
  echo "ok: $(grep -m1 'Join is disabled' "$work/off.txt")"
fi

if [ "$fails" -ne 0 ]; then
  echo "$fails case(s) failed"
  exit 1
fi
echo "all Join cases match the single-process reference"
