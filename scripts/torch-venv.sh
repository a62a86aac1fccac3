#!/usr/bin/env bash
# Creates (once) the Python virtual environment that pshard's PyTorch package is built, tested
# and benchmarked in: PyPI's torch, transformers, safetensors, pytest and scikit-build-core.
# torch is installed lean where that works on these machines: the wheel without its CUDA
# dependencies finds CUDA 13 in /usr/local/cuda through the loader's cache, except for four
# libraries (about 520 MB) pinned as torch 2.15.0 pins them; when that does not import, the full
# wheel set (several GiB) is installed instead. Safe to run concurrently (flock) and quick when
# the environment already matches (a stamp file); pip's own cache makes a re-creation cheap.
#
# Usage: scripts/torch-venv.sh [VENV_DIR]   (default: build/torch-venv)
# Environment: TORCH_VERSION (2.15.0), PSHARD_TEST_PYTHON (/usr/bin/python3).
# Exit status: 0 when the venv is ready; 1 with pip's error (log path printed) otherwise.
set -euo pipefail

venv_dir="${1:-build/torch-venv}"
python="${PSHARD_TEST_PYTHON:-/usr/bin/python3}"
torch_version="${TORCH_VERSION:-2.15.0}"
# Pinned together; the stamp records them, so a change here re-creates the venv.
packages=(
    "transformers==5.23.0" "safetensors==0.8.0" "pytest==9.2.0" "scikit-build-core==1.1.2"
    numpy "setuptools>=77.0.3" filelock "typing-extensions>=4.13.0" "sympy>=1.13.3"
    "networkx>=2.5.1" jinja2 "fsspec>=0.8.5"
)
# What torch 2.15.0's wheel needs beyond /usr/local/cuda (see the header).
cuda_extras=("nvidia-cufile==1.17.1.22.*" "nvidia-cusparselt-cu13==0.8.1"
    "nvidia-nvshmem-cu13==3.7.2" "nvidia-nccl-cu13==2.30.7")

if [[ ! -x "$python" ]]; then
    echo "torch-venv: $python not found; install python3 and python3-venv (Debian)" >&2
    exit 1
fi
mkdir -p "$(dirname "$venv_dir")"
exec 9>"${venv_dir}.lock"
flock 9

stamp_text="$("$python" --version 2>&1) torch==$torch_version ${packages[*]}"
stamp="$venv_dir/.pshard-stamp"
ready() {
    "$venv_dir/bin/python" -c 'import torch, torch.distributed, transformers, safetensors, pytest, scikit_build_core' \
        >/dev/null 2>&1
}
if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]] && ready; then
    echo "torch-venv: $venv_dir is ready ($stamp_text)"
    exit 0
fi
# Replace only what is a virtual environment (or nothing): never wipe an unrelated folder.
if [[ -e "$venv_dir" && ! -f "$venv_dir/pyvenv.cfg" && -n "$(ls -A "$venv_dir" 2>/dev/null)" ]]; then
    echo "torch-venv: $venv_dir exists and is not a virtual environment; not replacing it" >&2
    exit 1
fi
log="${venv_dir}.log"
echo "torch-venv: creating $venv_dir with torch $torch_version (log: $log)"
rm -rf "$venv_dir"
"$python" -m venv "$venv_dir" >"$log" 2>&1 || {
    cat "$log" >&2
    echo "torch-venv: '$python -m venv' failed; on Debian install python3-venv" >&2
    exit 1
}
pip=("$venv_dir/bin/python" -m pip install --disable-pip-version-check --no-input -q)
fail() {
    tail -20 "$log" >&2
    echo "torch-venv: $1 (whole log: $log)" >&2
    rm -rf "$venv_dir"
    exit 1
}
"${pip[@]}" "${packages[@]}" >>"$log" 2>&1 || fail "pip install of the tools failed"
torch_ok() { "$venv_dir/bin/python" -c 'import torch, torch.distributed' >>"$log" 2>&1; }
if ! { "${pip[@]}" --no-deps "torch==$torch_version" >>"$log" 2>&1 &&
    "${pip[@]}" --no-deps "${cuda_extras[@]}" >>"$log" 2>&1 && torch_ok; }; then
    echo "torch-venv: torch without its CUDA packages does not import here; installing the full wheel set"
    "${pip[@]}" "torch==$torch_version" >>"$log" 2>&1 && torch_ok || fail "pip install torch failed"
fi
ready || fail "the venv does not import its packages"
printf '%s\n' "$stamp_text" >"$stamp"
echo "torch-venv: $venv_dir is ready ($stamp_text)"
