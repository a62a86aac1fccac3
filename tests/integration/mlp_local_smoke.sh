#!/bin/sh
# Smoke test of pshard-mlp --local: two simulated ranks train a small MLP for 30 steps and the
# last step's loss must be below half the first's. Usage: mlp_local_smoke.sh PATH/TO/pshard-mlp
set -eu
mlp="$1"
out=$("$mlp" --local --world 2 --steps 30 --widths 64,64 --input 32 --output 8)
printf '%s\n' "$out"
printf '%s\n' "$out" | awk '
  $1 == "step" && $3 == "loss" { if (n == 0) first = $4; last = $4; n++ }
  $1 == "final" && $2 == "checksum" { have_checksum = 1 }
  END {
    if (n != 30) { printf "FAIL: %d step lines, want 30\n", n; exit 1 }
    if (!have_checksum) { print "FAIL: no final checksum line"; exit 1 }
    if (!(last + 0 < (first + 0) / 2)) { printf "FAIL: loss %s -> %s did not halve\n", first, last; exit 1 }
    printf "PASS: loss %s -> %s\n", first, last
  }'
