#!/usr/bin/env bash
# Checks pshard's Kubernetes manifests offline (no cluster needed): renders the overlays (cpu
# and gpu: an Indexed Job; jobset: a JobSet) with 'kubectl kustomize', validates every built-in
# object against the Kubernetes API schemas in strict mode (unknown fields fail) with the
# pinned kubernetes-validate (custom resources, which have no schema here, and the Jobs inside
# a JobSet are checked by check_manifests.py's custom-resources check), then runs our own checks
# (tests/deploy/check_manifests.py) and their self-test, which breaks the manifests once per
# check to prove each check can fail. Also renders the README's "overlay of your own" example
# to make sure replacing the token and the image works.
#
# Usage: deploy/check-manifests.sh [--venv DIR] [--coordinator-bin BIN] [--server-bin BIN]
#   --venv             where to keep the Python environment (default build/deploy-venv)
#   --*-bin            the built binaries, whose --help gives the defaults checked against
#                      (default build/coordinator/pshard-coordinator, build/shard_server/...)
# Exit status: 0 passed, 1 a check failed, 77 skipped (no kubectl, or PyPI unreachable).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/build/deploy-venv"
coordinator_bin="$root/build/coordinator/pshard-coordinator"
server_bin="$root/build/shard_server/pshard-server"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --venv) venv=$2; shift 2 ;;
        --coordinator-bin) coordinator_bin=$2; shift 2 ;;
        --server-bin) server_bin=$2; shift 2 ;;
        *) echo "usage: $0 [--venv DIR] [--coordinator-bin BIN] [--server-bin BIN]" >&2; exit 2 ;;
    esac
done

# Kubernetes versions the schemas are checked against: the oldest these manifests support
# (1.29: native sidecars on by default) and a recent one.
read -r -a k8s_versions <<<"${PSHARD_K8S_VERSIONS:-1.29.0 1.34.0}"
overlays=(cpu gpu jobset)
# kubernetes-validate and everything it pulls in, pinned; bump together.
packages=(
    "kubernetes-validate==1.37.0"
    "jsonschema==4.26.0"
    "jsonschema-specifications==2025.9.1"
    "referencing==0.37.0"
    "rpds-py==2026.9.1"
    "attrs==26.1.0"
    "PyYAML==6.0.4"
    "packaging==26.4"
    "importlib_resources==7.1.0"
    "typing_extensions==4.16.0"
)
python="${PSHARD_TEST_PYTHON:-/usr/bin/python3}"

skip() { echo "check-manifests: SKIP: $*" >&2; exit 77; }

command -v kubectl >/dev/null || skip "kubectl is not installed (it renders the kustomizations)"
[[ -x "$python" ]] || skip "$python not found (install python3 and python3-venv)"
for b in "$coordinator_bin" "$server_bin"; do
    [[ -x "$b" ]] || { echo "check-manifests: $b not found; build first (scripts/build.sh)" >&2
                       exit 1; }
done

# The virtual environment, made once (flock against parallel runs, a stamp for the pins).
make_venv() {
    local stamp_text stamp="$venv/.pshard-stamp"
    stamp_text="$("$python" --version 2>&1) ${packages[*]}"
    mkdir -p "$(dirname "$venv")"
    exec 9>"$venv.lock"
    flock 9
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" && -x "$venv/bin/python" ]]; then
        return 0
    fi
    if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" && -n "$(ls -A "$venv" 2>/dev/null)" ]]; then
        echo "check-manifests: $venv exists and is not a virtual environment" >&2
        return 1
    fi
    echo "check-manifests: creating $venv"
    rm -rf "$venv"
    if ! "$python" -m venv "$venv"; then
        echo "check-manifests: python3 -m venv failed (install python3-venv)" >&2
        rm -rf "$venv"
        return 1
    fi
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q \
            "${packages[@]}"; then
        rm -rf "$venv"
        # Unreachable index: skip. Reachable but failing (a bad pin): a real failure.
        if ! "$python" - <<'EOF'
import os, sys, urllib.request
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/pyyaml/"
try:
    urllib.request.urlopen(url, timeout=20)
except Exception as e:
    print(f"check-manifests: {url}: {e}", file=sys.stderr)
    sys.exit(1)
EOF
        then
            return 77
        fi
        echo "check-manifests: pip install ${packages[*]} failed (see above)" >&2
        return 1
    fi
    printf '%s\n' "$stamp_text" >"$stamp"
    exec 9>&-
}
rc=0
make_venv || rc=$?
if [[ $rc -eq 77 ]]; then skip "PyPI is not reachable, cannot install kubernetes-validate"; fi
[[ $rc -eq 0 ]] || exit "$rc"

work=$(mktemp -d "${TMPDIR:-/tmp}/pshard-manifests.XXXXXX")
trap 'rm -rf "$work"' EXIT

status=0
for overlay in "${overlays[@]}"; do
    echo "=== overlay $overlay"
    kubectl kustomize "$root/deploy/k8s/overlays/$overlay" >"$work/$overlay.yaml"
    # The built-in objects alone (an API group of Kubernetes' own, or the core group).
    "$venv/bin/python" - "$work/$overlay.yaml" "$work/$overlay-builtin.yaml" <<'EOF'
import sys, yaml
builtin = ("apps", "batch", "policy", "networking.k8s.io", "rbac.authorization.k8s.io")
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
keep = [d for d in docs if "/" not in d["apiVersion"] or d["apiVersion"].split("/")[0] in builtin]
yaml.safe_dump_all(keep, open(sys.argv[2], "w"))
print(f"     {len(keep)} built-in objects, {len(docs) - len(keep)} custom resources")
EOF
    for v in "${k8s_versions[@]}"; do
        if "$venv/bin/kubernetes-validate" --strict --quiet -k "$v" "$work/$overlay-builtin.yaml"; then
            echo "ok   schemas of Kubernetes $v (strict)"
        else
            echo "FAIL schemas of Kubernetes $v (strict)"
            status=1
        fi
    done
    "$venv/bin/python" "$root/tests/deploy/check_manifests.py" --overlay "$overlay" \
        --coordinator-bin "$coordinator_bin" --server-bin "$server_bin" "$work/$overlay.yaml" \
        || status=1
done

echo "=== self-test: every check catches its breakage"
"$venv/bin/python" "$root/tests/deploy/check_manifests.py" --self-test \
    --coordinator-bin "$coordinator_bin" --server-bin "$server_bin" \
    "$work/cpu.yaml" "$work/gpu.yaml" "$work/jobset.yaml" >"$work/self-test.log" ||
    { cat "$work/self-test.log"
                                                                 status=1; }
echo "ok   breakages caught: $(grep -c '^ok' "$work/self-test.log" || true)"

# README's own-overlay example: the placeholder token and the image are replaced.
echo "=== an overlay of your own (README.md, Deploy)"
mine="$work/my-pshard"
mkdir -p "$mine"
printf 'not-the-placeholder\n' >"$mine/cluster-token"
cat >"$mine/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- $(realpath --relative-to="$mine" "$root/deploy/k8s/overlays/cpu")
images:
- name: pshard
  newName: registry.example.com/pshard
  newTag: 0.1.0
- name: pshard-trainer
  newName: registry.example.com/pshard-trainer
  newTag: 0.1.0
secretGenerator:
- name: pshard-secrets
  namespace: pshard
  behavior: replace
  files:
  - token=cluster-token
EOF
kubectl kustomize "$mine" >"$work/mine.yaml"
if "$venv/bin/python" - "$work/mine.yaml" <<'EOF'
import base64, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
secret = next(d for d in docs if d["kind"] == "Secret")
token = base64.b64decode(secret["data"]["token"]).decode()
pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")]
images = {c["image"] for p in pods for c in p.get("initContainers", []) + p["containers"]}
refs = {v["secret"]["secretName"] for p in pods for v in p["volumes"] if "secret" in v}
ok = (token == "not-the-placeholder\n" and refs == {secret["metadata"]["name"]}
      and images == {"registry.example.com/pshard:0.1.0",
                     "registry.example.com/pshard-trainer:0.1.0"})
print(("ok  " if ok else "FAIL") + f" token replaced, images {sorted(images)}, secret {refs}")
sys.exit(0 if ok else 1)
EOF
then :; else status=1; fi

if [[ $status -eq 0 ]]; then
    echo "check-manifests: all passed"
else
    echo "check-manifests: FAILED"
fi
exit $status
