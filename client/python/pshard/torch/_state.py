"""State dicts and checkpoints of a model sharded on pshard, with the names of
torch.distributed.checkpoint.state_dict, plus the shard servers' sharded checkpoints."""
import dataclasses
import math
import warnings

import torch

import pshard
from ._fsdp import FSDPModule, _unit_of


@dataclasses.dataclass
class StateDictOptions:
    """torch.distributed.checkpoint.state_dict.StateDictOptions. pshard builds full state
    dicts (full_state_dict=True): the sharded form is the shard servers' checkpoint
    (save_checkpoint), which loads on any world size."""
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
    return _unit_of(model)


def _options(options, full_state_dict, cpu_offload):
    o = dataclasses.replace(options) if options is not None else StateDictOptions()
    if full_state_dict is not None:
        o.full_state_dict = full_state_dict
    if cpu_offload is not None:
        o.cpu_offload = cpu_offload
    if not o.full_state_dict:
        raise ValueError("full_state_dict=False is not supported: pshard's sharded state is "
                         "the shard servers' checkpoint (pshard.torch.save_checkpoint)")
    return o


def get_model_state_dict(model, *, submodules=None, options=None, full_state_dict=None,
                         cpu_offload=None):
    """The model's full state dict (parameters gathered from the shard servers, buffers), as
    model.state_dict() names it. Collective: every rank calls it. With cpu_offload=True only
    rank 0 gets the values, the others an empty dict, as torch does. Parameters come in
    param_dtype: with a bfloat16 MixedPrecisionPolicy they are the master weights rounded."""
    if submodules is not None:
        raise ValueError("submodules is not supported")
    o = _options(options, full_state_dict, cpu_offload)
    unit = _root_unit(model)
    m = unit.model
    sd = model.state_dict(keep_vars=True)
    if m is None:  # not defined yet: the module's own (rank 0's are what training starts from)
        out = {k: v.detach().clone() for k, v in sd.items()}
    else:
        if m.param_dtype != torch.float32:
            warnings.warn("the state dict holds the parameters in param_dtype "
                          f"({m.param_dtype}), not the fp32 master weights", stacklevel=2)
        values = {}
        for u in m.units:
            had = [m.client.is_gathered(i) for i in u.ids]
            u.unshard()
            for i in u.ids:
                values[i] = m.params[i].detach().clone()
            if not all(had):
                u.reshard()
        out = {}
        for k, v in sd.items():
            i = getattr(v, "_pshard_id", None)
            out[k] = values[i] if i is not None else v.detach().clone()
    if o.ignore_frozen_params:
        out = {k: v for k, v in out.items() if not (isinstance(sd[k], torch.nn.Parameter)
                                                    and not sd[k].requires_grad)}
    if o.cpu_offload and pshard.is_initialized() and pshard.get_rank() != 0:
        return {}
    return out


def set_model_state_dict(model, model_state_dict, *, options=None):
    """Loads a full state dict into a model before its first forward (the values then become
    the initial ones, from rank 0). Returns torch's missing/unexpected keys. Once the model is
    defined to the shard servers this raises FailedPreconditionError: resume from a
    checkpoint (pshardrun --resume) instead."""
    o = _options(options, None, None)
    unit = _root_unit(model)
    if unit.model is not None:
        raise pshard.FailedPreconditionError(
            "the model is already defined to the shard servers: load a state dict before its "
            "first forward, or resume from a checkpoint (pshardrun --resume)")
    return model.load_state_dict(model_state_dict, strict=o.strict)


def load_safetensors(model, path, strict=True):
    """Loads initial weights from a safetensors file (one exported by
    ``pshardctl checkpoint export``, or a Hugging Face model.safetensors) before the first
    forward. Names are the model's state_dict names."""
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
    step, path = m.client.checkpoint_save()
    return path


def get_step(model):
    """Optimizer steps the model has taken: 0 for a new model, the checkpoint's step after a
    resume (so the trainer continues its data and schedule from there). Defines the model to
    the shard servers if that has not happened yet (create the optimizer first)."""
    return model._pshard_model().step


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
