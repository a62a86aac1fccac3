#!/usr/bin/env bash
# Downloads, on a Debian 12 machine with its mirror, the packages that building pshard needs and
# that a GPU machine without a network may lack (gRPC core, protobuf-c and protoc, jansson,
# libevent, CUnit, OpenBLAS, pkgconf, with their own libraries), as .deb files into DIR (about
# 30 MB), for scripts/gpu-check.sh to unpack there (PSHARD_GPU_DEBS=DIR): nothing is installed,
# here or there. The C library, the compiler, OpenSSL's and zlib's runtime libraries are the
# machine's own.
# usage: scripts/gpu-debs.sh DIR
set -euo pipefail
dir=${1:?usage: scripts/gpu-debs.sh DIR}
packages=(
  libgrpc-dev libgrpc29 libabsl-dev libabsl20220623 libre2-dev libre2-9 libc-ares-dev libc-ares2
  libssl-dev zlib1g-dev
  libprotobuf-c-dev libprotobuf-c1 protobuf-c-compiler protobuf-compiler libprotoc32
  libprotobuf32
  libjansson-dev libjansson4
  libevent-dev libevent-2.1-7 libevent-core-2.1-7 libevent-extra-2.1-7 libevent-openssl-2.1-7
  libevent-pthreads-2.1-7
  libcunit1-dev libcunit1
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libopenblas0 libgfortran5
  pkgconf pkgconf-bin libpkgconf3
)
mkdir -p "$dir"
cd "$dir"
# (apt's _apt user may not write here: the download runs as the caller then, with a warning)
apt-get download "${packages[@]}"
echo "gpu-debs: $(ls ./*.deb | wc -l) packages, $(du -sh . | cut -f1) in $dir"
