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
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank", "group",
    "ProcessGroup", "GroupMember",
    "get_world_size", "Error", "PeerLostError", "DesyncError", "JoinedError", "TimeoutError",
    "AbortedError", "InvalidArgumentError", "NotFoundError", "OutOfMemoryError",
    "FailedPreconditionError", "UnavailableError",
]

_client = None


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    """Connects this trainer to its shard server, like torch.distributed.init_process_group.

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
    NCCL's). ``backend`` is accepted for torch compatibility: the shard servers' own backend
    (tcp or nccl) is chosen when they start. Raises pshard.Error subclasses, or ValueError for
    arguments pshard does not support.
    """
    global _client
    if _client is not None:
        raise FailedPreconditionError(
            "init_process_group was already called; call destroy_process_group first")
    if init_method is not None and not isinstance(init_method, str):
        raise TypeError("init_method must be a string such as 'env://', 'tcp://HOST:PORT' or "
                        "'file:///PATH'")
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
    server = coordinator = None
    connect_ms = timeout_ms or 300000
    if init_method in (None, "env://"):
        server = _os.environ.get("PSHARD_SERVER") or None
        coordinator = None if server else (_os.environ.get("PSHARD_COORDINATOR") or None)
        if not server and not coordinator:
            raise InvalidArgumentError(
                "PSHARD_SERVER is not set: launch the trainer with "
                "'pshardrun --nproc N -- python train.py', which starts the shard servers and "
                "sets it (or set it to this trainer's shard server, HOST:PORT, or "
                "PSHARD_COORDINATOR, or use init_method='tcp://HOST:PORT')")
    elif init_method.startswith("tcp://"):
        coordinator = _host_port(init_method[len("tcp://"):], init_method)
    elif init_method.startswith("file://"):
        coordinator = _wait_rendezvous_file(init_method[len("file://"):], connect_ms)
    else:
        raise ValueError(f"init_method {init_method!r} is not supported; use 'env://', "
                         "'tcp://HOST:PORT' (the coordinator) or 'file:///PATH' (a rendezvous "
                         "file)")
    if coordinator and init_method not in (None, "env://"):
        rank = int(rank) if rank is not None and int(rank) >= 0 else _env_int("RANK")
        world_size = (int(world_size) if world_size is not None and int(world_size) > 0
                      else _env_int("WORLD_SIZE"))
        if rank is None or world_size is None:
            raise ValueError(f"init_method {init_method!r} needs rank and world_size (the "
                             "arguments, or RANK and WORLD_SIZE), as torch does")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size {world_size})")
    _client = _C.Client(server=server, coordinator=coordinator, rank=int(rank),
                        world_size=int(world_size), timeout_ms=timeout_ms,
                        connect_timeout_ms=connect_ms,
                        job=_os.environ.get("PSHARD_JOB") or None)


def _env_int(name):
    v = _os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


def _host_port(text, what):
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in text:
        raise ValueError(f"init_method {what!r}: expected tcp://HOST:PORT")
    return text


def _wait_rendezvous_file(path, timeout_ms):
    """The coordinator's address from a rendezvous file, polled until it is written."""
    import time
    if not path.startswith("/"):
        raise ValueError(f"init_method file://{path}: expected file:///ABSOLUTE/PATH")
    give_up = time.monotonic() + timeout_ms / 1000
    while True:
        addr = _C.rendezvous_file_read(path)
        if addr:
            return addr
        if time.monotonic() > give_up:
            raise TimeoutError(f"rendezvous file {path} stayed absent or empty for "
                               f"{timeout_ms} ms: start the coordinator with --rdzv-file {path}")
        time.sleep(0.05)


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
    """This trainer's rank in group (default: the world, 0..world_size-1); -1 when it is not in
    the group (torch's GroupMember.NON_GROUP_MEMBER, or a group made without it)."""
    if _is_non_member(group):
        return -1
    return _resolve_group(group).rank()


def get_world_size(group=None):
    """The number of ranks of group (default: every trainer, one per shard server); -1 for
    GroupMember.NON_GROUP_MEMBER."""
    if _is_non_member(group):
        return -1
    return _resolve_group(group).size()


def destroy_process_group(group=None):
    """Leaves the cluster (group None or group.WORLD); the model defined through this process
    group cannot be used afterwards, nor can the groups made with new_group. A no-op when not
    initialized. A group made with new_group is only forgotten here (its collectives then fail);
    the shard servers keep it until the trainer leaves."""
    global _client
    if _is_non_member(group):
        return
    if group is not None and group is not _WORLD:
        _resolve_group(group)._handle = None
        return
    c, _client = _client, None
    if c is not None:
        c.close()


class ProcessGroup:
    """A process group, as torch.distributed's: the default one (every rank, group.WORLD), or
    one that new_group made (pshard.distributed.new_group). rank() is this trainer's rank in it
    (-1 when it is not a member), size() its number of ranks."""

    def __init__(self, _ranks=None, _handle=None, _desc=None):
        # None: the world, whose ranks are every trainer's; else the group's world ranks in
        # group-rank order and its pshard._C.Group
        self._ranks = None if _ranks is None else tuple(_ranks)
        self._handle = _handle
        self._desc = _desc

    def rank(self):
        me = _get_client().rank
        if self._ranks is None:
            return me
        return self._ranks.index(me) if me in self._ranks else -1

    def size(self):
        if self._ranks is None:
            return _get_client().world_size
        return len(self._ranks)

    def _world_ranks(self):
        """The world ranks of the group, in group-rank order."""
        return list(range(_get_client().world_size)) if self._ranks is None else list(self._ranks)

    def __repr__(self):
        if self._ranks is None:
            return "pshard.ProcessGroup(WORLD)"
        desc = f", desc={self._desc!r}" if self._desc else ""
        return f"pshard.ProcessGroup(ranks={list(self._ranks)}{desc})"


class group:  # noqa: N801 (torch.distributed.group's name)
    WORLD = ProcessGroup()


class GroupMember:
    """torch.distributed.GroupMember: WORLD (the default group) and NON_GROUP_MEMBER, what
    new_group returns to the ranks that are not in the group (torch's value, -100)."""
    WORLD = group.WORLD
    NON_GROUP_MEMBER = -100


_WORLD = group.WORLD


def _is_non_member(group_):
    return (isinstance(group_, int) and not isinstance(group_, bool) and
            group_ == GroupMember.NON_GROUP_MEMBER)


def _resolve_group(group_):
    """The ProcessGroup that group_ (None: the world) names; ValueError for anything else."""
    if group_ is None:
        return _WORLD
    if not isinstance(group_, ProcessGroup):
        raise ValueError(f"group must be a process group (group.WORLD, or one new_group made) or "
                         f"None, not {group_!r}")
    if group_._ranks is not None and group_._handle is None:
        raise FailedPreconditionError(f"{group_!r} was destroyed (destroy_process_group)")
    return group_
