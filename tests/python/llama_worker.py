"""A real FSDP2 training script on pshard, as a user ports it (the fully_shard import and the
init line changed, nothing else): a tiny Hugging Face Llama (GQA, rotary) built from a config,
fully_shard per decoder layer and on the root, plain torch.optim.AdamW with two parameter groups
and a LambdaLR, torch.nn.utils.clip_grad_norm_, data through DistributedSampler, and
torch.distributed.checkpoint (dcp.save / dcp.load of model and optimizer, loadable on another
world size). test_llama.py compares it with the same steps in one process.

usage: llama_worker.py MODE OUT [CKPT]
  train   (under pshardrun) steps FIRST..LAST-1; with CKPT and FIRST > 0 it first loads CKPT
          (dcp.load); with CKPT and FIRST == 0 it saves CKPT after the last step (dcp.save)
  reference  the same steps in one process, plain torch, on the union of the ranks' batches
Environment: LLAMA_FIRST, LLAMA_LAST (steps), LLAMA_OPT (torch: torch.optim.AdamW in the trainer;
pshard: pshard.torch.optim.AdamW on the shard servers), LLAMA_MESH ("R,S": HSDP), LLAMA_ASYNC
(set: dcp.async_save instead of dcp.save), LLAMA_DEVICE (cuda: the model on cuda:LOCAL_RANK (modulo the GPUs),
with FSDP2's CPUOffloadPolicy, as pshard keeps a GPU model's shards; default cpu),
LLAMA_OFFLOAD (set: CPUOffloadPolicy on the CPU too), LLAMA_GPU_SHARDS (set, with cuda: no
offload policy, the sharded parameters on the shard servers' GPUs), LLAMA_BF16 (set:
MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)).
Writes OUT/rank-R.json (losses and grad norms per step) and, from rank 0, OUT/final.pt (the
full state dict) and OUT/logits.pt (the sharded model's logits on a fixed input).
"""
import json
import math
import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)
MODE, OUT = sys.argv[1], sys.argv[2]
CKPT = sys.argv[3] if len(sys.argv) > 3 else None
FIRST, LAST = int(os.environ.get("LLAMA_FIRST", 0)), int(os.environ.get("LLAMA_LAST", 10))
OPT = os.environ.get("LLAMA_OPT", "torch")
# cuda: this rank's GPU, cuda:LOCAL_RANK, or with fewer GPUs than ranks (shard servers sharing
# one GPU, --shard-memory gpu) LOCAL_RANK modulo their count.
DEVICE = (f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % max(1, torch.cuda.device_count())}"
          if os.environ.get("LLAMA_DEVICE") == "cuda" else "cpu")
GLOBAL_BATCH, SEQ, SAMPLES = 12, 16, 120


def build_model():
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, 96, (SAMPLES, SEQ), generator=g))


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def lr_fn(step):
    return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * step / 10))


def reference():
    model = build_model()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_fn)
    sampler = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    order = list(sampler)
    data = dataset().tensors[0]
    losses, norms = [], []
    for step in range(LAST):
        batch = data[order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "rank-0.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms}, f)
    torch.save(model.state_dict(), os.path.join(OUT, "final.pt"))


def staged_bytes(rank):
    """What this rank's shard server copied of its GPU slices through host memory, as
    `pshardctl status --json` reports it ({"to_host": N, "to_device": M}), or None."""
    import subprocess
    ctl = os.environ.get("PSHARDCTL") or os.path.join(os.path.dirname(sys.executable),
                                                      "pshardctl")
    p = subprocess.run([ctl, "--json", "status"], capture_output=True, text=True, timeout=60)
    try:
        servers = json.loads(p.stdout)["servers"]
    except (ValueError, KeyError):
        print(f"pshardctl status failed: {p.stdout[-500:]} {p.stderr[-500:]}", flush=True)
        return None
    mine = [x.get("device_staged_bytes") for x in servers if x.get("server_rank") == rank]
    return mine[0] if len(mine) == 1 else None


def train():
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import pshard
    from pshard.torch import fully_shard          # was: from torch.distributed.fsdp import ...
    pshard.init_process_group()                    # was: dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    mesh = None
    if os.environ.get("LLAMA_MESH"):
        r, s = (int(x) for x in os.environ["LLAMA_MESH"].split(","))
        mesh = init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard"))
    model = build_model().to(DEVICE)
    kw = {}
    gpu_shards = os.environ.get("LLAMA_GPU_SHARDS")  # a GPU model's shards on its GPU
    if (DEVICE != "cpu" and not gpu_shards) or os.environ.get("LLAMA_OFFLOAD"):
        from torch.distributed.fsdp import CPUOffloadPolicy
        kw["offload_policy"] = CPUOffloadPolicy()
    if os.environ.get("LLAMA_BF16"):  # FSDP2's usual mixed precision
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if OPT == "pshard":
        import pshard.torch.optim as popt
        opt = popt.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    else:
        opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_fn)
    if CKPT and FIRST > 0:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=CKPT)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        for _ in range(FIRST):
            sched.step()
    sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = iter(DataLoader(dataset(), batch_size=GLOBAL_BATCH // world, sampler=sampler))
    losses, norms = [], []
    for step in range(LAST):
        (batch,) = next(loader)
        if step < FIRST:
            continue
        batch = batch.to(DEVICE)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().cpu().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
        norms.append(float(norm))
    import pshard.torch as pt
    server_steps = pt.get_step(model)  # the steps the shard servers were told of
    if CKPT and FIRST == 0:
        msd, osd = get_state_dict(model, opt)
        if os.environ.get("LLAMA_ASYNC"):  # dcp.async_save: staged, then written by a thread
            dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=CKPT).result()
        else:
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=CKPT)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    probe = torch.arange(2 * SEQ).reshape(2, SEQ) % 96
    with torch.no_grad():
        logits = model(input_ids=probe.to(DEVICE)).logits.cpu()
    staged = staged_bytes(rank)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"rank-{rank}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "server_steps": server_steps,
                   "memory": model._pshard_model().client.shard_memory()[0],
                   "region": model._pshard_model().client.region_memory()[0],
                   "staged": staged}, f)
    if rank == 0:
        torch.save(full, os.path.join(OUT, "final.pt"))
        torch.save(logits, os.path.join(OUT, "logits.pt"))
    pshard.destroy_process_group()


if MODE == "reference":
    reference()
else:
    train()
