#!/usr/bin/env bash
# The tree's C, CUDA and header files are formatted as .clang-format says (clang-format
# --dry-run -Werror over every tracked one); a file that is not is named with its first
# difference. Fix with: git ls-files '*.c' '*.h' '*.cu' | xargs clang-format -i
# usage: check_format.sh REPO_ROOT. Exits 77 (skipped) without clang-format or git.
set -uo pipefail
root="$1"
command -v clang-format > /dev/null || { echo "clang-format not found: skipped"; exit 77; }
command -v git > /dev/null || { echo "git not found: skipped"; exit 77; }
cd "$root" || exit 1
files=$(git ls-files '*.c' '*.h' '*.cu') || { echo "not a git checkout: skipped"; exit 77; }
[ -n "$files" ] || { echo "no files to check"; exit 1; }
n=$(echo "$files" | wc -l)
if out=$(echo "$files" | xargs clang-format --dry-run -Werror 2>&1); then
  echo "ok: $n files formatted as .clang-format says ($(clang-format --version | head -1))"
  exit 0
fi
echo "$out" | head -40
echo "FAIL: $(echo "$out" | grep -c 'error: code should be clang-formatted') places not formatted"
echo "fix with: git ls-files '*.c' '*.h' '*.cu' | xargs clang-format -i"
exit 1
