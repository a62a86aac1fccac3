"""Trainer for test_keyed_groups.py's Join case, on 4 ranks: keyed groups [0, 1] and [2, 3] are
made by their members before the loop; rank 0 has no batches and joins at once; the others
train two steps under pshard.torch.Join and all-reduce on their keyed group, which rank 0's
server shadows for rank 1 (its identity, zeros, changes nothing). Rank 1 then asks for another
keyed group with rank 0: refused at once with JoinedError naming rank 0 instead of waiting.
Writes OUTDIR/rank-R.json."""
import json
import os
import sys

import torch

import pshard
import pshard.torch as pt

torch.set_num_threads(1)
ALL_REDUCE = 3  # pshard_op_t


def main():
    out = sys.argv[1]
    pshard.init_process_group()
    c = pshard._get_client()
    rank = c.rank
    pair = [0, 1] if rank < 2 else [2, 3]
    g = c.new_groups([pair], 0, key=f"pair-{pair[0]}{pair[1]}")[0]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    pt.fully_shard(model)
    opt = pt.optim.SGD(model.parameters(), lr=0.1)
    got = {"sums": [], "joined_error": None}
    with pt.Join([model, opt]):
        for step in range(0 if rank == 0 else 2):
            loss = model(torch.full((3, 4), float(rank))).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            send, recv = torch.full((3,), rank + 1.0), torch.empty(3)
            c.collective_start(ALL_REDUCE, send, recv, 3, "fp32", 0, 0, g).wait()
            got["sums"].append(recv.tolist())
        if rank == 1:  # rank 0 joined before the steps above could run
            try:
                c.new_groups([[0, 1]], 3000, key="after-join")
                got["joined_error"] = "no error"
            except pshard.JoinedError as e:
                got["joined_error"] = str(e)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(got, f)
    pshard.destroy_process_group()


if __name__ == "__main__":
    main()
