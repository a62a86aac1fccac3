#!/usr/bin/env bash
# Checkpoints end to end with pshardrun and the example trainer:
#  - crash safety: a shard server killed (-9) after the shard files of step 15 are written but
#    before its manifest is committed leaves step 10 as the newest checkpoint; resuming from it
#    gives final weights equal to an uninterrupted run bit for bit (fp32);
#  - a flipped byte in a shard file is refused, naming the file; a --resume whose checkpoints
#    are all refused (a corrupt manifest, a link) fails naming them, unless --resume-allow-fresh;
#  - resharding: checkpoints saved with N servers load on M (4->3, 2->5, 3->1, and fsdp2 ->
#    fsdp1): the state saved again right after loading (master weights and every optimizer
#    state) equals the original element for element;
#  - full export to safetensors, read back by Debian's /usr/bin/python3 (json + struct), equals
#    the trainer's own final weights; --init-from imports it again;
#  - pshardrun --max-restarts: a trainer that dies makes everything restart from the newest
#    checkpoint, and the final weights equal the uninterrupted run bit for bit;
#  - --checkpoint-keep, `pshardctl checkpoint save|list`, and a checkpoint dir that cannot be
#    created (clear error, training stops, nothing damaged).
# usage: test_checkpoint.sh PSHARDRUN PSHARD-MLP PSHARDCTL COORDINATOR
set -euo pipefail
run="$1"
mlp="$2"
ctl="$3"
coord_bin="$4"
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
bg=()
fails=0
cleanup() {
  # pshardrun stops its own children on SIGTERM; SIGKILL only for what is left after that.
  for p in "${bg[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 500); do
    alive=0
    for p in "${bg[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && break
    sleep 0.02
  done
  for p in "${bg[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$fails" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

ARGS=(--batch 5 --widths 24,17 --input 9 --output 3 --optimizer adam --seed 4)

# state_equal DIR_A DIR_B: every section of every parameter of two committed step directories
# is equal bit for bit (whatever the world sizes and layouts they were saved with).
state_equal() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, os, struct, sys
def load(d):
    m = json.load(open(os.path.join(d, "manifest.json")))
    out = {}
    for k, sec in enumerate(m["sections"]):
        for p, prm in enumerate(m["params"]):
            n = 1
            for x in prm["shape"]: n *= x
            out[(sec, prm["name"])] = bytearray(4 * n)
    for f in m["files"]:
        data = open(os.path.join(d, f["path"]), "rb").read()
        sn = f["shard_numel"]
        for k, sec in enumerate(m["sections"]):
            for p, start, count, off in f["pieces"]:
                name = m["params"][p]["name"]
                b = 4 * (k * sn + off)
                out[(sec, name)][4 * start:4 * (start + count)] = data[b:b + 4 * count]
    return m, out
ma, a = load(sys.argv[1]); mb, b = load(sys.argv[2])
if ma["step"] != mb["step"]: sys.exit(f"steps differ: {ma['step']} vs {mb['step']}")
if a.keys() != b.keys(): sys.exit("different parameters or sections")
bad = [k for k in a if a[k] != b[k]]
if bad: sys.exit(f"{len(bad)} tensors differ, e.g. {bad[0]}")
print(f"{len(a)} tensors ({', '.join(ma['sections'])}) equal; world {ma['world_size']} "
      f"{ma['layout']} -> world {mb['world_size']} {mb['layout']}")
PY
}

echo "== uninterrupted reference, 20 steps"
"$run" --nproc 2 -- "$mlp" "${ARGS[@]}" --steps 20 --dump-weights "$work/ref.bin" > "$work/ref.txt" 2>&1 ||
  { cat "$work/ref.txt"; fail "the reference run failed"; }

echo "== crash between the shard files and the manifest of step 15"
if PSHARD_FAULT_INJECT=ckpt-before-manifest:15 timeout 120 "$run" --nproc 2 \
    --checkpoint-dir "$work/ck" --checkpoint-every 5 -- "$mlp" "${ARGS[@]}" --steps 20 \
    > "$work/crash.txt" 2>&1; then
  fail "the run with a crashing server succeeded"
fi
committed=$("$ctl" checkpoint list --checkpoint-dir "$work/ck" 2>&1 || true)
echo "$committed" | sed 's/^/  /'
if [ -f "$work/ck/step-00000015/manifest.json" ] || [ ! -f "$work/ck/step-00000010/manifest.json" ]; then
  fail "step 15 must be uncommitted and step 10 committed"; ls -R "$work/ck"
elif ! ls "$work/ck/step-00000015/" | grep -q shard; then
  fail "the crash came before any shard file of step 15 was written"
else
  echo "ok: step 15 has shard files but no manifest; step 10 is the newest committed"
fi

echo "== resume from the newest committed checkpoint"
if ! timeout 120 "$run" --nproc 2 --resume "$work/ck" --checkpoint-every 5 -- "$mlp" "${ARGS[@]}" --steps 20 \
    --dump-weights "$work/resumed.bin" > "$work/resume.txt" 2>&1; then
  cat "$work/resume.txt"; fail "the resumed run failed"
elif ! grep -q "resumed at step 10" "$work/resume.txt"; then
  cat "$work/resume.txt"; fail "did not resume at step 10"
elif ! cmp -s "$work/ref.bin" "$work/resumed.bin"; then
  fail "final weights after crash + resume differ from the uninterrupted run"
else
  echo "ok: resumed at step 10; final weights equal the uninterrupted run bit for bit"
fi

echo "== pshardrun --max-restarts: a trainer dies, everything restarts from the newest checkpoint"
rm -rf "$work/ckr"
if ! timeout 180 "$run" --nproc 2 --max-restarts 1 --replace-timeout-ms 0 --checkpoint-dir "$work/ckr" \
    --checkpoint-every 4 -- "$mlp" "${ARGS[@]}" --steps 20 --fail-at-step 15 --fail-rank 1 \
    --dump-weights "$work/restarted.bin" > "$work/restart.txt" 2>&1; then
  cat "$work/restart.txt"; fail "the run with a restart failed"
elif ! grep -q "^pshardrun: restart 1 of 1: .*resuming from the newest checkpoint" "$work/restart.txt" ||
     ! grep -q "rank 1: exiting before step 15" "$work/restart.txt" ||
     ! grep -q "resumed at step 12" "$work/restart.txt"; then
  cat "$work/restart.txt"; fail "no restart from step 12 after trainer 1 exited before step 15"
elif ! cmp -s "$work/ref.bin" "$work/restarted.bin"; then
  fail "final weights after a restart differ from the uninterrupted run"
else
  echo "ok: trainer 1 exited before step 15, the run restarted at step 12 and ended bit for bit like the uninterrupted one"
fi
echo "== without restarts left, the failure stands"
if timeout 120 "$run" --nproc 2 --checkpoint-dir "$work/ckr0" --checkpoint-every 4 -- "$mlp" \
    "${ARGS[@]}" --steps 20 --fail-at-step 3 > "$work/norestart.txt" 2>&1; then
  fail "a run whose trainer exited 3 succeeded without --max-restarts"
elif grep -q "restart 1" "$work/norestart.txt"; then
  fail "pshardrun restarted without --max-restarts"
else
  echo "ok: no --max-restarts, no restart"
fi

echo "== a flipped byte is refused, naming the file"
cp -r "$work/ck/step-00000010" "$work/flip-src"
mkdir -p "$work/flip" && cp -r "$work/flip-src" "$work/flip/step-00000010"
f="$work/flip/step-00000010/shard-00001-of-00002.bin"
byte=$(od -An -tu1 -j 100 -N 1 "$f" | tr -d ' ')
printf "$(printf '\\%03o' $(( (byte + 1) % 256 )))" | dd of="$f" bs=1 seek=100 conv=notrunc 2>/dev/null
if timeout 120 "$run" --nproc 2 --resume "$work/flip" -- "$mlp" "${ARGS[@]}" --steps 20 \
    > "$work/flip.txt" 2>&1; then
  fail "a corrupt checkpoint was loaded"
elif ! grep -q "shard-00001-of-00002.bin" "$work/flip.txt"; then
  cat "$work/flip.txt"; fail "the error does not name the corrupt file"
else
  echo "ok: $(grep -m1 -o 'shard-00001-of-00002.bin[^"]*' "$work/flip.txt" | head -c 160)"
fi

echo "== --resume whose only checkpoints are refused fails, naming them"
mkdir -p "$work/refused" && cp -r "$work/ck/step-00000010" "$work/refused/step-00000010"
head -c 40 "$work/ck/step-00000010/manifest.json" > "$work/refused/step-00000010/manifest.json"
ln -s "$work/ck/step-00000010" "$work/refused/step-00000020"
if timeout 120 "$run" --nproc 2 --resume "$work/refused" -- "$mlp" "${ARGS[@]}" --steps 4 \
    > "$work/refused.txt" 2>&1; then
  fail "a resume with nothing loadable trained from the start (exit 0)"
elif ! grep -q "nothing to resume from in .*refused" "$work/refused.txt"; then
  cat "$work/refused.txt"; fail "the error does not say that nothing was loadable"
else
  echo "ok: $(grep -m1 -o 'nothing to resume from[^"]*' "$work/refused.txt" | head -c 220)"
fi
if ! timeout 120 "$run" --nproc 2 --resume "$work/refused" --resume-allow-fresh -- "$mlp" \
    "${ARGS[@]}" --steps 4 > "$work/fresh.txt" 2>&1; then
  cat "$work/fresh.txt"; fail "--resume-allow-fresh did not start fresh"
elif grep -q "resumed at step" "$work/fresh.txt"; then
  fail "--resume-allow-fresh resumed from a refused checkpoint"
else
  echo "ok: --resume-allow-fresh starts from the initial values"
fi
[ -L "$work/refused/step-00000020" ] && [ -f "$work/ck/step-00000010/manifest.json" ] ||
  fail "the link in the root or what it points to was touched"

# reshard N M LAYOUT_FROM LAYOUT_TO: save at step 6 on N servers, load on M and save again.
reshard() {
  local n="$1" m="$2" from="$3" to="$4" d="$work/rs-$1-$2-$3-$4"
  if ! timeout 120 "$run" --nproc "$n" --checkpoint-dir "$d/a" -- "$mlp" "${ARGS[@]}" \
      --layout "$from" --steps 6 --checkpoint-at-end > "$d.a.txt" 2>&1; then
    cat "$d.a.txt"; fail "saving on $n servers failed"; return
  fi
  if ! timeout 120 "$run" --nproc "$m" --resume "$d/a" --checkpoint-dir "$d/b" -- "$mlp" \
      "${ARGS[@]}" --layout "$to" --steps 6 --checkpoint-at-end > "$d.b.txt" 2>&1; then
    cat "$d.b.txt"; fail "loading on $m servers failed"; return
  fi
  if state_equal "$d/a/step-00000006" "$d/b/step-00000006"; then
    echo "ok: resharded $n ($from) -> $m ($to)"
  else
    fail "state after resharding $n -> $m differs"
  fi
}
echo "== resharding"
reshard 4 3 fsdp2 fsdp2
reshard 2 5 fsdp2 fsdp2
reshard 3 1 fsdp2 fsdp2
reshard 2 3 fsdp2 fsdp1
reshard 3 2 fsdp1 fsdp2

# GPU-resident shards in the tests' host emulation (PSHARD_TEST_EMULATE_DEVICE=1), whose
# checkpoints stream through a 4 KiB bounce buffer (grown to the largest parameter piece, 18 KiB
# here, so a rank's 25 KiB sections take two passes): a host save loads on them directly (same
# world) and resharded (3 servers, fsdp1), and what they save loads back on host shards, all
# to the same state.
# emu_save EMULATE N LAYOUT FROM OUT: N servers (emulated or not) resume FROM (or start fresh,
# training 6 steps, when FROM is -) and save step 6 under OUT.
emu_save() {
  local resume=()
  [ "$4" != - ] && resume=(--resume "$4")
  PSHARD_TEST_EMULATE_DEVICE="$1" timeout 120 "$run" --nproc "$2" "${resume[@]}" \
    --checkpoint-dir "$5" -- "$mlp" "${ARGS[@]}" --widths 96,96 --input 32 --layout "$3" \
    --steps 6 --checkpoint-at-end \
    > "$5.txt" 2>&1 || { cat "$5.txt"; fail "$2 servers (emulated device: $1) failed"; }
}
echo "== GPU-resident shards (host emulation): checkpoints through the bounce buffer"
e="$work/emu"
emu_save 0 2 fsdp2 - "$e-host"
emu_save 1 2 fsdp2 "$e-host" "$e-dev"
emu_save 1 3 fsdp1 "$e-host" "$e-dev3"
emu_save 0 2 fsdp2 "$e-dev" "$e-back"
for d in "$e-dev" "$e-dev3" "$e-back"; do
  if state_equal "$e-host/step-00000006" "$d/step-00000006"; then
    echo "ok: ${d##*/}"
  else
    fail "${d##*/}: state differs from the host save"
  fi
done

echo "== full export to safetensors, and import"
if ! "$ctl" checkpoint export --format safetensors --checkpoint-dir "$work/ck" --step 20 \
    "$work/full.safetensors" > "$work/export.txt" 2>&1; then
  cat "$work/export.txt"; fail "export failed"
elif ! /usr/bin/python3 - "$work/full.safetensors" "$work/resumed.bin" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
(hlen,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + hlen])
names = [k for k in header if k != "__metadata__"]
data = raw[8 + hlen:]
got = b"".join(data[header[k]["data_offsets"][0]:header[k]["data_offsets"][1]] for k in names)
want = open(sys.argv[2], "rb").read()
assert all(header[k]["dtype"] == "F32" for k in names), "dtype"
assert got == want, f"exported weights differ ({len(got)} vs {len(want)} bytes)"
print(f"ok: {len(names)} tensors ({', '.join(names)}) equal the trainer's final weights")
PY
then
  fail "the export differs from the final weights"
fi
if timeout 120 "$run" --nproc 2 -- "$mlp" "${ARGS[@]}" --steps 0 \
    --init-from "$work/full.safetensors" --dump-weights "$work/imported.bin" > "$work/import.txt" 2>&1 &&
   cmp -s "$work/imported.bin" "$work/resumed.bin"; then
  echo "ok: --init-from the export gives the same weights"
else
  cat "$work/import.txt"; fail "import from safetensors"
fi

echo "== --checkpoint-keep 2"
timeout 120 "$run" --nproc 2 --checkpoint-dir "$work/keep" --checkpoint-every 5 \
  --checkpoint-keep 2 -- "$mlp" "${ARGS[@]}" --steps 20 > "$work/keep.txt" 2>&1 || fail "keep run failed"
kept=$(cd "$work/keep" && ls -d step-* | tr '\n' ' ')
if [ "$kept" = "step-00000015 step-00000020 " ]; then echo "ok: kept $kept"; else fail "kept: $kept"; fi

echo "== a checkpoint dir that cannot be created"
touch "$work/not-a-dir"
if timeout 120 "$run" --nproc 2 --checkpoint-dir "$work/not-a-dir/ck" --checkpoint-every 3 -- \
    "$mlp" "${ARGS[@]}" --steps 6 > "$work/bad.txt" 2>&1; then
  fail "training went on without its checkpoints"
elif ! grep -q "step 3 was applied, but checkpoint of step 3 not saved: .*not-a-dir/ck.*Not a directory" "$work/bad.txt"; then
  cat "$work/bad.txt"; fail "no clear message"
else
  echo "ok: $(grep -m1 -o 'step 3 was applied, but .*' "$work/bad.txt" | head -c 200)"
fi

echo "== pshardctl checkpoint save, online"
"$coord_bin" --listen 127.0.0.1:0 --port-file "$work/coord.port" --world-size 2 > "$work/coord.log" 2>&1 &
bg+=($!)
for _ in $(seq 1 500); do [ -s "$work/coord.port" ] && break; sleep 0.02; done
caddr="127.0.0.1:$(cat "$work/coord.port")"
# A shared coordinator: the job's id (torchrun's --rdzv-id) names it for pshardctl.
timeout 300 "$run" --nproc 2 --coordinator "$caddr" --rdzv-id online-job \
  --checkpoint-dir "$work/online" -- "$mlp" \
  "${ARGS[@]}" --steps 3000 --print-every 0 > "$work/online.txt" 2>&1 &
bg+=($!)
if out=$("$ctl" --coordinator "$caddr" --job online-job checkpoint save --timeout-ms 60000 2>&1) &&
   grep -q "checkpoint saved: step [0-9]* in .*online/step-" <<< "$out"; then
  echo "ok: $out"
  if ! "$ctl" checkpoint list --verify --checkpoint-dir "$work/online" > "$work/online-list.txt" 2>&1; then
    cat "$work/online-list.txt"; fail "the online checkpoint does not verify"
  fi
else
  echo "$out"; fail "pshardctl checkpoint save"
fi

if [ "$fails" -ne 0 ]; then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all checkpoint checks passed"
