"""Keyed process groups on 4 ranks (keyed_groups_worker.py): made by their members only, as
torch's new_group calls a backend, in different orders on different ranks; their collectives,
repeated keys and non-members refused, a member that never comes named in the others' error,
and the all-ranks NewGroups beside them."""
import json
import os

from conftest import HERE, pshardrun


def test_keyed_groups(tmp_path):
    p = pshardrun(4, os.path.join(HERE, "keyed_groups_worker.py"), [str(tmp_path)])
    assert p.returncode == 0, p.stdout[-4000:]
    for r in range(4):
        res = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert res["failed"] == [], (r, res)
        assert res["checks"] >= 12, (r, res)  # the worker ran its checks
        if r != 3:  # the members that came name the group and the one that did not
            e = res["missing_error"]
            assert e and "quartet" in e and "rank 3" in e and "never" in e, (r, e)
