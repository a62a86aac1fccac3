#!/usr/bin/env bash
# A shard server cut off from the network: two network namespaces this test creates, joined by
# a veth pair on 10.231.X.0/24 (addresses only inside them). Namespace A holds the coordinator,
# shard server 0 and trainer 0; namespace B shard server 1 and trainer 1, so every client is
# inside a namespace too. Once training runs, B's end of the link goes down. Then:
#  - trainer 0 must fail naming the lost member (rank 1 or trainer-1): the coordinator evicts
#    them when their leases lapse and server 0 stops its ring;
#  - trainer 1 must fail too: its server, cut off from the coordinator for longer than the
#    lease with a collective stalled as long, counts itself evicted;
# both within lease + 1 s (+ 2 s slack). Skips (77) where `ip netns` is not permitted.
# usage: test_netcut.sh COORDINATOR SERVER PSHARD-MLP
set -euo pipefail
coord_bin="$1"
server_bin="$2"
mlp="$3"
LEASE_MS=2000
HB_MS=500
BOUND_MS=$((LEASE_MS + 1000 + 2000))
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
. "$(dirname "$0")/netns_pair.sh" 231 nc
gone() { ! kill -0 "$1" 2>/dev/null; }
steps_printed() { [ "$(grep -c '^step' "$1" 2>/dev/null || true)" -ge "$2" ]; }

ip netns exec "$nsa" "$coord_bin" --listen "$ipa:0" --port-file "$work/coord.port" --world-size 2 \
  --lease-ms "$LEASE_MS" --heartbeat-ms "$HB_MS" > "$work/coord.log" 2>&1 &
pids+=($!)
wait_for 20 test -s "$work/coord.port"
caddr="$ipa:$(cat "$work/coord.port")"
# The namespaces stand for two hosts, whose ring goes through the sockets: on one real host the
# servers would share memory (the same-host transport), which no network cut separates.
ip netns exec "$nsa" "$server_bin" --coordinator "$caddr" --listen 127.0.0.1:0 --data-host "$ipa" \
  --transport tcp --port-file "$work/s0.port" --name pshard-server-0 > "$work/s0.log" 2>&1 &
pids+=($!)
ip netns exec "$nsb" "$server_bin" --coordinator "$caddr" --listen 127.0.0.1:0 --data-host "$ipb" \
  --transport tcp --port-file "$work/s1.port" --name pshard-server-1 > "$work/s1.log" 2>&1 &
pids+=($!)
wait_for 20 test -s "$work/s0.port"
wait_for 20 test -s "$work/s1.port"
tp=()
for r in 0 1; do
  ns=$nsa; [ "$r" = 1 ] && ns=$nsb
  ip netns exec "$ns" env RANK=$r WORLD_SIZE=2 PSHARD_SERVER="127.0.0.1:$(cat "$work/s$r.port")" \
    "$mlp" --steps 100000000 --widths 32,32 --input 16 --output 4 --batch 4 --print-every 1 \
    > "$work/t$r.out" 2> "$work/t$r.err" &
  tp[$r]=$!
  pids+=("${tp[$r]}")
done
wait_for 60 steps_printed "$work/t0.out" 3

echo "== link of namespace B (shard server 1, trainer 1) down"
t0=$(now_ms)
ip -n "$nsb" link set "$vb" down
check() { # RANK PATTERN
  local r="$1" pattern="$2"
  if ! wait_for $(( (BOUND_MS + 999) / 1000 )) gone "${tp[$r]}"; then
    echo "FAIL: trainer $r still runs $(( $(now_ms) - t0 )) ms after the cut"; fails=$((fails + 1)); return
  fi
  local took=$(( $(now_ms) - t0 )) code=0
  wait "${tp[$r]}" || code=$?
  if [ "$code" -eq 0 ] || ! grep -Eq -- "$pattern" "$work/t$r.err"; then
    echo "FAIL: trainer $r exited $code without naming the loss ($pattern):"; cat "$work/t$r.err"
    fails=$((fails + 1))
  elif [ "$took" -gt "$BOUND_MS" ]; then
    echo "FAIL: trainer $r took $took ms (bound $BOUND_MS)"; fails=$((fails + 1))
  else
    echo "ok: trainer $r failed after $took ms: $(grep -Em1 -- "$pattern" "$work/t$r.err" | cut -c1-200)"
  fi
}
check 0 "rank 1|trainer-1"
check 1 "lost contact with the coordinator"
if [ "$fails" -ne 0 ]; then exit 1; fi
echo "both sides of the cut reported it within lease + 1 s (+ slack)"
