# Sourced by the tests that run processes in two network namespaces of their own: makes
# namespaces $nsa and $nsb joined by a veth pair ($va in A, $vb in B) on 10.$1.X.0/24 with
# addresses $ipa and $ipb (only inside them), loopback up in both; registers the cleanup
# (kill -9 every PID in $pids, delete both namespaces, keep $work when $fails is non-zero);
# defines now_ms and wait_for SECONDS CMD.... Exits 77 (skip) where `ip netns` is not
# permitted. Needs $work set; usage: . netns_pair.sh SECOND_OCTET NAME_PREFIX
id=$$
nsa="pshard-$2a-$id"
nsb="pshard-$2b-$id"
va="$2a$id"
vb="$2b$id"
net="10.$1.$((id % 250)).0"
ipa="${net%.0}.1"
ipb="${net%.0}.2"
pids=()
fails=0

netns_cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del "$nsa" 2>/dev/null || true
  ip netns del "$nsb" 2>/dev/null || true
  if [ "$fails" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work"; fi
}
trap netns_cleanup EXIT

if ! ip netns add "$nsa" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here (needs root and CAP_SYS_ADMIN)"
  exit 77
fi
ip netns add "$nsb"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$nsa"
ip link set "$vb" netns "$nsb"
ip -n "$nsa" addr add "$ipa/24" dev "$va"
ip -n "$nsb" addr add "$ipb/24" dev "$vb"
for ns in "$nsa" "$nsb"; do ip -n "$ns" link set lo up; done
ip -n "$nsa" link set "$va" up
ip -n "$nsb" link set "$vb" up

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
wait_for() {
  local end=$(( $(now_ms) + $1 * 1000 )); shift
  until "$@"; do
    [ "$(now_ms)" -gt "$end" ] && return 1
    sleep 0.02
  done
}
