"""Uneven inputs under Join(throw_on_early_termination=True), on torch's own (DDP + torch's
Join on gloo) and on pshard's (fully_shard + pshard.torch.Join): rank r has 3 + r batches
(INPUTS "uneven"; "even": 3 each).
Each rank records where it ended (the exception's type and message, or none), how many steps
it took and whether a post hook ran, in out/rank-R.json. A collective in the except branch
(torch's contract: every rank ends there) proves all ranks are still in step.
argv: BACKEND (gloo | pshard) OUT INIT_FILE INPUTS"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable, JoinHook

backend, out, init, inputs = sys.argv[1:5]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
res = {"error": None, "steps": 0, "post_hook": False}


class Recorder(Joinable):
    """A Joinable with a post hook only (what pshard's Join runs)."""

    def __init__(self):
        super().__init__()

    def join_hook(self, **kwargs):
        class Hook(JoinHook):
            def post_hook(self, is_last_joiner):
                res["post_hook"] = True
        return Hook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
if backend == "pshard":
    import pshard
    import pshard.torch as pt
    pshard.init_process_group()
    pt.fully_shard(model[0])
    pt.fully_shard(model)
    opt = pt.optim.SGD(model.parameters(), lr=0.1)
    join = pt.Join([model, opt, Recorder()], throw_on_early_termination=True)
else:
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    join = TorchJoin([model, Recorder()], throw_on_early_termination=True)
try:
    with join:
        for step in range(3 + (rank if inputs == "uneven" else 0)):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            res["steps"] += 1
except RuntimeError as e:
    res["error"] = f"{type(e).__name__}: {e}"
# Every rank is here: a collective after the Join block completes.
t = torch.tensor([1.0])
dist.all_reduce(t)
res["after"] = t.item()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(res, f)
if backend == "pshard":
    pshard.destroy_process_group()
else:
    # torch's gloo aborts now and then in its teardown after a Join in throw mode ("terminate
    # called without an active exception", some 3 runs in 10 on torch 2.15), after everything
    # compared was written: leave without that teardown.
    sys.stdout.flush()
    os._exit(0)
