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
        if not remote:  # a DesyncError naming two ranks that asked for different groups
            assert res["desync"] and res["desync"].count("rank ") >= 2, (r, res)
