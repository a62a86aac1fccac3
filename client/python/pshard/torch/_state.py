"""State dicts and checkpoints of a model sharded on pshard, with the names of
torch.distributed.checkpoint.state_dict, plus the shard servers' sharded checkpoints.

The model's parameters are DTensors whose local tensors are the shard servers' fp32 masters, so
``model.state_dict()`` is always current and ``torch.distributed.checkpoint`` saves and loads it
as it does an FSDP2 model's; the functions here add the full (gathered) forms."""
import collections
import dataclasses
import math

import torch
from torch.distributed.tensor import DTensor, Shard

import pshard
from ._fsdp_param import shard_rows
from ._fsdp_param_group import unit_of
from ._fully_shard import FSDPModule


@dataclasses.dataclass
class StateDictOptions:
    """torch.distributed.checkpoint.state_dict.StateDictOptions' fields: full_state_dict=True
    gathers every parameter (collective), False keeps the sharded DTensors."""
    full_state_dict: bool = True
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False


def _root_unit(model):
    if not isinstance(model, FSDPModule):
        raise TypeError(f"{type(model).__name__} was not passed to fully_shard")
    return unit_of(model)


def _options(options, full_state_dict, cpu_offload):
    o = dataclasses.replace(options) if options is not None else StateDictOptions()
    if full_state_dict is not None:
        o.full_state_dict = full_state_dict
    if cpu_offload is not None:
        o.cpu_offload = cpu_offload
    return o


def _sharded_now(unit):
    """Every unit of the model registers its sharded parameters (after a forward without
    backward the root may still hold the gathered ones)."""
    if unit.model is not None:
        for u in unit.model.units:
            u.reshard()


def get_model_state_dict(model, *, submodules=None, options=None, full_state_dict=None,
                         cpu_offload=None):
    """The model's state dict as model.state_dict() names it: full (every parameter gathered
    into a plain tensor, the fp32 masters; collective, every rank calls it) or sharded
    (full_state_dict=False: the DTensors themselves). With cpu_offload=True and a full state
    dict only rank 0 gets the values, the others an empty dict, as torch does."""
    if submodules is not None:
        raise ValueError("submodules is not supported")
    o = _options(options, full_state_dict, cpu_offload)
    unit = _root_unit(model)
    _sharded_now(unit)
    sd = model.state_dict(keep_vars=True)
    out = {}
    for k, v in sd.items():
        if o.ignore_frozen_params and isinstance(v, torch.nn.Parameter) and not v.requires_grad:
            continue
        if isinstance(v, DTensor):
            out[k] = v.detach().full_tensor() if o.full_state_dict else v.detach()
        else:
            out[k] = v.detach().clone()
    if o.full_state_dict and o.cpu_offload and pshard.is_initialized() and pshard.get_rank():
        return {}
    return out


def _shard_of(target, value):
    """This rank's rows of value, a full tensor, as target (a Shard(0) DTensor) holds them."""
    dim = next(i for i, pl in enumerate(target.placements) if isinstance(pl, Shard))
    mesh = target.device_mesh
    lo, rows = shard_rows(value.shape[0], mesh.get_local_rank(dim), mesh.shape[dim])
    return value[lo:lo + rows]


def set_model_state_dict(model, model_state_dict, *, options=None):
    """Loads a state dict into the model, before or after its first forward: full tensors (each
    rank copies its rows), DTensors (of any placement on the model's mesh) or plain buffers.
    After the first forward the values land straight in the shard servers' masters. Returns
    torch's (missing_keys, unexpected_keys); with strict (the default) either raises."""
    o = _options(options, None, None)
    unit = _root_unit(model)
    _sharded_now(unit)
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in model_state_dict]
    unexpected = [k for k in model_state_dict if k not in own]
    if o.strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}: "
                           f"missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for k, v in model_state_dict.items():
            t = own.get(k)
            if t is None:
                continue
            if tuple(t.shape) != tuple(v.shape):
                raise RuntimeError(f"size mismatch for {k}: the model has {tuple(t.shape)}, the "
                                   f"state dict {tuple(v.shape)}")
            if isinstance(t, DTensor):
                if isinstance(v, DTensor):
                    v = v.redistribute(t.device_mesh, t.placements).to_local()
                else:
                    v = _shard_of(t, v)
                t.to_local().copy_(v)
            else:
                t.copy_(v.to(t.device))
    return collections.namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])(
        missing, unexpected)


def load_safetensors(model, path, strict=True):
    """Loads initial weights from a safetensors file (one exported by
    ``pshardctl checkpoint export``, or a Hugging Face model.safetensors) before the first
    forward or later. Names are the model's state_dict names."""
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("load_safetensors needs the safetensors package") from e
    sd = load_file(str(path))
    ref = model.state_dict()
    for k, v in sd.items():
        if k in ref and ref[k].dtype != v.dtype:
            sd[k] = v.to(ref[k].dtype)
    return set_model_state_dict(model, sd, options=StateDictOptions(strict=strict))


def save_checkpoint(model):
    """Saves a sharded checkpoint now, like torch.distributed.checkpoint.save: collective,
    every rank calls it after the same step. Each shard server writes its shard under its
    --checkpoint-dir (pshardrun --checkpoint-dir); it loads on any world size
    (pshardrun --resume). Returns the committed step directory."""
    m = _root_unit(model).model
    if m is None:
        raise pshard.FailedPreconditionError("the model has not run forward yet")
    m.wait_reductions()
    m.sync_device()
    step, path = m.client.checkpoint_save()
    return path


def get_step(model):
    """Optimizer steps the model has taken: 0 for a new model, the checkpoint's step after a
    resume (so the trainer continues its data and schedule from there). Defines the model to
    the shard servers if that has not happened yet (create the optimizer first)."""
    return model._pshard_model().step


def resume_step(model):
    """The step whose data this trainer takes next: get_step plus the steps aborted because
    a trainer was lost and replaced (pshardrun --max-restarts). A replacement trainer starts
    its data there; after resync it is where the others go on. Defines the model to the shard
    servers if that has not happened yet."""
    return model._pshard_model().client.resume_step


def resync(model):
    """After pshard.StepAbortedError (a trainer of the job was lost and is being replaced;
    none of the step in flight was applied on any rank): drops what the step had gathered and
    accumulated, waits until the shard servers rebuilt their ring, and returns the step whose
    data comes next (resume_step). With a torch.optim optimizer whose step() raised it, the
    step either counted on every rank (the lost trainer's commit had gone through) or it is
    rolled back here, values and optimizer state, as on every rank. Call
    optimizer.zero_grad() too, and go on from there::

        step = pshard.torch.resume_step(model)
        while step < steps:
            try:
                train_one_step(batch(step))
                step += 1
            except pshard.StepAbortedError:
                step = pshard.torch.resync(model)
    """
    return model._pshard_model().resync()


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_ over all shards: waits for the gradients'
    reduce-scatters, returns the total norm of the averaged gradients (a 0-d tensor) and
    scales them by max_norm / (norm + 1e-6) when that is below 1. parameters is the
    fully_shard root module or all of its trainable parameters. Collective."""
    if isinstance(parameters, FSDPModule):
        model = parameters._pshard_model()
    else:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        refs = {getattr(p, "_pshard_model_ref", None) for p in params}
        refs.discard(None)
        if len(refs) != 1:
            raise ValueError("clip_grad_norm_ takes the parameters of one pshard model (or its "
                             "root module)")
        model = refs.pop()()
        want = {i for i, f in enumerate(model.frozen) if not f}
        got = {p._pshard_id for p in params}
        if not want <= got:
            raise ValueError("clip_grad_norm_ needs all of the model's trainable parameters: "
                             "the norm is taken over every shard")
    norm_type = float(norm_type)
    if norm_type != 2.0 and not math.isinf(norm_type):
        raise ValueError(f"norm_type {norm_type} is not supported: 2.0 or inf")
    model.wait_reductions()
    total = model.client.clip_grad_norm(float(max_norm), norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, "
                           "so it cannot be clipped")
    return torch.tensor(total)
