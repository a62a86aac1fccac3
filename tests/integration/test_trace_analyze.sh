#!/usr/bin/env bash
# `pshardctl trace analyze` on hand-written trace directories (issue 29): trace files are
# untrusted input, so each malformed one (not JSON, wrong types, missing fields, a rank claimed
# twice, too large, not a regular file) must end the command with exit 2 and an error naming the
# file, never a crash or a hang; good ones must be reported: the rank that never started the
# newest operation (also when it left no file), a desync naming both ranks, a line per rank.
# usage: test_trace_analyze.sh PSHARDCTL
set -euo pipefail
ctl="$1"
work=$(mktemp -d)
fails=0
trap 'if [ "$fails" -eq 0 ]; then rm -rf "$work"; else echo "files kept in $work"; fi' EXIT
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
case_no=0

# newdir: a fresh directory in $d.
newdir() { case_no=$((case_no + 1)); d="$work/c$case_no"; mkdir -p "$d"; }

# rec OP SEQ STATE [SED]: one flight record, changed by the sed expression SED.
rec() {
  printf '{"rank":0,"op":"%s","seq":%s,"state":"%s","stuck":false,"waiting_on":-1,"seconds":0.5,"label":"step 3, w","dtype":"fp32","count":64,"error":"","tag":7,"start_time":100.0,"end_time":0}' \
    "$1" "$2" "$3" | sed "${4:-}"
}
# trace FILE RANK WORLD RECORDS...: a trace file holding the records.
trace() {
  local f="$1" rank="$2" world="$3"; shift 3
  local IFS=,
  printf '{"format":"pshard-trace","version":1,"rank":%s,"world_size":%s,"name":"srv-%s","job":"default","generation":1,"step":3,"time":1.0,"reason":"test","backend":"tcp","transport":"tcp","flight_records":[%s]}\n' \
    "$rank" "$world" "$rank" "$*" > "$f"
}

# refused WHAT PATTERN: analyze of $d exits 2 with PATTERN (which names the file) on stderr.
refused() {
  local what="$1" pattern="$2" code=0
  timeout 20 "$ctl" trace analyze "$d" > "$d.out" 2> "$d.err" || code=$?
  if [ "$code" -ne 2 ]; then
    fail "$what: exit $code, not 2: $(cat "$d.err" "$d.out" | head -5)"
  elif ! grep -q -- "$pattern" "$d.err"; then
    fail "$what: the error does not say '$pattern': $(cat "$d.err")"
  else
    echo "ok: $what: $(head -1 "$d.err")"
  fi
}
# reported WHAT PATTERN...: analyze of $d exits 0 and prints every PATTERN.
reported() {
  local what="$1" code=0; shift
  timeout 20 "$ctl" trace analyze "$d" > "$d.out" 2> "$d.err" || code=$?
  if [ "$code" -ne 0 ]; then
    fail "$what: exit $code: $(cat "$d.err")"; return
  fi
  for p in "$@"; do
    grep -q -- "$p" "$d.out" || { fail "$what: no '$p' in:"; cat "$d.out"; return; }
  done
  echo "ok: $what"
}

good0=$(rec all_gather 4 done)
newdir; echo 'this is { not json' > "$d/pshard-trace-rank-0.json"
refused "not JSON" "pshard-trace-rank-0.json: not JSON"
newdir; echo '[1,2,3]' > "$d/pshard-trace-rank-0.json"
refused "an array" "pshard-trace-rank-0.json: not a JSON object"
newdir; trace /dev/stdout 0 2 "$good0" | sed 's/"rank":0,"world/"rank":"0","world/' > "$d/pshard-trace-rank-0.json"
refused "rank as a string" "pshard-trace-rank-0.json: rank is not an integer"
newdir; echo '{"rank":0,"world_size":2}' > "$d/pshard-trace-rank-0.json"
refused "no flight_records" "pshard-trace-rank-0.json: flight_records is missing"
newdir; trace "$d/pshard-trace-rank-0.json" 0 2 '{"op":"all_gather","state":"done"}'
refused "a record without seq" "pshard-trace-rank-0.json: flight_records\[0\].seq is missing"
newdir; trace "$d/pshard-trace-rank-0.json" 0 2 "$good0" "$(rec all_gather '"5"' done)"
refused "seq as a string" "pshard-trace-rank-0.json: flight_records\[1\].seq is not an integer"
newdir; trace "$d/pshard-trace-rank-0.json" 0 2 "$(rec all_gather -3 done)"
refused "a negative seq" "pshard-trace-rank-0.json: flight_records\[0\].seq is -3"
newdir; trace "$d/pshard-trace-rank-0.json" 0 2 '"a record"'
refused "a record that is a string" "pshard-trace-rank-0.json: flight_records\[0\] is not an object"
newdir; trace "$d/pshard-trace-rank-0.json" 0 2 "$(rec all_gather 4 done 's/"end_time":0/"end_time":0,"label":5/')"
refused "a duplicate member" "pshard-trace-rank-0.json: not JSON"
newdir; trace "$d/pshard-trace-rank-0.json" 0 2 "$(rec all_gather 4 done 's/"start_time":100.0/"start_time":"soon"/')"
refused "a time as a string" "flight_records\[0\].start_time is not a number"
newdir; trace "$d/pshard-trace-rank-3.json" 3 2 "$good0"
refused "a rank past the world" "pshard-trace-rank-3.json: rank 3 is not below its world_size 2"
newdir; trace "$d/pshard-trace-rank-0.json" 0 0 "$good0"
refused "world size 0" "pshard-trace-rank-0.json: world_size is 0"
newdir; trace "$d/pshard-trace-rank-1.json" 0 2 "$good0"
refused "a file named for another rank" "pshard-trace-rank-1.json: says it is rank 0"
newdir; trace "$d/pshard-trace-rank-1.json" 1 2 "$good0"; trace "$d/pshard-trace-rank-01.json" 1 2 "$good0"
refused "two files claiming one rank" "both hold rank 1"
newdir; sed 's/"pshard-trace"/"something-else"/' <(trace /dev/stdout 0 2 "$good0") > "$d/pshard-trace-rank-0.json"
refused "another format" "pshard-trace-rank-0.json: format is"
newdir; many=(); for ((i = 0; i < 65; i++)); do many+=("$(rec all_gather "$i" done)"); done
trace "$d/pshard-trace-rank-0.json" 0 2 "${many[@]}"
refused "too many records" "pshard-trace-rank-0.json: 65 flight records"
newdir; head -c $((2 << 20)) /dev/zero | tr '\0' ' ' > "$d/pshard-trace-rank-0.json"
refused "a huge file" "pshard-trace-rank-0.json: 2097152 bytes, larger than"
newdir; mkfifo "$d/pshard-trace-rank-0.json"
refused "a FIFO" "pshard-trace-rank-0.json: not a regular file"
newdir; trace "$work/elsewhere.json" 0 2 "$good0"; ln -s "$work/elsewhere.json" "$d/pshard-trace-rank-0.json"
refused "a symbolic link" "pshard-trace-rank-0.json"
newdir; echo '{}' > "$d/unrelated.json"
refused "no trace files" "no pshard-trace-rank-\*.json in"
d="$work/does-not-exist"
refused "a missing directory" "cannot open $d"
code=0; "$ctl" trace analyze > /dev/null 2>&1 || code=$?
[ "$code" -eq 2 ] || fail "trace analyze without DIR exits $code, not 2"
code=0; "$ctl" trace frobnicate > /dev/null 2>&1 || code=$?
[ "$code" -eq 2 ] || fail "trace frobnicate exits $code, not 2"

# Reports.
newdir
# Rank 0's seq 6 was issued after its seq 5 failed, and failed at once without running: the
# newest operation started is still seq 5.
trace "$d/pshard-trace-rank-0.json" 0 3 "$(rec all_gather 4 done)" "$(rec reduce_scatter 5 failed 's/"waiting_on":-1/"waiting_on":2/; s/"end_time":0/"end_time":107.5/')" \
  "$(rec all_gather 6 failed 's/"start_time":100.0/"start_time":0/')"
trace "$d/pshard-trace-rank-1.json" 1 3 "$(rec all_gather 4 done)" "$(rec reduce_scatter 5 running 's/"waiting_on":-1/"waiting_on":2/; s/"seconds":0.5/"seconds":9.25/')"
trace "$d/pshard-trace-rank-2.json" 2 3 "$(rec all_gather 4 done)"
reported "a rank that never started" \
  "^rank 2 never started reduce_scatter seq 5 (step 3, w); ranks 0,1 waited for it 9.2 s" \
  "^rank 0 (srv-0): last reduce_scatter seq 5 (step 3, w) failed after 7.5 s, waiting on rank 2 \[trace: test\] (then 1 more issued that never ran)\|^rank 0 (srv-0): last reduce_scatter seq 5 (step 3, w) failed after 7.5 s, waiting on rank 2 (then 1 more issued that never ran)" \
  "^rank 2 (srv-2): last all_gather seq 4 (step 3, w) done" \
  "no two ranks ran different descriptors"
rm "$d/pshard-trace-rank-2.json"
reported "a rank that never started and left no file" \
  "^1 rank left no trace file: 2" \
  "^rank 2 never started reduce_scatter seq 5 (step 3, w) (it left no trace file; the ranks that waited name it)"
newdir
trace "$d/pshard-trace-rank-0.json" 0 2 "$(rec all_gather 4 done)"
trace "$d/pshard-trace-rank-1.json" 1 2 "$(rec all_reduce 4 failed 's/"tag":7/"tag":9/')"
reported "a desync" "^desync at seq 4: rank 0 ran all_gather fp32 count 64 tag 0x7 (step 3, w), rank 1 ran all_reduce fp32 count 64 tag 0x9 (step 3, w)"
newdir
trace "$d/pshard-trace-rank-0.json" 0 2 "$(rec all_gather 4 done 's/"label":"step 3, w"/"label":"\\u001b[31mred\\u0007x"/')"
trace "$d/pshard-trace-rank-1.json" 1 2
reported "control characters and an empty record list" "^rank 0 (srv-0): last all_gather seq 4 (?\[31mred?x) done" \
  "^rank 1 (srv-1): no operation started" "^rank 1 never started all_gather seq 4"
if grep -q $'\x1b' "$d.out"; then fail "an escape from a label reached the terminal"; fi

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
