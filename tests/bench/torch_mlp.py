#!/usr/bin/env python3
"""PyTorch's step time for the MLP pshard-mlp trains, as the yardstick of run-step-bench.sh.

Each step does what pshard-mlp's step does: a fresh batch x ~ N(0, 1) whose targets come from a
fixed random teacher MLP of the same shape (a no-grad forward), the student's forward and
backward with MSE, an SGD-momentum step and, when distributed, the loss averaged over the ranks
(pshard-mlp all-reduces it every step). One thread per rank.

Modes: local (one process), ddp (DistributedDataParallel, gloo, --world ranks on 127.0.0.1) and
fsdp2 (fully_shard per Linear and on the root, gloo on a CPU DeviceMesh). Each mode prints one
line that run-step-bench.sh reads:
    torch MODE world N step_ms X loss Y
or, when the installed torch cannot run the mode,
    torch MODE world N unsupported: REASON
Exit status: 0, also for an unsupported mode; 1 when a run fails in another way; 2 for usage.
"""
import argparse
import gc
import os
import socket
import sys
import time
import traceback

# One thread per rank; set before torch (and its BLAS) is loaded.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def make_mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp2_api():
    """fully_shard and init_device_mesh, or None with the reason they are missing."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError as e:
        return None, f"no DeviceMesh in torch {torch.__version__} ({e})"
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError as e:
            return None, f"no FSDP2 fully_shard in torch {torch.__version__} ({e})"
    return (fully_shard, init_device_mesh), None


def train(args, mode, rank, world):
    """Runs warmup + steps steps; returns (ms per timed step, last loss). The model and its
    optimizer are gone when it returns, before the process group is destroyed."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process
    widths = [args.input] + args.widths + [args.output]
    torch.manual_seed(args.seed)  # the same student init on every rank
    model = make_mlp(widths)
    teacher = make_mlp(widths)
    for p in teacher.parameters():
        p.requires_grad_(False)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp2":
        (fully_shard, init_device_mesh), _ = fsdp2_api()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.MSELoss()
    gen = torch.Generator().manual_seed(1000 + rank)
    distributed = mode != "local"
    t0 = None
    loss_value = float("nan")
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            if distributed:
                dist.barrier()
            t0 = time.perf_counter()
        x = torch.randn(args.batch, args.input, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        loss_sum = loss.detach().clone()
        if distributed:
            dist.all_reduce(loss_sum)
            loss_sum /= world
        loss_value = float(loss_sum)
    if distributed:
        dist.barrier()
    elapsed = time.perf_counter() - t0
    return elapsed * 1000.0 / args.steps, loss_value


def worker(rank, world, port, args, mode, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    try:
        ms, loss = train(args, mode, rank, world)
        gc.collect()  # DDP's and FSDP's hooks hold cycles; free them while gloo is up
        # The slowest rank's time is the step time.
        t = torch.tensor([ms], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put((t.item(), loss))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_mode(args, mode):
    if mode == "local":
        ms, loss = train(args, "local", 0, 1)
        print(f"torch local world 1 step_ms {ms:.3f} loss {loss:.6g}", flush=True)
        return 0
    if not dist.is_available() or not dist.is_gloo_available():
        print(f"torch {mode} world {args.world} unsupported: torch {torch.__version__} has no "
              f"gloo backend", flush=True)
        return 0
    if mode == "fsdp2":
        api, why = fsdp2_api()
        if api is None:
            print(f"torch fsdp2 world {args.world} unsupported: {why}", flush=True)
            return 0
    results = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(worker, args=(args.world, free_port(), args, mode, results), nprocs=args.world,
                 join=True)
    except Exception as e:  # a rank failed: for fsdp2 on CPU that means "unsupported here"
        msg = " ".join(str(e).split())
        if not results.empty():
            # The run finished and rank 0 reported; a rank died while tearing gloo down.
            ms, loss = results.get()
            print(f"# torch {mode}: a rank failed after the timed steps: {msg[:200]}",
                  flush=True)
            print(f"torch {mode} world {args.world} step_ms {ms:.3f} loss {loss:.6g}", flush=True)
            return 0
        if mode == "fsdp2":
            tail = msg[-300:]
            print(f"torch fsdp2 world {args.world} unsupported: fully_shard on CPU/gloo failed "
                  f"in torch {torch.__version__}: ...{tail}", flush=True)
            return 0
        traceback.print_exc()
        return 1
    ms, loss = results.get()
    print(f"torch {mode} world {args.world} step_ms {ms:.3f} loss {loss:.6g}", flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="all", choices=["local", "ddp", "fsdp2", "all"])
    ap.add_argument("--world", type=int, default=2, help="ranks of ddp and fsdp2")
    ap.add_argument("--steps", type=int, default=200, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    ap.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    ap.add_argument("--widths", default="1024,1024,1024,1024", help="hidden widths")
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        args.widths = [int(w) for w in args.widths.split(",") if w]
    except ValueError:
        ap.error(f"--widths '{args.widths}' is not a comma-separated list of integers")
    if args.steps < 1 or args.world < 1 or args.batch < 1:
        ap.error("--steps, --world and --batch must be positive")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} thread(s) per rank, "
          f"widths {args.input},{','.join(map(str, args.widths))},{args.output}, "
          f"batch {args.batch} per rank, {args.warmup}+{args.steps} steps", flush=True)
    modes = ["local", "ddp", "fsdp2"] if args.mode == "all" else [args.mode]
    rc = 0
    for mode in modes:
        rc = max(rc, run_mode(args, mode))
    return rc


if __name__ == "__main__":
    sys.exit(main())
