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
