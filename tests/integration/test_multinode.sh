#!/usr/bin/env bash
# Multi-node launch as torchrun's: two pshardrun "nodes" in two network namespaces this test
# creates, joined by a veth pair on 10.232.X.0/24 (addresses only inside them; every process,
# clients included, runs inside one). Node 0 (namespace A) starts the coordinator on
# --rdzv-endpoint A:0 and prints the port it got; node 1 (namespace B) joins it there. Each node
# runs 2 shard servers and 2 trainers (shard_trainer, which checks its training against the
# single-process reference) with PSHARD_TRANSPORT=tcp, so the data crosses the veth. Checks:
# both nodes exit 0, each trainer matched the reference, RANK = node * 2 + LOCAL_RANK and
# torchrun's other variables (MASTER_PORT: node 0's pick for torch's TCPStore, the same on
# both nodes, not the coordinator's), and the rings listen on the nodes' veth addresses. Skips (77)
# where `ip netns` is not permitted.
# usage: test_multinode.sh PSHARDRUN SHARD_TRAINER
set -euo pipefail
run="$1"
trainer="$2"
work=$(mktemp -d)
. "$(dirname "$0")/netns_pair.sh" 232 mn
fail() { echo "FAIL: $*"; fails=1; }

# Each trainer writes torchrun's variables, then trains 6 AdamW steps against the reference.
cmd='echo "trainer says rank $RANK"; env | grep -E "^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)=" | sort > "$OUT/env-$RANK"; exec "$TRAINER" "$PSHARD_SERVER" "$RANK" "$WORLD_SIZE" fsdp2 adamw fp32 6'
export OUT="$work" TRAINER="$trainer" PSHARD_TRANSPORT=tcp PSHARD_LOG=info
unset PSHARD_LOG_SUBSYS PSHARD_COORDINATOR PSHARD_SERVER PSHARD_SOCKET_IFNAME PSHARD_DATA_HOST RANK WORLD_SIZE \
  MASTER_ADDR MASTER_PORT || true

ip netns exec "$nsa" "$run" --nnodes 2 --node-rank 0 --nproc-per-node 2 \
  --rdzv-endpoint "$ipa:0" -- sh -c "$cmd" > "$work/node0.log" 2>&1 &
pids+=($!)
node0=$!
found() { grep -q "coordinator for 2 nodes on $ipa:[0-9]" "$work/node0.log"; }
if ! wait_for 30 found; then
  fail "node 0 did not say where its coordinator listens"; cat "$work/node0.log"; exit 1
fi
endpoint=$(grep -o "coordinator for 2 nodes on $ipa:[0-9]*" "$work/node0.log" | head -1 | awk '{print $NF}')
ip netns exec "$nsb" "$run" --nnodes 2 --node-rank 1 --nproc-per-node 2 \
  --rdzv-endpoint "$endpoint" -- sh -c "$cmd" > "$work/node1.log" 2>&1 &
pids+=($!)
node1=$!

rc0=0; rc1=0
deadline=$(( $(now_ms) + 150000 ))
while kill -0 "$node0" 2>/dev/null || kill -0 "$node1" 2>/dev/null; do
  if [ "$(now_ms)" -gt "$deadline" ]; then fail "the nodes did not finish in 150 s"; break; fi
  sleep 0.1
done
wait "$node0" || rc0=$?
wait "$node1" || rc1=$?
[ "$rc0" -eq 0 ] || fail "node 0 exited $rc0"
[ "$rc1" -eq 0 ] || fail "node 1 exited $rc1"
grep -q "rank 0: 6 steps match the single-process reference" "$work/node0.log" ||
  fail "rank 0 did not match the reference"
for r in 0 1 2 3; do
  f="$work/env-$r"
  [ -f "$f" ] || { fail "trainer $r did not run"; continue; }
  node=$((r / 2)); local_rank=$((r % 2))
  for want in "RANK=$r" "LOCAL_RANK=$local_rank" "WORLD_SIZE=4" "LOCAL_WORLD_SIZE=2" \
              "GROUP_RANK=$node" "GROUP_WORLD_SIZE=2" "MASTER_ADDR=$ipa"; do
    grep -qx "$want" "$f" || fail "trainer $r: no $want in $(tr '\n' ' ' < "$f")"
  done
  # MASTER_PORT: node 0's pick for torch's TCPStore (published through the coordinator's
  # store), the same on both nodes, never the gRPC coordinator's port.
  mport=$(sed -n 's/^MASTER_PORT=//p' "$f")
  [ -n "$mport" ] && [ "$mport" != "${endpoint##*:}" ] ||
    fail "trainer $r: MASTER_PORT '$mport' is empty or the coordinator's port ${endpoint##*:}"
  [ "$r" -eq 0 ] && mport0=$mport
  [ "$mport" = "$mport0" ] || fail "trainer $r: MASTER_PORT $mport, trainer 0 has $mport0"
done
# Each node's trainers are labelled with their global ranks, and the rings linked over the
# veth addresses (the coll lines name them).
grep -q "^\[trainer 3\] trainer says rank 3" "$work/node1.log" ||
  fail "node 1's output lacks '[trainer 3] trainer says rank 3'"
grep -q "linked to .*($ipb:" "$work/node0.log" || grep -q "linked to .*($ipb:" "$work/node1.log" ||
  fail "no ring link to node 1's address $ipb"
if [ "$fails" -ne 0 ]; then
  echo "---- node 0"; tail -40 "$work/node0.log"; echo "---- node 1"; tail -40 "$work/node1.log"
  exit 1
fi
echo "ok: 2 nodes x 2 ranks trained to the reference over $ipa/$ipb"
