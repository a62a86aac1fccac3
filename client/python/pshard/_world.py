"""This process's connection to its shard server (a pshard._C.Client): made by
pshard.init_process_group or by backend "pshard" when torch's init_process_group comes first,
closed by destroy_process_group, or at the interpreter's exit (an atexit hook), so that a
trainer that ends cleanly leaves the cluster and its shard server serves the next job. Needs no
torch."""
import atexit
import datetime as _dt
import os as _os
import time

from . import _C
from ._C import FailedPreconditionError, InvalidArgumentError, TimeoutError

_client = None
_hooked = False  # drop() is registered with atexit
# Python objects torch holds only through their C++ side (the default group's store, the
# backends): kept alive until the client is dropped
_kept = []


def keep(obj):
    """Keeps obj alive until drop()."""
    _kept.append(obj)


def current():
    """The connected client, or None."""
    return _client


def _get_client():
    if _client is None:
        raise FailedPreconditionError(
            "the default process group is not initialized: call "
            "pshard.init_process_group() first")
    return _client


def connect(init_method=None, rank=-1, world_size=-1, timeout=None):
    """Connects this process's client and returns it: what pshard.init_process_group does
    before torch's part, and what backend "pshard" does when torch's init_process_group comes
    first. FailedPreconditionError when one is connected already."""
    global _client
    if _client is not None:
        raise FailedPreconditionError(
            "init_process_group was already called; call destroy_process_group first")
    if init_method is not None and not isinstance(init_method, str):
        raise TypeError("init_method must be a string such as 'env://', 'tcp://HOST:PORT' or "
                        "'file:///PATH'")
    timeout_ms = 0
    if timeout is not None:
        if not isinstance(timeout, _dt.timedelta):
            raise TypeError("timeout must be a datetime.timedelta")
        timeout_ms = int(timeout.total_seconds() * 1000)
        if timeout_ms <= 0:
            raise ValueError("timeout must be positive")
        if timeout_ms > 86400000:
            raise ValueError(f"timeout={timeout} is longer than pshard's collectives allow "
                             "(24 hours)")
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
    rank = -1 if rank is None else int(rank)
    world_size = -1 if world_size is None else int(world_size)
    if coordinator and init_method not in (None, "env://"):
        rank = rank if rank >= 0 else _env_int("RANK")
        world_size = world_size if world_size > 0 else _env_int("WORLD_SIZE")
        if rank is None or world_size is None:
            raise ValueError(f"init_method {init_method!r} needs rank and world_size (the "
                             "arguments, or RANK and WORLD_SIZE), as torch does")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size {world_size})")
    try:
        _client = _C.Client(server=server, coordinator=coordinator, rank=int(rank),
                            world_size=int(world_size), coll_timeout_ms=timeout_ms,
                            connect_timeout_ms=connect_ms,
                            job=_os.environ.get("PSHARD_JOB") or None)
    except InvalidArgumentError as e:
        # libpshard names the environment's variables; name the arguments where they came
        # from the call
        msg = str(e)
        env = f"WORLD_SIZE is {world_size}"
        if world_size > 0 and msg.startswith(env + " "):
            raise InvalidArgumentError(f"world_size={world_size} (the argument)"
                                       + msg[len(env):]) from None
        raise
    global _hooked
    if not _hooked:
        atexit.register(drop)
        _hooked = True
    return _client


def drop():
    """Closes this process's client (backend "pshard"'s shutdown, destroy_process_group, and
    at exit): it leaves the cluster at once; tensors still viewing its memory keep it mapped
    with their last values until they are gone. A no-op without one."""
    global _client
    c, _client = _client, None
    _kept.clear()
    if c is not None:
        c.close()


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


