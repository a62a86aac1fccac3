"""fully_shard: FSDP2's per-module units on pshard's shard servers.

Each ``fully_shard(module)`` call makes one unit whose parameters are gathered together. The
first unit to run forward becomes the root: it defines the whole model (every parameter of its
subtree, by fully qualified name) to the shard servers, with rank 0's values as the initial
ones, and from then on each nn.Parameter's storage is a fixed view of the shared memory the
shard server gathers into. Resharding gives those pages back (they read as zeros) and the next
gather writes the same addresses, so tensors autograd saved in forward see the values again in
backward without a copy; this is how FSDP2 keeps an unsharded parameter's storage valid.

Gradients: where the parameter's dtype is the reduce dtype, ``param.grad`` is a view of the
shared-memory gradient buffer that autograd accumulates into, and the reduce-scatter reads it
in place; otherwise it is converted into that buffer once. A unit's gradients are
reduce-scattered asynchronously as soon as all of them are accumulated; the optimizer step
waits for them.
"""
import dataclasses
import os
import warnings
import weakref
from typing import Optional

import torch
from torch import nn

import pshard

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision: parameters are gathered in param_dtype, gradients reduced in
    reduce_dtype (default: param_dtype), outputs cast to output_dtype, and floating-point
    inputs cast to param_dtype when cast_forward_inputs. Master weights and optimizer state are
    fp32 on the shard servers."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass
class OffloadPolicy:
    """No offload (FSDP2's default)."""


@dataclasses.dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """FSDP2's CPU offload. With pshard, where the shard state lives is the shard server's
    setting (``pshard-server --offload cpu``; CPU servers keep it in host memory anyway), so
    fully_shard refuses this policy instead of ignoring it."""
    pin_memory: bool = True


class _Unit:
    """One fully_shard call: a module whose parameters are gathered together."""

    def __init__(self, module, reshard_after_forward, mp_policy):
        self.module_ref = weakref.ref(module)
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp_policy
        self.model = None          # the _Model once the root initialised
        self.parent = None         # the nearest enclosing unit
        self.ids = []              # pshard parameter indices this unit gathers
        self.grad_ids = []         # those whose gradients are reduce-scattered
        self.gather_work = None    # an issued asynchronous gather
        self.requires_grad_sync = True
        self.fwd_prefetch = None   # explicit set_modules_to_forward_prefetch, or None
        self.bwd_prefetch = None
        self.ready = 0             # gradients accumulated in this backward
        self.in_backward = False   # pre-backward ran, post-backward not yet
        self.forward_ran = False
        self.mesh = None           # HSDP: (replicate, shard); None: sharded over the world

    @property
    def module(self):
        return self.module_ref()

    # ---- gathering ---------------------------------------------------------------------
    def wait_gather(self):
        w, self.gather_work = self.gather_work, None
        if w is not None:
            w.wait()

    def unshard(self):
        self.wait_gather()
        self.model.client.gather(self.ids)

    def unshard_async(self):
        if self.gather_work is None and self.ids:
            self.gather_work = self.model.client.gather_start(self.ids)

    def reshard(self):
        self.wait_gather()
        self.model.client.reshard(self.ids)


class _Model:
    """The root's model: the client, every parameter and unit, and the training state that
    spans units (pending reduce-scatters, the forward order for prefetching)."""

    def __init__(self, root_unit, client):
        self.client = client
        self.root = root_unit
        self.units = []
        self.params = []           # nn.Parameter per pshard id
        self.names = []
        self.frozen = []           # per id: never reduced or stepped
        self.grad_views = {}       # id -> the shared-memory gradient view handed to torch
        self.pending = []          # reduce-scatter Works not yet waited on
        self.fwd_order = []        # units by pre-forward in the last forward (forward prefetch)
        self.bwd_order = []        # units by post-forward in the last forward (backward
                                   # prefetch walks it backwards, as FSDP2 does)
        self.cur_pre, self.cur_post = [], []
        self.callback_queued = False
        self.optimizers = []
        self.param_dtype = None
        self.reduce_dtype = None
        self.step = 0
        self.last_grad_norm = None
        self.reduced = False       # a reduce-scatter was issued since the last step
        self.group_src = []

    def wait_reductions(self):
        pending, self.pending = self.pending, []
        first = None
        for w in pending:
            try:
                w.wait()
            except pshard.Error as e:
                first = first or e
        if first is not None:
            raise first

    def optimizer_step(self, opt):
        """opt.step(): the pending reduce-scatters, then every group's hyperparameters to the
        servers, which update their slices."""
        if opt not in self.optimizers:
            raise pshard.FailedPreconditionError("this optimizer does not hold the model")
        if not self.reduced:
            raise pshard.FailedPreconditionError(
                "step() before backward: no gradients were reduce-scattered since the last "
                "step (with set_requires_gradient_sync(False), turn it back on for the last "
                "micro-batch)")
        self.wait_reductions()
        groups = []
        for g, frozen in self.group_src:
            d = opt._pshard_group_dict(g) if g is not None else {"lr": 0.0}
            d["frozen"] = frozen
            groups.append(d)
        self.step, self.last_grad_norm = self.client.step(groups=groups)
        self.reduced = False

    def reset_after_error(self):
        """Forgets per-iteration state after a failed or joined iteration."""
        self.pending = []
        for u in self.units:
            u.gather_work = None
            u.in_backward = False
            u.ready = 0
        self.grad_views.clear()
        for p in self.params:
            p.grad = None
        self.callback_queued = False


# Units by module, and the owner model of each parameter, without keeping either alive.
_UNITS = weakref.WeakKeyDictionary()


def _unit_of(module):
    return _UNITS.get(module)


class FSDPModule:
    """Mixed into every module fully_shard was applied to (FSDP2's FSDPModule)."""

    def _pshard_unit(self):
        u = _unit_of(self)
        if u is None:
            raise pshard.FailedPreconditionError("this module was not passed to fully_shard")
        return u

    def _pshard_model(self):
        u = self._pshard_unit()
        if u.model is None:
            _lazy_init(u)
        return u.model

    def reshard(self):
        """Frees this unit's full parameters (FSDP2's reshard)."""
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
            return _UnshardHandle(u)
        u.unshard()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: gradients accumulate locally across backward passes (FSDP2's no_sync);
        True: the next backward reduce-scatters them."""
        for m in (self.modules() if recurse else [self]):
            u = _unit_of(m)
            if u is not None:
                u.requires_grad_sync = bool(requires_gradient_sync)

    def set_modules_to_forward_prefetch(self, modules):
        """Gathers these units (asynchronously) when this unit's forward starts."""
        self._pshard_unit().fwd_prefetch = [_require_unit(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        """Gathers these units (asynchronously) when this unit's backward starts."""
        self._pshard_unit().bwd_prefetch = [_require_unit(m) for m in modules]

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        for m in (self.modules() if recurse else [self]):
            u = _unit_of(m)
            if u is not None:
                u.reshard_after_forward = bool(reshard_after_forward)

    def join_hook(self, **kwargs):
        from ._join import _ModelJoinHook
        return _ModelJoinHook(self)

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return None


class _UnshardHandle:
    def __init__(self, unit):
        self._unit = unit

    def wait(self):
        self._unit.unshard()


def _require_unit(m):
    u = _unit_of(m)
    if u is None:
        raise ValueError(f"{type(m).__name__} was not passed to fully_shard")
    return u


_CLASSES = {}


def fully_shard(module, *, mesh=None, reshard_after_forward=True, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                ignored_params=None):
    """Makes module one unit of a model sharded on pshard's shard servers (FSDP2's
    fully_shard): apply it to each block and then to the root. Returns the module, whose class
    gains FSDPModule's methods. Raises ValueError/TypeError for options pshard does not
    support (shard_placement_fn, CPUOffloadPolicy, int reshard_after_forward). mesh: a 1-D
    DeviceMesh of the world (plain FSDP), or a 2-D one from
    init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard")) for HSDP (sharded
    over the S ranks of each replica, replicated across the R replicas; (world, 1) is
    NO_SHARD); every fully_shard of a model takes the same mesh."""
    if isinstance(module, (list, tuple)):
        raise ValueError("fully_shard takes one module; group modules in an nn.ModuleList")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, not {type(module).__name__}")
    mesh_shape = _mesh_shape(mesh)
    if shard_placement_fn is not None:
        raise ValueError("shard_placement_fn is not supported: pshard shards on dim 0")
    if ignored_params:
        raise ValueError("ignored_params is not supported")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError("reshard_after_forward must be True or False (an int, resharding to "
                         "a smaller world, is not supported)")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a pshard.torch.MixedPrecisionPolicy")
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise ValueError("offload is the shard server's setting (pshard-server --offload cpu); "
                         "pass offload_policy=None or OffloadPolicy()")
    for dt in (mp_policy.param_dtype, mp_policy.reduce_dtype):
        if dt is not None and dt not in _DTYPE_NAMES:
            raise ValueError(f"dtype {dt} is not supported: float32, bfloat16, float16")
    existing = _unit_of(module)
    if existing is not None:
        if existing.model is not None:
            raise pshard.FailedPreconditionError(
                "fully_shard was applied again after the model ran forward")
        existing.reshard_after_forward = reshard_after_forward
        existing.mp = mp_policy
        existing.mesh = mesh_shape
        return module
    unit = _Unit(module, reshard_after_forward, mp_policy)
    unit.mesh = mesh_shape
    _UNITS[module] = unit
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, always_call=False)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        new = _CLASSES.get(cls)
        if new is None:
            new = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _CLASSES[cls] = new
        module.__class__ = new
    return module


def _mesh_shape(mesh):
    """fully_shard's mesh as (replicate, shard), or None for the whole world."""
    if mesh is None:
        return None
    from ..distributed import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError("mesh must be a pshard.distributed.DeviceMesh (init_device_mesh), not "
                        f"{type(mesh).__name__}")
    world = pshard.get_world_size()
    if mesh.mesh.numel() != world or mesh.mesh.reshape(-1).tolist() != list(range(world)):
        raise ValueError(f"mesh {mesh.mesh.tolist()} must hold every rank in order "
                         "(init_device_mesh's)")
    if mesh.ndim == 1:
        return None
    if mesh.ndim != 2:
        raise ValueError(f"a {mesh.ndim}-D mesh: fully_shard takes a 1-D mesh (FSDP) or a 2-D "
                         "(replicate, shard) one (HSDP)")
    return tuple(mesh.mesh.shape)


# ---- lazy initialisation ------------------------------------------------------------------

def _layout():
    """PSHARD_LAYOUT: fsdp2 (each parameter sharded on dim 0, the default) or fsdp1 (all
    parameters flattened into one buffer split in equal chunks)."""
    layout = os.environ.get("PSHARD_LAYOUT", "fsdp2") or "fsdp2"
    if layout not in ("fsdp2", "fsdp1"):
        raise ValueError(f"PSHARD_LAYOUT={layout!r}: use fsdp2 or fsdp1")
    return layout


def _lazy_init(root_unit):
    """Defines the model of root_unit's subtree to the shard servers and points every
    parameter at its shared-memory buffer."""
    from . import optim as _optim
    root = root_unit.module
    client = pshard._get_client()
    units = []
    owner = {}      # module -> its nearest unit (itself if a unit)
    for name, m in root.named_modules():
        u = _unit_of(m)
        if u is not None:
            if u.model is not None:
                raise pshard.FailedPreconditionError(
                    f"'{name}' belongs to a model that was already initialised")
            units.append(u)
    for m in root.modules():
        u = _unit_of(m)
        if u is not None:
            owner[m] = u
        for child in m.children():
            if _unit_of(child) is None:
                owner.setdefault(child, owner.get(m, root_unit))
            else:
                _unit_of(child).parent = owner.get(m, root_unit)
    root_unit.parent = None

    # Every parameter once, by its first fully qualified name (tied ones are one parameter).
    named = list(root.named_parameters())
    if not named:
        raise pshard.InvalidArgumentError(
            f"{type(root).__name__} has no parameters: there is nothing to shard")
    index = {}
    for i, (name, p) in enumerate(named):
        index[id(p)] = i
    # Which units use each parameter directly; shared ones go to the nearest common unit.
    users = [set() for _ in named]
    for m in root.modules():
        u = owner.get(m, root_unit)
        for p in m._parameters.values():
            if p is not None:
                users[index[id(p)]].add(u)

    def chain(u):
        out = []
        while u is not None:
            out.append(u)
            u = u.parent
        return out

    for i, (name, p) in enumerate(named):
        us = list(users[i])
        if len(us) == 1:
            u = us[0]
        else:
            common = set(chain(us[0]))
            for other in us[1:]:
                common &= set(chain(other))
            u = next(x for x in chain(us[0]) if x in common)
        u.ids.append(i)

    # One param_dtype and reduce_dtype for the model (the servers keep one).
    pdt = {u.mp.param_dtype for u in units}
    rdt = {u.mp.reduce_dtype for u in units}
    if len(pdt) > 1 or len(rdt) > 1:
        raise ValueError("every fully_shard call of one model must use the same "
                         "MixedPrecisionPolicy param_dtype and reduce_dtype")
    param_dtype = pdt.pop()
    dtypes = {p.dtype for _, p in named}
    for name, p in named:
        if p.dtype not in _DTYPE_NAMES:
            raise TypeError(f"parameter '{name}' has dtype {p.dtype}; pshard shards float32, "
                            "bfloat16 and float16 parameters")
        if p.device.type != "cpu":
            raise ValueError(f"parameter '{name}' is on {p.device}; pshard trainers compute on "
                             "the CPU for now")
    if param_dtype is None:
        if len(dtypes) > 1:
            raise TypeError(f"the parameters mix dtypes {sorted(map(str, dtypes))}; set "
                            "MixedPrecisionPolicy(param_dtype=...)")
        param_dtype = dtypes.pop()
    reduce_dtype = rdt.pop() or param_dtype
    if reduce_dtype == torch.float16:
        raise ValueError("reduce_dtype float16 is not supported: use float32 or bfloat16")

    # Optimizer groups: each parameter's pshard optimizer group, or frozen.
    opts = _optim._optimizers_of([p for _, p in named])
    kinds = {o._pshard_kind for o in opts}
    if len(kinds) > 1:
        raise ValueError("one model takes one kind of pshard optimizer")
    kind = kinds.pop() if kinds else "sgd"
    groups, param_groups, frozen = [], [None] * len(named), [False] * len(named)
    group_src = []  # per server group: (the optimizer's param_group or None, frozen)
    for o in opts:
        for g in o.param_groups:
            gi = len(groups)
            groups.append(o._pshard_group_dict(g))
            group_src.append((g, False))
            for p in g["params"]:
                if param_groups[index[id(p)]] is not None:
                    raise ValueError("a parameter is in two pshard optimizer groups")
                param_groups[index[id(p)]] = gi
    if not opts:
        warnings.warn("no pshard.torch.optim optimizer holds this model's parameters: they "
                      "will not be trained (create the optimizer before the first forward)",
                      stacklevel=3)
    frozen_group = None
    for i, (name, p) in enumerate(named):
        if param_groups[i] is None or not p.requires_grad:
            frozen[i] = True
            if param_groups[i] is None:
                if frozen_group is None:
                    frozen_group = len(groups)
                    groups.append({"lr": 0.0, "frozen": True})
                    group_src.append((None, True))
                param_groups[i] = frozen_group
    # A trainable parameter that is not requires_grad gets a frozen group of its own kind.
    split = {}
    for i, (name, p) in enumerate(named):
        gi = param_groups[i]
        if frozen[i] and not groups[gi].get("frozen"):
            if gi not in split:
                split[gi] = len(groups)
                groups.append(dict(groups[gi], frozen=True))
                group_src.append((group_src[gi][0], True))
            param_groups[i] = split[gi]

    # Buffers (BatchNorm statistics, ...) start equal everywhere: rank 0's.
    if client.world_size > 1:
        from .. import distributed as _dist
        for bname, b in root.named_buffers():
            if b.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
                _dist.broadcast(b.data, 0)

    init = None
    if client.rank == 0:
        init = [p.detach().to(torch.float32).contiguous() for _, p in named]
    meshes = {u.mesh for u in units}
    if len(meshes) > 1:
        shapes = sorted(map(str, meshes))
        raise ValueError(f"the units of one model were given different meshes {shapes}: pass "
                         "the same mesh to every fully_shard")
    mesh = meshes.pop() if meshes else None
    model = _Model(root_unit, client)
    model.step = client.define_model(
        [n for n, _ in named], [tuple(p.shape) for _, p in named], init=init, optimizer=kind,
        groups=groups, param_groups=param_groups, param_dtype=_DTYPE_NAMES[param_dtype],
        reduce_dtype=_DTYPE_NAMES[reduce_dtype],
        layout=_layout(), reshard_after_forward=True, max_gathers_in_flight=2,
        replicate=mesh[0] if mesh else 0, shard=mesh[1] if mesh else 0)
    del init
    model.param_dtype, model.reduce_dtype = param_dtype, reduce_dtype
    model.units = units
    model.names = [n for n, _ in named]
    model.params = [p for _, p in named]
    model.frozen = frozen
    model.optimizers = list(opts)
    model.group_src = group_src
    for i, p in enumerate(model.params):
        view = torch.from_dlpack(client.param_buffer(i))
        with torch.no_grad():
            p.data = view
        p._pshard_id = i
        p._pshard_model_ref = weakref.ref(model)
    for u in units:
        u.model = model
        u.grad_ids = [i for i in u.ids if not frozen[i]]
        for i in u.grad_ids:
            model.params[i].register_post_accumulate_grad_hook(_make_grad_hook(u, i))
    for o in opts:
        o._pshard_model = model
    return model


# ---- hooks ------------------------------------------------------------------------------

def _cast(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        out = [_cast(x, dtype) for x in obj]
        return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def _tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    elif hasattr(obj, "to_tuple"):  # transformers' ModelOutput
        _tensors(obj.to_tuple(), out)
    return out


def _pre_forward(module, args, kwargs):
    u = _unit_of(module)
    if u.model is None:
        _lazy_init(u)
    model = u.model
    if u is model.root:
        model.cur_pre, model.cur_post = [], []
    model.cur_pre.append(u)
    u.unshard()
    # Prefetch: the explicit list, else the unit that ran after this one last time.
    if u.fwd_prefetch is not None:
        nxt = u.fwd_prefetch
    else:
        order = model.fwd_order
        k = order.index(u) if u in order else -1
        nxt = [order[k + 1]] if 0 <= k < len(order) - 1 else []
    for v in nxt:
        v.unshard_async()
    if u.mp.cast_forward_inputs and u.mp.param_dtype is not None:
        args, kwargs = _cast(args, u.mp.param_dtype), _cast(kwargs, u.mp.param_dtype)
    return args, kwargs


def _post_forward(module, args, output):
    u = _unit_of(module)
    model = u.model
    model.cur_post.append(u)
    if u is model.root:
        model.fwd_order, model.bwd_order = model.cur_pre, model.cur_post
    if u.reshard_after_forward and u is not model.root:
        u.reshard()
    if torch.is_grad_enabled():
        outs = _tensors(output, [])
        if outs:
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda grads, u=u: _pre_backward(u), mode="any")
    if u.mp.output_dtype is not None:
        output = _cast(output, u.mp.output_dtype)
    return output


def _pre_backward(u):
    model = u.model
    if not model.callback_queued:
        model.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _post_backward_final(model))
    if u.in_backward:
        return
    u.in_backward = True
    u.ready = 0
    u.unshard()
    if u.bwd_prefetch is not None:
        nxt = u.bwd_prefetch
    else:
        order = model.bwd_order
        k = order.index(u) if u in order else -1
        nxt = [order[k - 1]] if k > 0 else []
    for v in nxt:
        v.unshard_async()
    if model.param_dtype == model.reduce_dtype:
        # Autograd accumulates straight into the shared-memory gradient buffers.
        for i in u.grad_ids:
            p = model.params[i]
            view, fresh = _grad_view(model, i)
            if p.grad is None:
                if not fresh:
                    view.zero_()  # the caller dropped the accumulated gradient (zero_grad)
            elif p.grad is not view:
                view.copy_(p.grad)
            p.grad = view


def _grad_view(model, i):
    """(the torch view of parameter i's shared-memory gradient buffer, whether it was just
    made): made once per reduction and dropped when the reduce-scatter starts."""
    view = model.grad_views.get(i)
    if view is not None:
        return view, False
    view = torch.from_dlpack(model.client.grad(i))
    model.grad_views[i] = view
    return view, True


def _make_grad_hook(u, i):
    def hook(p):
        u.ready += 1
        if u.ready == len(u.grad_ids):
            _post_backward(u)
    return hook


def _post_backward(u):
    if not u.in_backward:
        return
    u.in_backward = False
    model = u.model
    if model.param_dtype != model.reduce_dtype:
        for i in u.grad_ids:
            p = model.params[i]
            view, _ = _grad_view(model, i)
            if p.grad is not None:
                view.add_(p.grad)
                p.grad = None
    for i in u.ids:
        if model.frozen[i]:
            model.params[i].grad = None  # not in any optimizer: nothing would use it
    if u.requires_grad_sync and u.grad_ids:
        for i in u.grad_ids:
            model.grad_views.pop(i, None)
            model.params[i].grad = None
        model.pending.append(model.client.reduce_scatter_start(u.grad_ids))
        model.reduced = True
    u.reshard()


def _post_backward_final(model):
    model.callback_queued = False
    for u in model.units:
        if u.in_backward:
            _post_backward(u)
