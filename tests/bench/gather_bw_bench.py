#!/usr/bin/env python3
"""The gather bandwidth of pshard.torch against the device's own copy bandwidth (issue 31's second
figure): one fp32 parameter of --mib MiB (a bias-free square Linear), fully_shard'ed with
pshard.torch, gathered (FSDPModule.unshard) and freed (reshard) --iters times; each gather is
timed to the point the full parameter is usable on the device (synchronized), and set against
copying the same bytes from one tensor to another on that device (Tensor.copy_, synchronized).

  pshardrun --nproc 1 --backend nccl -- python gather_bw_bench.py --device cuda   # GPU shards
  pshardrun --nproc 1 -- python gather_bw_bench.py                                # CPU

Prints one line:
  gather_bw device D world N bytes B gather_gbps X copy_gbps Y ratio X/Y
(GB/s = 1e9 bytes a second; with N ranks each gather moves the whole parameter into every rank).
"""
import argparse
import math
import os
import time

import torch


def timed(fn, sync, iters):
    """Mean seconds of fn() over iters calls, each synchronized."""
    total = 0.0
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        total += time.perf_counter() - t0
    return total / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mib", type=int, default=64, help="the parameter's size in MiB (fp32)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if args.mib < 1 or args.iters < 1:
        ap.error("--mib and --iters must be positive")
    torch.set_num_threads(1)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this torch sees no CUDA device")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                           % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        sync = torch.cuda.synchronize
    else:
        dev, sync = torch.device("cpu"), (lambda: None)

    import pshard
    import pshard.torch as pt
    pshard.init_process_group()
    n = int(math.isqrt(args.mib * (1 << 20) // 4))
    model = torch.nn.Linear(n, n, bias=False).to(dev)
    pt.fully_shard(model)
    nbytes = n * n * 4

    def gather():
        model.unshard()
        model.weight.sum()  # reading it: the gather is complete and usable here

    def cycle():
        gather()
        model.reshard()

    cycle()  # warm up (first-touch of the buffers)
    gather_s = 0.0
    for _ in range(args.iters):
        gather_s += timed(gather, sync, 1)
        model.reshard()
    gather_s /= args.iters
    src = torch.ones(n * n, device=dev)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        dst.sum()  # the same read as after a gather

    copy()
    copy_s = timed(copy, sync, args.iters)
    g, c = nbytes / gather_s / 1e9, nbytes / copy_s / 1e9
    print(f"gather_bw device {dev} world {pshard.get_world_size()} bytes {nbytes} "
          f"gather_gbps {g:.2f} copy_gbps {c:.2f} ratio {g / c:.3f}", flush=True)
    pshard.destroy_process_group()


if __name__ == "__main__":
    main()
