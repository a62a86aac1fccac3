"""pshard.distributed's process groups on 4 ranks (groups_worker.py): new_group and its
relatives, every collective with group= against local references, init_device_mesh, bad
arguments refused before any exchange, and groups made in different orders failing with a
desync instead of hanging. Also the groups' collectives on the remote path (PSHARD_REMOTE=1)."""
import json
import os

import pytest

from conftest import HERE, pshardrun


@pytest.mark.parametrize("remote", [False, True], ids=["shm", "remote"])
def test_groups(tmp_path, remote):
    args = [str(tmp_path)] + (["quick"] if remote else [])
    p = pshardrun(4, os.path.join(HERE, "groups_worker.py"), args,
                  env={"PSHARD_REMOTE": "1"} if remote else None)
    assert p.returncode == 0, p.stdout[-4000:]
    for r in range(4):
        res = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert res["failed"] == [], (r, res)
        assert res["checks"] > 50, (r, res)  # the worker ran its checks


def test_lost_rank_fails_its_groups_only(cluster, tmp_path):
    """Rank 1's trainer dies: rank 0, in a group with it, fails with PeerLostError naming it
    within the lease; ranks 2 and 3, in a group without it, finish their collectives."""
    import json

    from conftest import check_peer_lost, run_trainers
    c = cluster(4, lease_ms=2000, heartbeat_ms=500)
    out = tmp_path / "out"
    out.mkdir()
    run_trainers(c, "groups_kill_worker.py", [str(out)], out)
    check_peer_lost(out, 0, 1)
    for r in (2, 3):
        res = json.loads((out / f"rank-{r}.json").read_text())
        assert res["error"] is None and res["after_loss"] >= 1, (r, res)
