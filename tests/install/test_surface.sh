#!/usr/bin/env bash
# libpshard's installed surface is honest: installs the build into a scratch prefix, lists every
# function the installed headers declare (the compiler's own -aux-info, not a grep) and checks
# that each is named pshard_*, that a trainer using only the installed headers and -lpshard
# links and loads with all of them, and that libpshard exports nothing the headers do not
# declare.
# usage: test_surface.sh BUILD_DIR CC [EXTRA_CFLAGS...]
set -euo pipefail
build=$1 cc=$2
shift 2
extra=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
inc=$tmp/prefix/include
lib=$tmp/prefix/lib
[ -f "$lib/libpshard.so" ] || { echo "FAIL: no libpshard.so under $lib"; exit 1; }

headers=$(cd "$inc" && find pshard -name '*.h' | sort)
echo "installed headers: $(echo $headers)"
{
  for h in $headers; do echo "#include \"$h\""; done
} >"$tmp/all.c"
"$cc" -std=c11 -I"$inc" -fsyntax-only -aux-info "$tmp/aux.txt" "$tmp/all.c"
# aux-info lines: /* FILE:LINE:NC */ extern TYPE NAME (ARGS); -- keep those from the prefix.
grep -F "/* $inc/" "$tmp/aux.txt" | sed -E 's|^/\*[^*]*\*/ *||' |
  sed -E 's/^(.*[^A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*) *\(.*$/\2/' | sort -u >"$tmp/declared"
echo "declared functions: $(wc -l <"$tmp/declared")"
[ -s "$tmp/declared" ] || { echo "FAIL: found no declarations"; exit 1; }
if grep -v '^pshard_' "$tmp/declared" >"$tmp/foreign"; then
  echo "FAIL: the installed headers declare functions outside pshard_*:"
  sed 's/^/  /' "$tmp/foreign"
  fail=1
fi

{
  for h in $headers; do echo "#include \"$h\""; done
  echo "#include <stdio.h>"
  echo "typedef void (*fn_t)(void);"
  echo "static fn_t const used[] = {"
  sed -E 's/.*/    (fn_t)\&&,/' "$tmp/declared"
  echo "};"
  echo "int main(void) {"
  echo "    size_t n = 0;"
  echo "    for (size_t i = 0; i < sizeof(used) / sizeof(used[0]); i++) n += used[i] != 0;"
  echo "    printf(\"%zu functions resolved\\n\", n);"
  echo "    return 0;"
  echo "}"
} >"$tmp/trainer.c"
if ! "$cc" -std=c11 -Wno-cast-function-type "${extra[@]}" -I"$inc" "$tmp/trainer.c" \
    -L"$lib" -lpshard -Wl,-rpath,"$lib" -o "$tmp/trainer" 2>"$tmp/link.err"; then
  echo "FAIL: a trainer that calls every installed function does not link with -lpshard:"
  grep -E "undefined reference|error" "$tmp/link.err" | sed 's/^/  /' | head -40
  fail=1
else
  "$tmp/trainer" || fail=1
fi

nm -D --defined-only "$lib/libpshard.so" | awk '$2 ~ /^[TWiV]$/ {print $3}' | sed 's/@.*//' |
  sort -u >"$tmp/exported"
echo "exported functions: $(wc -l <"$tmp/exported")"
if comm -23 "$tmp/exported" "$tmp/declared" >"$tmp/undeclared" && [ -s "$tmp/undeclared" ]; then
  echo "FAIL: libpshard exports functions no installed header declares:"
  sed 's/^/  /' "$tmp/undeclared"
  fail=1
fi
[ "$fail" -eq 0 ] && echo "PASS: every installed declaration is exported and vice versa"
exit "$fail"
