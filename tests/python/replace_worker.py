"""Trainer for test_replace.py: a small model under pshard.torch (fully_shard per layer and
root, pshard.torch.optim.AdamW on the shard servers) trained for STEPS steps on data that each
rank draws from (step, rank). On the first attempt rank 1 exits (os._exit, no goodbye) just
before step FAIL_STEP; the others catch pshard.StepAbortedError, resync and go on, and the
replacement that pshardrun starts begins at pshard.torch.resume_step. SKIP (a comma list)
leaves steps out: the reference run. Rank 0 writes the final full weights to OUT/weights.pt;
every rank writes OUT/rank-R-A.json (A: its attempt) with the steps it saw aborted and where
it started.
With OPTIM "torch" a torch.optim.AdamW steps the shards in the trainer instead: its state is
the trainer's, so a lost trainer cannot be replaced and the job must fail.
argv: OUT FAIL_STEP SKIP [OPTIM]"""
import json
import os
import sys

import torch

import pshard
import pshard.torch as pt

torch.set_num_threads(1)
out, fail_step = sys.argv[1], int(sys.argv[2])
skip = {int(s) for s in sys.argv[3].split(",") if s}
optim = sys.argv[4] if len(sys.argv) > 4 else "server"
STEPS = 12
attempt = os.environ.get("PSHARD_RESTART_COUNT", "0")
pshard.init_process_group()
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
pt.fully_shard(model[0])
pt.fully_shard(model[2])
pt.fully_shard(model)
opt = (pt.optim.AdamW if optim == "server" else torch.optim.AdamW)(model.parameters(), lr=1e-2)
step = started_at = pt.resume_step(model)
aborted = []
while step < STEPS:
    if step in skip:
        step += 1
        continue
    if rank == 1 and step == fail_step and attempt == "0":
        sys.stdout.flush()
        os._exit(3)
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
    except pshard.StepAbortedError:
        opt.zero_grad()
        nxt = pt.resync(model)
        aborted.extend(range(step, nxt))
        step = nxt
sd = pt.get_model_state_dict(model, options=pt.StateDictOptions(full_state_dict=True))
if rank == 0:
    torch.save({k: v.clone() for k, v in sd.items()}, os.path.join(out, "weights.pt"))
with open(os.path.join(out, f"rank-{rank}-{attempt}.json"), "w") as f:
    json.dump({"aborted": aborted, "started_at": started_at, "steps": pt.get_step(model)}, f)
pshard.destroy_process_group()
