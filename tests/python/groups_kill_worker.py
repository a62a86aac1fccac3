"""Trainer for test_groups.py's rank-loss case, on 4 ranks: groups [0, 1] and [2, 3]; each
rank all-reduces on its group in a loop, and rank 1 kills itself after a few. Rank 0 must fail
with PeerLostError naming rank 1 (its group holds it); ranks 2 and 3 must finish their loop
(theirs does not). Writes OUTDIR/rank-R.json."""
import json
import os
import signal
import sys
import time

import torch

import pshard
import pshard.distributed as dist

torch.set_num_threads(1)


def main():
    out = sys.argv[1]
    pshard.init_process_group()
    rank = pshard.get_rank()
    g01, g23 = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])[1]
    mine = g01 if rank < 2 else g23
    res = {"done": 0, "error": None, "after_loss": 0}
    killed = os.path.join(out, "killed")
    deadline = time.time() + 60
    try:
        for i in range(1_000_000):
            if rank == 1 and i == 5:
                with open(killed + ".tmp", "w") as f:
                    f.write(repr(time.time()))
                os.rename(killed + ".tmp", killed)
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.ones(4)
            dist.all_reduce(x, group=mine)
            assert torch.equal(x, torch.full((4,), 2.0))
            res["done"] += 1
            # Ranks 2 and 3 go on until well after rank 1's lease lapsed (2 s), and decide to
            # stop together (an all-reduce of their flags every round, so they stay in step).
            if rank >= 2:
                late = os.path.exists(killed) and time.time() > float(open(killed).read()) + 4
                flag = torch.tensor([int(late)])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mine)
                res["after_loss"] += int(late)
                if flag.item():
                    break
            if time.time() > deadline:
                break
    except pshard.Error as e:
        res["error"] = {"type": type(e).__name__, "message": str(e), "time": time.time()}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
