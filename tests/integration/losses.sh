# Sourced by the shell tests that compare a distributed run with the --local reference.
# compare_losses REF DIST TOL [all]: every "step N loss X" line of DIST matches REF's line for
# N within TOL relative; with "all", DIST must also have as many step lines as REF.
compare_losses() {
  local nref=0
  [ "${4:-}" = all ] && nref=$(grep -c '^step' "$1")
  awk -v tol="$3" -v nref="$nref" '
    FNR == NR { if ($1 == "step" && $3 == "loss") ref[$2] = $4; next }
    $1 == "step" && $3 == "loss" {
      n++
      if (!($2 in ref)) { printf "step %s missing from the reference\n", $2; bad = 1; next }
      d = $4 - ref[$2]; if (d < 0) d = -d
      r = ref[$2]; if (r < 0) r = -r
      if (d > tol * r + 1e-9) { printf "step %s: distributed %s, reference %s\n", $2, $4, ref[$2]; bad = 1 }
    }
    END {
      if (n == 0) { print "no step lines"; bad = 1 }
      if (nref > 0 && n != nref) { printf "%d step lines, the reference has %d\n", n, nref; bad = 1 }
      exit bad
    }' "$1" "$2"
}

# mlp_case NPROC TOL [PSHARDRUN FLAGS...] -- [PSHARD-MLP ARGS...]: the core oracle for one
# configuration: `$run --nproc NPROC FLAGS -- $mlp ARGS` must print rank 0's `step N loss X`
# lines as `$mlp --local --world NPROC ARGS` does, within TOL relative, every step. Uses the
# caller's run, mlp and work; counts a failure in fails. ARGS follow a small default model.
mlp_case() {
  local nproc="$1" tol="$2"; shift 2
  local flags=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  local args=(--steps 8 --batch 6 --widths 37,50 --input 19 --output 1 --seed 3 "$@")
  echo "== nproc $nproc ${flags[*]}: ${args[*]}"
  "$mlp" --local --world "$nproc" "${args[@]}" > "$work/local.txt"
  if ! timeout 300 "$run" --nproc "$nproc" "${flags[@]}" -- "$mlp" "${args[@]}" \
      > "$work/dist.txt" 2>&1; then
    echo "FAIL: pshardrun exited non-zero"; cat "$work/dist.txt"; fails=$((fails + 1)); return
  fi
  # pshardrun prefixes rank 0's lines with "[trainer 0] ".
  sed -n 's/^\[trainer 0\] //p' "$work/dist.txt" > "$work/dist0.txt"
  if compare_losses "$work/local.txt" "$work/dist0.txt" "$tol" all; then
    echo "ok: $(grep -c '^step' "$work/dist0.txt") steps match within $tol"
  else
    echo "FAIL"; paste "$work/local.txt" "$work/dist0.txt"; fails=$((fails + 1))
  fi
}
