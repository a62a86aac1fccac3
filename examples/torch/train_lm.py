#!/usr/bin/env python3
"""Trains a Hugging Face GPT-2 causal LM (a small config built here, random init: nothing is
downloaded) byte-level on the Python standard library's own sources, sharded on pshard:

    pshardrun --nproc 2 -- python examples/torch/train_lm.py --steps 50

Each rank trains on its own part of the text. The port from torch FSDP2 is the import:
``from pshard.torch import fully_shard`` and ``pshard.torch.optim.AdamW``. Options:
  --uneven             rank r gets r more batches than rank 0, under pshard.torch.Join
  --param-dtype bf16   gathers parameters in bfloat16 (fp32 master weights on the servers)
  --checkpoint-every K saves a sharded checkpoint every K steps (pshardrun --checkpoint-dir D);
                       ``pshardrun --resume D`` continues from the newest one, on any world size
  --optimizer torch    torch.optim.AdamW in the trainer instead of pshard.torch.optim.AdamW on
                       the shard servers (a replacement of a lost trainer gets its state back)
  --mesh RxS           HSDP: R replicas of S shard ranks (R * S = the world size) instead of
                       sharding over every rank; a lost shard server then heals from a replica
  --fail-at-step N --fail-rank R [--fail-kind trainer|server]
                       on its first attempt, trainer R exits before step N (trainer, the
                       default), or kills its own shard server there and waits to be stopped
                       (server; healed under --mesh and the servers' optimizer): a failure for
                       pshardrun --max-restarts and tests/bench/run-failure-bench.sh
Prints ``step N loss X tokens/s Y`` lines.
"""
import argparse
import glob
import math
import os
import re
import signal
import sys
import time
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh


def parse_mesh(text):
    """--mesh RxS as (R, S)."""
    m = re.fullmatch(r"([0-9]+)x([0-9]+)", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give replicas x shard ranks, e.g. 2x2")
    return int(m[1]), int(m[2])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ (0: off)")
    p.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--reshard-after-forward", type=int, choices=[0, 1], default=1)
    p.add_argument("--uneven", action="store_true")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--print-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-bytes", type=int, default=4 << 20,
                   help="how much of the standard library's sources to read")
    p.add_argument("--optimizer", choices=["server", "torch"], default="server")
    p.add_argument("--mesh", type=parse_mesh, default=None,
                   help="RxS: HSDP, R replicas of S shard ranks (default: FSDP over every rank)")
    p.add_argument("--fail-at-step", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-kind", choices=["trainer", "server"], default="trainer",
                   help="what --fail-at-step loses: this trainer or its shard server")
    args = p.parse_args(argv)
    if args.uneven and args.optimizer == "torch":
        p.error("--uneven needs --optimizer server: a rank that joined steps its shard on the "
                "shard servers, where a trainer's torch.optim cannot reach it")
    return args


def build_mesh(args, world):
    """None (fully_shard's default: FSDP over every rank) or --mesh's 2-D DeviceMesh for HSDP:
    each parameter sharded over the S ranks of a replica and replicated across the R replicas.
    SystemExit when R * S is not the world size."""
    if args.mesh is None:
        return None
    r, s = args.mesh
    if r * s != world:
        raise SystemExit(f"--mesh {r}x{s} holds {r * s} ranks, but the job has {world}: "
                         "R * S must be the world size")
    return init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard"))


def kill_own_shard_server():
    """Loses this rank's shard server, as a crash would: SIGKILL to the process that pshardrun
    (our parent) started for it, the one whose --port-file is .../server-LOCAL_RANK.ATTEMPT.port.
    Then waits for pshardrun to stop this trainer, which it does when it replaces the server.
    SystemExit when no such server is found (another launcher)."""
    port_file = re.compile(rf"/server-{os.environ['LOCAL_RANK']}\.[0-9]+\.port$")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # (gone meanwhile)
            continue
        if ppid == os.getppid() and any(port_file.search(a) for a in cmdline):
            os.kill(int(pid), signal.SIGKILL)
            while True:
                signal.pause()
    raise SystemExit("--fail-kind server: no shard server of this rank found among "
                     "pshardrun's children")


def build_model(args):
    """The GPT-2 architecture with tied embeddings, dropout 0, from a config built here."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(args.seed)
    cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.d_model,
                     n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, tie_word_embeddings=True)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def load_text(limit):
    """Bytes of the Python standard library's .py files (every machine has them), in a fixed
    order, as a 1-D int64 tensor of byte values."""
    libdir = os.path.dirname(os.__file__)
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(libdir, "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= limit:
            break
    return torch.frombuffer(data[:limit], dtype=torch.uint8).long()


def batch_at(text, rank, world, step, args):
    """Rank rank's batch at step: random windows of its own contiguous part of the text."""
    part = text.numel() // world
    lo = rank * part
    g = torch.Generator().manual_seed(args.seed * 7919 + rank * 104729 + step)
    starts = torch.randint(lo, lo + part - args.seq - 1, (args.batch,), generator=g)
    return torch.stack([text[s:s + args.seq] for s in starts.tolist()])


def param_groups(model, weight_decay):
    """The usual LM recipe: no weight decay for biases and LayerNorm weights."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(args):
    def f(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import pshard
    import pshard.torch as pt

    pshard.init_process_group()
    rank, world = pshard.get_rank(), pshard.get_world_size()
    mesh = build_mesh(args, world)
    text = load_text(args.text_bytes)
    model = build_model(args)
    mp = pt.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.param_dtype == "bf16" else None)
    for block in model.transformer.h:
        pt.fully_shard(block, mesh=mesh, mp_policy=mp,
                       reshard_after_forward=bool(args.reshard_after_forward))
    pt.fully_shard(model, mesh=mesh, mp_policy=mp)
    adamw = torch.optim.AdamW if args.optimizer == "torch" else pt.optim.AdamW
    opt = adamw(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    # > 0 after pshardrun --resume, or in a replacement of a lost trainer (pshardrun
    # --max-restarts): the data goes on after the steps applied and aborted, the schedule
    # after the steps applied.
    start = pt.resume_step(model)
    with warnings.catch_warnings():  # (torch warns of a schedule stepped before the optimizer)
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(pt.get_step(model)):
            sched.step()
    if rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        print(f"GPT-2 {args.layers}x{args.d_model}, {nparams / 1e6:.2f}M parameters, "
              f"{world} ranks, param_dtype {args.param_dtype}, text {text.numel()} bytes"
              + (f", resuming at step {start}" if start else ""), flush=True)
    steps = args.steps + (rank if args.uneven else 0)
    tokens = args.batch * args.seq
    join = pt.Join([model, opt] if args.optimizer == "server" else [model], enable=args.uneven)
    t0, done = time.perf_counter(), 0
    with join:
        step = start
        first_attempt = os.environ.get("PSHARD_RESTART_COUNT", "0") == "0"
        while step < steps:
            if first_attempt and rank == args.fail_rank and step + 1 == args.fail_at_step:
                if args.fail_kind == "server":
                    print(f"rank {rank} killing its shard server before step {step + 1} "
                          "(--fail-at-step --fail-kind server)", flush=True)
                    kill_own_shard_server()  # (does not return)
                print(f"rank {rank} exiting before step {step + 1} (--fail-at-step)",
                      flush=True)
                os._exit(3)
            x = batch_at(text, rank, world, step, args)
            try:
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                if args.clip > 0:
                    pt.clip_grad_norm_(model, args.clip)
                opt.step()
                opt.zero_grad()
                sched.step()
                done += 1
                if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                    path = pt.save_checkpoint(model)
                    if rank == 0:
                        print(f"checkpoint {path}", flush=True)
            except pshard.StepAbortedError as e:
                # A trainer or (under --mesh) a shard server of the job was lost and is being
                # replaced: this step counts on every rank or on none (resync restores what it
                # changed here then); go on where the shard servers say, as its replacement
                # will.
                opt.zero_grad()
                nxt = pt.resync(model)
                if rank == 0:
                    print(f"step {step + 1} aborted ({e}); going on at step {nxt + 1}",
                          flush=True)
                step = nxt
                continue
            if args.print_every and ((step + 1) % args.print_every == 0 or step == start):
                dt = time.perf_counter() - t0
                print(f"step {step + 1} loss {loss.item():.4f} tokens/s "
                      f"{done * tokens / dt:.0f}", flush=True)
            step += 1
    if args.uneven and join.result and join.result["is_last_joiner"]:
        print(f"rank {rank} joined last after {steps} steps", flush=True)
    pshard.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
