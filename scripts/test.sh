#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine: installs what is missing, builds, runs
# every CTest suite (the Python ones, label python, in a venv with PyPI's torch and the pshard
# package pip-installed from this checkout), then builds again with AddressSanitizer+UBSan
# and runs the C suites there. --quick skips the sanitizer pass.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
quick=0
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
  esac
done

"$root/scripts/install-deps.sh"

jobs=$(nproc)
status=0
PSHARD_BUILD_DIR="$root/build" "$root/scripts/build.sh"
(cd "$root/build" && ctest --output-on-failure -j "$jobs" --timeout 600) || status=1

if [ "$quick" -eq 0 ]; then
  echo "=== second pass: AddressSanitizer + UBSan ==="
  PSHARD_BUILD_DIR="$root/build-asan" PSHARD_BUILD_TYPE=Debug "$root/scripts/build.sh" \
    -DPSHARD_SANITIZE=ON
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/support/lsan.supp:print_suppressions=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  (cd "$root/build-asan" && ctest --output-on-failure -j "$jobs" --timeout 900 -LE 'slow|python') || status=1
fi
exit $status
