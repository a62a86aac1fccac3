"""A torch trainer under pshardrun: init_process_group("gloo") through env:// (MASTER_ADDR and
MASTER_PORT as pshardrun sets them, or, with argv[2] == "pshard", pshard's Store through
install_env_rendezvous), one all_reduce, and its result in OUT/rank-R.json."""
import json
import os
import sys

import torch
import torch.distributed as dist

out, mode = sys.argv[1], sys.argv[2]
if mode == "pshard":
    from pshard._store import Store, install_env_rendezvous
    install_env_rendezvous()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
store_type = type(dist.distributed_c10d._get_default_store()).__name__
if mode == "pshard":
    # The default store is a PrefixStore over what the rendezvous gave.
    inner = dist.distributed_c10d._get_default_store()
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    store_type = type(inner).__name__
    assert isinstance(inner, Store), type(inner)
t = torch.tensor([float(rank + 1)] * 4)
dist.all_reduce(t)
dist.barrier()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "sum": t.tolist(), "store": store_type,
               "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]],
               "coordinator": os.environ["PSHARD_COORDINATOR"]}, f)
dist.destroy_process_group()
