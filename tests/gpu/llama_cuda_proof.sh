#!/usr/bin/env bash
# A tiny Hugging Face Llama trained with pshard.torch on cuda:0 (tests/python/llama_worker.py
# with LLAMA_DEVICE=cuda, world 1), once with FSDP2's CPUOffloadPolicy (the shard server
# --backend nccl --offload cpu) and once with the shards on the server's GPU (--backend nccl,
# DTensors over its memory through CUDA IPC), against the same steps in plain torch on the CPU
# (the worker's reference): losses and gradient norms within 1e-4 relative. Exits 77 (skipped) unless PYTHON
# has torch with a usable CUDA device, transformers and pshard (scripts/pshard-venv.sh).
# usage: llama_cuda_proof.sh PYTHON PSHARDRUN
set -uo pipefail
py=$1
run=$2
worker="$(cd "$(dirname "$0")/../python" && pwd)/llama_worker.py"
if ! "$py" -c "import sys, torch, transformers, pshard; sys.exit(0 if torch.cuda.is_available() else 1)" \
  > /dev/null 2>&1; then
  echo "no python with torch (seeing a CUDA device), transformers and pshard at $py: skipping"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
if ! "$py" "$worker" reference "$work/ref"; then
  echo "FAILED: the CPU reference did not run"
  exit 1
fi
# CPUOffloadPolicy (shards in the server's host memory), then GPU-resident shards (DTensors over
# the server's GPU memory, opened through CUDA IPC).
if ! LLAMA_DEVICE=cuda "$run" --nproc 1 --backend nccl --offload cpu -- \
  "$py" "$worker" train "$work/offload"; then
  echo "FAILED: pshard.torch on cuda (CPUOffloadPolicy) did not train"
  exit 1
fi
if ! LLAMA_DEVICE=cuda LLAMA_GPU_SHARDS=1 "$run" --nproc 1 --backend nccl -- \
  "$py" "$worker" train "$work/gpu-shards"; then
  echo "FAILED: pshard.torch on cuda (GPU-resident shards) did not train"
  exit 1
fi
"$py" - "$work" << 'PY'
import json, sys
work = sys.argv[1]
ref = json.load(open(f"{work}/ref/rank-0.json"))
bad = 0
for run, want in (("offload", "host"), ("gpu-shards", "cuda")):
  got = json.load(open(f"{work}/{run}/rank-0.json"))
  print(f"{run}: shards in {got['memory']} memory (expected {want})")
  bad += got["memory"] != want
  bad += len(got["losses"]) != len(ref["losses"])
  for what in ("losses", "norms"):
    for s, (a, b) in enumerate(zip(got[what], ref[what])):
        rel = abs(a - b) / max(abs(b), 1e-12)
        print(f"{run} {what[:-1]} step {s}: cuda {a:.8f} cpu {b:.8f} rel {rel:.2e}")
        bad += rel > 1e-4
if bad:
    print(f"FAILED: {bad} checks (memory, step count, values within 1e-4 relative)")
    sys.exit(1)
print("a tiny Llama on cuda with pshard.torch matches the CPU within 1e-4")
PY
