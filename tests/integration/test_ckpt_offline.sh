#!/usr/bin/env bash
# pshardctl's offline checkpoint commands against synthetic checkpoints (ckpt_synth):
#  - `checkpoint list` shows the committed steps and notes a save that never committed;
#    --json parses; PSHARD_CHECKPOINT_DIR stands in for --checkpoint-dir;
#  - `list --verify` says ok for every file, then, after one flipped byte, exits 1 naming the
#    corrupt file;
#  - `checkpoint export` in fp32 and bf16: Debian's /usr/bin/python3 (json + struct only) parses
#    the file (8-byte little-endian header length, JSON header padded to 8 bytes, data offsets
#    back to back) and compares every value with the master weights it reassembles from the raw
#    shard files itself: exactly for fp32, as round-to-nearest-even for bf16;
#  - export refuses a corrupt checkpoint (exit 1, naming the file, writing nothing) and an
#    unknown step;
#  - with COORDINATOR: `checkpoint save` against a real coordinator, this script standing in
#    for rank 0 (it answers the request in the store): saved, failed, and no answer.
# usage: test_ckpt_offline.sh CKPT_SYNTH PSHARDCTL [COORDINATOR]
set -euo pipefail
synth="$1"
ctl="$2"
coord_bin="${3:-}"
py=/usr/bin/python3
[ -x "$py" ] || py=python3
work=$(mktemp -d)
fails=0
coord_pid=
cleanup() {
  if [ -n "$coord_pid" ]; then kill "$coord_pid" 2>/dev/null || true; wait "$coord_pid" 2>/dev/null || true; fi
  if [ "$fails" -eq 0 ]; then rm -rf "$work"; else echo "files kept in $work"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
ok() { echo "ok: $*"; }

ck="$work/ck"
"$synth" "$ck" 10 3 fsdp2 3 > /dev/null
"$synth" "$ck" 20 4 fsdp1 2 > /dev/null
"$synth" "$ck" 30 2 fsdp2 1 > /dev/null
# A save that never committed: shard files, no manifest.
"$synth" "$ck" 40 2 fsdp2 1 > /dev/null
rm "$ck/step-00000040/manifest.json"

echo "== list"
out=$("$ctl" checkpoint list --checkpoint-dir "$ck")
echo "$out" | sed 's/^/  /'
steps=$(echo "$out" | awk '$1 ~ /^[0-9]+$/ {print $1}' | tr '\n' ' ')
if [ "$steps" != "10 20 30 " ]; then
  fail "list shows steps '$steps', want '10 20 30 '"
elif ! grep -q "^10 .* 3 fsdp2 *adam .*master,exp_avg,exp_avg_sq" <<< "$out"; then
  fail "step 10's row is wrong"
elif ! grep -q "ignored: step-00000040: no manifest.json" <<< "$out"; then
  fail "the uncommitted step 40 is not noted"
else
  ok "steps 10 20 30 listed, step 40 noted as uncommitted"
fi
if PSHARD_CHECKPOINT_DIR="$ck" "$ctl" --json checkpoint list > "$work/list.json"; then
  if "$py" - "$work/list.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert [c["step"] for c in d["checkpoints"]] == [10, 20, 30], d
c = d["checkpoints"][1]
assert c["world_size"] == 4 and c["layout"] == "fsdp1" and c["optimizer"] == "sgd", c
assert c["sections"] == ["master", "momentum_buffer"], c
assert len(c["files"]) == 4 and c["bytes"] == sum(f["bytes"] for f in c["files"]), c
assert len(d["ignored"]) == 1 and d["ignored"][0]["dir"].endswith("step-00000040"), d
PY
  then ok "--json parses, with PSHARD_CHECKPOINT_DIR"; else fail "list --json"; fi
else
  fail "list --json exited non-zero"
fi
if "$ctl" checkpoint list > /dev/null 2> "$work/nodir.txt" || [ $? -ne 2 ]; then
  fail "list without a directory must exit 2"
elif ! grep -q "needs --checkpoint-dir" "$work/nodir.txt"; then
  fail "list without a directory: $(cat "$work/nodir.txt")"
else
  ok "list without a directory: $(cat "$work/nodir.txt")"
fi

echo "== list --verify"
if out=$("$ctl" checkpoint list --verify --checkpoint-dir "$ck"); then
  n_ok=$(echo "$out" | grep -c "^    ok ")
  if [ "$n_ok" -eq 9 ] && grep -q "verified 9 files: all ok" <<< "$out"; then
    ok "9 files verified"
  else
    echo "$out"; fail "expected 9 ok files"
  fi
else
  echo "$out"; fail "list --verify of a sound checkpoint exited non-zero"
fi

# check_export FILE STEP_DIR DTYPE: the file is a well-formed safetensors file whose tensors
# equal the master weights reassembled from STEP_DIR's shard files.
check_export() {
  "$py" - "$1" "$2" "$3" <<'PY'
import json, os, struct, sys
path, step_dir, dtype = sys.argv[1:4]
raw = open(path, "rb").read()
(hlen,) = struct.unpack("<Q", raw[:8])
assert hlen % 8 == 0 and 8 + hlen <= len(raw), f"header length {hlen}"
text = raw[8:8 + hlen].decode("utf-8")
assert text.startswith("{") and text.rstrip(" ").endswith("}"), "header padding is not spaces"
header = json.loads(text)
data = raw[8 + hlen:]
meta = header.pop("__metadata__")
m = json.load(open(os.path.join(step_dir, "manifest.json")))
assert meta == {"format": "pt", "pshard_step": str(m["step"])}, meta
names = [p["name"] for p in m["params"]]
assert list(header) == names, f"tensor order {list(header)} vs {names}"
# Master weights from the raw files, as the format describes them.
full = {}
for p in m["params"]:
    n = 1
    for x in p["shape"]:
        n *= x
    full[p["name"]] = [None] * n
for f in m["files"]:
    blob = open(os.path.join(step_dir, f["path"]), "rb").read()
    assert len(blob) == f["bytes"]
    for param, start, count, off in f["pieces"]:
        vals = struct.unpack_from(f"<{count}I", blob, 4 * off)   # section 0, as bits
        full[m["params"][param]["name"]][start:start + count] = vals
size = 4 if dtype == "fp32" else 2
end = 0
bad = 0
for p in m["params"]:
    t = header[p["name"]]
    want_bits = full[p["name"]]
    assert t["dtype"] == ("F32" if dtype == "fp32" else "BF16"), t
    assert t["shape"] == p["shape"], t
    b, e = t["data_offsets"]
    assert b == end and e - b == size * len(want_bits), (p["name"], t)
    end = e
    if dtype == "fp32":
        got = list(struct.unpack_from(f"<{len(want_bits)}I", data, b))
        bad += sum(g != w for g, w in zip(got, want_bits))
    else:
        got = list(struct.unpack_from(f"<{len(want_bits)}H", data, b))
        for g, w in zip(got, want_bits):
            # round to nearest, ties to even, on the fp32 bits (the values are finite)
            rounded = ((w + 0x7FFF + ((w >> 16) & 1)) >> 16) & 0xFFFF
            bad += g != rounded
assert end == len(data), f"data is {len(data)} bytes, tensors end at {end}"
assert bad == 0, f"{bad} values differ"
print(f"{len(names)} tensors, {len(data)} bytes of {dtype} equal the shard files' master weights")
PY
}

echo "== export"
if "$ctl" checkpoint export --format safetensors --checkpoint-dir "$ck" "$work/newest.st" \
    > "$work/export.txt" 2>&1 && grep -q "exported step 30 " "$work/export.txt"; then
  cat "$work/export.txt"
  if check_export "$work/newest.st" "$ck/step-00000030" fp32; then
    ok "the newest step (30) exported in fp32"
  else
    fail "fp32 export of step 30"
  fi
else
  cat "$work/export.txt"; fail "export of the newest step"
fi
for spec in "10 fp32" "10 bf16" "20 bf16"; do
  set -- $spec
  if "$ctl" checkpoint export --dtype "$2" --step "$1" --checkpoint-dir "$ck" \
      "$work/s$1-$2.safetensors" > "$work/export.txt" 2>&1 &&
     check_export "$work/s$1-$2.safetensors" "$ck/step-000000$1" "$2"; then
    ok "step $1 in $2"
  else
    cat "$work/export.txt"; fail "export of step $1 in $2"
  fi
done
if "$ctl" --json checkpoint export --step 20 --checkpoint-dir "$ck" "$work/j.st" > "$work/j.json" &&
   "$py" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["step"]==20 and d["tensors"]==7, d' "$work/j.json"; then
  ok "export --json"
else
  fail "export --json"
fi
if "$ctl" checkpoint export --step 15 --checkpoint-dir "$ck" "$work/none.st" > "$work/e.txt" 2>&1 ||
   ! grep -q "no committed checkpoint of step 15" "$work/e.txt"; then
  cat "$work/e.txt"; fail "export of a missing step"
else
  ok "$(cat "$work/e.txt")"
fi

echo "== a flipped byte"
f="$ck/step-00000010/shard-00001-of-00003.bin"
byte=$(od -An -tu1 -j 21 -N 1 "$f" | tr -d ' ')
printf "$(printf '\\%03o' $(( (byte + 1) % 256 )))" | dd of="$f" bs=1 seek=21 conv=notrunc 2>/dev/null
rc=0
"$ctl" checkpoint list --verify --checkpoint-dir "$ck" > "$work/verify.txt" 2>&1 || rc=$?
if [ "$rc" -ne 1 ]; then
  cat "$work/verify.txt"; fail "list --verify exited $rc on a corrupt checkpoint, want 1"
elif ! grep -q "CORRUPT  shard-00001-of-00003.bin: .*checksum mismatch" "$work/verify.txt" ||
     [ "$(grep -c CORRUPT "$work/verify.txt")" -ne 2 ]; then
  cat "$work/verify.txt"; fail "list --verify does not name exactly the corrupt file"
else
  ok "$(grep CORRUPT "$work/verify.txt" | head -1 | sed 's/^ *//' | head -c 160)"
fi
rc=0
"$ctl" checkpoint export --step 10 --checkpoint-dir "$ck" "$work/corrupt.st" > "$work/refuse.txt" 2>&1 || rc=$?
if [ "$rc" -ne 1 ] || [ -e "$work/corrupt.st" ]; then
  cat "$work/refuse.txt"; fail "export of a corrupt checkpoint: exit $rc, want 1 and no file"
elif ! grep -q "refusing to export step 10: .*shard-00001-of-00003.bin" "$work/refuse.txt"; then
  cat "$work/refuse.txt"; fail "the refusal does not name the file"
else
  ok "$(head -c 200 "$work/refuse.txt")"
fi
# A truncated file is refused the same way.
truncate -s 8 "$ck/step-00000020/shard-00003-of-00004.bin"
rc=0
"$ctl" checkpoint export --step 20 --checkpoint-dir "$ck" "$work/trunc.st" > "$work/trunc.txt" 2>&1 || rc=$?
if [ "$rc" -eq 1 ] && grep -q "shard-00003-of-00004.bin: truncated: 8 of" "$work/trunc.txt"; then
  ok "$(head -c 200 "$work/trunc.txt")"
else
  cat "$work/trunc.txt"; fail "export of a truncated checkpoint"
fi

if [ -n "$coord_bin" ]; then
  echo "== checkpoint save, with this script answering as rank 0"
  "$coord_bin" --listen 127.0.0.1:0 --port-file "$work/coord.port" --world-size 2 \
    > "$work/coord.log" 2>&1 &
  coord_pid=$!
  for _ in $(seq 1 500); do [ -s "$work/coord.port" ] && break; sleep 0.02; done
  c=(--coordinator "127.0.0.1:$(cat "$work/coord.port")")
  # answer N VALUE: wait for request N, then set its done key.
  answer() {
    for _ in $(seq 1 500); do
      v=$("$ctl" "${c[@]}" store get pshard/checkpoint/request 2>/dev/null || true)
      [ "$v" = "$1" ] && break
      sleep 0.02
    done
    "$ctl" "${c[@]}" store set "pshard/checkpoint/done/$1" "$2"
  }
  answer 1 "step=40 dir=/abs/ck/step-00000040" &
  rc=0
  out=$("$ctl" "${c[@]}" checkpoint save --timeout-ms 20000 2>&1) || rc=$?
  wait $! || true
  if [ "$rc" -eq 0 ] && [ "$out" = "checkpoint saved: step 40 in /abs/ck/step-00000040" ]; then
    ok "$out"
  else
    fail "save: exit $rc: $out"
  fi
  answer 2 "error=rank 1: cannot write /ck/step-00000041: No space left on device" &
  rc=0
  out=$("$ctl" "${c[@]}" checkpoint save --timeout-ms 20000 2>&1) || rc=$?
  wait $! || true
  if [ "$rc" -eq 1 ] && grep -q "checkpoint save failed: rank 1: cannot write /ck/step-00000041: No space left on device" <<< "$out"; then
    ok "$out"
  else
    fail "save answered with an error: exit $rc: $out"
  fi
  rc=0
  out=$("$ctl" "${c[@]}" checkpoint save --timeout-ms 300 2>&1) || rc=$?
  if [ "$rc" -eq 1 ] && grep -q "no answer to request 3 within 300 ms" <<< "$out"; then
    ok "$out"
  else
    fail "save without an answer: exit $rc: $out"
  fi
fi

if [ "$fails" -ne 0 ]; then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all offline checkpoint checks passed"
