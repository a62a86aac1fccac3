#!/usr/bin/env bash
# The wheel a user pip installs: builds it (scripts/build-wheel.sh: CPU, auditwheel-repaired),
# installs it with numpy into a fresh venv, and in an empty environment (env -i: no
# LD_LIBRARY_PATH, no build tree on PATH) checks that
#   - every shared library the extension, libpshard and the programs load is either in the
#     manylinux baseline (glibc, libstdc++, libgcc_s, ...) or one the wheel carries in
#     pshard.libs/ (ldd: the system's libgrpc, libssl, ... are installed here, so loading them
#     from /usr/lib would pass unnoticed on this machine and fail on a user's),
#   - pshard and pshard._C import from the venv,
#   - the wheel's own pshardrun trains a 2-rank job (wheel_train.py: pshard's Python API and
#     numpy, no torch) whose losses match a one-process numpy reference and fall a hundredfold.
# Usage: test_wheel.sh SOURCE_DIR WORK_DIR WHEEL_BUILD_DIR
#   (WHEEL_BUILD_DIR: build-wheel.sh's cached build venv and CMake tree, PSHARD_WHEEL_WORK)
# Exit status: 0 pass, 1 fail, 77 skipped (PyPI unreachable: no build tools, no numpy).
set -euo pipefail

src="$1"
work="$2"
wheel_build="$3"
python=/usr/bin/python3
numpy_pin="numpy==2.4.6"

run_pid=""
cleanup() {
    # Only what this script started: pshardrun (which stops its coordinator, servers and
    # trainers), by PID.
    if [ -n "$run_pid" ] && kill -0 "$run_pid" 2>/dev/null; then
        kill -TERM "$run_pid" 2>/dev/null || true
        wait "$run_pid" 2>/dev/null || true
    fi
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

# pip's own settings (an index mirror, a proxy) reach pip; nothing else from this environment
# reaches the installed wheel.
pip_env=(HOME="$HOME" PATH=/usr/bin:/bin LANG=C.UTF-8)
while IFS='=' read -r name _; do
    case "$name" in
        PIP_* | http_proxy | https_proxy | HTTP_PROXY | HTTPS_PROXY | no_proxy | NO_PROXY)
            pip_env+=("$name=${!name}") ;;
    esac
done < <(env)

# Skipped rather than failed when PyPI cannot be reached (pip's own index query).
skip_if_offline() {
    if ! env -i "${pip_env[@]}" timeout 60 "$python" -m pip index versions pip \
            --disable-pip-version-check >/dev/null 2>&1; then
        echo "PyPI is unreachable ($1): skipped"
        exit 77
    fi
}

mkdir -p "$work"
out="$work/dist"
rc=0
wheel=$(PSHARD_WHEEL_WORK="$wheel_build" "$src/scripts/build-wheel.sh" "$out" | tail -1) ||
    rc=$?
if [ "$rc" -eq 3 ]; then
    skip_if_offline "the build venv"
fi
[ "$rc" -eq 0 ] || fail "scripts/build-wheel.sh exited $rc"
case "$(basename "$wheel")" in
    pshard-*-manylinux_*_x86_64.whl) ;;
    *) fail "the wheel $wheel has no manylinux tag" ;;
esac
echo "wheel: $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

# A fresh venv each run: what a user gets from `pip install pshard-....whl`.
venv="$work/venv"
rm -rf "$venv"
env -i "${pip_env[@]}" "$python" -m venv "$venv" || fail "python3 -m venv failed"
if ! env -i "${pip_env[@]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        --no-input "$wheel" "$numpy_pin" >"$work/pip.log" 2>&1; then
    skip_if_offline "numpy"
    cat "$work/pip.log" >&2
    fail "pip install of the wheel failed"
fi

home="$work/home"
rm -rf "$home" "$work/tmp"
mkdir -p "$home" "$work/tmp"
clean=(env -i HOME="$home" PATH="$venv/bin:/usr/bin:/bin" TMPDIR="$work/tmp" LANG=C.UTF-8)
site=$("${clean[@]}" python -c 'import sysconfig; print(sysconfig.get_path("platlib"))')

# The manylinux baseline (auditwheel's policy whitelist, the part a C program can load), the
# dynamic loader and the vDSO: everything else must resolve inside the wheel.
baseline=" libc.so.6 libm.so.6 libdl.so.2 librt.so.1 libpthread.so.0 libgcc_s.so.1 \
libstdc++.so.6 libresolv.so.2 libutil.so.1 libnsl.so.1 libz.so.1 "
elves=()
for f in "$site"/pshard/*.so* "$site"/pshard.scripts/* "$venv"/bin/pshard*; do
    [ -f "$f" ] && [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] && elves+=("$f")
done
[ ${#elves[@]} -ge 6 ] ||
    fail "found ${#elves[@]} ELF files (want pshard/_C, libpshard and the 4 programs): ${elves[*]}"
for f in "${elves[@]}"; do
    lines=$("${clean[@]}" ldd "$f") || fail "ldd $f failed"
    while read -r name arrow path _; do
        [ "$arrow" = "=>" ] || continue
        [ "$path" != "not" ] || fail "$f: $name is not found"
        path=$(realpath -m "$path")
        case "$path" in
            "$site"/pshard.libs/* | "$site"/pshard/*) continue ;;
        esac
        [[ "$baseline" == *" $name "* ]] ||
            fail "$f loads $name from $path, neither the manylinux baseline nor pshard.libs/"
    done <<<"$lines"
done
echo "libraries: ${#elves[@]} ELF files load only the baseline and the wheel's own"

# Imports, from / so that no checkout's pshard/ can shadow the venv's.
(cd / && "${clean[@]}" python -c '
import sys, pshard, pshard._C
for m in (pshard, pshard._C):
    assert m.__file__.startswith(sys.prefix + "/"), f"{m.__name__} from {m.__file__}"
print("imports:", pshard._C.__file__)
') || fail "pshard or pshard._C did not import from the venv"
[ "$("${clean[@]}" sh -c 'command -v pshardrun')" = "$venv/bin/pshardrun" ] ||
    fail "pshardrun is not the venv's"

# Two ranks with the wheel's pshardrun (it starts the coordinator and the shard servers on
# ephemeral loopback ports and stops them). Waited for, not slept on; timeout bounds a hang.
(cd "$work" && exec "${clean[@]}" timeout -k 10 240 pshardrun --nproc 2 -- \
    python "$src/tests/packaging/wheel_train.py") >"$work/train.log" 2>&1 &
run_pid=$!
train_rc=0
wait "$run_pid" || train_rc=$?
run_pid=""
cat "$work/train.log"
[ "$train_rc" -eq 0 ] || fail "pshardrun --nproc 2 exited $train_rc"
for r in 0 1; do
    grep -q "wheel_train rank $r/2: loss" "$work/train.log" || fail "no result line from rank $r"
done
echo "PASS"
