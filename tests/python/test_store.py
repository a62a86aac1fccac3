"""pshard.Store (torch's Store over the coordinator), side by side with torch's own TCPStore and
HashStore; install_env_rendezvous; and torch's env:// rendezvous under pshardrun (MASTER_PORT
is a port torch's TCPStore can use)."""
import importlib
import json
import os
import socket
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import pshard
from pshard import _C
from pshard._store import KEY_PREFIX, Store, install_env_rendezvous

from conftest import HERE, program, pshardrun

rdzv = importlib.import_module("torch.distributed.rendezvous")

SHORT = timedelta(milliseconds=500)


@pytest.fixture
def coordinator(tmp_path):
    """A coordinator on an ephemeral loopback port; its HOST:PORT."""
    port_file = tmp_path / "coord.port"
    log = open(tmp_path / "coord.log", "wb")
    p = subprocess.Popen([program("pshard-coordinator"), "--listen", "127.0.0.1:0",
                          "--port-file", str(port_file)], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert p.poll() is None, f"coordinator exited with {p.returncode}"
            assert time.monotonic() < deadline, "coordinator wrote no port file in 30 s"
            time.sleep(0.02)
        yield "127.0.0.1:" + port_file.read_text().strip()
    finally:
        p.kill()
        p.wait()
        log.close()


_job_counter = [0]


@pytest.fixture
def stores(coordinator):
    """{"pshard": Store in a fresh job, "tcp": TCPStore (master, port 0), "hash": HashStore},
    all with a 500 ms timeout."""
    _job_counter[0] += 1
    made = {
        "pshard": Store(coordinator, job=f"store-test-{os.getpid()}-{_job_counter[0]}",
                        timeout=SHORT),
        "tcp": dist.TCPStore("127.0.0.1", 0, 1, True, timeout=SHORT),
        "hash": dist.HashStore(),
    }
    made["hash"].set_timeout(SHORT)
    yield made
    made["pshard"].close()


ALL = ["pshard", "tcp", "hash"]


def each(stores, fn, names=ALL):
    """fn(store) on each store; the results by name, exceptions as their type."""
    out = {}
    for n in names:
        try:
            out[n] = fn(stores[n])
        except Exception as e:  # noqa: BLE001 (compared below)
            out[n] = type(e)
    return out


def same(results):
    assert len(set(map(repr, results.values()))) == 1, results
    return next(iter(results.values()))


def test_set_get_bytes_and_str(stores):
    def run(s):
        s.set("b", b"\x00\x01bytes")
        s.set("s", "text")
        s.set("e", b"")
        return s.get("b"), s.get("s"), s.get("e")
    assert same(each(stores, run)) == (b"\x00\x01bytes", b"text", b"")


def test_set_overwrites(stores):
    def run(s):
        s.set("k", "one")
        s.set("k", "two")
        return s.get("k")
    assert same(each(stores, run)) == b"two"


@pytest.mark.parametrize("name", ["pshard", "tcp"])
def test_get_missing_waits_then_raises_diststoreerror(stores, name):
    s = stores[name]
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError) as ei:
        s.get("absent")
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.45, elapsed
    assert "absent" in str(ei.value)
    assert "wait timeout after 500ms" in str(ei.value)


def test_get_waits_for_a_later_set(stores):
    s = stores["pshard"]
    s.set_timeout(timedelta(days=3650))
    threading.Timer(0.2, lambda: s.set("later", b"v")).start()
    assert s.get("later") == b"v"
    # The C side clamps what would overflow its deadlines.
    threading.Timer(0.2, lambda: s.set("later2", b"w")).start()
    assert s._store.get(KEY_PREFIX + "later2", 2**62) == b"w"


def test_add_creates_and_returns_the_new_value(stores):
    def run(s):
        return s.add("n", 3), s.add("n", -1), s.add("n", 0), s.get("n")
    assert same(each(stores, run)) == (3, 2, 2, b"2")


def test_add_on_text_is_a_clear_error(stores):
    s = stores["pshard"]
    s.set("t", "abc")
    with pytest.raises(pshard.InvalidArgumentError, match="not a base-10 integer"):
        s.add("t", 1)


def test_compare_set_matches_tcpstore(stores):
    # HashStore differs from TCPStore for an absent key with a non-empty expected value; the
    # contract is TCPStore's.
    def run(s):
        return (s.compare_set("c1", "", "v"),       # absent, empty expected: swaps
                s.compare_set("c2", "x", "v"),      # absent, non-empty: echoes expected
                s.check(["c2"]),                    # ... and stores nothing
                s.compare_set("c1", "v", "w"),      # matching: swaps
                s.compare_set("c1", "zz", "q"),     # not matching: current value
                s.get("c1"))
    assert same(each(stores, run, ["pshard", "tcp"])) == (b"v", b"x", False, b"w", b"w", b"w")


def test_compare_set_on_an_empty_value(stores):
    def run(s):
        s.set("e", b"")
        return s.compare_set("e", "x", "y"), s.compare_set("e", "", "y"), s.get("e")
    assert same(each(stores, run, ["pshard", "tcp"])) == (b"", b"y", b"y")


def test_wait_with_and_without_timeout(stores):
    def run(s):
        s.set("w1", "1")
        s.wait(["w1"])
        s.wait(["w1"], timedelta(seconds=5))
        s.wait([])
        try:
            t0 = time.monotonic()
            s.wait(["w1", "w2"], timedelta(milliseconds=300))
            return "no error"
        except Exception as e:  # noqa: BLE001
            return type(e), time.monotonic() - t0 >= 0.25
    assert same(each(stores, run, ["pshard", "tcp"])) == (dist.DistStoreError, True)


def test_wait_default_timeout_is_the_stores(stores):
    s = stores["pshard"]
    s.set_timeout(timedelta(milliseconds=300))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="300ms"):
        s.wait(["never"])
    assert time.monotonic() - t0 >= 0.25


def test_check(stores):
    def run(s):
        s.set("c", "1")
        return s.check(["c"]), s.check(["c", "missing"]), s.check([])
    assert same(each(stores, run)) == (True, False, True)


def test_delete_key(stores):
    def run(s):
        s.set("d", "1")
        return s.delete_key("d"), s.delete_key("d"), s.check(["d"])
    assert same(each(stores, run)) == (True, False, False)


def test_num_keys_names_what_to_use(stores):
    with pytest.raises(NotImplementedError, match="check"):
        stores["pshard"].num_keys()


def test_prefixstore_calls_through_torch(stores):
    """torch's own wrappers call the Python methods from C++ (its PythonStore trampoline)."""
    p = dist.PrefixStore("pfx", stores["pshard"])
    p.set("a", "1")
    assert p.get("a") == b"1"
    assert p.add("n", 5) == 5
    assert p.compare_set("a", "1", "2") == b"2"
    p.wait(["a"])
    p.wait(["a"], timedelta(seconds=1))
    assert p.check(["a"]) and not p.check(["b"])
    with pytest.raises(dist.DistStoreError):
        p.wait(["b"], timedelta(milliseconds=200))
    # PrefixStore put its prefix in front; pshard.Store put "torch/" in front of that.
    raw = _C.Store(stores["pshard"].coordinator, stores["pshard"].job)
    assert raw.get(KEY_PREFIX + "pfx/a", 1000) == b"2"
    raw.close()


def test_keys_are_prefixed_and_scoped_by_job(coordinator):
    a = Store(coordinator, job="job-a", timeout=SHORT)
    b = Store(coordinator, job="job-b", timeout=SHORT)
    a.set("k", "in a")
    assert not b.check(["k"])
    raw = _C.Store(coordinator, "job-a")
    assert raw.check([KEY_PREFIX + "k"], 1000) and not raw.check(["k"], 1000)
    raw.close()
    a.close()
    b.close()


def test_concurrent_threads(stores):
    s = stores["pshard"]

    def adder():
        for _ in range(25):
            s.add("ctr", 1)
    threads = [threading.Thread(target=adder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.add("ctr", 0) == 100


def test_bad_keys_and_values(stores):
    s = stores["pshard"]
    raw = s._store
    with pytest.raises(pshard.InvalidArgumentError, match="empty"):
        raw.set("", b"v", 1000)
    with pytest.raises(pshard.InvalidArgumentError, match="limit"):
        s.set("x" * 2000, b"v")
    with pytest.raises(pshard.InvalidArgumentError, match="limit"):
        s.set("big", b"x" * (1024 * 1024 + 1))
    with pytest.raises(TypeError):
        s.set("k", 3)


def test_closed_store_raises(coordinator):
    s = Store(coordinator, timeout=SHORT)
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.set("k", "v")


def test_unreachable_coordinator_is_a_network_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = Store(f"127.0.0.1:{port}", timeout=timedelta(milliseconds=300))
    with pytest.raises((dist.DistNetworkError, dist.DistStoreError)):
        s.set("k", "v")
    s.close()


def test_constructor_defaults_from_environment(coordinator, monkeypatch):
    monkeypatch.delenv("PSHARD_COORDINATOR", raising=False)
    with pytest.raises(ValueError, match="PSHARD_COORDINATOR"):
        Store()
    monkeypatch.setenv("PSHARD_COORDINATOR", coordinator)
    monkeypatch.setenv("PSHARD_JOB", "env-job")
    s = Store()
    assert (s.coordinator, s.job) == (coordinator, "env-job")
    assert s.timeout == timedelta(minutes=5)
    s.set("k", "v")
    assert Store(coordinator, job="env-job").get("k") == b"v"
    s.close()


def test_install_env_rendezvous(coordinator, monkeypatch):
    original = rdzv._rendezvous_handlers["env"]
    try:
        install_env_rendezvous()
        installed = rdzv._rendezvous_handlers["env"]
        install_env_rendezvous()
        assert rdzv._rendezvous_handlers["env"] is installed  # idempotent
        monkeypatch.setenv("PSHARD_COORDINATOR", coordinator)
        monkeypatch.setenv("PSHARD_JOB", "rdzv-job")
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "3")
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        monkeypatch.delenv("MASTER_PORT", raising=False)
        store, rank, world = next(rdzv.rendezvous("env://", timeout=SHORT))
        assert isinstance(store, Store) and (rank, world) == (1, 3)
        assert store.job == "rdzv-job" and store.timeout == SHORT
        # Without PSHARD_COORDINATOR: torch's own handler, a TCPStore on MASTER_PORT.
        monkeypatch.delenv("PSHARD_COORDINATOR")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        store, rank, world = next(rdzv.rendezvous("env://", timeout=SHORT))
        assert isinstance(store, dist.TCPStore) and (rank, world) == (0, 1)
        assert store.port == port
    finally:
        rdzv._rendezvous_handlers["env"] = original


def _run_gloo(tmp_path, mode):
    out = tmp_path / mode
    out.mkdir()
    p = pshardrun(2, os.path.join(HERE, "store_worker.py"), [str(out), mode], timeout=300)
    assert p.returncode == 0, p.stdout[-6000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def test_pshardrun_env_init_process_group_gloo(tmp_path):
    """torch's env:// under pshardrun: MASTER_PORT is a port rank 0's TCPStore can listen on,
    not the gRPC coordinator."""
    res = _run_gloo(tmp_path, "env")
    for r, x in enumerate(res):
        assert x["rank"] == r and x["world"] == 2
        assert x["sum"] == [3.0] * 4
        assert x["store"] == "PrefixStore"
        assert x["master"][0] == "127.0.0.1"
        assert f"127.0.0.1:{x['master'][1]}" != x["coordinator"]
    assert res[0]["master"] == res[1]["master"]


def test_pshardrun_env_rendezvous_on_pshard_store(tmp_path):
    res = _run_gloo(tmp_path, "pshard")
    for x in res:
        assert x["sum"] == [3.0] * 4 and x["store"] == "Store"
