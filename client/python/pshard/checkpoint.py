"""Converting between pshard's own checkpoints (the shard servers' ``pshardrun --checkpoint-dir``,
``save_checkpoint``) and torch.distributed.checkpoint (DCP), offline: one process, no cluster,
no model code.

    python -m pshard.checkpoint to-dcp ROOT/step-00000040 OUT_DIR
    python -m pshard.checkpoint from-dcp DCP_DIR ROOT [--step N] [--optimizer adamw]
                                         [--params NAMES_FILE]

The DCP side is laid out as ``get_state_dict(model, optimizer)`` gives it and FSDP2 scripts save
it: ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}}``, so
``dcp.load`` + ``set_state_dict`` take it on any world size, into pshard or into torch's own
FSDP2, DDP or a single process; each parameter's ``step`` is torch's (one that never had a
gradient has step 0). pshard's side is a checkpoint of world size 1, which the shard servers
resume on any world size (``pshardrun --resume ROOT``).

What does not carry over, and why:
- pshard's checkpoints hold the parameters, not buffers (the model's code makes those); a DCP's
  buffers are refused in ``from_dcp`` unless ``params`` names the parameters to take.
- pshard's checkpoints record one set of optimizer hyperparameters (the resuming job's optimizer
  sets them again); ``to_dcp`` writes one param group holding every parameter. To load the state
  into an optimizer with other groups, load only its ``"state"``:
  ``dcp.load({"model": msd, "optim": {"state": osd["state"]}}, ...)`` then ``set_state_dict``.
- Both hold the whole state in memory while converting (about 3x the fp32 model for Adam).
"""
import argparse
import ctypes
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import _C

__all__ = ["to_dcp", "from_dcp", "main"]

_STATE = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"),
          "adamw": ("exp_avg", "exp_avg_sq")}


def _one_process(fn, *args, **kw):
    """dcp.save/load in this one process (no_dist), without DCP's warning that says so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, no_dist=True, **kw)


def _torch_group(opt):
    """torch's own param group for pshard's optimizer record, every key this torch has."""
    dummy = [torch.nn.Parameter(torch.zeros(1))]
    kind = opt["kind"]
    if kind == "sgd":
        o = torch.optim.SGD(dummy, lr=opt["lr"], momentum=opt["momentum"],
                            dampening=opt["dampening"], nesterov=opt["nesterov"],
                            weight_decay=opt["weight_decay"])
    else:
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        o = cls(dummy, lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]), eps=opt["eps"],
                weight_decay=opt["weight_decay"])
    return o.state_dict()["param_groups"][0]


def to_dcp(step_dir, dcp_dir):
    """Writes the pshard checkpoint in step_dir (a ``ROOT/step-N`` directory, every shard file
    verified first) as a DCP checkpoint in dcp_dir. Returns the step."""
    handle, info = _C.ckpt_open(os.fspath(step_dir), verify=True)
    step, opt, sections = info["step"], info["optimizer"], info["sections"]
    model, state, names = {}, {}, []
    for i, (name, shape, skipped) in enumerate(info["params"]):
        tensors = []
        for s in range(len(sections)):
            numel = 1
            for d in shape:
                numel *= d
            buf = bytearray(numel * 4)
            _C.ckpt_read(handle, s, i, buf)
            tensors.append(torch.frombuffer(buf, dtype=torch.float32).reshape(shape)
                           if numel else torch.zeros(shape))
        model[name] = tensors[0]
        names.append(name)
        st = dict(zip(sections[1:], tensors[1:]))
        if opt["kind"] != "sgd":  # torch's Adam/AdamW keep a float32 step per parameter
            st["step"] = torch.tensor(float(step - skipped))
        if st:
            state[name] = st
    group = dict(_torch_group(opt), params=names)
    _one_process(dcp.save, {"model": model, "optim": {"state": state, "param_groups": [group]}},
                 checkpoint_id=os.fspath(dcp_dir))
    return step


def _group0(dcp_dir, md):
    """param_groups[0] of the DCP's optimizer, as far as it was saved ({} when none)."""
    keys = [k.split(".", 3)[3] for k in md if k.startswith("optim.param_groups.0.")]
    if not keys:
        return {}
    dest = {"optim": {"param_groups": [{k: None for k in keys if "." not in k}]}}
    _one_process(dcp.load, dest, checkpoint_id=dcp_dir)
    return dest["optim"]["param_groups"][0]


def _kind_of(md, group, names):
    def has(s):
        return any(f"optim.state.{n}.{s}" in md for n in names)
    if has("momentum_buffer"):
        return "sgd"
    if has("exp_avg") and "decoupled_weight_decay" in group:
        return "adamw" if group["decoupled_weight_decay"] else "adam"
    raise ValueError(
        "cannot tell the optimizer from this DCP checkpoint (no optimizer state, or Adam's "
        "without param_groups' decoupled_weight_decay): pass optimizer='sgd', 'adam' or 'adamw' "
        "(--optimizer), the kind the resuming job uses")


def _load(dcp_dir, md, keys):
    """The tensors of keys (flattened DCP keys), loaded into fresh tensors of their dtype."""
    dest = {}
    for k in keys:
        m = md[k]
        dest[k] = torch.empty(m.size, dtype=m.properties.dtype)
    # Flat keys load as they were saved: DCP flattens nested dicts to dotted keys.
    _one_process(dcp.load, dest, checkpoint_id=dcp_dir)
    return dest


def _buffer(t):
    t = t.detach().to(torch.float32).contiguous()
    return t, (ctypes.c_char * (t.numel() * 4)).from_address(t.data_ptr()) if t.numel() else b""


def from_dcp(dcp_dir, root, *, step=None, optimizer=None, params=None):
    """Writes the DCP checkpoint in dcp_dir (saved as ``{"model": ..., "optim": ...}``) as pshard
    checkpoint ``ROOT/step-N`` (N: step, or the largest parameter step of the optimizer state),
    which ``pshardrun --resume ROOT`` resumes on any world size. optimizer: "sgd", "adam" or
    "adamw", the kind the resuming job uses (read from the DCP when it can be told); params: the
    parameter names in the model's order (``[n for n, _ in model.named_parameters()]``; default:
    every tensor under "model", which must then all be floating-point parameters). Returns the
    step directory."""
    dcp_dir = os.fspath(dcp_dir)
    md = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    model_keys = [k[len("model."):] for k, m in md.items()
                  if k.startswith("model.") and isinstance(m, TensorStorageMetadata)]
    if not model_keys:
        raise ValueError(f"{dcp_dir} holds no 'model.*' tensors: pshard converts a DCP saved as "
                         "{'model': model_state_dict, 'optim': optimizer_state_dict}, as "
                         "get_state_dict gives them")
    names = list(params) if params is not None else model_keys
    for n in names:
        if n not in model_keys:
            raise ValueError(f"parameter {n!r} is not in {dcp_dir} (its model holds "
                             f"{len(model_keys)} tensors, e.g. {model_keys[:3]})")
        dt = md["model." + n].properties.dtype
        if not dt.is_floating_point:
            raise ValueError(f"model.{n} is {dt}, not a floating-point parameter (a buffer?): "
                             "pass params= the parameter names, e.g. "
                             "[n for n, _ in model.named_parameters()]")
    group = _group0(dcp_dir, md)
    kind = optimizer or _kind_of(md, group, names)
    if kind not in _STATE:
        raise ValueError(f"optimizer {kind!r}: pshard's servers run 'sgd', 'adam' or 'adamw'")
    betas = group.get("betas", (0.9, 0.999))
    opt = {"kind": kind, "lr": float(group.get("lr", 0.0)),
           "momentum": float(group.get("momentum", 0.0)),
           "dampening": float(group.get("dampening", 0.0)),
           "nesterov": bool(group.get("nesterov", False)),
           "weight_decay": float(group.get("weight_decay", 0.0)),
           "beta1": float(betas[0]), "beta2": float(betas[1]), "eps": float(group.get("eps", 1e-8))}
    states = _STATE[kind] if kind != "sgd" or opt["momentum"] != 0 else ()
    keys = ["model." + n for n in names]
    keys += [f"optim.state.{n}.{s}" for n in names for s in states + ("step",)
             if f"optim.state.{n}.{s}" in md]
    got = _load(dcp_dir, md, keys)
    steps = {n: int(got[f"optim.state.{n}.step"].item())
             for n in names if f"optim.state.{n}.step" in got}
    for n in names:  # SGD keeps no step: a parameter with a momentum buffer took them all
        if kind == "sgd" and f"optim.state.{n}.momentum_buffer" in got:
            steps[n] = None
    top = max([s for s in steps.values() if s is not None], default=0)
    if step is None:
        if kind == "sgd":
            raise ValueError("torch's SGD keeps no step count: pass step= (--step), the number "
                             "of optimizer steps the checkpoint was saved after")
        step = top
    if step < top:
        raise ValueError(f"step={step} is below a parameter's optimizer step ({top})")
    plist, data, keep = [], [[] for _ in range(1 + len(states))], []
    for n in names:
        w = got["model." + n]
        ps = steps.get(n, 0)
        plist.append((n, tuple(w.shape), 0 if ps is None else step - ps))
        for i, t in enumerate([w] + [got.get(f"optim.state.{n}.{s}") for s in states]):
            if t is None:  # never stepped: torch keeps no state; pshard's is zeros
                t = torch.zeros(w.shape)
            elif tuple(t.shape) != tuple(w.shape):
                raise ValueError(f"optim.state.{n}.{states[i - 1]} has shape {tuple(t.shape)}; "
                                 f"the parameter's is {tuple(w.shape)}")
            t, buf = _buffer(t)
            keep.append(t)
            data[i].append(buf)
    return _C.ckpt_write(os.fspath(root), int(step), opt, plist, data)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pshard.checkpoint", description=(
        "Converts between pshard's checkpoints and torch.distributed.checkpoint, offline."))
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-dcp", help="a pshard checkpoint (ROOT/step-N) to a DCP directory")
    a.add_argument("step_dir")
    a.add_argument("dcp_dir")
    b = sub.add_parser("from-dcp", help="a DCP directory to pshard checkpoint ROOT/step-N")
    b.add_argument("dcp_dir")
    b.add_argument("root")
    b.add_argument("--step", type=int)
    b.add_argument("--optimizer", choices=sorted(_STATE))
    b.add_argument("--params", metavar="FILE",
                   help="the parameter names in the model's order, one per line")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "to-dcp":
            step = to_dcp(args.step_dir, args.dcp_dir)
            print(f"step {step}: {args.step_dir} -> {args.dcp_dir} (DCP)")
        else:
            params = None
            if args.params:
                with open(args.params) as f:
                    params = [ln.strip() for ln in f if ln.strip()]
            out = from_dcp(args.dcp_dir, args.root, step=args.step, optimizer=args.optimizer,
                           params=params)
            print(f"{args.dcp_dir} -> {out} (pshard)")
    except (ValueError, OSError, _C.Error) as e:
        print(f"pshard.checkpoint: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
