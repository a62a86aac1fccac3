"""A trainer that trains a tiny pshard.torch model for three steps and then ends, as users'
scripts do: mode "exit" keeps the model and optimizer at module level and just returns (no
destroy_process_group); mode "destroy" calls pshard.destroy_process_group() while a shard view
(a parameter's local tensor) is alive, then reads it (its last values) and uses the model (an
error); mode "die" ends with os._exit (no exit hooks: as if killed). Writes out/rank-R.json."""
import json
import os
import sys

import torch

import pshard
import pshard.torch as pt

mode, out = sys.argv[1], sys.argv[2]
pshard.init_process_group()
rank = pshard.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
pt.fully_shard(model[0])
pt.fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(3):
    g = torch.Generator().manual_seed(rank * 100 + step)
    loss = model(torch.randn(4, 8, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
result = {"loss": loss.item(), "error": None}
if mode == "destroy":
    local = model[0].weight.to_local()
    before = local.clone()
    pshard.destroy_process_group()
    result["view_kept"] = bool(torch.equal(local, before)) and float(local.abs().sum()) > 0
    try:
        model(torch.randn(2, 8))
    except Exception as e:  # noqa: BLE001 - the type and message are the result
        result["use_after_close"] = f"{type(e).__name__}: {e}"
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(result, f)
if mode == "die":
    os._exit(0)
