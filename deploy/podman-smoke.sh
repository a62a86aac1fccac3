#!/usr/bin/env bash
# Container smoke test with podman, no registry needed: builds a Debian 12 base image with
# debootstrap (once; cached as an image), builds pshard's server image from deploy/Containerfile
# and the trainer image from deploy/Containerfile.trainer on it (PyPI's torch, through a pip
# cache kept on this machine), runs a coordinator and two shard servers (and a trainer beside
# each, sharing the server's network and IPC namespaces as in the Kubernetes pod: first the C
# example from the server image, then, as a second job on the same coordinator with two more
# servers, the PyTorch example from the trainer image) on a user-defined network with
# the Kubernetes manifests' hardening (read-only root, no capabilities, non-root), checks
# health from outside through published ports, stops everything with SIGTERM and checks that
# each server exited 0 within the grace period. Removes the containers and the network it
# made; keeps the images as a cache.
#
# Usage: deploy/podman-smoke.sh [--pshardctl BIN|none]
#   --pshardctl BIN  a pshardctl on this machine for the checks from outside (default:
#                    build/tools/pshardctl if built); 'none' or no build: the image's own,
#                    run inside the coordinator's container
# Environment: PSHARD_DEBIAN_MIRROR (default: the bookworm mirror apt uses here),
#   PSHARD_SMOKE_STATE (default /var/tmp/pshard-podman: containers.conf and the build log),
#   PSHARD_REFRESH_BASE=1 rebuilds the Debian base image, PSHARD_SMOKE_TORCH=0 leaves out the
#   trainer image and the PyTorch run.
# Needs root and: apt-get install podman buildah runc uidmap debootstrap
# Exit status: 0 passed, 1 failed, 77 skipped (not root, podman/debootstrap missing, or PyPI not
#   reachable for the trainer image).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
pshardctl=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --pshardctl) pshardctl=$2; shift 2 ;;
        *) echo "usage: $0 [--pshardctl BIN|none]" >&2; exit 2 ;;
    esac
done
if [[ -z "$pshardctl" && -x "$root/build/tools/pshardctl" ]]; then
    pshardctl="$root/build/tools/pshardctl"
elif [[ "$pshardctl" == none ]]; then
    pshardctl=""
fi

skip() { echo "podman-smoke: SKIP: $*" >&2; exit 77; }
fail() { echo "podman-smoke: FAIL: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || skip "needs root (rootful podman, debootstrap)"
for tool in podman debootstrap; do
    command -v "$tool" >/dev/null ||
        skip "$tool is missing: apt-get install podman buildah runc uidmap debootstrap"
done

state=${PSHARD_SMOKE_STATE:-/var/tmp/pshard-podman}
mkdir -p "$state"
# This machine's podman needs runc (crun is not installed) and explicit ulimits.
export CONTAINERS_CONF="$state/containers.conf"
cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
# One run at a time: the base image and the names below are shared.
exec 8>"$state/lock"
flock 8

base_image=localhost/pshard-debian:bookworm-minbase
image=localhost/pshard:smoke
trainer_image=localhost/pshard-trainer:smoke
with_torch=${PSHARD_SMOKE_TORCH:-1}
# pip's cache for the trainer image's build (torch and the CUDA libraries it links: about 2.5 GB
# to fetch once).
pip_cache="$state/pip-cache"
mkdir -p "$pip_cache"
# The CA bundle pip uses here (PIP_CERT, e.g. for a proxy in front of PyPI), for the build's pip.
pip_ca=()
pip_cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
if [[ -n "$pip_cert" && -s "$pip_cert" ]]; then
    pip_ca=(-v "$pip_cert:/run/pip-ca.crt:ro")
fi
if [[ "$with_torch" == 1 ]] && ! python3 - <<'EOF'
import os, sys, urllib.request
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/torch/"
try:
    urllib.request.urlopen(url, timeout=20)
except Exception as e:
    print(f"podman-smoke: {url}: {e}", file=sys.stderr)
    sys.exit(1)
EOF
then
    skip "PyPI is not reachable for the trainer image (PSHARD_SMOKE_TORCH=0 runs the rest)"
fi
run_id="pshard-smoke-$$"
grace=30   # seconds, as terminationGracePeriodSeconds in the manifests
t0=$SECONDS
phase() { echo "podman-smoke: [$((SECONDS - t0)) s] $*"; }

# --- the Debian base image ---------------------------------------------------------------
# The mirrors apt uses on this machine for bookworm and bookworm-security (deb822 .sources
# files, else one-line sources.list); containers reach the same ones.
read -r mirror security_mirror < <(python3 - <<'EOF'
import glob, re
main = sec = None
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
        if "deb" not in fields.get("Types", "").split() or fields.get("Enabled") == "no":
            continue
        uri, suites = fields.get("URIs", "").split()[:1], fields.get("Suites", "").split()
        if uri and "bookworm" in suites and not main:
            main = uri[0]
        if uri and "bookworm-security" in suites and not sec:
            sec = uri[0]
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m and m.group(2) == "bookworm" and not main:
            main = m.group(1)
        if m and m.group(2) == "bookworm-security" and not sec:
            sec = m.group(1)
main = main or "http://deb.debian.org/debian"
print(main, sec or main.rstrip("/") + "-security")
EOF
)
mirror=${PSHARD_DEBIAN_MIRROR:-$mirror}

if [[ "${PSHARD_REFRESH_BASE:-0}" == 1 ]] || ! podman image exists "$base_image"; then
    phase "building $base_image with debootstrap from $mirror"
    rootfs="$state/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$state/debootstrap.log" 2>&1 ||
        { tail -20 "$state/debootstrap.log"; fail "debootstrap failed ($state/debootstrap.log)"; }
    rm -f "$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security_mirror
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # Nothing of this machine's identity or caches in the image.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    : >"$rootfs/etc/resolv.conf"
    : >"$rootfs/etc/hostname"
    tar -C "$rootfs" --numeric-owner -c . |
        podman import --quiet --change 'CMD ["/bin/bash"]' - "$base_image" >/dev/null
    rm -rf "$rootfs"
else
    phase "reusing $base_image"
fi

# --- the image ------------------------------------------------------------------------------
phase "building $image from deploy/Containerfile"
# Host networking for RUN steps: apt reaches the mirror the same way the host does.
if ! podman build --network host -f "$root/deploy/Containerfile" \
        --build-arg BUILD_BASE="$base_image" --build-arg RUNTIME_BASE="$base_image" \
        -t "$image" "$root" >"$state/build.log" 2>&1; then
    tail -40 "$state/build.log"
    fail "image build failed (log: $state/build.log)"
fi
# Builds leave their earlier layers behind as untagged images; keep a day of them as cache.
podman image prune -f --filter until=24h >/dev/null || true
size=$(podman image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}')
phase "image built ($size)"

user=$(podman image inspect -f '{{.Config.User}}' "$image")
[[ "$user" == 10001:10001 ]] || fail "image user is '$user', not 10001:10001"
entry=$(podman image inspect -f '{{join .Config.Entrypoint " "}}' "$image")
[[ "$entry" == "/usr/bin/tini --" ]] || fail "image entrypoint is '$entry', not tini"
in_image() { podman run --rm --network none "$image" "$@"; }
[[ $(in_image id -u) == 10001 ]] || fail "the image does not run as uid 10001"
# Only runtime libraries: no compiler, linker or -dev package.
# shellcheck disable=SC2016  # dpkg-query's own ${...} format, not the shell's
build_tools=$(in_image dpkg-query -W -f '${Package} ${db:Status-Status}\n' |
    awk '$2 == "installed" {print $1}' |
    grep -E '^(gcc|cpp|g\+\+|binutils|make|cmake)(-[0-9]+)?$|-dev$' || true)
[[ -z "$build_tools" ]] || fail "the runtime image holds build tools: $build_tools"
for b in pshard-coordinator pshard-server pshardctl pshardrun pshard-mlp; do
    in_image "$b" --version >/dev/null || fail "$b --version failed in the image"
done
phase "image: user 10001, tini entrypoint, no build tools, all five binaries run"

if [[ "$with_torch" == 1 ]]; then
    phase "building $trainer_image from deploy/Containerfile.trainer"
    if ! podman build --network host -f "$root/deploy/Containerfile.trainer" \
            -v "$pip_cache:/var/cache/pip" "${pip_ca[@]}" \
            --build-arg BUILD_BASE="$base_image" --build-arg RUNTIME_BASE="$base_image" \
            -t "$trainer_image" "$root" >"$state/build-trainer.log" 2>&1; then
        tail -40 "$state/build-trainer.log"
        fail "trainer image build failed (log: $state/build-trainer.log)"
    fi
    podman image prune -f --filter until=24h >/dev/null || true
    size=$(podman image inspect -f '{{.Size}}' "$trainer_image" |
        awk '{printf "%.0f MB", $1 / 1e6}')
    user=$(podman image inspect -f '{{.Config.User}}' "$trainer_image")
    [[ "$user" == 10001:10001 ]] || fail "trainer image user is '$user', not 10001:10001"
    [[ $(podman run --rm --network none "$trainer_image" id -u) == 10001 ]] ||
        fail "the trainer image does not run as uid 10001"
    podman run --rm --network none "$trainer_image" python -c \
        'import torch, transformers, pshard.torch; assert not torch.cuda.is_available()' ||
        fail "the trainer image cannot import torch, transformers and pshard.torch"
    phase "trainer image built ($size): user 10001, imports torch, transformers, pshard.torch"
fi

# --- a small cluster ------------------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/pshard-smoke.XXXXXX")
containers=()
network=""
cleanup() {
    for ((i = ${#containers[@]} - 1; i >= 0; i--)); do
        podman rm -f -t 0 "${containers[i]}" >/dev/null 2>&1 || true
    done
    if [[ -n "$network" ]]; then podman network rm -f "$network" >/dev/null 2>&1 || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

network="$run_id"
podman network create "$network" >/dev/null
subnet=$(podman network inspect -f '{{range .Subnets}}{{.Subnet}}{{end}}' "$network")
[[ "$subnet" =~ ^([0-9]+\.[0-9]+\.[0-9]+)\.0/24$ ]] || fail "unexpected subnet '$subnet'"
net=${BASH_REMATCH[1]}
coord_ip=$net.10

head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
chmod 0755 "$work" && chmod 0644 "$work/token"
# The same hardening as the manifests' securityContext.
harden=(--read-only --read-only-tmpfs=false --tmpfs "/tmp:rw,size=64m" --cap-drop ALL
        --security-opt no-new-privileges
        -v "$work/token:/etc/pshard/secrets/token:ro"
        -e PSHARD_TOKEN_FILE=/etc/pshard/secrets/token)

start() { containers+=("$1"); podman run -d --name "$@" >/dev/null; }
start "$run_id-coordinator" --network "$network" --ip "$coord_ip" -p 127.0.0.1::29500 \
    "${harden[@]}" "$image" pshard-coordinator --world-size 2
for r in 0 1; do
    ip=$net.2$r
    start "$run_id-server-$r" --network "$network" --ip "$ip" -p 127.0.0.1::29600 \
        --shm-size 256m --ipc shareable -e PSHARD_NAME="pshard-server-$r" "${harden[@]}" \
        "$image" pshard-server --coordinator "$coord_ip:29500" --listen 0.0.0.0:29600 \
        --advertise "$ip:29600" --data-host "$ip"
done
host_port() { podman port "$1" "$2/tcp" | head -n1 | sed 's/.*://'; }
coord_addr=127.0.0.1:$(host_port "$run_id-coordinator" 29500)

# pshardctl: from outside through the published port (OUTSIDE), or without a pshardctl here,
# the image's own inside the coordinator's container (INSIDE, on the podman network).
ctl() {   # OUTSIDE INSIDE ARGS...
    local outside=$1 inside=$2; shift 2
    if [[ -n "$pshardctl" ]]; then
        env -u PSHARD_TOKEN_FILE "$pshardctl" --coordinator "$outside" --timeout-ms 3000 "$@"
    else
        podman exec "$run_id-coordinator" pshardctl --coordinator "$inside" --timeout-ms 3000 "$@"
    fi
}
wait_healthy() {   # OUTSIDE INSIDE SERVICE: poll until SERVING, 90 s at most
    local deadline=$((SECONDS + 90))
    until ctl "$1" "$2" health "$3" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || { ctl "$1" "$2" health "$3" || true; return 1; }
        sleep 0.5
    done
}
where="from outside" ctl_token="$work/token"
if [[ -z "$pshardctl" ]]; then
    where="from inside the coordinator's container" ctl_token=/etc/pshard/secrets/token
fi
wait_healthy "$coord_addr" "$coord_ip:29500" pshard.Cluster ||
    { podman logs "$run_id-coordinator" | tail -20; fail "the cluster did not form"; }
phase "$where: $(ctl "$coord_addr" "$coord_ip:29500" health pshard.Cluster)"
for r in 0 1; do
    addr=127.0.0.1:$(host_port "$run_id-server-$r" 29600)
    wait_healthy "$addr" "$net.2$r:29600" pshard.ShardServer ||
        fail "shard server $r is not SERVING"
    phase "$where, shard server $r: $(ctl "$addr" "$net.2$r:29600" health pshard.ShardServer)"
done
ctl "$coord_addr" "$coord_ip:29500" --token-file "$ctl_token" --json status \
    >"$work/status.json" || fail "status with the token failed"
# Ranks follow the member names (what the trainer Job's trainer-INDEX names rely on).
python3 - "$work/status.json" <<'EOF' || fail "ranks do not follow the names (status above)"
import json, sys
status = json.load(open(sys.argv[1]))
ranks = {m["name"]: m["rank"] for m in status["members"] if m.get("role") == "shard_server"}
if ranks != {"pshard-server-0": 0, "pshard-server-1": 1}:
    print(json.dumps(status, indent=1), file=sys.stderr)
    sys.exit(1)
EOF
if [[ -n "$pshardctl" ]] && ctl "$coord_addr" - status >/dev/null 2>&1; then
    fail "status without the token succeeded"
fi
podman exec "$run_id-coordinator" pshardctl --coordinator 127.0.0.1:29500 \
    --token-file /etc/pshard/secrets/token members >/dev/null ||
    fail "pshardctl in the image failed"
phase "status: ranks follow the names; it needs the token; pshardctl in the image works"

# Trainers as in the pod: the shard server's localhost and /dev/shm.
for r in 0 1; do
    start "$run_id-trainer-$r" --network "container:$run_id-server-$r" \
        --ipc "container:$run_id-server-$r" "${harden[@]}" -e RANK=$r -e WORLD_SIZE=2 \
        -e LOCAL_RANK=0 -e PSHARD_SERVER=127.0.0.1:29600 -e OPENBLAS_NUM_THREADS=1 \
        "$image" pshard-mlp --steps 5 --widths 64,64
done
for r in 0 1; do
    rc=$(timeout 180 podman wait "$run_id-trainer-$r") || rc=timeout
    [[ "$rc" == 0 ]] || { podman logs "$run_id-trainer-$r" | tail -20
                          fail "trainer $r exited with $rc"; }
done
phase "trainers trained through shared memory: $(podman logs "$run_id-trainer-0" 2>&1 |
    grep '^step' | tail -n1)"

# The PyTorch example from the trainer image, as a second job on the same coordinator (its own
# members and ranks: the servers above keep theirs), against two more servers from the server
# image, each trainer beside its server as in the Kubernetes pod.
if [[ "$with_torch" == 1 ]]; then
    job=torch-smoke
    for r in 0 1; do
        ip=$net.3$r
        start "$run_id-tserver-$r" --network "$network" --ip "$ip" --shm-size 256m \
            --ipc shareable -e PSHARD_NAME="trainer-$r" -e PSHARD_JOB=$job "${harden[@]}" \
            "$image" pshard-server --coordinator "$coord_ip:29500" --listen 0.0.0.0:29600 \
            --advertise "$ip:29600" --data-host "$ip"
    done
    t1=$SECONDS
    for r in 0 1; do
        start "$run_id-torch-$r" --network "container:$run_id-tserver-$r" \
            --ipc "container:$run_id-tserver-$r" "${harden[@]}" -e RANK=$r -e WORLD_SIZE=2 \
            -e LOCAL_RANK=0 -e PSHARD_SERVER=127.0.0.1:29600 -e PSHARD_JOB=$job \
            -e PSHARD_COORDINATOR="$coord_ip:29500" -e OMP_NUM_THREADS=1 \
            "$trainer_image" python /opt/pshard/examples/torch/train_lm.py --steps 6 \
            --layers 1 --d-model 64 --heads 2 --seq 32 --batch 2 --text-bytes 65536 \
            --warmup 2 --print-every 3
    done
    for r in 0 1; do
        rc=$(timeout 300 podman wait "$run_id-torch-$r") || rc=timeout
        [[ "$rc" == 0 ]] || { podman logs "$run_id-torch-$r" 2>&1 | tail -30
                              podman logs "$run_id-tserver-$r" 2>&1 | tail -10
                              fail "PyTorch trainer $r exited with $rc"; }
    done
    last=$(podman logs "$run_id-torch-0" 2>&1 | grep '^step' | tail -n1 || true)
    [[ "$last" == "step 6 "* ]] || { podman logs "$run_id-torch-0" 2>&1 | tail -30
                                     fail "the PyTorch example did not reach step 6"; }
    phase "PyTorch example trained from the trainer image in $((SECONDS - t1)) s: $last"
fi

# --- stop with SIGTERM --------------------------------------------------------------------
stop_check() {   # NAME: podman stop sends SIGTERM, SIGKILL only after the grace period
    local t1=$SECONDS code
    podman stop -t "$grace" "$1" >/dev/null
    code=$(podman inspect -f '{{.State.ExitCode}}' "$1")
    [[ "$code" == 0 ]] || { podman logs "$1" | tail -20; fail "$1 exited $code after SIGTERM"; }
    phase "$1 stopped by SIGTERM: exit 0 after $((SECONDS - t1)) s (grace $grace s)"
}
for r in 0 1; do stop_check "$run_id-server-$r"; done
if [[ "$with_torch" == 1 ]]; then
    for r in 0 1; do stop_check "$run_id-tserver-$r"; done
fi
stop_check "$run_id-coordinator"
# And the server itself as PID 1, without tini in front.
start "$run_id-pid1" --network none --entrypoint pshard-coordinator "${harden[@]}" "$image" \
    --world-size 1
for _ in $(seq 100); do
    podman logs "$run_id-pid1" 2>&1 | grep -q 'listening on' && break
    sleep 0.1
done
stop_check "$run_id-pid1"

phase "passed"
