"""pshard.distributed on torch tensors, 1 to 5 ranks, against values computed locally."""
import json
import os

import pytest

from conftest import HERE, pshardrun


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_collectives(tmp_path, world):
    p = pshardrun(world, os.path.join(HERE, "dist_worker.py"), [str(tmp_path)])
    assert p.returncode == 0, p.stdout[-4000:]
    for r in range(world):
        res = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert res["failed"] == [], res
