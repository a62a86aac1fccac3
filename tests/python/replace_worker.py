"""Trainer for test_replace.py: a small model under pshard.torch (fully_shard per layer and
root) trained for STEPS steps on data that each rank draws from (step, rank). On the first
attempt rank 1 is lost (os._exit, no goodbye) at step FAIL_STEP, at the point WHERE says; the
others catch pshard.StepAbortedError, resync and go on, and the replacement that pshardrun
starts begins at pshard.torch.resume_step. SKIP (a comma list) leaves steps out: the reference
run. Rank 0 writes the final full weights to OUT/weights.pt; every rank writes OUT/rank-R-A.json
(A: its attempt) with the steps it saw aborted and where it started.
OPTIM: "server" (pshard.torch.optim.AdamW, on the shard servers), "torch" (torch.optim.AdamW
in the trainer, two parameter groups and a LambdaLR schedule, its state kept for a replacement
by pshard.torch; the replacement advances its schedule to get_step) or "torch-extra" (an AdamW
that also steps a parameter outside the model, whose state therefore cannot be kept).
WHERE: "forward" (before the step's forward), "server" (rank 1 kills its own shard server
before the step's forward, and waits for pshardrun to stop it: HSDP heals the server from a
replica), "update" (after the optimizer updated the values,
before the step's commit: nobody counts the step and everyone rolls it back), "commit" (after
the commit: everybody counts it), "backup" (after the values were copied aside, before the
update).
MESH: "" (FSDP over the world) or "RxS" (HSDP: R replicas of S shard ranks).
REPLACE_WORKER_BATCHNORM=1 in the environment puts a BatchNorm1d after the first layer;
REPLACE_WORKER_OTHER_MODEL=1 makes a replacement (a later attempt) define a wider model;
REPLACE_WORKER_STATUS=PSHARDCTL has rank 0 write `pshardctl --json status` at the end to
OUT/status.json; REPLACE_WORKER_SAVE=1 saves a checkpoint (pshardrun --checkpoint-dir) after the last step.
argv: OUT FAIL_STEP SKIP [OPTIM [WHERE [MESH]]]"""
import json
import os
import sys

import torch

import pshard
import pshard.torch as pt
from pshard.torch import _optim_keep

torch.set_num_threads(1)
out, fail_step = sys.argv[1], int(sys.argv[2])
skip = {int(s) for s in sys.argv[3].split(",") if s}
optim = sys.argv[4] if len(sys.argv) > 4 else "server"
where = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else "forward"
mesh_arg = sys.argv[6] if len(sys.argv) > 6 else ""
STEPS = 12
attempt = os.environ.get("PSHARD_RESTART_COUNT", "0")
pshard.init_process_group()
rank = torch.distributed.get_rank()
torch.manual_seed(0)
width = 33 if os.environ.get("REPLACE_WORKER_OTHER_MODEL") == "1" and attempt != "0" else 32
model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(),
                            torch.nn.Linear(width, 4))
if os.environ.get("REPLACE_WORKER_BATCHNORM") == "1":  # running statistics only a trainer has
    model.insert(1, torch.nn.BatchNorm1d(32))
mesh = None
if mesh_arg:
    from torch.distributed.device_mesh import init_device_mesh
    r, s = (int(v) for v in mesh_arg.split("x"))
    mesh = init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard"))
pt.fully_shard(model[0], mesh=mesh)
pt.fully_shard(model[2], mesh=mesh)
pt.fully_shard(model, mesh=mesh)
sched = None
if optim == "server":
    opt = pt.optim.AdamW(model.parameters(), lr=1e-2)
elif optim == "torch-extra":  # a parameter outside the model too: nothing can be kept
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([*model.parameters(), extra], lr=1e-2)
else:
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1},
                             {"params": model[2].parameters(), "lr": 2e-2}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
step = started_at = pt.resume_step(model)
if sched is not None:
    for _ in range(pt.get_step(model)):  # the schedule goes by the steps applied
        sched.step()
aborted = []
lose = rank == 1 and attempt == "0"


def lost():
    sys.stdout.flush()
    os._exit(3)


def kill_own_server():
    """SIGKILL to this rank's shard server (pshardrun's child, like this trainer, started with
    --port-file .../server-LOCAL_RANK.ATTEMPT.port), then wait for pshardrun to stop this
    trainer."""
    import re
    import signal
    tail = re.compile(rf"/server-{os.environ['LOCAL_RANK']}\.[0-9]+\.port$")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == os.getppid() and any(tail.search(a.decode(errors="replace"))
                                        for a in args):
            os.kill(int(pid), signal.SIGKILL)
            sys.stdout.flush()
            signal.pause()
    raise SystemExit(f"no shard server of this rank found ({tail})")


if lose and where not in ("forward", "server"):
    # The points inside opt.step(): the optimizer's own post-hook runs before pshard.torch's
    # global one (the commit); the kept state's methods run at the others.
    if where == "update":
        opt.register_step_post_hook(lambda *a: lost() if step == fail_step else None)
    else:
        cls = _optim_keep.KeptState
        name = {"commit": "committed", "backup": "before_step"}[where]
        orig = getattr(cls, name)

        def at_point(self, *a):
            r = orig(self, *a)
            if step == fail_step:
                lost()
            return r
        setattr(cls, name, at_point)
while step < STEPS:
    if step in skip:
        step += 1
        continue
    if lose and where == "forward" and step == fail_step:
        lost()
    if lose and where == "server" and step == fail_step:
        kill_own_server()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        step += 1
    except pshard.StepAbortedError:
        opt.zero_grad()
        nxt = pt.resync(model)
        aborted.extend(range(step, nxt))
        step = nxt
mesh_sums = {}
if mesh is not None:
    # The DeviceMesh's own process groups still work after the abort: the survivors' are rebuilt
    # on their first use, the replacement's were made again by its init_device_mesh.
    for dim in ("replicate", "shard"):
        g = mesh.get_group(dim)
        t = torch.tensor([float(rank + 1)])
        torch.distributed.all_reduce(t, group=g)
        mesh_sums[dim] = [t.item(), float(sum(r + 1 for r in
                                              torch.distributed.get_process_group_ranks(g)))]
if rank == 0 and os.environ.get("REPLACE_WORKER_STATUS"):  # what pshardctl says of the servers
    import subprocess
    with open(os.path.join(out, "status.json"), "w") as f:
        subprocess.run([os.environ["REPLACE_WORKER_STATUS"], "--json", "status"], stdout=f,
                       check=True)
if os.environ.get("REPLACE_WORKER_SAVE") == "1":  # a checkpoint after the last step
    pt.save_checkpoint(model)
sd = pt.get_model_state_dict(model, options=pt.StateDictOptions(full_state_dict=True))
if rank == 0:
    torch.save({k: v.clone() for k, v in sd.items()}, os.path.join(out, "weights.pt"))
with open(os.path.join(out, f"rank-{rank}-{attempt}.json"), "w") as f:
    json.dump({"aborted": aborted, "started_at": started_at, "steps": pt.get_step(model),
               "lr": [g["lr"] for g in opt.param_groups], "mesh_sums": mesh_sums}, f)
pshard.destroy_process_group()
