"""Trainer for test_memory.py: an MLP of 8 equal blocks, FULL_SHARD or SHARD_GRAD_OP; writes
its pool counters, the parameter bytes of the units, and where the parameters' storage lives
(OUTDIR/rank-R.json)."""
import json
import os
import sys

import torch

import pshard
import pshard.torch as pt

torch.set_num_threads(1)


def main():
    raf = sys.argv[1] == "full"
    out = sys.argv[2]
    pshard.init_process_group()
    rank = pshard.get_rank()
    torch.manual_seed(0)
    d = 64
    blocks = [torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()) for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Linear(d, d), *blocks, torch.nn.Linear(d, 1))
    for b in blocks:
        pt.fully_shard(b, reshard_after_forward=raf)
    pt.fully_shard(model, reshard_after_forward=raf)
    opt = pt.optim.SGD(model.parameters(), lr=0.01)
    c = pshard._get_client()
    addrs, locals_ = [], []
    for step in range(4):
        x = torch.randn(16, d)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        # Where each unsharded parameter's storage is: the client's fixed shared-memory buffer;
        # and each sharded parameter's local tensor: the server's own master weights.
        fsdp_params = model._pshard_model().fsdp_params
        addrs.append([fp.unsharded.data_ptr() for fp in fsdp_params])
        locals_.append([p.to_local().data_ptr() if p.to_local().numel() else 0
                        for p in model.parameters()])
    n = len(list(model.parameters()))
    buffers = [c.param_buffer(i).address for i in range(n)]
    masters = [c.shard_view(i)[0].address if c.shard_view(i)[3] else 0 for i in range(n)]
    st = pt.memory_stats()
    block_bytes = sum(p.numel() * 4 for p in blocks[0].parameters())
    root_bytes = sum(p.numel() * 4 for p in model.parameters()) - 8 * block_bytes
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"stats": st, "block_bytes": block_bytes, "root_bytes": root_bytes,
                   "addrs": addrs, "buffers": buffers, "locals": locals_,
                   "masters": masters}, f)
    pshard.destroy_process_group()


main()
