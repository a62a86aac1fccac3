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
    StepAbortedError,
    TimeoutError,
    UnavailableError,
)
from . import _C

__version__ = "0.1.0"
__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "Error", "PeerLostError", "DesyncError", "JoinedError", "TimeoutError",
    "AbortedError", "InvalidArgumentError", "NotFoundError", "OutOfMemoryError",
    "FailedPreconditionError", "UnavailableError", "StepAbortedError", "report_step",
]

from ._world import _get_client, current as _current  # noqa: F401  (pshard._get_client)
from . import _world


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    """Connects this trainer to its shard server and, when torch is installed, initializes
    torch.distributed's default process group on backend "pshard" (torch's own
    init_process_group with a Store over the coordinator), so torch.distributed.get_rank(),
    DistributedSampler, init_device_mesh, DTensor, DDP and DCP see the job and run their
    collectives on the shard servers.

    ``init_method`` is ``"env://"`` (the default): ``RANK``, ``WORLD_SIZE`` and
    ``PSHARD_SERVER`` (this trainer's shard server, ``HOST:PORT``; or ``PSHARD_COORDINATOR``,
    which names it) come from the environment, as ``pshardrun`` sets them; ``rank`` and
    ``world_size`` override the first two. ``"tcp://HOST:PORT"`` names the coordinator (torch's
    rank 0 store), and ``"file:///PATH"`` a rendezvous file that a coordinator started with
    ``--rdzv-file PATH`` writes its address into (waited for up to ``timeout``); with either,
    the coordinator names this rank's shard server once the cluster has formed, and ``rank``
    and ``world_size`` are required (arguments or ``RANK`` / ``WORLD_SIZE``), as torch
    requires them.
    ``timeout`` (a ``datetime.timedelta``) bounds every operation (default 10 minutes, like
    NCCL's). ``backend`` may be None or "pshard" (the shard servers' own transport, tcp or
    nccl, is chosen when they start); ``store`` replaces the coordinator's store for torch.
    Raises pshard.Error subclasses, or ValueError for arguments pshard does not support.
    """
    if _current() is not None:
        raise FailedPreconditionError(
            "init_process_group was already called; call destroy_process_group first")
    if backend not in (None, "pshard"):
        raise ValueError(f"backend {backend!r}: pshard.init_process_group initializes backend "
                         "'pshard'; for another backend call torch.distributed's "
                         "init_process_group")
    if pg_options is not None:
        raise ValueError("pg_options are not supported: the shard servers' transport is chosen "
                         "when they start (pshard-server --backend / --transport)")
    c = _world.connect(init_method, rank, world_size, timeout)
    try:
        dist = _torch_distributed()
    except ImportError:
        return  # without torch: pshard's own API only
    from . import _backend, _store
    _backend.register()
    if dist.is_initialized():
        return  # torch's default group exists already (e.g. made by torch with this backend)
    if store is None:
        if not (c.coordinator or _os.environ.get("PSHARD_COORDINATOR")):
            _world.drop()
            raise InvalidArgumentError(
                "no coordinator is known for torch's store: set PSHARD_COORDINATOR (pshardrun "
                "does) or pass store=")
        store = _store.Store(coordinator=c.coordinator or None, job=c.job or None)
    # torch keeps only the C++ side of the store; its calls reach the Python methods while
    # the Python object lives
    _world.keep(store)
    kwargs = {} if timeout is None else {"timeout": timeout}
    try:
        dist.init_process_group(backend=_backend.BACKEND_NAME, store=store, rank=c.rank,
                                world_size=c.world_size, group_name=group_name, **kwargs)
    except BaseException:
        _world.drop()
        raise


def _torch_distributed():
    import torch.distributed as dist
    return dist


def is_initialized():
    """True between init_process_group and destroy_process_group."""
    return _current() is not None


def get_rank(group=None):
    """This trainer's rank: in the world (group None), or, with torch, torch.distributed's
    get_rank(group)."""
    if group is not None:
        return _torch_distributed().get_rank(group)
    return _get_client().rank


def get_world_size(group=None):
    """The number of trainers (one per shard server), or torch.distributed's
    get_world_size(group)."""
    if group is not None:
        return _torch_distributed().get_world_size(group)
    return _get_client().world_size


def report_step(tokens=None, samples=None):
    """Marks the end of a training step on this rank's shard server, with the tokens and samples
    the step processed (None: not counted). The server times each step, splits it into the time
    spent waiting on pshard and the rest (compute), and exposes both in /metrics with the
    counters pshard_step_tokens_total and pshard_step_samples_total; ``pshardctl status`` names
    the slowest rank. Without marks each optimizer step on the servers (or a torch.optim step
    of a ``fully_shard`` model) ends a step; once a trainer reports one, only its reports do.
    Call it once per step, after the optimizer, on every rank. Raises ValueError for a negative
    count, and pshard's errors (e.g. InvalidArgumentError over 2**53)."""
    _get_client().report_step(tokens=int(tokens or 0), samples=int(samples or 0))


def destroy_process_group(group=None):
    """Leaves the cluster: destroys torch's default group on backend "pshard" (and with it every
    group made from it) and closes this trainer's connection. A group of some ranks is
    destroyed as torch's destroy_process_group(group) does. A no-op when not initialized."""
    if group is not None:
        _torch_distributed().destroy_process_group(group)
        return
    if _current() is None:
        return
    try:
        dist = _torch_distributed()
    except ImportError:
        dist = None
    if dist is not None and dist.is_initialized() and dist.get_backend() == "pshard":
        dist.destroy_process_group()
    _world.drop()


# torch present: backend "pshard" is registered at import, so torch's own
# init_process_group(backend="pshard") works without calling pshard's first.
try:
    from . import _backend as _backend_module
    from . import _store as _store_module
except ImportError:  # no torch: pshard's C API only
    _backend_module = _store_module = None
else:
    _backend_module.register()
    _store_module.install_env_rendezvous()
