"""init_process_group's init methods besides env://: tcp://HOST:PORT (the coordinator) and
file:///PATH (a rendezvous file the coordinator writes with --rdzv-file), with trainers that
have no PSHARD_SERVER: the coordinator names each rank's shard server."""
import os
import subprocess
import sys

import pytest

from conftest import BIN

TRAINER = r"""
import sys, torch, pshard, pshard.distributed as dist
method, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pshard.init_process_group(init_method=method, rank=rank, world_size=world)
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
print("rank", pshard.get_rank(), "of", pshard.get_world_size(), "sum", x.item(), flush=True)
pshard.destroy_process_group()
"""


def bare_env():
    """The environment without anything that names a server or coordinator."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PSHARD_SERVER", "PSHARD_COORDINATOR", "RANK", "WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "PSHARD_JOB")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def init_raises(args, exc, **env):
    """Runs pshard.init_process_group(ARGS) in a fresh interpreter (bare_env plus env) and
    returns what it printed of the exception it raised (class exc): its status and message."""
    code = (f"import datetime, pshard\ntry:\n    pshard.init_process_group({args})\n"
            f"except {exc} as e:\n    print('raised', getattr(e, 'status', ''), e)\n")
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=dict(bare_env(), **env),
                       timeout=120)
    assert p.returncode == 0 and "raised" in p.stdout, p.stdout
    return p.stdout


def run_trainers(method, world):
    procs = [subprocess.Popen([sys.executable, "-c", TRAINER, method, str(r), str(world)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=bare_env(), stdin=subprocess.DEVNULL) for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append((p.returncode, out))
    return outs


def test_tcp_init_method(cluster):
    c = cluster(2)
    for r, (rc, out) in enumerate(run_trainers(f"tcp://{c.coord}", 2)):
        assert rc == 0, out
        assert f"rank {r} of 2 sum 3.0" in out, out


def test_file_init_method(cluster, tmp_path):
    path = tmp_path / "rdzv"
    cluster(2, rdzv_file=path)
    assert path.read_text().startswith("127.0.0.1:")
    for r, (rc, out) in enumerate(run_trainers(f"file://{path}", 2)):
        assert rc == 0, out
        assert f"rank {r} of 2 sum 3.0" in out, out


def test_rendezvous_file_must_be_empty(tmp_path):
    path = tmp_path / "rdzv"
    path.write_text("10.9.8.7:29500\n")
    p = subprocess.run([os.path.join(BIN, "pshard-coordinator"), "--listen", "127.0.0.1:0",
                        "--rdzv-file", str(path)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=30)
    assert p.returncode == 2, p.stdout
    assert "already holds '10.9.8.7:29500'" in p.stdout and "absent or empty" in p.stdout
    assert path.read_text() == "10.9.8.7:29500\n"  # left as it was
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    p = subprocess.run([os.path.join(BIN, "pshard-coordinator"), "--listen", "127.0.0.1:0",
                        "--rdzv-file", str(link)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=30)
    assert p.returncode == 2 and "symbolic link" in p.stdout, p.stdout


def test_rendezvous_file_emptied_at_clean_stop(tmp_path):
    path = tmp_path / "rdzv"
    port_file = tmp_path / "port"
    p = subprocess.Popen([os.path.join(BIN, "pshard-coordinator"), "--listen", "127.0.0.1:0",
                          "--port-file", str(port_file), "--rdzv-file", str(path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        assert path.read_text() == f"127.0.0.1:{port_file.read_text().strip()}\n"
        p.terminate()
        assert p.wait(timeout=20) == 0
        assert path.read_text() == ""  # ready for the next run
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("method,kwargs,exc,text", [
    ("tcp://nohostport", {"rank": 0, "world_size": 1}, ValueError, "tcp://HOST:PORT"),
    ("file://relative/path", {"rank": 0, "world_size": 1}, ValueError, "ABSOLUTE"),
    ("tcp://127.0.0.1:1", {}, ValueError, "needs rank and world_size"),
    ("tcp://127.0.0.1:1", {"rank": 3, "world_size": 2}, ValueError, "not in [0, world_size"),
    ("udp://127.0.0.1:1", {}, ValueError, "not supported"),
])
def test_bad_init_methods(method, kwargs, exc, text):
    out = init_raises(f"init_method={method!r}, **{kwargs!r}", exc.__name__)
    assert text in out, out


def test_no_coordinator_times_out():
    out = init_raises("init_method='tcp://127.0.0.1:1', rank=0, world_size=1, "
                      "timeout=datetime.timedelta(seconds=2)", "pshard.TimeoutError")
    assert "no shard server for rank 0 at coordinator 127.0.0.1:1" in out, out


def test_world_size_argument_named(cluster):
    """A world size given as init_process_group's argument (no WORLD_SIZE in the environment)
    that the cluster does not have is named as the argument, not as the variable."""
    c = cluster(2)
    out = init_raises("rank=0, world_size=3", "pshard.InvalidArgumentError",
                      PSHARD_SERVER=c.servers[0])
    assert "world_size=3 (the argument) but the cluster has 2" in out, out
    assert "WORLD_SIZE" not in out, out


def test_rendezvous_file_others_may_write_is_refused(tmp_path):
    """The address in a rendezvous file receives the cluster token: a file its group or others
    may write is refused (with the reason), never connected to."""
    path = tmp_path / "rdzv"
    path.write_text("127.0.0.1:1\n")
    path.chmod(0o666)
    out = init_raises(f"init_method='file://{path}', rank=0, world_size=1", "pshard.Error")
    assert "PSHARD_ERR_PERMISSION" in out and "writable by others" in out, out


def test_two_coordinators_one_rendezvous_file(tmp_path):
    """Two coordinators started together on one rendezvous file: exactly one keeps it."""
    import time
    path = tmp_path / "rdzv"
    procs = [subprocess.Popen([os.path.join(BIN, "pshard-coordinator"), "--listen",
                               "127.0.0.1:0", "--port-file", str(tmp_path / f"port{i}"),
                               "--rdzv-file", str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither coordinator gave the file up"
            time.sleep(0.05)
        lost = [p for p in procs if p.poll() is not None]
        assert len(lost) == 1 and lost[0].returncode == 2, [p.returncode for p in procs]
        out = lost[0].stdout.read()
        assert "rendezvous file" in out and "already holds" in out, out
        kept = procs.index(next(p for p in procs if p.poll() is None))
        port_file = tmp_path / f"port{kept}"
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while path.read_text().startswith("#"):  # claimed; published right after
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert path.read_text() == f"127.0.0.1:{port_file.read_text().strip()}\n"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
