# What the integration scripts that start real processes share (sourced: `. "$(dirname
# "$0")/harness.sh"`): a clock in milliseconds, polling with a deadline, a trainer's progress,
# and stopping every process the script started (their PIDs in its array `pids`).

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# wait_for SECONDS CMD...: polls CMD every 20 ms until it succeeds; fails after SECONDS.
wait_for() {
  local end=$(( $(now_ms) + $1 * 1000 )); shift
  until "$@"; do
    if [ "$(now_ms)" -gt "$end" ]; then return 1; fi
    sleep 0.02
  done
}

# steps_printed LOG N: LOG holds at least N "step ..." lines.
steps_printed() {
  local n
  n=$(grep -c '^step' "$1" 2>/dev/null || true)
  [ "${n:-0}" -ge "$2" ]
}

gone() { ! kill -0 "$1" 2>/dev/null; }

# stop_started: continues (a SIGSTOPped one could not die) and kills -9 each PID in pids, by
# its id, and reaps them.
stop_started() {
  for p in "${pids[@]}"; do
    kill -CONT "$p" 2>/dev/null || true
    kill -9 "$p" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
