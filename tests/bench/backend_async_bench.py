"""What a queued (async_op=True) collective of backend "pshard" costs beside the same blocking
one: a queued one is staged (its input copied into the client's scratch region at the call and
its result copied out at wait(), so the caller may resize its tensors meanwhile), a blocking one
copies the same bytes in and out as it runs. Prints, for all_reduce of 0.25 and 16 MiB, the
best of 5 rounds of 10 of each, measured side by side in one run, and their ratio.
usage: pshardrun --nproc 2 -- python tests/bench/backend_async_bench.py"""
import time

import torch

import pshard
import pshard.distributed as dist

torch.set_num_threads(1)
pshard.init_process_group()
rank = dist.get_rank()
for n in (1 << 16, 1 << 22):
    t = torch.ones(n)
    for _ in range(3):
        dist.all_reduce(t, async_op=True).wait()
    best_async = best_blocking = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(t, async_op=True).wait()
        best_async = min(best_async, (time.perf_counter() - t0) / 10)
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(t)
        best_blocking = min(best_blocking, (time.perf_counter() - t0) / 10)
    if rank == 0:
        print(f"all_reduce {n * 4 / 2**20:.2f} MiB on {dist.get_world_size()} ranks: queued "
              f"{best_async * 1e3:.2f} ms, blocking {best_blocking * 1e3:.2f} ms, ratio "
              f"{best_async / best_blocking:.2f}", flush=True)
pshard.destroy_process_group()
