"""A DDP-style trainer on backend "pshard" (no fully_shard, so no Step on the servers) that marks
its steps with pshard.report_step; rank SLOW sleeps SLEEP seconds in each step's compute.
Rank 0 then polls `pshardctl --json status` until the coordinator names a slowest rank (the
servers' medians arrive with their heartbeats) and writes what it said to OUT_DIR/status.json.

usage: straggler_worker.py PSHARDCTL OUT_DIR SLOW SLEEP STEPS
"""
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import pshard

ctl, out_dir, slow, sleep_s, steps = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                      float(sys.argv[4]), int(sys.argv[5]))
pshard.init_process_group()
rank = dist.get_rank()
grad = torch.ones(1024)
for step in range(steps):
    if rank == slow:
        time.sleep(sleep_s)  # a slow data loader: time outside pshard
    dist.all_reduce(grad)
    grad.fill_(1.0)
    pshard.report_step(tokens=4096, samples=8)
try:
    pshard.report_step(tokens=-1)
except ValueError:
    pass
else:
    raise AssertionError("report_step(tokens=-1) did not raise ValueError")

status = None
if rank == 0:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        p = subprocess.run([ctl, "--coordinator", os.environ["PSHARD_COORDINATOR"], "--json",
                            "status"], stdout=subprocess.PIPE, text=True)
        try:
            status = json.loads(p.stdout)
        except ValueError:
            status = None
        if status and status.get("straggler", {}).get("rank") is not None:
            break
        time.sleep(0.2)
    with open(os.path.join(out_dir, "status.json"), "w") as f:
        json.dump(status, f)
dist.barrier()
pshard.destroy_process_group()
