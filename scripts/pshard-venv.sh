#!/usr/bin/env bash
# Makes the Python virtual environment with torch (scripts/torch-venv.sh, reused when it is
# already there) and installs the pshard package from this checkout into it with pip: its
# extension module and the pshard programs (pshardrun, pshard-server, ...) are built by the
# project's CMake through scikit-build-core (an incremental build under
# client/python/build/). Prints the venv's path on its last line.
#
# Usage: scripts/pshard-venv.sh [VENV_DIR]   (default: build/torch-venv)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv_dir="${1:-$root/build/torch-venv}"
# absolute: the import check below runs from /
[[ "$venv_dir" == /* ]] || venv_dir="$PWD/$venv_dir"
"$root/scripts/torch-venv.sh" "$venv_dir" >&2
exec 9>"${venv_dir}.lock"
flock 9
# pip builds in the package's one build folder (client/python/build/<wheel tag>), whichever the
# venv: two of these scripts at once, for two venvs, take turns there.
mkdir -p "$root/client/python/build"
exec 8>"$root/client/python/build/.pshard-venv.lock"
flock 8
log="${venv_dir}.pshard.log"
if ! "$venv_dir/bin/python" -m pip install --disable-pip-version-check --no-input -q \
        --no-build-isolation --config-settings=cmake.define.PSHARD_WERROR=ON \
        "$root/client/python" >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "pshard-venv: pip install ./client/python failed (whole log: $log)" >&2
    exit 1
fi
(cd / && "$venv_dir/bin/python" -c 'import pshard, pshard.torch, pshard.distributed') || {
    echo "pshard-venv: pshard does not import in $venv_dir" >&2
    exit 1
}
echo "$venv_dir"
