"""A plain torch training script that test_torch_native.py runs on torch's gloo and on backend
"pshard": torch's own DistributedDataParallel or torch's own FSDP2 (fully_shard per layer, then
the root) around a tiny MLP or a tiny Hugging Face Llama (random init, built in code),
torch.optim.AdamW with two parameter groups, clip_grad_norm_, 5 steps; each rank trains on its
own deterministic batches (cases.batch: the bytes of the standard library's os.py for Llama).

usage: torch_native_worker.py BACKEND MODE MODEL OUT_DIR INIT_FILE
  BACKEND gloo (plain processes) or pshard (under pshardrun; `import pshard` registers the
  backend): either way torch's own init_process_group with RANK / WORLD_SIZE from the
  environment and a FileStore at INIT_FILE. MODE ddp, fsdp2 or bad (pshard
  only: wrong uses, each refused with the cluster serving on); MODEL mlp or llama.
Writes OUT_DIR/rank-R.pt: {"losses": this rank's loss per step, "norms": the total gradient norm
per step} and, on rank 0, "final": the full state dict after the last step.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import cases

BACKEND, MODE, MODEL, OUT, INIT = sys.argv[1:6]
STEPS = 5
CFG = {"model": MODEL, "seed": 0, "batch": 4, "seq": 16, "din": 8, "dout": 4}
if BACKEND == "pshard":
    import pshard  # noqa: F401  (registers backend "pshard" with torch.distributed)


def build_model():
    """The model, the same on every rank and backend (torch.manual_seed before random init)."""
    torch.manual_seed(0)
    if MODEL == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 4))
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def units(model):
    """The modules that get their own fully_shard unit before the root."""
    if MODEL == "mlp":
        return [m for m in model if isinstance(m, torch.nn.Linear)][:-1]
    return list(model.model.layers)


def loss_of(model, rank, step):
    x, y = cases.batch(CFG, rank, step)
    if MODEL == "mlp":
        return torch.nn.functional.mse_loss(model(x), y)
    return model(input_ids=x, labels=x).loss


def bad_paths(world):
    """Each wrong use raises a clear error, and the cluster goes on serving (a collective after
    each gives the right sum). pshard.torch's fully_shard here; the names of what was refused."""
    import pshard.torch as pt
    from torch.distributed.device_mesh import DeviceMesh
    seen = []

    def expect(name, exc, words, fn):
        try:
            fn()
        except exc as e:
            assert all(w in str(e) for w in words), (name, str(e))
            seen.append(name)
        else:
            raise AssertionError(f"{name}: no {exc}")
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(world))), (name, t)

    expect("int16 sum", TypeError, ["int16"],
           lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16)))
    expect("bitwise and of floats", (TypeError, ValueError), ["BAND"],
           lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND))
    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    expect("gloo mesh", ValueError, ["gloo", "pshard"],
           lambda: pt.fully_shard(torch.nn.Linear(4, 4), mesh=mesh))
    model = build_model()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for m in units(model):
        pt.fully_shard(m)
    pt.fully_shard(model)
    loss_of(model, dist.get_rank(), 0).backward()
    expect("optimizer before fully_shard", pshard.FailedPreconditionError,
           ["before fully_shard", "model.parameters()"], early.step)
    full = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    expect("full state dict into DTensors", (RuntimeError, ValueError), ["set_model_state_dict"],
           lambda: model.load_state_dict(full))
    return seen


def main():
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(BACKEND, init_method="file://" + INIT, rank=rank, world_size=world)
    assert dist.get_backend() == BACKEND, dist.get_backend()
    if MODE == "bad":
        seen = bad_paths(world)
        os.makedirs(OUT, exist_ok=True)
        torch.save({"seen": seen}, os.path.join(OUT, f"rank-{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        return
    model = build_model()
    if MODE == "ddp":
        model = DistributedDataParallel(model)
        inner = model.module
    else:
        mesh = init_device_mesh("cpu", (world,))
        for m in units(model):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        inner = model
    # Two groups, as LM recipes do: no weight decay and half the rate for biases and norms.
    decay = [p for p in inner.parameters() if p.ndim >= 2]
    no_decay = [p for p in inner.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}],
                            lr=1e-2, foreach=False)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of(model, rank, step)
        loss.backward()
        # max_norm below the first steps' norms, so clipping scales the gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the shards' norms
            norm = norm.full_tensor()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    if MODE == "ddp":
        final = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    else:  # a collective: every rank calls it, rank 0 gets the full tensors
        final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    result = {"losses": losses, "norms": norms}
    if rank == 0:
        result["final"] = final
    os.makedirs(OUT, exist_ok=True)
    torch.save(result, os.path.join(OUT, f"rank-{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: losses {losses}")


if __name__ == "__main__":
    main()
