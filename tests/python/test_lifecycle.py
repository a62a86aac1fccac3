"""A trainer's lifetime on long-lived shard servers (started by hand, as plain torchrun with
PSHARD_COORDINATOR or a Kubernetes StatefulSet runs them): a trainer that used pshard.torch
leaves the cluster when it ends cleanly (destroy_process_group, or just the interpreter's exit),
so its shard server serves the next job instead of evicting it; tensors still viewing the
servers' memory after the close keep their last values, and using the model raises. And when a
trainer dies, health, status and metrics say that the shard servers cannot serve."""
import json
import re
import time

import pytest

from conftest import metric, run_trainers, stop_procs


def server_logs(c):
    return "".join((c.tmp / f"s{r}.log").read_text() for r in range(c.n))


def test_trainers_leave_and_the_next_job_runs(cluster, tmp_path):
    lease_s = 2.0
    c = cluster(2, lease_ms=int(lease_s * 1000), heartbeat_ms=500)
    for i, mode in enumerate(["exit", "destroy", "exit"]):
        out = tmp_path / f"job{i}"
        out.mkdir()
        run_trainers(c, "lifecycle_worker.py", [mode, str(out)], out)
        for r in range(c.n):
            f = out / f"rank-{r}.json"
            assert f.exists(), (out / f"t{r}.log").read_text()[-3000:]
            res = json.loads(f.read_text())
            assert res["error"] is None, res
            if mode == "destroy":
                assert res["view_kept"], res
                assert "destroy" in res["use_after_close"], res
        # Past the trainers' lease (an evicted trainer would be noticed by now), the shard
        # servers still serve: no trainer was evicted.
        until = time.monotonic() + 2.5 * lease_s
        while time.monotonic() < until:
            assert "evicted" not in server_logs(c), server_logs(c)[-3000:]
            time.sleep(0.1)
    assert "evicted" not in server_logs(c), server_logs(c)[-3000:]


def test_dead_trainer_is_not_reported_healthy(cluster, tmp_path):
    """A trainer that dies (no leave) is evicted; its shard servers stop serving (the ring
    failed). The coordinator must not say "formed" and healthy then: Status says degraded and
    names the ranks that are not serving, pshard.Cluster and `pshardctl health` are
    NOT_SERVING (exit 1), `pshardctl status` exits 1, the cluster-state gauge says degraded,
    and the shard servers no longer count a trainer as attached."""
    c = cluster(2, lease_ms=2000, heartbeat_ms=500, metrics=True)
    deadline = time.monotonic() + 60
    while (p := c.ctl("health")).returncode != 0:  # formed, and every ring up
        assert time.monotonic() < deadline, p.stdout + p.stderr
        time.sleep(0.2)
    assert "pshard.Cluster: SERVING" in p.stdout, p.stdout
    out = tmp_path / "job"
    out.mkdir()
    run_trainers(c, "lifecycle_worker.py", ["die", str(out)], out)
    for r in range(c.n):
        assert json.loads((out / f"rank-{r}.json").read_text())["error"] is None
    deadline = time.monotonic() + 60
    while True:  # the lease lapses, the servers abort their rings, the coordinator hears it
        st = c.ctl("status", "--json")
        doc = json.loads(st.stdout) if st.stdout.strip() else {}
        down = [m for m in doc.get("members", []) if m["role"] == "shard_server"
                and not m["serving"]]
        if len(down) == c.n:
            break
        assert time.monotonic() < deadline, st.stdout + st.stderr
        time.sleep(0.2)
    assert doc["state"] == "degraded", doc
    assert st.returncode == 1, st.returncode
    assert all("ring failed" in m["not_serving_reason"] for m in down), down
    assert "rank 0 (pshard-server-0) not serving" in doc["awaiting"], doc["awaiting"]
    text = c.ctl("status")
    assert "cluster      degraded" in text.stdout and "NOT SERVING: " in text.stdout, text.stdout
    h = c.ctl("health")
    assert h.returncode == 1 and "pshard.Cluster: NOT_SERVING" in h.stdout, h.stdout + h.stderr
    assert c.ctl("health", "pshard.Cluster").returncode == 1
    cm = c.scrape("coord")
    assert metric(cm, "pshard_coordinator_cluster_state", state="degraded") == 1, cm
    assert metric(cm, "pshard_coordinator_cluster_state", state="formed") == 0, cm
    for r in range(c.n):
        sm = c.scrape(f"s{r}")
        assert metric(sm, "pshard_shard_trainer_attached") == 0, sm


def test_full_store_fails_the_job_at_once(tmp_path):
    """With the coordinator's store full, the shard servers cannot build their ring: a trainer
    must fail at once with the cause, not wait out its connect timeout (300 s)."""
    import os
    import subprocess
    import sys

    from conftest import program

    from pshard._store import Store
    procs = []

    def start(cmd, log):
        with open(tmp_path / log, "ab") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))

    def port(path):
        deadline = time.monotonic() + 30
        while not (path.exists() and path.read_text().strip()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.02)
        return path.read_text().strip()
    try:
        start([program("pshard-coordinator"), "--listen", "127.0.0.1:0", "--port-file",
               str(tmp_path / "coord.port"), "--world-size", "2"], "coord.log")
        coord = "127.0.0.1:" + port(tmp_path / "coord.port")
        store = Store(coord)
        size, i, full = 1 << 20, 0, 0
        while size >= 1:  # 256 MiB of values, then ever smaller ones into what is left
            try:
                store.set(f"f{i}", b"x" * size)
                i += 1
            except Exception as e:  # noqa: BLE001 - the store's refusal
                assert "store is full" in str(e), e
                full += 1
                size //= 2
        assert full > 0 and i > 200, (i, full)
        for r in range(2):
            start([program("pshard-server"), "--coordinator", coord, "--listen", "127.0.0.1:0",
                   "--port-file", str(tmp_path / f"s{r}.port"), "--name", f"srv-{r}"],
                  f"s{r}.log")
        server = "127.0.0.1:" + port(tmp_path / "s0.port")
        env = dict(os.environ, RANK="0", WORLD_SIZE="2", PSHARD_SERVER=server,
                   PYTHONDONTWRITEBYTECODE="1")
        env.pop("PSHARD_COORDINATOR", None)
        code = ("import pshard\ntry:\n    pshard.init_process_group()\n"
                "except pshard.Error as e:\n    print('raised', e.status, e)\n")
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, timeout=200)
        took = time.monotonic() - t0
        assert "raised" in p.stdout and "store is full" in p.stdout, p.stdout
        assert took < 120, took  # long before the 300 s connect timeout
    finally:
        stop_procs(procs)


def test_killed_trainers_leave_nothing_in_dev_shm(tmp_path):
    """A trainer killed (-9) while it waits for the cluster to form, or inside its DefineModel
    (waiting for the other rank), must not leave its shared memory in /dev/shm for good: the
    regions are unnamed but for the calls that open them, and the next pshard process sweeps
    what dead ones left."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import program
    procs = []

    def start(cmd, log, env=None):
        with open(tmp_path / log, "ab") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
        return procs[-1]

    def port(path):
        deadline = time.monotonic() + 30
        while not (path.exists() and path.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return path.read_text().strip()

    def left_by(pid):  # names in /dev/shm a trainer of this pid made (any naming scheme)
        return [n for n in os.listdir("/dev/shm")
                if n.startswith("pshard-") and not n.startswith("pshard-srv-")
                and f"-{pid}-" in "-" + n[len("pshard-"):]]

    def until(what, cond, limit=60):
        deadline = time.monotonic() + limit
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    def maps_shm(pid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                return "/dev/shm/" in f.read()
        except OSError:
            return False

    trainer = [sys.executable, "-c",
               "import torch, pshard, pshard.torch as pt\n"
               "pshard.init_process_group()\n"
               "m = torch.nn.Linear(64, 64)\n"
               "pt.fully_shard(m)\n"
               "m(torch.zeros(1, 64))\n"]
    try:
        start([program("pshard-coordinator"), "--listen", "127.0.0.1:0", "--port-file",
               str(tmp_path / "coord.port"), "--world-size", "2"], "coord.log")
        coord = "127.0.0.1:" + port(tmp_path / "coord.port")

        def server(r):
            start([program("pshard-server"), "--coordinator", coord, "--listen", "127.0.0.1:0",
                   "--port-file", str(tmp_path / f"s{r}.port"), "--name", f"srv-{r}"],
                  f"s{r}.log")
            return "127.0.0.1:" + port(tmp_path / f"s{r}.port")

        def env(r, srv):
            e = dict(os.environ, RANK=str(r), WORLD_SIZE="2", PSHARD_SERVER=srv,
                     PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
            e.pop("PSHARD_COORDINATOR", None)
            return e
        s0 = server(0)
        # 1. Killed while the cluster is forming (one server of two): it waits in Attach.
        t = start(trainer, "t-forming.log", env(0, s0))
        until("the trainer made its regions", lambda: maps_shm(t.pid))
        t.send_signal(signal.SIGKILL)
        t.wait()
        dead = t.pid
        # 2. Killed inside DefineModel: rank 1 never defines, so rank 0's call waits.
        s1 = server(1)
        t = start(trainer, "t-define.log", env(0, s0))
        until("rank 0 is in DefineModel, its model region named for the server",
              lambda: len(left_by(t.pid)) >= 1, limit=120)
        t.send_signal(signal.SIGKILL)
        t.wait()
        dead2 = t.pid
        # The next pshard process sweeps what they left (a trainer connecting for rank 1).
        nxt = start(trainer, "t-next.log", env(1, s1))
        until("the leftovers of the killed trainers are swept",
              lambda: not left_by(dead) and not left_by(dead2))
        nxt.send_signal(signal.SIGKILL)
        nxt.wait()
    finally:
        stop_procs(procs)
