#!/usr/bin/env bash
# Checkpoint save and load throughput per shard server against raw sequential I/O of the same
# bytes, side by side in one run. The model is the example MLP (WIDTHS, default 4 hidden layers
# of 4096, Adam: master + 2 states), saved by NPROC (2) servers with --checkpoint-at-end and then
# loaded with --resume. Save = every server writes its shard (CRC-32C on the way, fsync) and
# rank 0 commits the manifest. Load = verify the checksums + read the byte ranges a rank owns
# (the files are in the page cache, as a just-written checkpoint is). The reference is
# pshard-io-ref: dd-style 8 MiB write(2)s + fsync, and a read into a full-size buffer, NPROC of
# them at once like the servers. Target: both ratios >= 0.8.
# usage: tests/bench/run-ckpt-bench.sh [BUILD_DIR]   (env NPROC, WIDTHS, DIR)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-$ROOT/build}"
NPROC="${NPROC:-2}"
WIDTHS="${WIDTHS:-4096,4096,4096,4096}"
DIR="${DIR:-$(mktemp -d /var/tmp/pshard-ckpt-bench.XXXXXX)}"
trap 'rm -rf "$DIR"' EXIT
export OPENBLAS_NUM_THREADS=1
args=(--widths "$WIDTHS" --input 256 --output 64 --optimizer adam --batch 8 --print-every 0)
"$BUILD/tools/pshardrun" --nproc "$NPROC" --log info --checkpoint-dir "$DIR/ck" -- \
  "$BUILD/examples/pshard-mlp" "${args[@]}" --steps 1 --checkpoint-at-end > "$DIR/save.txt" 2>&1
"$BUILD/tools/pshardrun" --nproc "$NPROC" --log info --resume "$DIR/ck" --checkpoint-dir "$DIR/ck2" -- \
  "$BUILD/examples/pshard-mlp" "${args[@]}" --steps 1 > "$DIR/load.txt" 2>&1
# "checkpoint of step 1 committed in DIR (123.4 ms, 456 bytes here)", "resumed step 1 from DIR (78.9 ms)"
save_ms=$(sed -n 's/.*checkpoint of step 1 committed in .* (\([0-9.]*\) ms, [0-9]* bytes here).*/\1/p' "$DIR/save.txt" | sort -n | tail -1)
bytes=$(sed -n 's/.*checkpoint of step 1 committed in .* ([0-9.]* ms, \([0-9]*\) bytes here).*/\1/p' "$DIR/save.txt" | sort -n | tail -1)
load_ms=$(sed -n 's/.*resumed step 1 from .* (\([0-9.]*\) ms).*/\1/p' "$DIR/load.txt" | sort -n | tail -1)
[ -n "$save_ms" ] && [ -n "$load_ms" ] && [ -n "$bytes" ] || { cat "$DIR/save.txt" "$DIR/load.txt"; exit 1; }
[ -x "$BUILD/tests/bench/pshard-io-ref" ] || { echo "build pshard-io-ref first" >&2; exit 1; }
# The reference: NPROC concurrent writers (write+fsync) and then readers of the same bytes per
# server, as the servers themselves write and read at the same time.
for ((r = 0; r < NPROC; r++)); do
  "$BUILD/tests/bench/pshard-io-ref" write "$DIR/ref.$r" "$bytes" > "$DIR/w.$r" &
done
wait
for ((r = 0; r < NPROC; r++)); do
  "$BUILD/tests/bench/pshard-io-ref" read "$DIR/ref.$r" > "$DIR/r.$r" &
done
wait
dd_w_ms=$(cat "$DIR"/w.* | awk '{ if ($2 > m) m = $2 } END { print m }')
dd_r_ms=$(cat "$DIR"/r.* | awk '{ if ($2 > m) m = $2 } END { print m }')
ddbytes=$bytes
awk -v n="$NPROC" -v b="$bytes" -v db="$ddbytes" -v s="$save_ms" -v l="$load_ms" -v w="$dd_w_ms" -v r="$dd_r_ms" 'BEGIN {
  printf "per server: %d bytes (%d servers, %s)\n", b, n, ENVIRON["WIDTHS"]
  sv = b / s / 1e3; lv = b / l / 1e3; dw = db / w / 1e3; dr = db / r / 1e3
  printf "save %.1f ms = %.0f MB/s   raw write+fsync %.1f ms = %.0f MB/s   ratio %.2f (target >= 0.8)\n", s, sv, w, dw, sv / dw
  printf "load %.1f ms = %.0f MB/s   raw read (cached) %.1f ms = %.0f MB/s   ratio %.2f (target >= 0.8)\n", l, lv, r, dr, lv / dr
}'
