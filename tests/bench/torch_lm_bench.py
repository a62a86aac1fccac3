#!/usr/bin/env python3
"""One rank of run-torch-bench.sh: the example LM (examples/torch/train_lm.py's model, text and
batches) trained for --warmup + --steps steps with AdamW (two param groups), one torch thread,
in one of these modes:

  local        one process, plain torch.optim.AdamW, no communication (the yardstick)
  ddp          torch DistributedDataParallel on gloo (launch with torchrun --nproc-per-node N)
  fsdp2        torch fully_shard per GPT-2 block and on the root, gloo on a CPU DeviceMesh
               (torchrun)
  pshard       pshard.torch.fully_shard per block and on the root, pshard.torch.optim.AdamW,
               the optimizer on the shard servers (launch with pshardrun --nproc N)
  pshard_topt  the same with torch.optim.AdamW, stepping the DTensor shards in the trainer
               (their local tensors are the servers' memory) (pshardrun)
  fsdp2_pshard torch's own fully_shard as in fsdp2, on backend "pshard": torch's
               init_process_group("pshard") under pshardrun

With --device cuda the model and batches are on cuda:LOCAL_RANK (modulo the GPUs there are),
fsdp2 and ddp run on nccl with a cuda DeviceMesh, and pshard's shard servers should be started
with --backend nccl (GPU-resident shards) or --shard-memory gpu (tests/bench/run-gpu-bench.sh).

Each rank prints one line that run-torch-bench.sh reads:
  bench MODE rank R world N step_ms X loss Y vmhwm_kb H shmem_kb T [server_vmhwm_kb S
  server_shmem_kb M ...]
step_ms is this rank's mean over the timed steps (the script takes the slowest rank); vmhwm_kb
is this process's peak RSS and shmem_kb its shared-memory RSS at the end (the pages of the
model region it touched, which its shard server maps too); under pshardrun the server_* fields
are the peak RSS of this rank's own shard server (found as pshardrun names it) and that server's
shared-memory RSS (the model region, with the optimizer state only the server touches).
When the installed torch cannot run the mode, rank 0 prints
  bench MODE rank 0 world N unsupported: REASON
and the exit status is 0.
"""
import argparse
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "torch"))
import train_lm  # noqa: E402


def status_kb(path, keys):
    """The given fields (kB) of a /proc/PID/status or smaps_rollup file; missing ones are 0."""
    out = dict.fromkeys(keys, 0)
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in out:
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def own_server_status(rank):
    """VmHWM and RssShmem of this rank's shard server: pshardrun (our parent) starts it with
    --name pshardrun-<its pid>-<rank>. None when it is not found (another launcher)."""
    want = f"pshardrun-{os.getppid()}-{rank}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if want in argv and any(a.endswith(b"pshard-server") for a in argv[:1]):
            out = status_kb(f"/proc/{pid}/status", ("VmHWM", "RssShmem"))
            out.update(status_kb(f"/proc/{pid}/smaps_rollup", ("Pss", "Pss_Shmem")))
            return out
    return None


def fsdp2_fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def device_of(args):
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def setup(args):
    """(rank, world, model, optimizer, barrier(), finish())."""
    dev = device_of(args)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model = train_lm.build_model(args).to(dev)
    if args.mode in ("pshard", "pshard_topt"):
        import pshard
        import pshard.torch as pt
        import pshard.distributed as pd
        pshard.init_process_group()
        rank, world = pshard.get_rank(), pshard.get_world_size()
        for block in model.transformer.h:
            pt.fully_shard(block)
        pt.fully_shard(model)
        optim = pt.optim if args.mode == "pshard" else torch.optim
        opt = optim.AdamW(train_lm.param_groups(model, args.weight_decay), lr=args.lr,
                          betas=(0.9, 0.95))

        def barrier():
            pd.barrier()
        return rank, world, model, opt, barrier, pshard.destroy_process_group
    if args.mode == "local":
        opt = torch.optim.AdamW(train_lm.param_groups(model, args.weight_decay), lr=args.lr,
                                betas=(0.9, 0.95))
        return 0, 1, model, opt, lambda: None, lambda: None
    import torch.distributed as dist
    if args.mode == "fsdp2_pshard":
        import pshard  # noqa: F401  (registers the backend)
        dist.init_process_group("pshard")
    elif dev.type == "cuda":
        dist.init_process_group("nccl", device_id=dev)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        fully_shard = fsdp2_fully_shard()
        mesh = init_device_mesh(dev.type, (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    inner = model.module if args.mode == "ddp" else model
    opt = torch.optim.AdamW(train_lm.param_groups(inner, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95))
    return rank, world, model, opt, dist.barrier, dist.destroy_process_group


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", required=True, choices=["local", "ddp", "fsdp2", "pshard", "pshard_topt",
                                                     "fsdp2_pshard"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-bytes", type=int, default=2 << 20)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model trains (cuda: cuda:LOCAL_RANK)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        ap.error("--steps and --batch must be positive, --warmup not negative")
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    try:
        rank, world, model, opt, barrier, finish = setup(args)
    except Exception as e:  # noqa: BLE001 - report what this torch cannot do, then stop
        if args.mode in ("ddp", "fsdp2"):
            if os.environ.get("RANK", "0") == "0":
                print(f"bench {args.mode} rank 0 world {os.environ.get('WORLD_SIZE', '?')} "
                      f"unsupported: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                      flush=True)
            return 0
        raise
    # The local yardstick trains on rank 0's batches; each distributed rank on its own part.
    text = train_lm.load_text(args.text_bytes)
    data_world = max(world, 2)
    t0, loss = None, float("nan")
    dev = device_of(args)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            sync()
            barrier()
            t0 = time.perf_counter()
        x = train_lm.batch_at(text, rank, data_world, s, args).to(dev)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach()
    loss = float(loss)  # the step's work is done once its loss is read
    sync()
    elapsed = time.perf_counter() - t0
    fields = [f"bench {args.mode} rank {rank} world {world}",
              f"step_ms {elapsed * 1000.0 / args.steps:.3f} loss {loss:.5f}",
              "vmhwm_kb {VmHWM} shmem_kb {RssShmem}".format(
                  **status_kb('/proc/self/status', ('VmHWM', 'RssShmem')))]
    srv = own_server_status(rank)
    if srv is not None:
        fields.append(f"server_vmhwm_kb {srv['VmHWM']} server_shmem_kb {srv['RssShmem']} "
                      f"server_pss_kb {srv.get('Pss', 0)} "
                      f"server_pss_shmem_kb {srv.get('Pss_Shmem', 0)}")
    if args.mode in ("pshard", "pshard_topt"):
        import pshard.torch as pt
        st = pt.memory_stats()
        fields.append(f"pool_peak_kb {st['peak_in_use_bytes'] // 1024} "
                      f"pool_touched_kb {st['touched_bytes'] // 1024}")
    print(" ".join(fields), flush=True)
    barrier()
    del model, opt
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
