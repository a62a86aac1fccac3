"""pshard.distributed: torch.distributed's own collectives, groups and device meshes, which run
on backend "pshard" (the shard servers' collectives) once ``pshard.init_process_group()`` has
initialized torch's default group. The names are re-exported for code written against earlier
pshard releases; new code calls ``torch.distributed`` directly, exactly as it would on gloo or
NCCL. While some trainers have joined (pshard.torch.Join), their shard servers take part for
them: a reduction gets their identity (zeros for a sum, ones for a product, -inf for a max) and
an average is over the others.
"""
from torch.distributed import (  # noqa: F401  (re-exported)
    GroupMember,
    ProcessGroup,
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    irecv,
    isend,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: F401

__all__ = ["ReduceOp", "all_reduce", "reduce", "broadcast", "all_gather_into_tensor",
           "all_gather", "gather", "scatter", "all_to_all_single", "all_to_all", "barrier",
           "get_rank", "get_world_size", "group", "GroupMember", "ProcessGroup", "new_group",
           "new_subgroups", "new_subgroups_by_enumeration", "get_process_group_ranks",
           "get_group_rank", "get_global_rank", "DeviceMesh", "init_device_mesh", "send", "recv",
           "isend", "irecv", "reduce_scatter_tensor", "reduce_scatter"]
