"""A trainer for the pshard.torch tests, run under pshardrun: worker.py CONFIG.json OUTDIR.
It trains cases.make_model(cfg) with pshard.torch as the config says and writes
OUTDIR/rank-R.json (per-step losses, what happened) and, from rank 0, OUTDIR/final.pt (the
full state dict after training)."""
import datetime
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import pshard  # noqa: E402
import pshard.torch as pt  # noqa: E402
import cases  # noqa: E402

torch.set_num_threads(1)


def main():
    cfg = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    # A hang becomes a TimeoutError naming the rank that did not answer, well before the
    # test's own limit.
    pshard.init_process_group(timeout=datetime.timedelta(seconds=cfg.get("timeout_s", 60)))
    rank, world = pshard.get_rank(), pshard.get_world_size()
    result = {"rank": rank, "world": world, "losses": [], "error": None}
    try:
        fault = cfg.get("fault")
        if fault:
            # A bad first attempt, each rank's error kept; then the same cluster trains.
            try:
                result["recovered"] = bad_attempt(cfg, fault, rank)
                result["fault_error"] = None
            except (pshard.Error, ValueError, TypeError) as e:
                result["fault_error"] = {"type": type(e).__name__, "message": str(e)}
        if fault != "step_first":
            train(cfg, rank, world, result, out)
    except pshard.Error as e:
        result["error"] = {"type": type(e).__name__, "message": str(e),
                           "status": getattr(e, "status", None), "time": time.time()}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    pshard.destroy_process_group()


def bad_attempt(cfg, fault, rank):
    if fault == "mismatch":  # rank 1's model differs in one shape
        model = cases.make_model(dict(cfg, width=cfg.get("width", 16) + (rank == 1)))
    elif fault == "rename":  # rank 1's model has an extra layer: names differ
        model = cases.make_model(cfg)
        if rank == 1:
            model.add_module("extra", torch.nn.Linear(2, 2))
    elif fault == "no_params":
        model = torch.nn.Sequential(torch.nn.ReLU())
    else:
        model = cases.make_model(cfg)
    pt.fully_shard(model)
    opt = pt.optim.SGD(model.parameters(), lr=0.1) if fault != "no_params" else None
    x, y = cases.batch(cfg, rank, 0)
    if fault == "no_params":
        model(x)
    elif fault == "step_first":
        loss = cases.loss_of(model, cfg, x, y)
        try:
            opt.step()
        except pshard.FailedPreconditionError:
            # The same model goes on: backward, then the step works.
            loss.backward()
            opt.step()
            loss2 = cases.loss_of(model, cfg, x, y)
            loss2.backward()
            opt.step()
            return [loss.item(), loss2.item()]
        return None
    else:
        cases.loss_of(model, cfg, x, y).backward()
        opt.step()


def train(cfg, rank, world, result, out):
    model = cases.make_model(cfg)
    if cfg.get("freeze"):
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                for p in m.parameters():
                    p.requires_grad_(False)
    mp = pt.MixedPrecisionPolicy(
        param_dtype=getattr(torch, cfg["param_dtype"]) if cfg.get("param_dtype") else None,
        reduce_dtype=torch.float16 if cfg.get("reduce_fp16") else None)
    raf = cfg.get("reshard_after_forward", True)
    mesh = None
    if cfg.get("mesh"):  # HSDP: (replicate, shard)
        import pshard.distributed as dist
        mesh = dist.init_device_mesh("cpu", tuple(cfg["mesh"]),
                                     mesh_dim_names=("replicate", "shard"))
    for b in cases.blocks(model, cfg):
        pt.fully_shard(b, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
    pt.fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
    if cfg.get("divide_factor"):
        for m in model.modules():
            if isinstance(m, pt.FSDPModule):
                m.set_gradient_divide_factor(cfg["divide_factor"])
    if cfg.get("load"):
        sd = torch.load(cfg["load"])
        pt.set_model_state_dict(model, sd)
    if cfg.get("load_safetensors"):
        pt.load_safetensors(model, cfg["load_safetensors"])
    opt = cases.make_optimizer(pt.optim, cases.param_groups(model, cfg), cfg)
    sched = cases.make_scheduler(opt, cfg)
    start = pt.get_step(model)  # > 0 when the servers resumed a checkpoint
    result["start"] = start
    for _ in range(start):
        if sched:
            sched.step()
    accum = cfg.get("accum", 1)
    nb = cases.batches_of(cfg, rank)
    join = cfg.get("join")
    ctx = pt.Join([model, opt], throw_on_early_termination=(join == "throw"),
                  enable=(join != "disabled")) if join else None
    peak_units = 0

    def dump_optim(at):
        """The optimizer's full state dict (torch's get_optimizer_state_dict, what dcp.save
        takes) after `at` steps, written by rank 0 to optim-AT.pt."""
        if cfg.get("optim_dump_at") != at:
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)
        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(osd, os.path.join(out, f"optim-{at}.pt"))

    def run():
        nonlocal peak_units
        dump_optim(start)
        for s in range(start, nb):
            total = 0.0
            for a in range(accum):
                if cfg.get("accum_all_reduce"):  # HSDP: skip only the replicas' all-reduce
                    model.set_requires_all_reduce(a == accum - 1)
                else:
                    model.set_requires_gradient_sync(a == accum - 1)
                x, y = cases.batch(cfg, rank, s * accum + a)
                loss = cases.loss_of(model, cfg, x, y) / accum
                loss.backward()
                total += loss.item()
            if cfg.get("log_loss"):
                # A metric all-reduced right after backward, while the last units'
                # reduce-scatters may still be queued: it must run after them on every rank.
                import pshard.distributed as dist
                t = torch.tensor([total])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                result.setdefault("mean_losses", []).append(t.item())
            if cfg.get("kill_rank") == rank and s == cfg.get("kill_step", 3):
                # Killed mid-step: after its reduce-scatters were issued, before the step.
                with open(os.path.join(out, "killed"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if cfg.get("clip"):
                result.setdefault("norms", []).append(
                    pt.clip_grad_norm_(model, cfg["clip"]).item())
            opt.step()
            if sched:
                sched.step()
            result["losses"].append(total)
            if cfg.get("save_at") == s + 1:
                result["checkpoint"] = pt.save_checkpoint(model)
            dump_optim(s + 1)
            st = pt.memory_stats()
            result["peak_in_use_bytes"] = st["peak_in_use_bytes"]

    if ctx is None:
        run()
    else:
        try:
            with ctx:
                run()
        finally:
            result["join"] = ctx.result
    if join == "throw":
        return  # the other ranks stopped with JoinedError: no collective state dict
    inner = model._pshard_model()
    result["memory"] = inner.client.shard_memory()[0]
    result["region"] = inner.client.region_memory()[0]
    result["full_elements"] = sum(fp.sharded.numel() for fp in inner.fsdp_params)
    result["staged"] = inner.staged_on is not None
    # What staged unsharded parameters hold after the last backward resharded every unit.
    result["staged_bytes"] = sum(fp.unsharded.untyped_storage().nbytes()
                                 for fp in inner.fsdp_params if fp.staged)
    result["param_steps"] = {k: int(v["step"]) for k, v in opt.state_dict()["state"].items()
                             if "step" in v}
    # optimizer.state, as tools read it (torch.optim's layout): the same counts
    result["state_steps"] = sorted(int(st["step"]) for st in opt.state.values()
                                   if isinstance(st, dict) and "step" in st)
    sd = pt.get_model_state_dict(model, options=pt.StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    if rank == 0:
        torch.save(sd, os.path.join(out, "final.pt"))
    if cfg.get("all_final"):  # every rank's view (HSDP: each replica's own shards)
        torch.save(sd, os.path.join(out, f"final-{rank}.pt"))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
