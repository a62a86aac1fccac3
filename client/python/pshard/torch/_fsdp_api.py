"""FSDP2's policies for pshard.torch.fully_shard: torch's own MixedPrecisionPolicy,
OffloadPolicy and CPUOffloadPolicy (re-exported, not look-alikes), and the checks of what
pshard can honour."""
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DTYPE_NAMES",
           "check_policies"]

# The dtypes the shard servers gather and reduce in, by pshard's names.
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_policies(mp_policy, offload_policy):
    """TypeError/ValueError for policies pshard cannot honour: an mp_policy that is not a
    MixedPrecisionPolicy (torch's), a dtype the servers do not convert to, an offload_policy
    that is not torch's (CPUOffloadPolicy is what pshard does anyway)."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, not "
                        f"{type(mp_policy).__name__}")
    for what in ("param_dtype", "reduce_dtype"):
        dt = getattr(mp_policy, what)
        if dt is not None and dt not in DTYPE_NAMES:
            raise ValueError(f"MixedPrecisionPolicy {what}={dt} is not supported: float32, "
                             "bfloat16 or float16")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError("offload_policy must be a torch.distributed.fsdp.OffloadPolicy, not "
                        f"{type(offload_policy).__name__}")
    # CPUOffloadPolicy is where pshard.torch keeps the sharded parameters, gradients and
    # optimizer state anyway: host memory (the shard servers'). A model on the CPU needs no
    # policy; a model on a GPU must pass it (the definition refuses it without, _fsdp_init),
    # so that its sharded parameters being on the CPU is what the script asked for.
