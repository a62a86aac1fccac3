"""Optimizers that run on the shard servers: torch.optim.Optimizer subclasses with torch's
signatures and defaults. Each shard server updates its slice of every parameter with its fp32
master weights and optimizer state; ``step()`` waits for the gradients' reduce-scatters and
sends every param_group's hyperparameters (read at every step, so torch.optim.lr_scheduler
schedulers work unchanged). Create the optimizer after fully_shard and before the model's
first forward, which defines the model to the servers. The state lives on the servers, not in
``optimizer.state`` (pshard.torch.save_checkpoint saves it; ``state_dict()`` raises, saying
so). Any torch.optim optimizer may step the same sharded parameters in the trainer instead.
Options pshard cannot honour (amsgrad, maximize, capturable, differentiable, fused) raise
ValueError.
"""
import weakref

import torch

import pshard
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
        super().__init__(params, defaults)
        # The state lives on the servers. An entry here tells torch's DCP helpers
        # (get_optimizer_state_dict) it exists, so they do not run a "zero-lr" step to make
        # one, which would advance the servers' Adam step count; state_dict() then says
        # where it is.
        self.state["pshard"] = "the optimizer state is on the shard servers"
        _ALL.add(self)

    def state_dict(self):
        raise NotImplementedError(
            f"pshard.torch.optim.{type(self).__name__} keeps its state on the shard servers, "
            "not in the trainer: checkpoint it with pshard.torch.save_checkpoint(model) (or "
            "pshardrun --checkpoint-dir), which loads on any world size; for "
            "torch.distributed.checkpoint use a torch.optim optimizer, which steps the same "
            "sharded parameters in the trainer")

    def load_state_dict(self, state_dict):
        raise NotImplementedError(
            f"pshard.torch.optim.{type(self).__name__} keeps its state on the shard servers: "
            "resume it with pshardrun --resume DIR (a pshard checkpoint)")

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
