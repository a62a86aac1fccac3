"""Trainer for test_join.py's collectives case: rank 0 has no batches and joins at once; the
others train a few steps under pshard.torch.Join and all-reduce metrics with every reduction.
A joined rank must change no result: its server contributes the reduction's identity (zeros for
a sum, ones for a product, +inf for a min, -inf for a max), and an average is over the others.
Writes OUTDIR/rank-R.json with what each all_reduce gave."""
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
            for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
                x = torch.tensor([rank + 1.0, -(rank + 1.0)])
                dist.all_reduce(x, op=getattr(dist.ReduceOp, name))
                got[f"{name} {step}"] = x.tolist()
            # To and from a root while rank 0 has joined: its server takes part with the
            # reduction's identity (reduce) or zeros (its gather block).
            x = torch.tensor([rank + 1.0, -(rank + 1.0)])
            dist.reduce(x, 2, op=dist.ReduceOp.MIN)
            got[f"reduce {step}"] = x.tolist()
            outs = [torch.zeros(2) for _ in range(3)] if rank == 1 else None
            dist.gather(torch.tensor([rank * 1.0, step * 1.0]), outs, dst=1)
            if outs is not None:
                got[f"gather {step}"] = [o.tolist() for o in outs]
            y = torch.zeros(2)
            dist.scatter(y, [torch.tensor([r * 10.0, step * 1.0]) for r in range(3)]
                         if rank == 2 else None, src=2)
            got[f"scatter {step}"] = y.tolist()
            a2a = torch.zeros(3)
            dist.all_to_all_single(a2a, torch.tensor([rank * 10.0 + k for k in range(3)]))
            got[f"all_to_all {step}"] = a2a.tolist()
            # Uneven splits: the joined rank 0's blocks arrive as zeros of the expected size.
            sends = {1: [1, 1, 2], 2: [1, 2, 1]}[rank]
            recvs = {1: [2, 1, 2], 2: [1, 2, 1]}[rank]
            a2av = torch.full((sum(recvs),), -1.0)
            dist.all_to_all_single(a2av, torch.arange(4.0) + 10 * rank,
                                   output_split_sizes=recvs, input_split_sizes=sends)
            got[f"all_to_all uneven {step}"] = a2av.tolist()
            # reduce_scatter: rank 0's block is the identity; the average over ranks 1 and 2.
            rs = torch.zeros(2)
            dist.reduce_scatter_tensor(rs, torch.arange(6.0) + 10 * rank, op=dist.ReduceOp.AVG)
            got[f"reduce_scatter {step}"] = rs.tolist()
            # Point-to-point: with the joined rank 0 a clear JoinedError; between 1 and 2 data.
            try:
                dist.send(torch.ones(2), 0, tag=step)
                got[f"send to joined {step}"] = "no error"
            except pshard.JoinedError as e:
                got[f"send to joined {step}"] = str(e)
            box = torch.zeros(2)
            if rank == 1:
                dist.send(torch.tensor([1.0, step]), 2, tag=9)
            else:
                dist.recv(box, 1, tag=9)
            got[f"p2p {step}"] = box.tolist()
            for name in ("BAND", "BOR", "BXOR"):
                x = torch.tensor([rank + 1, 12 - rank], dtype=torch.int64)
                dist.all_reduce(x, op=getattr(dist.ReduceOp, name))
                got[f"{name} {step}"] = x.tolist()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(got, f)
    pshard.destroy_process_group()


if __name__ == "__main__":
    main()
