"""Keyed process groups on 4 ranks (keyed_groups_worker.py): made by their members only, as
torch's new_group calls a backend, in different orders on different ranks; their collectives,
repeated keys and non-members refused, a member that never comes named in the others' error,
the all-ranks NewGroups beside them; and Join (keyed_join_worker.py): a joined member shadows
its keyed group, and a new keyed group with it is refused."""
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


def test_keyed_group_join(tmp_path):
    """Rank 0 joins at once: its server shadows its keyed group's all_reduces for rank 1, and
    a new keyed group with it is refused with JoinedError naming it."""
    p = pshardrun(4, os.path.join(HERE, "keyed_join_worker.py"), [str(tmp_path)])
    assert p.returncode == 0, p.stdout[-4000:]
    assert json.loads((tmp_path / "rank-0.json").read_text())["sums"] == []
    for r, want in ((1, 2.0), (2, 3.0 + 4.0), (3, 3.0 + 4.0)):  # rank 0 adds zeros
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert got["sums"] == [[want] * 3] * 2, (r, got)
    e = json.loads((tmp_path / "rank-1.json").read_text())["joined_error"]
    assert e and "rank 0 has joined" in e and "after-join" in e, e
