"""init_process_group(timeout=T) with rank 1 late: rank 0 enters a barrier and an all_reduce;
rank 1 enters them only once rank 0 has given up (its result file exists). Run on torch's gloo
and on pshard (through torch's API with backend "pshard", or pshard.init_process_group).
Writes out/rank-R.json: each operation's outcome ("ok" / the sum, or "Type: message") and how
long it took.
argv: API (torch | pshard) BACKEND (gloo | pshard) OUT INIT_FILE TIMEOUT_S"""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

api, backend, out, init, timeout_s = sys.argv[1:6]
T = datetime.timedelta(seconds=float(timeout_s))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if api == "pshard":
    import pshard
    pshard.init_process_group(timeout=T)
else:
    if backend == "pshard":
        import pshard  # noqa: F401 - registers the backend
    dist.init_process_group(backend, init_method="file://" + init, rank=rank, world_size=world,
                            timeout=T)


def wait_for(name):
    path = os.path.join(out, name)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def attempt(fn):
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        value = f"{type(e).__name__}: {e}"
    return value, time.monotonic() - t0


def all_reduce():
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


if rank == 1:
    wait_for("rank-0.json")  # late: rank 0 has given up
res = {}
res["barrier"], res["barrier_s"] = attempt(lambda: dist.barrier() or "ok")
res["all_reduce"], res["all_reduce_s"] = attempt(all_reduce)
with open(os.path.join(out, f"rank-{rank}.json.tmp"), "w") as f:
    json.dump(res, f)
os.rename(os.path.join(out, f"rank-{rank}.json.tmp"), os.path.join(out, f"rank-{rank}.json"))
if rank == 0:
    wait_for("rank-1.json")
if backend == "pshard":
    import pshard
    pshard.destroy_process_group()  # leaves the cluster
os._exit(0)  # (gloo in an error state may not tear down cleanly)
