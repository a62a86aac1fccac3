"""pshard: FSDP-style fully sharded data parallel training on pshard's shard servers.

The process-group functions follow torch.distributed's names; a trainer launched by
``pshardrun --nproc N -- python train.py`` finds everything it needs in the environment
(``RANK``, ``WORLD_SIZE``, ``PSHARD_SERVER``, ...). ``pshard.torch`` (FSDP2's ``fully_shard``,
optimizers, Join, state dicts) and ``pshard.distributed`` (collectives on tensors) need torch;
this module does not.
"""
import datetime as _dt
import os as _os

from ._C import (  # noqa: F401  (re-exported)
    AbortedError,
    DesyncError,
    Error,
    FailedPreconditionError,
    InvalidArgumentError,
    JoinedError,
    NotFoundError,
    OutOfMemoryError,
    PeerLostError,
    TimeoutError,
    UnavailableError,
)
from . import _C

__version__ = "0.1.0"
__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "Error", "PeerLostError", "DesyncError", "JoinedError", "TimeoutError",
    "AbortedError", "InvalidArgumentError", "NotFoundError", "OutOfMemoryError",
    "FailedPreconditionError", "UnavailableError",
]

_client = None


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    """Connects this trainer to its shard server, like torch.distributed.init_process_group.

    ``init_method`` is ``"env://"`` (the default): ``RANK``, ``WORLD_SIZE`` and
    ``PSHARD_SERVER`` (this trainer's shard server, ``HOST:PORT``) come from the environment,
    as ``pshardrun`` sets them; ``rank`` and ``world_size`` override the first two.
    ``timeout`` (a ``datetime.timedelta``) bounds every operation (default 10 minutes, like
    NCCL's). ``backend`` is accepted for torch compatibility: the shard servers' own backend
    (tcp or nccl) is chosen when they start. Raises pshard.Error subclasses, or ValueError for
    arguments pshard does not support.
    """
    global _client
    if _client is not None:
        raise FailedPreconditionError(
            "init_process_group was already called; call destroy_process_group first")
    if init_method not in (None, "env://"):
        raise ValueError(f"init_method {init_method!r} is not supported; use 'env://' under "
                         "pshardrun")
    if store is not None or pg_options is not None:
        raise ValueError("store and pg_options are not supported: the coordinator is the store")
    if backend not in (None, "pshard", "gloo", "nccl", "cpu:gloo", "cuda:nccl",
                       "cpu:gloo,cuda:nccl"):
        raise ValueError(f"unknown backend {backend!r}")
    timeout_ms = 0
    if timeout is not None:
        if not isinstance(timeout, _dt.timedelta):
            raise TypeError("timeout must be a datetime.timedelta")
        timeout_ms = int(timeout.total_seconds() * 1000)
        if timeout_ms <= 0:
            raise ValueError("timeout must be positive")
    server = _os.environ.get("PSHARD_SERVER")
    if not server:
        raise InvalidArgumentError(
            "PSHARD_SERVER is not set: launch the trainer with "
            "'pshardrun --nproc N -- python train.py', which starts the shard servers and sets "
            "it (or set it to this trainer's shard server, HOST:PORT)")
    _client = _C.Client(server=server, rank=int(rank), world_size=int(world_size),
                        timeout_ms=timeout_ms)


def is_initialized():
    """True between init_process_group and destroy_process_group."""
    return _client is not None


def _get_client():
    if _client is None:
        raise FailedPreconditionError(
            "the default process group is not initialized: call "
            "pshard.init_process_group() first")
    return _client


def get_rank(group=None):
    """This trainer's rank, 0..world_size-1."""
    _no_group(group)
    return _get_client().rank


def get_world_size(group=None):
    """The number of trainers (one per shard server)."""
    _no_group(group)
    return _get_client().world_size


def destroy_process_group(group=None):
    """Leaves the cluster; the model defined through this process group cannot be used
    afterwards. A no-op when not initialized."""
    global _client
    _no_group(group)
    c, _client = _client, None
    if c is not None:
        c.close()


def _no_group(group):
    if group is not None:
        raise ValueError("process groups other than the default one are not supported yet")
