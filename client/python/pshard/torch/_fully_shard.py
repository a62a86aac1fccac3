"""fully_shard and FSDPModule: FSDP2's entry point on pshard's shard servers.

``fully_shard(module)`` makes one unit whose parameters are gathered together and replaces
each parameter of the module's subtree (those no nested fully_shard took) with its sharded
parameter: a DTensor (Shard(0), on ``mesh``, by default a 1-D mesh of every rank) holding this
rank's rows (``_fsdp_param.py``). Apply it to each block and then to the root, then create the
optimizer from ``model.parameters()``. The root's first forward defines the model to the shard
servers (``_fsdp_init.py``) and the hooks (``_fsdp_state.py``) drive gathers and
reduce-scatters.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import pshard
from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, check_policies
from ._fsdp_param import device_of, make_sharded
from ._fsdp_param_group import Unit, register_unit, require_unit, unit_of
from ._fsdp_state import ensure_init, install_optimizer_hooks, post_forward, pre_forward
from ._join import ModelJoinHook

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]


class FSDPModule:
    """Mixed into every module fully_shard was applied to (FSDP2's FSDPModule)."""

    def _pshard_unit(self):
        u = unit_of(self)
        if u is None:
            raise pshard.FailedPreconditionError("this module was not passed to fully_shard")
        return u

    def _pshard_model(self):
        return ensure_init(self._pshard_unit())

    def reshard(self):
        """Frees this unit's full parameters and registers the sharded ones (FSDP2's
        reshard)."""
        u = self._pshard_unit()
        if u.model is not None:
            u.reshard()

    def unshard(self, async_op=False):
        """Gathers this unit's full parameters; with async_op=True returns a handle whose
        wait() finishes the gather."""
        u = self._pshard_unit()
        self._pshard_model()
        if async_op:
            u.unshard_async()
            return UnshardHandle(u)
        u.unshard()
        return None

    def _units(self, recurse):
        seen = []
        for m in (self.modules() if recurse else [self]):
            u = unit_of(m)
            if u is not None and u not in seen:
                seen.append(u)
        return seen

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: gradients accumulate locally across backward passes (FSDP2's no_sync);
        True: the next backward reduce-scatters them."""
        for u in self._units(recurse):
            u.requires_grad_sync = bool(requires_gradient_sync)

    def set_modules_to_forward_prefetch(self, modules):
        """Gathers these units (asynchronously) when this unit's forward starts."""
        self._pshard_unit().fwd_prefetch = [require_unit(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        """Gathers these units (asynchronously) when this unit's backward starts."""
        self._pshard_unit().bwd_prefetch = [require_unit(m) for m in modules]

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("reshard_after_forward must be a bool")
        for u in self._units(recurse):
            u.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """False keeps the units gathered after backward (for gradient accumulation without
        gathering again); they are resharded at the next optimizer step."""
        for u in self._units(recurse):
            u.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward):
        """Accepted for FSDP2's API: pshard finishes every backward the same way (its sharded
        gradients are set at the end of each backward that reduce-scatters)."""
        if not isinstance(is_last_backward, bool):
            raise ValueError("is_last_backward must be a bool")

    def set_gradient_divide_factor(self, factor):
        """This unit's reduced gradients are the ranks' sum divided by factor instead of their
        mean (FSDP2's; not recursive). The trainer scales its gradients by (ranks / factor)
        before the servers average them; with ranks joined (pshard's Join) the servers
        average over the ranks that contributed, so the divisor shrinks in proportion."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or \
                not float(factor) > 0 or float(factor) == float("inf"):
            raise ValueError(f"gradient divide factor must be a positive finite number, not "
                             f"{factor!r}")
        self._pshard_unit().divide_factor = float(factor)

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP: False leaves the replicas' gradients unreduced for this backward (gradient
        accumulation). pshard's servers reduce-scatter and all-reduce in one operation, so
        False defers the whole reduction, as set_requires_gradient_sync(False) does: the
        gradients accumulate in the trainer and the next backward with True reduces them all
        (the sums FSDP2 reaches; its sharded .grad between is partial, pshard's is not set).
        No effect on a 1-D mesh, as in FSDP2."""
        if not isinstance(requires_all_reduce, bool):
            raise ValueError("requires_all_reduce must be a bool")
        for u in self._units(recurse):
            u.requires_all_reduce = requires_all_reduce

    def join_hook(self, **kwargs):
        return ModelJoinHook(self)

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return None


class UnshardHandle:
    """What unshard(async_op=True) returns: wait() finishes the gather."""

    def __init__(self, unit):
        self._unit = unit

    def wait(self):
        self._unit.unshard()


_CLASSES = {}
_DEFAULT_MESH = []


def _before_state_dict(module, prefix, keep_vars):
    """A state dict holds the sharded parameters: a unit still gathered after a forward
    without backward registers them again first (outside backward)."""
    u = unit_of(module)
    if u is not None and u.model is not None and u.unsharded and not u.in_backward:
        u.reshard()


def _before_load_state_dict(module, state_dict, prefix, *args):
    """load_state_dict copies into the sharded parameters (the servers' masters): a gathered
    unit would keep the old values, so it is resharded first. A full plain tensor for a
    DTensor parameter cannot be copied (torch says "mixed torch.Tensor and DTensor"): refused
    up front, naming the function that loads full state dicts."""
    for name, p in module.named_parameters():
        v = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
            raise RuntimeError(
                f"load_state_dict: '{prefix + name}' is a plain tensor of shape "
                f"{tuple(v.shape)}, and the model's parameters are sharded DTensors: load a "
                "full state dict with torch.distributed.checkpoint.state_dict."
                "set_model_state_dict(model, sd, options=StateDictOptions("
                "full_state_dict=True)) (or pshard.torch.set_model_state_dict), or pass the "
                "DTensors of model.state_dict()")
    _before_state_dict(module, prefix, False)


def _default_mesh(device_type):
    """FSDP2's default: a 1-D mesh of every rank (torch's default group, backend pshard) of the
    device type the model computes on."""
    world = pshard.get_world_size()
    _DEFAULT_MESH[:] = [e for e in _DEFAULT_MESH if e[0] is dist.group.WORLD]
    for _, dt, m in _DEFAULT_MESH:
        if dt == device_type:
            return m
    m = init_device_mesh(device_type, (world,))
    _DEFAULT_MESH.append((dist.group.WORLD, device_type, m))
    return m


def _device_type(modules):
    """The device type the modules compute on: their parameters' (a sharded one's from before
    fully_shard); the CPU for modules without any. ValueError for several."""
    types = {(device_of(p) if hasattr(p, "_pshard_sharded") else p.device).type
             for m in modules for p in m.parameters()}
    if len(types) > 1:
        raise ValueError(f"the module's parameters are on several device types "
                         f"({', '.join(sorted(types))}): move it to one device before "
                         "fully_shard")
    kind = types.pop() if types else "cpu"
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"the module's parameters are on {kind}: pshard shards parameters "
                         "with their values on the CPU or a CUDA device (materialize a meta "
                         "module first: to_empty(device=...) and its initialization)")
    return kind


def _check_mesh(mesh, device_type):
    """mesh (None: the default for device_type, where the modules compute) as the DeviceMesh
    the model shards over, with its placements and this rank's (shard index, shard count);
    TypeError/ValueError for a mesh pshard cannot shard over."""
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError("mesh must be a torch.distributed.device_mesh.DeviceMesh "
                        f"(init_device_mesh), not {type(mesh).__name__}")
    if not pshard.is_initialized() or not dist.is_initialized():
        raise pshard.FailedPreconditionError(
            "fully_shard needs the process group: call pshard.init_process_group() first")
    if dist.get_backend() != "pshard":
        raise ValueError(f"torch's default process group is on backend {dist.get_backend()!r}: "
                         "pshard.torch.fully_shard needs backend 'pshard' (initialize it with "
                         "pshard.init_process_group())")
    if mesh is None:
        mesh = _default_mesh(device_type)
    world = pshard.get_world_size()
    if mesh.mesh.reshape(-1).tolist() != list(range(world)):
        raise ValueError(f"mesh {mesh.mesh.tolist()} must hold every rank in order "
                         "(init_device_mesh's)")
    if mesh.device_type not in ("cpu", "cuda"):
        raise ValueError(f"mesh device_type {mesh.device_type!r}: pshard trainers compute on "
                         "the CPU or CUDA devices (init_device_mesh('cpu' or 'cuda', ...))")
    if mesh.device_type != device_type:
        raise ValueError(f"a {mesh.device_type} mesh for a module on {device_type}: FSDP2 "
                         "computes on the mesh's device type, so move the module there first, "
                         f"or pass init_device_mesh({device_type!r}, ...) (CPU offload keeps "
                         "the GPU's mesh)")
    for d in range(mesh.ndim):
        backend = dist.get_backend(mesh.get_group(d))
        if backend != "pshard":
            raise ValueError(f"mesh dimension {d} is a process group of backend {backend!r}: "
                             "pshard shards over backend 'pshard' groups")
    if mesh.ndim == 1:
        return mesh, (Shard(0),), mesh.get_local_rank(0), mesh.shape[0]
    if mesh.ndim != 2:
        raise ValueError(f"a {mesh.ndim}-D mesh: fully_shard takes a 1-D mesh (FSDP) or a 2-D "
                         "(replicate, shard) one (HSDP)")
    return mesh, (Replicate(), Shard(0)), mesh.get_local_rank(1), mesh.shape[1]


def _shard_parameters(modules, mesh, placements, shard_rank, shard_size, ignored, host):
    """Replaces every parameter of modules' subtrees that no fully_shard took yet (and that is
    not ignored) with its sharded parameter; a parameter held by several modules (tied) gets
    one sharded parameter everywhere."""
    for top in modules:
        for m in top.modules():
            for pname, p in list(m._parameters.items()):
                if p is None or getattr(p, "_pshard_sharded", False) or id(p) in ignored:
                    continue
                sp = getattr(p, "_pshard_sharded_param", None)
                if sp is None:
                    sp = make_sharded(p, mesh, placements, shard_rank, shard_size, host)
                    sp._pshard_sharded = True
                    p._pshard_sharded_param = sp
                    p._pshard_replaced = True
                m._parameters[pname] = sp


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                ignored_params=None, dp_mesh_dims=None):
    """FSDP2's fully_shard on pshard's shard servers: makes module (or the modules of a list,
    gathered together) one unit and shards its parameters (see the module doc). Returns the
    module, whose class gains FSDPModule's methods.

    mesh: None (every rank, of the device type the module's parameters are on), a 1-D
    DeviceMesh of every rank, or a 2-D one from init_device_mesh("cpu" or "cuda", (R, S),
    mesh_dim_names=("replicate", "shard")) for HSDP (sharded
    over the S ranks of each replica, replicated across the R replicas); every unit of a model
    takes the same mesh. reshard_after_forward: True, False or None (True except for the root,
    FSDP2's default). mp_policy and offload_policy are torch's classes; CPU offload is the
    shard server's setting (pshard-server --offload cpu). ignored_params stay as they are,
    neither sharded nor reduced. NotImplementedError for shard_placement_fn, an int
    reshard_after_forward and dp_mesh_dims; TypeError/ValueError for bad arguments."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes an nn.Module or a list of them, not "
                            f"{type(m).__name__}")
    if shard_placement_fn is not None:
        raise NotImplementedError("shard_placement_fn: pshard shards every parameter on dim 0 "
                                  "(FSDP2's default placement); pass None")
    if dp_mesh_dims is not None:
        raise NotImplementedError("dp_mesh_dims: pass a 1-D or (replicate, shard) mesh instead")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward}: resharding to a smaller world after "
            "forward is not supported; use True (reshard, gather again in backward) or False "
            "(keep the full parameters until backward)")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError("reshard_after_forward must be None, True or False")
    check_policies(mp_policy, offload_policy)
    mesh, placements, shard_rank, shard_size = _check_mesh(mesh, _device_type(modules))
    ignored = set()
    for p in ignored_params or ():
        if not isinstance(p, torch.Tensor):
            raise TypeError("ignored_params must hold parameters")
        ignored.add(id(p))
    existing = [unit_of(m) for m in modules]
    if any(u is not None for u in existing):
        u = existing[0]
        if u is None or any(x is not u for x in existing) or len(u.module_refs) != len(modules):
            raise ValueError("fully_shard was applied to these modules in another grouping "
                             "before")
        if u.model is not None:
            raise pshard.FailedPreconditionError(
                "fully_shard was applied again after the model ran forward")
        u.reshard_after_forward, u.mp, u.mesh = reshard_after_forward, mp_policy, mesh
        u.offload = offload_policy
        u.ignored |= ignored
        _shard_parameters(modules, mesh, placements, shard_rank, shard_size, u.ignored,
                          isinstance(offload_policy, CPUOffloadPolicy))
        return module
    unit = Unit(modules, reshard_after_forward, mp_policy, mesh)
    unit.offload = offload_policy
    unit.ignored = ignored
    _shard_parameters(modules, mesh, placements, shard_rank, shard_size, ignored,
                      isinstance(offload_policy, CPUOffloadPolicy))
    install_optimizer_hooks()
    for m in modules:
        register_unit(m, unit)
        m.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(post_forward, always_call=False)
        m.register_state_dict_pre_hook(_before_state_dict)
        m.register_load_state_dict_pre_hook(_before_load_state_dict)
        cls = type(m)
        if not issubclass(cls, FSDPModule):
            new = _CLASSES.get(cls)
            if new is None:
                new = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
                _CLASSES[cls] = new
            m.__class__ = new
    return module
