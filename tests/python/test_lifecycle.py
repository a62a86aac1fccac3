"""A trainer's lifetime on long-lived shard servers (started by hand, as plain torchrun with
PSHARD_COORDINATOR or a Kubernetes StatefulSet runs them): a trainer that used pshard.torch
leaves the cluster when it ends cleanly (destroy_process_group, or just the interpreter's exit),
so its shard server serves the next job instead of evicting it; tensors still viewing the
servers' memory after the close keep their last values, and using the model raises."""
import json
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
