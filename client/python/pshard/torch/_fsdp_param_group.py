"""One fully_shard unit (FSDP2's FSDPParamGroup): the parameters gathered together, its
gather/reshard on the shard servers, and the registry of units by module."""
import weakref

__all__ = ["Unit", "unit_of", "register_unit", "require_unit"]


class Unit:
    """One fully_shard call: a module (or several, fully_shard([a, b])) whose parameters are
    gathered together. ids are the pshard ids it gathers (its own parameters, and shared ones
    whose users' nearest common unit it is), params their FSDPParams."""

    def __init__(self, modules, reshard_after_forward, mp_policy, mesh):
        self.module_refs = [weakref.ref(m) for m in modules]
        self.reshard_after_forward = reshard_after_forward  # None: True except for the root
        self.reshard_after_backward = True
        self.mp = mp_policy
        self.offload = None        # torch's OffloadPolicy given to fully_shard
        self.mesh = mesh           # torch DeviceMesh
        self.model = None          # the _Model once the root initialised
        self.parent = None         # the nearest enclosing unit
        self.ids = []              # pshard parameter ids this unit gathers
        self.params = []           # their FSDPParams
        self.grad_ids = []         # those whose gradients are reduce-scattered
        self.gather_work = None    # an issued asynchronous gather
        self.requires_grad_sync = True
        self.requires_all_reduce = True  # HSDP: False defers the reduction (see FSDPModule)
        self.divide_factor = None  # set_gradient_divide_factor: the sum is divided by it
        self.fwd_prefetch = None   # explicit set_modules_to_forward_prefetch, or None
        self.bwd_prefetch = None
        self.ready = 0             # gradients accumulated in this backward
        self.in_backward = False   # pre-backward ran, post-backward not yet
        self.unsharded = False     # the modules hold the unsharded parameters
        self.ignored = set()       # ids of ignored_params: neither sharded nor reduced
        self.fwd_active = False    # pre-forward ran in this forward, post-forward not yet
        self.fwd_done = 0          # modules of the unit whose forward ended in this forward

    @property
    def modules(self):
        return [m for m in (r() for r in self.module_refs) if m is not None]

    @property
    def module(self):
        return self.module_refs[0]()

    def reshards_after_forward(self):
        if self.reshard_after_forward is None:
            return self is not self.model.root
        return self.reshard_after_forward

    # ---- gathering ---------------------------------------------------------------------
    def wait_gather(self):
        w, self.gather_work = self.gather_work, None
        if w is not None:
            w.wait()

    def unshard(self):
        """Gathers the unit (a no-op for what is gathered already) and registers the unsharded
        parameters on the modules."""
        self.wait_gather()
        self.model.sync_device()
        self.model.client.gather(self.ids)
        for fp in self.params:
            fp.fill()
        if not self.unsharded:
            for fp in self.params:
                fp.to_unsharded()
            self.unsharded = True

    def unshard_async(self):
        if self.gather_work is None and self.ids:
            self.model.sync_device()
            self.gather_work = self.model.client.gather_start(self.ids)

    def reshard(self):
        """Registers the sharded parameters again and frees the full buffers."""
        self.wait_gather()
        if self.unsharded:
            for fp in self.params:
                fp.to_sharded()
            self.unsharded = False
        for fp in self.params:
            fp.free()
        self.model.client.reshard(self.ids)

    def to_sharded(self):
        """The sharded parameters on the modules, without touching the servers (after a step,
        which resharded everything on the client)."""
        if self.unsharded:
            for fp in self.params:
                fp.to_sharded()
            self.unsharded = False
        for fp in self.params:
            fp.free()


# Units by module, without keeping either alive.
_UNITS = weakref.WeakKeyDictionary()


def unit_of(module):
    """The unit fully_shard made of module, or None."""
    return _UNITS.get(module)


def register_unit(module, unit):
    _UNITS[module] = unit


def require_unit(module):
    u = unit_of(module)
    if u is None:
        raise ValueError(f"{type(module).__name__} was not passed to fully_shard")
    return u
