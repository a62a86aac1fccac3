"""pshard.distributed on torch tensors, 1 to 5 ranks, against values computed locally; also on
the remote path (PSHARD_REMOTE=1: the scratch region's bytes cross gRPC)."""
import json
import os

import pytest

from conftest import HERE, pshardrun


@pytest.mark.parametrize("world,remote", [(1, False), (2, False), (3, False), (5, False),
                                          (3, True)])
def test_collectives(tmp_path, world, remote):
    p = pshardrun(world, os.path.join(HERE, "dist_worker.py"), [str(tmp_path)],
                  env={"PSHARD_REMOTE": "1"} if remote else None)
    assert p.returncode == 0, p.stdout[-4000:]
    for r in range(world):
        res = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert res["failed"] == [], res
