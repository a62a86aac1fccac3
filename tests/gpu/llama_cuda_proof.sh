#!/usr/bin/env bash
# A tiny Hugging Face Llama trained with pshard.torch on cuda:0 (tests/python/llama_worker.py
# with LLAMA_DEVICE=cuda: FSDP2's CPUOffloadPolicy, the shard server on the GPU with --backend
# nccl --offload cpu, world 1) against the same steps in plain torch on the CPU (the worker's
# reference): losses and gradient norms within 1e-4 relative. Exits 77 (skipped) unless PYTHON
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
if ! LLAMA_DEVICE=cuda "$run" --nproc 1 --backend nccl --offload cpu -- \
  "$py" "$worker" train "$work/gpu"; then
  echo "FAILED: pshard.torch on cuda did not train"
  exit 1
fi
"$py" - "$work" << 'PY'
import json, sys
work = sys.argv[1]
ref = json.load(open(f"{work}/ref/rank-0.json"))
got = json.load(open(f"{work}/gpu/rank-0.json"))
bad = 0
for what in ("losses", "norms"):
    for s, (a, b) in enumerate(zip(got[what], ref[what])):
        rel = abs(a - b) / max(abs(b), 1e-12)
        print(f"{what[:-1]} step {s}: cuda {a:.8f} cpu {b:.8f} rel {rel:.2e}")
        bad += rel > 1e-4
if len(got["losses"]) != len(ref["losses"]) or bad:
    print(f"FAILED: {bad} values beyond 1e-4 relative")
    sys.exit(1)
print("a tiny Llama on cuda with pshard.torch matches the CPU within 1e-4")
PY
