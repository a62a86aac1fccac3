"""Optimizers that run on the shard servers: torch.optim.Optimizer subclasses with torch's
signatures and defaults. Each shard server updates its slice of every parameter with its fp32
master weights and optimizer state; ``step()`` waits for the gradients' reduce-scatters and
sends every param_group's hyperparameters (read at every step, so torch.optim.lr_scheduler
schedulers work unchanged). Create the optimizer after fully_shard and before the model's
first forward, which defines the model to the servers. The state lives in the servers' memory,
not in the trainer: ``state_dict()`` gives it as torch's optimizers name it (Adam's ``step``,
``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``), each tensor a DTensor shaped and
placed like its parameter whose local tensor views the server's memory (so torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict`` and ``torch.distributed.checkpoint``
work, and a checkpoint loads into torch's own optimizer and back); ``load_state_dict`` writes
it there (before the first forward it is kept until the model is defined). Any torch.optim
optimizer may step the same sharded parameters in the trainer instead. Options pshard cannot
honour (amsgrad, maximize, capturable, differentiable, fused) raise ValueError.
"""
import weakref

import torch
from torch.distributed.tensor import DTensor

import pshard
from ._fsdp_param import local_dtensor
from ._join import NoopJoinHook

__all__ = ["SGD", "Adam", "AdamW"]

_ALL = weakref.WeakSet()


def _optimizers_of(params):
    """The pshard optimizers holding any of params (a model's); each must hold only them."""
    ids = {id(p) for p in params}
    found = []
    for o in list(_ALL):
        held = [p for g in o.param_groups for p in g["params"]]
        if any(id(p) in ids for p in held):
            foreign = [p for p in held if id(p) not in ids]
            if foreign:
                raise ValueError("a pshard optimizer holds parameters of two models (or ones "
                                 "outside the fully_shard root)")
            found.append(o)
    if len(found) > 1:
        raise ValueError("one pshard optimizer per model: put every parameter group in one")
    return found


def _unsupported(group, names):
    for name, bad in names:
        if name in group and group[name] not in bad:
            raise ValueError(f"{name}={group[name]!r} is not supported by pshard's shard-server "
                             "optimizers")


class _Optimizer(torch.optim.Optimizer):
    _pshard_kind = "sgd"
    _pshard_server_side = True  # stepped on the servers (the trainer-step hooks skip it)
    _refused = (("maximize", (False,)), ("capturable", (False,)),
                ("differentiable", (False,)), ("fused", (None, False)))

    def __init__(self, params, defaults):
        self._pshard_model = None
        self._pshard_pending = None  # a state loaded before the model was defined
        super().__init__(params, defaults)
        # The state lives on the servers. Until the model is defined, an entry here tells
        # torch's DCP helpers (get_optimizer_state_dict) it exists, so they do not run a
        # "zero-lr" step to make one (a step before the first forward); then the entries are
        # the servers' state itself (_pshard_bind_state).
        self.state["pshard"] = "the optimizer state is on the shard servers: see state_dict()"
        _ALL.add(self)

    # The state's names, torch.optim's: the server's state arrays in order (state0, state1).
    _state_names = ()

    def _pshard_state_names(self, group):
        return self._state_names

    def _pshard_params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _pshard_local_shape(self, p):
        local = p.to_local() if isinstance(p, DTensor) else p
        return tuple(local.shape)

    def _pshard_as_dtensor(self, p, local):
        if not isinstance(p, DTensor):
            return local
        return local_dtensor(local, p.device_mesh, p.placements, p.shape, p.stride())

    def _pshard_views(self, p):
        """The server's state arrays of p's shard (local tensors shaped like p's) and its own
        step count (a 1-element int64 tensor), or None before the model is defined."""
        model = self._pshard_model
        if model is None:
            return None
        s0, s1, step = model.client.shard_state(p._pshard_id)
        shape = self._pshard_local_shape(p)
        return ([torch.from_dlpack(v).view(shape) if v is not None else None for v in (s0, s1)],
                torch.from_dlpack(step))

    def state_dict(self):
        """torch.optim's state dict of the servers' state (see the module's doc): per trained
        parameter its DTensors (views of the servers' memory once the model is defined; before
        that zeros, or what load_state_dict was given, for torch.distributed.checkpoint.load
        to fill in) and, for Adam, ``step`` as torch keeps it (a float32 scalar tensor)."""
        index, groups, state = {}, [], {}
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(d)
        pend_states, pend_steps = (self._pshard_pending or ({}, None, {}))[0::2]
        for g in self.param_groups:
            names = self._pshard_state_names(g)
            for p in g["params"]:
                if not p.requires_grad or not names:
                    continue
                got = self._pshard_views(p)
                if got is None:
                    shape = self._pshard_local_shape(p)
                    views = pend_states.get(id(p)) or [torch.zeros(shape) for _ in names]
                    step = pend_steps.get(id(p), 0)
                else:
                    views, step = got[0], int(got[1].item())
                st = {n: self._pshard_as_dtensor(p, v) for n, v in zip(names, views)}
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
                state[index[id(p)]] = st
        return {"state": state, "param_groups": groups}

    def _pshard_local(self, p, name, v):
        """This rank's rows of a loaded state tensor v of parameter p (a DTensor like p, or a
        full plain tensor), fp32; ValueError naming what does not fit."""
        shape = self._pshard_local_shape(p)
        if isinstance(v, DTensor):
            if tuple(v.shape) != tuple(p.shape) or v.placements != p.placements:
                raise ValueError(f"optimizer state '{name}' is a DTensor of shape "
                                 f"{tuple(v.shape)} placed {v.placements}; its parameter is "
                                 f"{tuple(p.shape)} placed {p.placements}")
            v = v.to_local()
        elif isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and \
                isinstance(p, DTensor):
            from ._fsdp_param import shard_rows
            dim = p.placements[-1].dim
            mesh_dim = p.device_mesh.ndim - 1
            lo, rows = shard_rows(p.shape[dim], p.device_mesh.get_local_rank(mesh_dim),
                                  p.device_mesh.size(mesh_dim))
            v = v.narrow(dim, lo, rows)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
            raise ValueError(f"optimizer state '{name}' of shape "
                             f"{tuple(getattr(v, 'shape', ()))} does not fit this rank's "
                             f"shard of its parameter, {shape}")
        return v.detach().to(torch.float32)

    def load_state_dict(self, state_dict):
        """Loads torch.optim's state dict format (this optimizer's own, or torch's optimizer of
        the same kind: keys by index or, from torch.distributed.checkpoint's helpers, by
        parameter name, matched by position as torch does) into the servers' memory, and
        sets the servers' step count to its ``step``; before the model's first forward it is
        kept until the model is defined. The parameter groups' hyperparameters are replaced
        by the saved ones, as torch does."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the loaded state dict has {len(saved)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for g, sg in zip(self.param_groups, saved):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("the loaded state dict has a parameter group of "
                                 f"{len(sg['params'])} parameters where this optimizer's has "
                                 f"{len(g['params'])}")
        new_groups = []
        for g, sg in zip(self.param_groups, saved):
            ng = {k: v for k, v in sg.items() if k != "params"}
            ng["params"] = g["params"]
            _unsupported(ng, self._refused)
            self._pshard_group_dict(ng)  # validates the values
            new_groups.append(ng)
        keys = {}
        for g, sg in zip(self.param_groups, saved):
            for p, k in zip(g["params"], sg["params"]):
                keys[k] = p
        locals_, steps = {}, {}
        for k, st in state_dict.get("state", {}).items():
            p = keys.get(k)
            if p is None:
                raise ValueError(f"the loaded state dict has state for parameter {k!r}, which "
                                 "is in none of its parameter groups")
            g = next(g for g in new_groups if any(q is p for q in g["params"]))
            names = self._pshard_state_names(g)
            if not p.requires_grad or not names:
                continue
            missing = [n for n in names if n not in st]
            if missing:
                raise ValueError(f"the loaded state of parameter {k!r} lacks {missing} (it has "
                                 f"{sorted(st)}): it is not {type(self).__name__}'s")
            locals_[id(p)] = [self._pshard_local(p, n, st[n]) for n in names]
            if "step" in st:
                s = st["step"]
                s = float(s.item() if isinstance(s, torch.Tensor) else s)
                if not (s >= 0 and s == int(s)):
                    raise ValueError(f"the loaded state of parameter {k!r} has step {s}: not a "
                                     "count of steps")
                steps[id(p)] = int(s)
            else:
                # torch's SGD keeps no count: a loaded momentum buffer is used from the next
                # step on, which the servers do once the parameter's count is past 0.
                steps[id(p)] = 1
        # The servers' count (checkpoints, Adam's bias correction of a parameter stepped every
        # time) is the furthest parameter's; each parameter keeps its own, as torch's do.
        step = max(steps.values()) if steps else None
        if step is not None and not any("step" in st for st in state_dict.get("state",
                                                                                {}).values()):
            step = max(step, self._pshard_model.step if self._pshard_model else 0)
        for g, ng in zip(self.param_groups, new_groups):
            # In place: the model keeps these dicts (it reads them at every step).
            params = g["params"]
            g.clear()
            g.update(ng)
            g["params"] = params
        self._pshard_pending = (locals_, step, steps)
        if self._pshard_model is not None:
            self._pshard_apply_pending()

    def _pshard_bind_state(self):
        """optimizer.state as torch.optim keeps it, over the servers' memory (the model is
        defined): per trained parameter its state DTensors (live views: always current) and
        "step", a 0-dim int64 view of the parameter's own count."""
        state = {}
        for g in self.param_groups:
            names = self._pshard_state_names(g)
            for p in g["params"]:
                if not p.requires_grad or not names:
                    continue
                views, count = self._pshard_views(p)
                st = {n: self._pshard_as_dtensor(p, v) for n, v in zip(names, views)
                      if v is not None}
                st["step"] = count.view(())
                state[p] = st
        if state:  # (else the marker stays: SGD without momentum keeps no state)
            self.state.clear()
            self.state.update(state)

    def _pshard_apply_pending(self):
        """Writes a loaded state into the servers' memory (the model is defined). A trained
        parameter the state has nothing for starts afresh, as in torch (no state, count 0)."""
        if not self._pshard_pending:
            return
        locals_, step, steps = self._pshard_pending
        self._pshard_pending = None
        model = self._pshard_model
        model.wait_reductions()
        if step is not None and step != model.step:
            model.sync_device()
            model.client.set_step(step)  # (every parameter's count too)
            model.step = step
        with torch.no_grad():
            for g in self.param_groups:
                if not self._pshard_state_names(g):
                    continue
                for p in g["params"]:
                    if not p.requires_grad:
                        continue
                    views, count = self._pshard_views(p)
                    vals = locals_.get(id(p))
                    for j, view in enumerate(views):
                        if view is None:
                            if vals is not None and j < len(vals):
                                raise ValueError("the shard servers keep no such optimizer "
                                                 "state for this model (SGD without "
                                                 "momentum?)")
                            continue
                        if vals is None:
                            view.zero_()
                        elif view.data_ptr() != vals[j].data_ptr():
                            view.copy_(vals[j])
                    count.fill_(steps.get(id(p), 0))

    def add_param_group(self, param_group):
        if getattr(self, "_pshard_model", None) is not None:
            raise pshard.FailedPreconditionError(
                "the model is already defined to the shard servers: add parameter groups "
                "before its first forward")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        for p in g["params"]:
            if hasattr(p, "_pshard_id"):
                raise pshard.FailedPreconditionError(
                    "create pshard optimizers before the model's first forward (it defines "
                    "the model, with its parameter groups, to the shard servers)")
        _unsupported(g, self._refused)
        self._pshard_group_dict(g)  # validates its values

    @staticmethod
    def _lr(g):
        lr = g["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        lr = float(lr)
        if not lr >= 0:
            raise ValueError(f"invalid learning rate: {lr}")
        return lr

    @torch.no_grad()
    def step(self, closure=None):
        """Runs the optimizer on every shard (after the pending reduce-scatters) and returns
        the closure's loss, if one was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        model = self._pshard_model
        if model is None:
            raise pshard.FailedPreconditionError(
                "step() before the model's first forward and backward")
        model.optimizer_step(self)
        return loss

    def join_hook(self, **kwargs):
        return NoopJoinHook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return None


class SGD(_Optimizer):
    """torch.optim.SGD on the shard servers (momentum, dampening, nesterov, weight_decay)."""
    _pshard_kind = "sgd"

    def _pshard_state_names(self, group):
        return ("momentum_buffer",) if float(group["momentum"]) != 0 else ()

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False, foreach=None, differentiable=False, fused=None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)

    def _pshard_group_dict(self, g):
        d = dict(lr=self._lr(g), momentum=float(g["momentum"]), dampening=float(g["dampening"]),
                 weight_decay=float(g["weight_decay"]), nesterov=bool(g["nesterov"]))
        if d["momentum"] < 0 or d["weight_decay"] < 0:
            raise ValueError(f"invalid momentum or weight_decay: {d}")
        if d["nesterov"] and (d["momentum"] <= 0 or d["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return d


class Adam(_Optimizer):
    """torch.optim.Adam on the shard servers (L2 weight decay; decoupled_weight_decay=True is
    AdamW)."""
    _pshard_kind = "adam"
    _refused = _Optimizer._refused + (("amsgrad", (False,)),)
    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False):
        if decoupled_weight_decay:
            self._pshard_kind = "adamw"
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        foreach=foreach, maximize=maximize, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    def _pshard_group_dict(self, g):
        b1, b2 = (float(b.item() if isinstance(b, torch.Tensor) else b) for b in g["betas"])
        d = dict(lr=self._lr(g), betas=(b1, b2), eps=float(g["eps"]),
                 weight_decay=float(g["weight_decay"]))
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"invalid betas: {(b1, b2)}")
        if d["eps"] < 0 or d["weight_decay"] < 0:
            raise ValueError(f"invalid eps or weight_decay: {d}")
        return d


class AdamW(Adam):
    """torch.optim.AdamW on the shard servers (decoupled weight decay, default 1e-2)."""
    _pshard_kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)
