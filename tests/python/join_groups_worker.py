"""Trainer for test_join.py's process-group case, on 4 ranks: groups [0, 1], [1, 2, 3] and
[2, 3] are made before the loop; rank 0 has no batches and joins at once; the others train two
steps under pshard.torch.Join and all-reduce on every group and the world. Rank 0's server
shadows the operations of [0, 1] (on its own thread) and of the world, so nobody hangs, and
its contribution changes nothing. Writes OUTDIR/rank-R.json with what each collective gave."""
import json
import os
import sys

import torch

import pshard
import pshard.distributed as dist
import pshard.torch as pt

torch.set_num_threads(1)


def main():
    out = sys.argv[1]
    pshard.init_process_group()
    rank = pshard.get_rank()
    groups = {"01": dist.new_group([0, 1]), "123": dist.new_group([1, 2, 3]),
              "23": dist.new_group([2, 3])}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    pt.fully_shard(model)
    opt = pt.optim.SGD(model.parameters(), lr=0.1)
    got = {}
    with pt.Join([model, opt]):
        for step in range(0 if rank == 0 else 2):
            loss = model(torch.full((3, 4), float(rank))).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            for gname, g in list(groups.items()) + [("world", None)]:
                if g is not None and dist.get_rank(g) < 0:
                    continue  # not a member (torch's collectives would do nothing)
                for op in ("SUM", "AVG", "MAX"):
                    x = torch.tensor([rank + 1.0, -(rank + 1.0)])
                    dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=g)
                    got[f"{gname} {op} {step}"] = x.tolist()
            x = torch.tensor([rank * 1.0, step * 1.0])
            if dist.get_rank(groups["123"]) >= 0:
                dist.broadcast(x, src=3, group=groups["123"])
                got[f"123 broadcast {step}"] = x.tolist()
            if rank == 1:  # the root of this broadcast (rank 0) has joined
                try:
                    dist.broadcast(x, src=0, group=groups["01"])
                    got[f"01 broadcast {step}"] = "no error"
                except RuntimeError as e:
                    got[f"01 broadcast {step}"] = str(e)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(got, f)
    pshard.destroy_process_group()


if __name__ == "__main__":
    main()
