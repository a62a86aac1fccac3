#!/usr/bin/env bash
# Creates (once) the Python virtual environment the integration tests run in: grpcio with
# health checking and reflection, and prometheus-client (whose parser reads /metrics in
# metrics_test.py), which Debian does not package. Safe to run concurrently
# (flock) and quick when the environment already matches (a stamp file).
#
# Usage: scripts/test-venv.sh [VENV_DIR]   (default: build/.venv)
# Exit status: 0 when the venv is ready; non-zero with pip's own error when it cannot be made.
set -euo pipefail

venv_dir="${1:-build/.venv}"

# Debian's interpreter, not a pyenv shim that may be first on PATH.
python="${PSHARD_TEST_PYTHON:-/usr/bin/python3}"

# Pinned to versions known to interoperate with the coordinator; bump together.
packages=(
    "grpcio==1.85.3"
    "grpcio-health-checking==1.85.1"
    "grpcio-reflection==1.85.1"
    "protobuf==7.36.2"
    "prometheus-client==0.26.0"
)

if [[ ! -x "$python" ]]; then
    echo "test-venv: $python not found; install python3 and python3-venv (Debian)" >&2
    exit 1
fi

mkdir -p "$(dirname "$venv_dir")"
lock="${venv_dir}.lock"
stamp_text="$("$python" --version 2>&1) ${packages[*]}"

exec 9>"$lock"
flock 9

stamp="$venv_dir/.pshard-stamp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" && -x "$venv_dir/bin/python" ]]; then
    echo "test-venv: $venv_dir is ready ($stamp_text)"
    exit 0
fi

# A venv made from an older package list: install what changed into it (pip keeps what already
# matches) instead of making it anew under a test that may be using it.
if [[ -f "$venv_dir/pyvenv.cfg" && -x "$venv_dir/bin/python" && -f "$stamp" &&
      "$(head -c 64 "$stamp")" == "$("$python" --version 2>&1)"* ]]; then
    echo "test-venv: updating $venv_dir"
    if "$venv_dir/bin/python" -m pip install --disable-pip-version-check --no-input -q \
            "${packages[@]}" &&
        "$venv_dir/bin/python" -c 'import grpc, grpc_health.v1, grpc_reflection.v1alpha, google.protobuf, prometheus_client.parser'; then
        printf '%s\n' "$stamp_text" >"$stamp"
        echo "test-venv: $venv_dir is ready ($stamp_text)"
        exit 0
    fi
    echo "test-venv: updating $venv_dir failed; making it anew" >&2
fi

# Replace only what is a virtual environment (or nothing): never wipe an unrelated folder.
if [[ -e "$venv_dir" && ! -f "$venv_dir/pyvenv.cfg" && -n "$(ls -A "$venv_dir" 2>/dev/null)" ]]; then
    echo "test-venv: $venv_dir exists and is not a virtual environment; not replacing it" >&2
    exit 1
fi
echo "test-venv: creating $venv_dir with $python"
rm -rf "$venv_dir"
if ! "$python" -m venv "$venv_dir"; then
    echo "test-venv: '$python -m venv' failed; on Debian install python3-venv" >&2
    rm -rf "$venv_dir"
    exit 1
fi

# Quiet progress, but pip's errors go to stderr as they are.
if ! "$venv_dir/bin/python" -m pip install --disable-pip-version-check --no-input -q \
        "${packages[@]}"; then
    echo "test-venv: pip install ${packages[*]} failed (see above)" >&2
    rm -rf "$venv_dir"
    exit 1
fi

"$venv_dir/bin/python" -c 'import grpc, grpc_health.v1, grpc_reflection.v1alpha, google.protobuf, prometheus_client.parser'
printf '%s\n' "$stamp_text" >"$stamp"
echo "test-venv: $venv_dir is ready ($stamp_text)"
