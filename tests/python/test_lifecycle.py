"""A trainer's lifetime on long-lived shard servers (started by hand, as plain torchrun with
PSHARD_COORDINATOR or a Kubernetes StatefulSet runs them): a trainer that used pshard.torch
leaves the cluster when it ends cleanly (destroy_process_group, or just the interpreter's exit),
so its shard server serves the next job instead of evicting it; tensors still viewing the
servers' memory after the close keep their last values, and using the model raises. And when a
trainer dies, health, status and metrics say that the shard servers cannot serve."""
import json
import re
import time

from conftest import run_trainers


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


def metric(text, name, **labels):
    """The value of metric name with (at least) these labels in a /metrics text, or None."""
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


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
