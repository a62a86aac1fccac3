#!/usr/bin/env bash
# Installs the Debian 12 packages pshard needs to build and test, and only those still missing.
# Safe to re-run; waits for the dpkg lock instead of failing when another apt is running.
set -euo pipefail

# The one list of what the source build needs (the README's Install section names the same;
# CMake names the package of whichever is missing). Building: compiler, CMake, pkg-config,
# gRPC core, protoc and protoc-c, protobuf-c, OpenSSL, jansson, libevent, python3-dev. Tests
# only: CUnit and the rest below. Building the wheel (scripts/build-wheel.sh) needs the build
# packages; installing the wheel it makes needs none of them.
packages=(
  build-essential cmake pkg-config git ca-certificates
  binutils  # nm, for scripts/file-cycles.py (CTest file_cycles)
  libgrpc-dev protobuf-c-compiler libprotobuf-c-dev protobuf-compiler libprotobuf-dev
  libevent-dev libcunit1-dev libssl-dev openssl libopenblas-dev libjansson-dev
  python3 python3-venv python3-dev  # python3-dev: the pshard extension module; python3-venv:
                                    # the venvs of build-wheel.sh and CTest packaging_wheel
  iproute2  # ip netns, for the network-cut test
  clang-format  # the format check (CTest format): the tree stays as .clang-format says
)

# The container smoke test (deploy/podman-smoke.sh, CTest deploy_podman_smoke): podman with
# runc builds and runs pshard's image; debootstrap makes its Debian base, since no container
# registry is reachable. (kubectl, for deploy/check-manifests.sh, is not a Debian package; that
# test skips without it.)
packages+=(podman buildah runc uidmap debootstrap)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
  --no-install-recommends "${missing[@]}"
