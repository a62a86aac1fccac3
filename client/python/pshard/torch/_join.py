"""pshard.torch.Join: torch.distributed.algorithms.Join for a model sharded on pshard.

torch's Join keeps the ranks that ran out of input answering their peers' collectives by
running each Joinable's main hook in lockstep with them. With pshard the shard servers do that
themselves: a joined rank's server takes part in every gather, reduce-scatter, step and
collective the others run (its real slice for gathers, zeros for gradients, averages over the
contributing ranks). So on leaving the ``with`` block a rank calls pshard's join, which returns
once every rank has joined, and then runs each hook's post_hook(is_last_joiner).

Main hooks are not called: what torch's main hooks do (answer the others' collectives with
zeros or this rank's shard) is what the servers do. A Joinable whose hook overrides main_hook
is refused when the Join is made, since pshard cannot run it in lockstep with the others.

With throw_on_early_termination=True, as torch's Join: the ranks still training raise
pshard.JoinedError at their next operation (naming the rank that ran out of input), and the
ranks that ran out of input raise JoinedError("Rank R exhausted all inputs.") when they leave
the block (a RuntimeError, as torch's), so every rank ends in the same except branch; no post
hooks run then. With even inputs (no rank's operation was refused) nobody raises.
"""
import torch
from torch.distributed.algorithms.join import JoinHook as _TorchJoinHook

import pshard
from ._fsdp_param_group import unit_of


class JoinHook(_TorchJoinHook):
    """torch's JoinHook: main_hook() (not called by pshard: the servers shadow the joined
    rank) and post_hook(is_last_joiner), run once every rank has joined."""

    def main_hook(self):
        pass

    def post_hook(self, is_last_joiner):
        pass


class Joinable:
    """What Join takes: objects with join_hook(**kwargs) -> JoinHook (and, for torch's sake,
    join_device and join_process_group). fully_shard modules and pshard optimizers are
    Joinables."""

    def join_hook(self, **kwargs):
        raise NotImplementedError

    @property
    def join_device(self):
        raise NotImplementedError

    @property
    def join_process_group(self):
        raise NotImplementedError


class NoopJoinHook(JoinHook):
    pass


class ModelJoinHook(JoinHook):
    def __init__(self, module):
        self.module = module


class Join:
    """Context manager for uneven inputs (torch.distributed.algorithms.Join's signature).

    Every rank may leave the block after a different number of iterations without hanging.
    With throw_on_early_termination=True, the first rank to leave makes every other rank's
    next pshard operation raise pshard.JoinedError naming it; that error passes through this
    context manager after the rank has joined too, so all of them stop at once. With
    enable=False the block runs as it is and uneven inputs hang as with plain FSDP.
    """

    def __init__(self, joinables, enable=True, throw_on_early_termination=False, **kwargs):
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        for j in joinables:
            if not hasattr(j, "join_hook"):
                raise TypeError(f"{type(j).__name__} is not Joinable (it has no join_hook)")
        self._joinables = list(joinables)
        self._hooks = [j.join_hook(**kwargs) for j in self._joinables]
        for j, h in zip(self._joinables, self._hooks):
            main = getattr(type(h), "main_hook", None)
            if main not in (None, JoinHook.main_hook, _TorchJoinHook.main_hook):
                raise NotImplementedError(
                    f"{type(j).__name__}'s join hook ({type(h).__name__}) has a main_hook: "
                    "pshard.torch.Join does not run main hooks, because the shard servers "
                    "answer the other ranks' collectives for a joined rank themselves (zeros "
                    "to sums, its shard to gathers). Drop the main_hook if it only shadows "
                    "collectives (post_hook runs as in torch); anything else it does cannot "
                    "run in lockstep with the others under pshard")
        self._enable = bool(enable)
        self._throw = bool(throw_on_early_termination)
        self.result = None  # pshard's join result: is_last_joiner, last_rank, step, ...

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self._enable:
            return False
        if exc_type is not None and not issubclass(exc_type, pshard.JoinedError):
            return False
        client = pshard._get_client()
        for j in self._joinables:
            unit = unit_of(j) if isinstance(j, torch.nn.Module) else None
            if unit is None:
                continue
            if unit.model is None:
                # A rank that had no input at all still defines the model with the others.
                j._pshard_model()
            else:
                unit.model.reset_after_error()
        self.result = client.join(enable=True, throw_on_early_termination=self._throw)
        if self._throw and exc_type is not None:
            return False  # the JoinedError goes on; torch runs no post hooks when it throws
        if self._throw and self.result["others_raised"]:
            raise pshard.JoinedError(f"Rank {client.rank} exhausted all inputs.")
        for h in self._hooks:
            h.post_hook(self.result["is_last_joiner"])
        return False

    @staticmethod
    def notify_join_context(joinable):
        """torch calls this at the start of each iteration's collectives; pshard's servers track
        who has joined, so there is nothing to do. Returns None."""
        return None
