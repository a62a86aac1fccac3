"""The root's lazy initialisation (at its first forward, as FSDP2's): defines the whole model
to the shard servers (every parameter by its fully qualified name, the pshard optimizers'
parameter groups), then moves every sharded parameter's local tensor onto the server's master
weights (each rank's own rows, as FSDP2 keeps them; replica 0's on an HSDP mesh; the
checkpoint's after pshardrun --resume) and makes the unsharded parameters over the stable full
buffers."""
import os
import warnings
import weakref

import torch
import torch.distributed as dist

import pshard
from . import optim as _optim
from ._fsdp_api import DTYPE_NAMES, CPUOffloadPolicy
from ._fsdp_model import Model
from ._optim_keep import open_kept
from ._fsdp_param import FSDPParam, device_of
from ._fsdp_param_group import unit_of

__all__ = ["lazy_init"]


def _layout():
    """PSHARD_LAYOUT: pshard.torch shards each parameter on dim 0 (FSDP2's layout, fsdp2);
    the flat fsdp1 layout is the C API's, whose shards are not rows."""
    layout = os.environ.get("PSHARD_LAYOUT", "fsdp2") or "fsdp2"
    if layout != "fsdp2":
        raise ValueError(f"PSHARD_LAYOUT={layout!r}: pshard.torch's parameters are DTensors "
                         "sharded on dim 0 (FSDP2's layout, fsdp2); the flat fsdp1 layout is "
                         "for C trainers (pshard_model_config_t.layout)")
    return layout


def _compute_device(named, units):
    """Where the modules compute: the device the parameters were on before fully_shard (one for
    the model), and for a model on a GPU whether FSDP2's CPUOffloadPolicy was given (every unit
    alike). PSHARD_TEST_EMULATE_DEVICE=1 makes a CPU model stage its unsharded parameters as a
    GPU model does (the tests' stand-in for a GPU). Returns (device, offload, staged_on)."""
    devs = {device_of(p) for _, p in named}
    if len(devs) > 1:
        raise ValueError(f"the model's parameters are on several devices "
                         f"({', '.join(sorted(str(d) for d in devs))}): move the whole model to "
                         "one device before fully_shard")
    dev = devs.pop()
    if dev.type == "cpu":
        emulate = os.environ.get("PSHARD_TEST_EMULATE_DEVICE") == "1"
        return dev, False, (dev if emulate else None)
    if dev.type != "cuda":
        raise ValueError(f"the model is on {dev}: pshard trainers compute on the CPU or on a "
                         "CUDA device")
    offload = {isinstance(u.offload, CPUOffloadPolicy) for u in units}
    if len(offload) > 1:
        raise ValueError("some fully_shard calls of this model gave CPUOffloadPolicy and some "
                         "did not: pass the same offload_policy to every one")
    return dev, offload.pop(), dev


def _check_memory(client, device, offload):
    """Whether the shard servers keep the shards where this model needs them: a CPU model, in
    host memory (or the emulated device's); a GPU model with CPUOffloadPolicy, in host memory;
    one without, in its own GPU's memory (GPU-resident shards, opened through CUDA IPC).
    Returns the CUDA device of GPU-resident shards, or None; an error naming the fix else."""
    memory, where = client.shard_memory()
    if device.type == "cpu":
        if memory == "cuda":
            raise pshard.FailedPreconditionError(
                f"the shard servers keep the shards in GPU memory (cuda:{where}) and the model "
                "is on the CPU: move the model to cuda:LOCAL_RANK, or start the shard servers "
                "with --offload cpu")
        return None
    if offload:
        if memory != "host":
            raise pshard.FailedPreconditionError(
                f"CPUOffloadPolicy keeps the sharded parameters in host memory, but the shard "
                f"servers keep them in {memory} memory: start them with --offload cpu, or drop "
                "the policy (the shards then stay on the GPU)")
        return None
    if memory != "cuda":
        raise pshard.FailedPreconditionError(
            f"the model is on {device} and the shard servers keep the shards in {memory} "
            "memory: pass offload_policy=CPUOffloadPolicy() to fully_shard (FSDP2's CPU "
            "offload, which is what that is), or start the shard servers with --backend nccl "
            "and without --offload cpu (GPU-resident shards)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if where != index:
        raise pshard.FailedPreconditionError(
            f"the model is on cuda:{index} and its shard server keeps the shards on cuda:{where}: "
            "give each trainer its server's GPU (pshardrun: --device is the local rank; "
            "torch.cuda.set_device(LOCAL_RANK))")
    return torch.device("cuda", where)


def _device_pool_bytes(units, named, param_dtype, reduce_dtype, frozen, root_unit):
    """The size of the model region in the shard server's GPU memory: room for every gradient
    at once (FSDP2 keeps full unsharded gradients across set_requires_gradient_sync(False)
    too), the root unit's parameters (gathered through the whole iteration) and three of the
    largest unit's (the one computing, the one prefetched and one more for the first fit's
    holes), with 512 bytes of alignment a tensor. A gather waits for reduce-scatters in flight
    to give their blocks back; PSHARD_DEVICE_POOL_BYTES overrides the size."""
    env = os.environ.get("PSHARD_DEVICE_POOL_BYTES")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = -1
        if n <= 0:
            raise ValueError(f"PSHARD_DEVICE_POOL_BYTES={env!r}: give a positive number of bytes")
        return n
    pes = torch.empty((), dtype=param_dtype).element_size()
    res = torch.empty((), dtype=reduce_dtype).element_size()
    numel = [p.numel() for _, p in named]
    grads = sum(n * res + 512 for i, n in enumerate(numel) if not frozen[i])
    unit_bytes = [sum(numel[i] * pes + 512 for i in u.ids) for u in units]
    root = sum(numel[i] * pes + 512 for i in root_unit.ids)
    return grads + root + 3 * max(unit_bytes, default=0)


def _check_region(client, device, shards_on):
    """A GPU model whose shards are in its GPU's memory has its full buffers there too (the
    model region in the shard server's GPU memory, opened through CUDA IPC), so that gathers
    and reduce-scatters move no bytes through the host."""
    kind, where = client.region_memory()
    if device.type == "cuda" and shards_on is not None and (kind != "cuda" or
                                                             where != shards_on.index):
        raise pshard.FailedPreconditionError(
            f"the shard servers keep the shards on {shards_on} but gave the model region in "
            f"{kind} memory (an older pshard-server?): run pshard-server and the client of one "
            "pshard release")


def _units_and_owners(root_unit):
    """Every unit of the root's subtree (once, in module order) and each module's nearest
    unit; sets each unit's parent."""
    root = root_unit.module
    units = []
    for name, m in root.named_modules():
        u = unit_of(m)
        if u is not None and u not in units:
            if u.model is not None:
                raise pshard.FailedPreconditionError(
                    f"'{name}' belongs to a model that was already initialised")
            units.append(u)
    owner = {}
    for m in root.modules():
        u = unit_of(m)
        if u is not None:
            owner[m] = u
        for child in m.children():
            cu = unit_of(child)
            if cu is None:
                owner.setdefault(child, owner.get(m, root_unit))
            elif cu is not owner.get(m, root_unit):
                cu.parent = owner.get(m, root_unit)
    root_unit.parent = None
    return units, owner


def _assign(root, root_unit, owner, named, ignored):
    """Each parameter's unit: the one whose modules use it, shared ones the nearest common
    unit; and every (module, name) that holds it."""
    index = {id(p): i for i, (_, p) in enumerate(named)}
    users = [set() for _ in named]
    slots = [[] for _ in named]
    for m in root.modules():
        u = owner.get(m, root_unit)
        for pname, p in m._parameters.items():
            if p is not None and id(p) not in ignored:
                users[index[id(p)]].add(u)
                slots[index[id(p)]].append((m, pname))

    def chain(u):
        out = []
        while u is not None:
            out.append(u)
            u = u.parent
        return out

    where = []
    for i in range(len(named)):
        us = list(users[i])
        if len(us) == 1:
            where.append(us[0])
            continue
        common = set(chain(us[0]))
        for other in us[1:]:
            common &= set(chain(other))
        where.append(next(x for x in chain(us[0]) if x in common))
    return where, slots


def _optimizer_groups(named, index):
    """The pshard optimizers' groups for the servers: (kind, groups, param_groups, frozen,
    group_src, optimizers). A trainable parameter in no pshard optimizer is in a group of lr 0
    the servers reduce gradients for but never update (a torch.optim optimizer in the trainer
    steps it); one that does not require grad is frozen."""
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
    frozen_group = trainer_group = None
    for i, (name, p) in enumerate(named):
        if param_groups[i] is None and p.requires_grad:
            if trainer_group is None:
                trainer_group = len(groups)
                groups.append({"lr": 0.0})
                group_src.append((None, False))
            param_groups[i] = trainer_group
        elif param_groups[i] is None or not p.requires_grad:
            frozen[i] = True
            if param_groups[i] is None:
                if frozen_group is None:
                    frozen_group = len(groups)
                    groups.append({"lr": 0.0, "frozen": True})
                    group_src.append((None, True))
                param_groups[i] = frozen_group
    # A parameter of a pshard optimizer that is not requires_grad: a frozen group of its kind.
    split = {}
    for i, (name, p) in enumerate(named):
        gi = param_groups[i]
        if frozen[i] and not groups[gi].get("frozen"):
            if gi not in split:
                split[gi] = len(groups)
                groups.append(dict(groups[gi], frozen=True))
                group_src.append((group_src[gi][0], True))
            param_groups[i] = split[gi]
    return kind, groups, param_groups, frozen, group_src, opts


def _take_over_kept_state(model, client, step):
    """A replacement: the torch.optim state its lost predecessor kept (if it kept one) is
    settled against the servers' step count, the step in flight kept or rolled back on this
    rank's shard, and goes into the new optimizer at its first step."""
    try:
        names = client.trainer_state_info()[:2]
    except pshard.Error:
        return  # the shard is not mapped here: no torch.optim optimizer stepped it
    kept = open_kept(model, names)
    if kept is not None:
        kept.settle(step)
        model.keeper = kept


def lazy_init(root_unit):
    """Defines the model of root_unit's subtree to the shard servers and binds every parameter
    to the servers' memory. Collective: every rank's root runs it at its first forward."""
    root = root_unit.module
    client = pshard._get_client()
    units, owner = _units_and_owners(root_unit)
    ignored = set().union(*(u.ignored for u in units))
    named = [(n, p) for n, p in root.named_parameters() if id(p) not in ignored]
    if not named:
        raise pshard.InvalidArgumentError(
            f"{type(root).__name__} has no parameters: there is nothing to shard")
    for name, p in named:
        if not hasattr(p, "_pshard_sharded"):
            raise pshard.FailedPreconditionError(
                f"parameter '{name}' was added to the model after fully_shard: apply "
                "fully_shard to the module that holds it (or again to the root)")
        if p.dtype != torch.float32:
            raise TypeError(f"parameter '{name}' is {p.dtype}: pshard's sharded parameters are "
                            "the shard servers' fp32 master weights; keep the model in float32 "
                            "and gather in bfloat16 with MixedPrecisionPolicy(param_dtype="
                            "torch.bfloat16)")
    device, offload, staged_on = _compute_device(named, units)
    index = {id(p): i for i, (_, p) in enumerate(named)}
    where, slots = _assign(root, root_unit, owner, named, ignored)
    for i, u in enumerate(where):
        u.ids.append(i)

    # One param_dtype and reduce_dtype for the model (the servers keep one).
    pdt = {u.mp.param_dtype for u in units}
    rdt = {u.mp.reduce_dtype for u in units}
    if len(pdt) > 1 or len(rdt) > 1:
        raise ValueError("every fully_shard call of one model must use the same "
                         "MixedPrecisionPolicy param_dtype and reduce_dtype")
    param_dtype = pdt.pop() or torch.float32
    reduce_dtype = rdt.pop() or param_dtype
    # float16 reductions: the trainer rounds the gradients to float16 (what FSDP2 reduces)
    # and the servers sum them in float32 (they reduce fp32 and bf16 only), so the sums carry
    # no float16 rounding or overflow of their own.
    round_grads = reduce_dtype if reduce_dtype == torch.float16 else None
    if round_grads is not None:
        reduce_dtype = torch.float32
    meshes = {id(u.mesh): u.mesh for u in units}
    if len(meshes) > 1:
        raise ValueError("the units of one model were given different meshes: pass the same "
                         "mesh to every fully_shard")
    mesh = next(iter(meshes.values()))
    hsdp = mesh.ndim == 2

    kind, groups, param_groups, frozen, group_src, opts = _optimizer_groups(named, index)

    # The servers take the definition first (a rank whose model differs is named there, before
    # any collective of its values); rank 0 passes zeros of the right sizes (one buffer of the
    # largest parameter's size), and each rank then writes its own rows into its server's
    # masters below, as FSDP2 keeps each rank's shard of its own module.
    init = None
    if client.rank == 0:
        most = max(p.numel() for _, p in named)
        zeros = torch.zeros(most, dtype=torch.float32)
        init = [zeros[:p.numel()] for _, p in named]
    on_device = staged_on is not None and not offload
    step = client.define_model(
        [n for n, _ in named], [tuple(p.shape) for _, p in named], init=init, optimizer=kind,
        groups=groups, param_groups=param_groups, param_dtype=DTYPE_NAMES[param_dtype],
        reduce_dtype=DTYPE_NAMES[reduce_dtype], layout=_layout(), reshard_after_forward=True,
        max_gathers_in_flight=2, replicate=mesh.shape[0] if hsdp else 0,
        shard=mesh.shape[1] if hsdp else 0,
        # A staged model without CPU offload computes on the GPU whose memory holds the shards:
        # its full buffers go there too (the servers keep them in shared memory otherwise),
        # as blocks of a pool that a reshard gives back, not a fixed buffer per parameter.
        device_region=on_device, stable_param_buffers=not on_device,
        pool_bytes=_device_pool_bytes(units, named, param_dtype, reduce_dtype, frozen,
                                      root_unit) if on_device else 0)
    del init
    # A lost trainer's replacement (steps aborted so far): the servers hold the job's state, and
    # the other ranks are mid-training, running no collective of an initialisation.
    taken_over = client.resume_step > step
    if taken_over:
        _refuse_lost_buffers(root)

    # Buffers (BatchNorm statistics, ...) start equal everywhere: rank 0's.
    if client.world_size > 1 and not taken_over:
        for _, b in root.named_buffers():
            if b.device.type == "cpu":
                dist.broadcast(b.data, 0)
            else:  # backend pshard moves host tensors
                t = b.data.cpu()
                dist.broadcast(t, 0)
                b.data.copy_(t)

    model = Model(root_unit, client)
    model.step = step
    model.param_dtype, model.reduce_dtype = param_dtype, reduce_dtype
    model.round_grads = round_grads
    model.mean_over = mesh.size()  # the ranks the servers average a gradient over
    model.units = units
    model.names = [n for n, _ in named]
    model.frozen = frozen
    model.optimizers = list(opts)
    model.group_src = group_src
    model.mesh = mesh
    model.staged_on = staged_on
    model.shards_on = _check_memory(client, device, offload)
    _check_region(client, device, model.shards_on)
    shard_dim = 1 if hsdp else 0
    shard_rank, shard_size = mesh.get_local_rank(shard_dim), mesh.shape[shard_dim]
    for i, (name, p) in enumerate(named):
        fp = FSDPParam(i, name, p, slots[i], mesh, p.placements, shard_rank, shard_size)
        master, grad, _offset, _numel = client.shard_view(i)
        full = None if staged_on is not None else torch.from_dlpack(client.param_buffer(i))
        own = p.to_local().detach()
        fp.bind(full, torch.from_dlpack(master),
                torch.from_dlpack(grad) if grad is not None else None, staged_on=staged_on,
                gathered=(lambda i=i: torch.from_dlpack(client.param(i))), dtype=param_dtype)
        if step == 0 and not taken_over:  # a fresh model: this rank's rows (after --resume or
            # a take-over: the servers')
            with torch.no_grad():
                fp.sharded.to_local().copy_(own)
                if hsdp:  # every replica starts from replica 0's values
                    dist.broadcast(fp.sharded.to_local(), group=mesh.get_group(0),
                                   group_src=0)
        p._pshard_id = i
        p._pshard_model_ref = weakref.ref(model)
        model.fsdp_params.append(fp)
    for u in units:
        u.model = model
        u.params = [model.fsdp_params[i] for i in u.ids]
        u.grad_ids = [i for i in u.ids if not frozen[i]]
    if taken_over:
        _take_over_kept_state(model, client, step)
    for o in opts:
        o._pshard_model = model
    _check_uncovered(model, opts)
    for o in opts:  # a state loaded before the definition (DCP's load) goes to the servers
        o._pshard_apply_pending()
        o._pshard_bind_state()
    return model


def _check_uncovered(model, opts):
    """With pshard optimizers, a trainable parameter none of them holds would never train:
    say so (a torch.optim optimizer may hold it instead, stepping in the trainer)."""
    if not opts:
        return
    held = {id(p) for o in opts for g in o.param_groups for p in g["params"]}
    missing = [fp.name for fp in model.fsdp_params
               if fp.sharded.requires_grad and id(fp.sharded) not in held]
    if missing:
        warnings.warn(f"no pshard.torch.optim optimizer holds {missing[:3]}"
                      f"{' ...' if len(missing) > 3 else ''}: the shard servers will not step "
                      "them (a torch.optim optimizer in the trainer may)", stacklevel=4)


def _refuse_lost_buffers(root):
    """A replacement cannot get back buffers that training changed in the lost trainer only
    (BatchNorm's running statistics: no shard server holds them): refused, rather than going
    on with this rank's statistics silently back at their initial values."""
    norm = torch.nn.modules.batchnorm._NormBase
    lost = [n for n, m in root.named_modules()
            if isinstance(m, norm) and m.track_running_stats and m.running_mean is not None]
    if lost:
        names = ", ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
        raise pshard.FailedPreconditionError(
            f"this trainer replaces a lost one, but the model's running statistics ({names}: "
            "BatchNorm buffers that training updates in the trainer) were only in the lost "
            "trainer and cannot be recovered; restart the whole job from a checkpoint instead "
            "(pshardrun --replace-timeout-ms 0), or use a normalization without running "
            "statistics (LayerNorm, GroupNorm, or track_running_stats=False)")
