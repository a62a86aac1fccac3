"""torch.distributed's Store over the coordinator's key/value store, and an ``env://``
rendezvous that uses it.

``Store`` is a real ``torch.distributed.Store`` (torch's Python-store trampoline calls its
methods from C++: process groups, ``PrefixStore``), with TCPStore's semantics, on the job the
trainer belongs to. Its keys live under ``torch/`` in the job's store, so they never meet
pshard's own keys. ``install_env_rendezvous()`` makes ``init_method="env://"`` use it when
``PSHARD_COORDINATOR`` is set (as pshardrun sets it).
"""
import importlib
import os
import threading
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from . import _C

# The module, not torch.distributed's rendezvous() function that shadows its name.
_rdzv = importlib.import_module("torch.distributed.rendezvous")

__all__ = ["Store", "install_env_rendezvous", "KEY_PREFIX"]

KEY_PREFIX = "torch/"


def _ms(timeout):
    """A timedelta as whole milliseconds, at least 1 (0 would mean the C default) and at most
    what the C side takes (longer waits are waits without end in practice)."""
    return min(max(1, int(timeout.total_seconds() * 1000)), 10**12)


def _bytes(value, what):
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):  # torch's C++ side hands std::vector<uint8_t> as a list
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, not {type(value).__name__}")


class Store(dist.Store):
    """A ``torch.distributed.Store`` on pshard's coordinator.

    ``coordinator`` is ``HOST:PORT`` (default ``PSHARD_COORDINATOR``), ``job`` the coordinator's
    job (default ``PSHARD_JOB``; none: its default job), ``timeout`` how long ``get`` and
    ``wait`` wait for keys (``set_timeout`` changes it, as on every torch store). The token
    comes from ``PSHARD_TOKEN_FILE``. Errors: a key not set in time raises
    ``torch.distributed.DistStoreError`` (as TCPStore does), a coordinator that cannot be
    reached ``torch.distributed.DistNetworkError``; others are ``pshard.Error`` subclasses.
    Thread-safe. As with every Python store, keep a reference to it while torch uses it (in a
    ``PrefixStore`` or a process group): torch's C++ side reaches these methods only through
    the live Python object.
    """

    def __init__(self, coordinator=None, job=None, timeout=timedelta(minutes=5)):
        super().__init__()
        coordinator = coordinator or os.environ.get("PSHARD_COORDINATOR")
        if not coordinator:
            raise ValueError(
                "pshard.Store needs the coordinator's HOST:PORT: pass coordinator= or set "
                "PSHARD_COORDINATOR (pshardrun sets it)")
        if job is None:
            job = os.environ.get("PSHARD_JOB") or None
        self.coordinator, self.job = coordinator, job
        self._store = _C.Store(coordinator, job)
        self.set_timeout(timeout)

    # Every call goes through here: pshard's errors become torch's where torch has one.
    def _call(self, fn, *args, keys=()):
        try:
            return fn(*args)
        except _C.TimeoutError as e:
            if not keys:  # the coordinator did not answer in time
                raise dist.DistStoreError(f"pshard store on {self.coordinator}: {e}") from e
            raise dist.DistStoreError(
                f"wait timeout after {int(self.timeout.total_seconds() * 1000)}ms, keys: "
                f"{', '.join(keys)} (pshard store on {self.coordinator}: {e})") from e
        except _C.UnavailableError as e:
            raise dist.DistNetworkError(
                f"pshard store: coordinator {self.coordinator} unavailable: {e}") from e

    def _timeout_ms(self, timeout=None):
        return _ms(self.timeout if timeout is None else timeout)

    def set(self, key, value):
        self._call(self._store.set, KEY_PREFIX + key, _bytes(value, "value"),
                   self._timeout_ms())

    def get(self, key):
        """Waits up to the store's timeout for key, like TCPStore.get."""
        return self._call(self._store.get, KEY_PREFIX + key, self._timeout_ms(), keys=(key,))

    def add(self, key, amount):
        return self._call(self._store.add, KEY_PREFIX + key, int(amount), self._timeout_ms())

    def compare_set(self, key, expected_value, desired_value):
        """TCPStore's answers: the value now stored, or expected_value itself when the key is
        absent and expected_value is not empty (nothing is stored then)."""
        return self._call(self._store.compare_set, KEY_PREFIX + key,
                          _bytes(expected_value, "expected_value"),
                          _bytes(desired_value, "desired_value"), self._timeout_ms())

    def wait(self, keys, timeout=None):
        """Waits until every key is set, up to timeout (default: the store's timeout)."""
        ms = self._timeout_ms(timeout)
        full = [KEY_PREFIX + k for k in keys]
        try:
            self._store.wait(full, ms)
        except _C.TimeoutError as e:
            raise dist.DistStoreError(
                f"wait timeout after {ms}ms, keys: {', '.join(keys)} (pshard store on "
                f"{self.coordinator}: {e})") from e
        except _C.UnavailableError as e:
            raise dist.DistNetworkError(
                f"pshard store: coordinator {self.coordinator} unavailable: {e}") from e

    def check(self, keys):
        return self._call(self._store.check, [KEY_PREFIX + k for k in keys], self._timeout_ms())

    def delete_key(self, key):
        return self._call(self._store.delete_key, KEY_PREFIX + key, self._timeout_ms())

    def num_keys(self):
        raise NotImplementedError(
            "pshard.Store cannot count keys: the coordinator's store has no key count; use "
            "check(keys) for the keys you expect, or add() on a counter key")

    def close(self):
        """Closes the connection; later calls raise ValueError."""
        self._store.close()


_install_lock = threading.Lock()
_rendezvous_stores = []  # every Store the env:// handler made, for the life of the process


def _pshard_env_handler(original):
    def handler(url, timeout=timedelta(minutes=5), **kwargs):
        if not os.environ.get("PSHARD_COORDINATOR"):
            yield from original(url, timeout=timeout, **kwargs)
            return
        query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
        rank = query.get("rank", os.environ.get("RANK"))
        world_size = query.get("world_size", os.environ.get("WORLD_SIZE"))
        if rank is None or world_size is None:
            missing = "RANK" if rank is None else "WORLD_SIZE"
            raise ValueError("Error initializing torch.distributed using env:// rendezvous: "
                             f"environment variable {missing} expected, but not set")
        store = Store(timeout=timeout)
        # torch keeps only the C++ side of what the rendezvous yields (in a PrefixStore); its
        # calls reach the Python methods only while the Python object lives, so it must live
        # as long as the process group may use it.
        with _install_lock:
            _rendezvous_stores.append(store)
        yield (store, int(rank), int(world_size))
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    handler._pshard_original = original
    return handler


def install_env_rendezvous():
    """Makes torch's ``env://`` rendezvous yield (pshard ``Store``, RANK, WORLD_SIZE) when
    ``PSHARD_COORDINATOR`` is set, with no TCPStore; without it, torch's own handler runs
    unchanged. Idempotent; thread-safe."""
    with _install_lock:
        current = _rdzv._rendezvous_handlers.get("env")
        if current is None or getattr(current, "_pshard_original", None) is not None:
            return
        _rdzv._rendezvous_handlers["env"] = _pshard_env_handler(current)
