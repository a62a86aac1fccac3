"""Trainer for test_memory.py's shard-view case: pshard._C directly, no pshard.torch. Defines a
model whose last rank owns no rows of one parameter, reads this rank's fp32 shard of each from
the shard server's memory (Client.shard_view), writes new masters through it with torch, and
checks every rank gathers them; a trainer step (Client.step_trainer) counts the step.
Writes OUTDIR/rank-R.json."""
import json
import os
import sys

import torch

import pshard

torch.set_num_threads(1)


def main():
    out = sys.argv[1]
    pshard.init_process_group()
    c = pshard._get_client()
    rank, world = c.rank, c.world_size
    shapes = [(5, 3), (1,)]
    init = [torch.arange(15, dtype=torch.float32).reshape(5, 3) + 1,
            torch.tensor([42.0])]
    c.define_model(["w", "b"], shapes, init=init)
    res = {"rank": rank, "views": []}
    for i, full in enumerate(init):
        master, grad, offset, numel = c.shard_view(i)
        m = torch.from_dlpack(master)
        g = torch.from_dlpack(grad)
        flat = full.reshape(-1)
        res["views"].append({
            "offset": offset, "numel": numel, "shape": list(m.shape), "dtype": str(m.dtype),
            "master_ok": torch.equal(m, flat[offset:offset + numel]),
            "grad_zero": bool((g == 0).all()) and g.numel() == numel,
        })
        # The server's master weights, updated in place as an optimizer would.
        m.mul_(-1)
    try:
        c.shard_view(len(init))
        res["bad_index"] = "no error"
    except pshard.InvalidArgumentError as e:
        res["bad_index"] = "InvalidArgumentError"
    res["step"] = c.step_trainer()
    c.gather(None)
    res["gathered_ok"] = all(
        torch.equal(torch.frombuffer(c.param_buffer(i), dtype=torch.float32).reshape(full.shape),
                    -full) for i, full in enumerate(init))
    del m, g, master, grad
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)
    pshard.destroy_process_group()


main()
