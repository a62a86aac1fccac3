#!/usr/bin/env bash
# A tiny Hugging Face Llama trained with pshard.torch on cuda:0 (tests/python/llama_worker.py
# with LLAMA_DEVICE=cuda, world 1), once with FSDP2's CPUOffloadPolicy (the shard server
# --backend nccl --offload cpu) and once with the shards on the server's GPU (--backend nccl,
# DTensors over its memory and the full buffers in it, both through CUDA IPC, with no byte
# through the host, as the server's counters say), against the same steps in plain torch on the
# CPU (the worker's reference), and then two ranks sharing the GPU (--backend tcp --shard-memory
# gpu, what the tcp collectives move staged through host memory, as their counters say):
# losses and gradient norms within 1e-4 relative; and with bf16 mixed precision on the GPU
# against the same on the CPU with pshard: losses within 1e-2, norms 5e-2. Exits 77 unless PYTHON
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
# the workers read their servers' counters with the pshardctl built beside this pshardrun
export PSHARDCTL="$(dirname "$run")/pshardctl"
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
# Two ranks sharing the one GPU (NCCL takes one rank per GPU): their shard servers keep the shards
# on GPU 0 and run the collectives over the host transports (--backend tcp --shard-memory gpu).
# (one GPU visible: every rank's model and every server on it, whatever the machine has)
first_gpu=${CUDA_VISIBLE_DEVICES:-0}
if ! CUDA_VISIBLE_DEVICES=${first_gpu%%,*} LLAMA_DEVICE=cuda LLAMA_GPU_SHARDS=1 \
  "$run" --nproc 2 --backend tcp --shard-memory gpu -- "$py" "$worker" train "$work/shared-gpu"; then
  echo "FAILED: pshard.torch on cuda (two ranks sharing one GPU over tcp) did not train"
  exit 1
fi
# bf16 mixed precision (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)): the
# GPU-resident run against the same pshard.torch run on the CPU.
if ! LLAMA_BF16=1 "$run" --nproc 1 -- "$py" "$worker" train "$work/bf16-cpu"; then
  echo "FAILED: pshard.torch on the CPU (bf16) did not train"
  exit 1
fi
if ! LLAMA_BF16=1 LLAMA_DEVICE=cuda LLAMA_GPU_SHARDS=1 "$run" --nproc 1 --backend nccl -- \
  "$py" "$worker" train "$work/bf16-cuda"; then
  echo "FAILED: pshard.torch on cuda (bf16, GPU-resident shards) did not train"
  exit 1
fi
"$py" - "$work" << 'PY'
import json, sys
work = sys.argv[1]
ref = json.load(open(f"{work}/ref/rank-0.json"))
bad = 0
# (run, ranks, shard and region memory, whether the server copies between host and GPU memory:
# nccl stages CPU offload's host buffers, tcp the GPU buffers; nccl with both in GPU memory none)
for run, world, want, staged in (("offload", 1, "host", True), ("gpu-shards", 1, "cuda", False),
                                 ("shared-gpu", 2, "cuda", True)):
  ranks = [json.load(open(f"{work}/{run}/rank-{r}.json")) for r in range(world)]
  got = ranks[0]
  print(f"{run}: {world} rank(s), shards in {got['memory']} memory (expected {want}), model "
        f"region in {got.get('region')} memory (expected {want})")
  bad += got["memory"] != want
  # GPU-resident shards: the full buffers are the server's GPU memory too (CUDA IPC)
  bad += got.get("region") != want
  bad += len(got["losses"]) != len(ref["losses"])
  for r, res in enumerate(ranks):
    st = res.get("staged")
    print(f"{run} rank {r}: GPU bytes its server copied through host memory: {st}")
    if st is None:
      bad += 1
    elif staged:
      bad += not (st["to_host"] > 0 and st["to_device"] > 0)
    else:  # nccl reads and writes the GPU shards and the model region where they are: no copy
      # through the host (CUDA IPC only)
      bad += st["to_host"] != 0 or st["to_device"] != 0
  for what in ("losses", "norms"):
    for s, (a, b) in enumerate(zip(got[what], ref[what])):
        rel = abs(a - b) / max(abs(b), 1e-12)
        print(f"{run} {what[:-1]} step {s}: cuda {a:.8f} cpu {b:.8f} rel {rel:.2e}")
        bad += rel > 1e-4
# bf16 on the GPU against bf16 on the CPU (different matmul kernels round differently):
# losses within 1e-2 and gradient norms within 5e-2 relative.
cpu = json.load(open(f"{work}/bf16-cpu/rank-0.json"))
gpu = json.load(open(f"{work}/bf16-cuda/rank-0.json"))
bad += len(gpu["losses"]) != len(cpu["losses"])
for what, tol in (("losses", 1e-2), ("norms", 5e-2)):
  for s, (a, b) in enumerate(zip(gpu[what], cpu[what])):
    rel = abs(a - b) / max(abs(b), 1e-12)
    print(f"bf16 {what[:-1]} step {s}: cuda {a:.8f} cpu {b:.8f} rel {rel:.2e} (tolerance {tol})")
    bad += rel > tol
if bad:
    print(f"FAILED: {bad} checks (memory, staging counters, step count, fp32 values within 1e-4 "
          "relative, bf16 within 1e-2 / 5e-2)")
    sys.exit(1)
print("a tiny Llama on cuda with pshard.torch matches the CPU: fp32 within 1e-4 (one rank on "
      "nccl with host or GPU shards, two ranks sharing one GPU over tcp), bf16 within 1e-2")
PY
