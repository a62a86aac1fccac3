"""pshard.torch: PyTorch models sharded on pshard's shard servers, with FSDP2's names.

    import pshard
    from pshard.torch import fully_shard
    pshard.init_process_group()       # torch's default group, on backend "pshard"
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # or pshard.torch.optim.AdamW: on
                                                           # the shard servers

Needs torch 2.4 or newer.
"""
import torch as _torch


def _version_tuple(v):
    out = []
    for part in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


if _version_tuple(_torch.__version__) < (2, 4):
    raise ImportError(f"pshard.torch needs torch >= 2.4; this is torch {_torch.__version__}")

import pshard  # noqa: E402
from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy  # noqa: E402
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard  # noqa: E402
from ._join import Join, JoinHook, Joinable  # noqa: E402
from ._state import (  # noqa: E402
    StateDictOptions,
    clip_grad_norm_,
    get_model_state_dict,
    get_step,
    load_safetensors,
    resume_step,
    resync,
    save_checkpoint,
    set_model_state_dict,
)
from . import optim  # noqa: E402

__all__ = [
    "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    "Join", "JoinHook", "Joinable", "optim", "clip_grad_norm_", "get_model_state_dict",
    "set_model_state_dict", "StateDictOptions", "save_checkpoint", "load_safetensors",
    "get_step", "resume_step", "resync", "memory_stats",
]


def memory_stats(model=None):
    """This trainer's shared-memory pool counters (pool_bytes, in_use_bytes,
    peak_in_use_bytes, params_gathered, params_skipped, peak_gathers_in_flight)."""
    return pshard._get_client().memory_stats()
