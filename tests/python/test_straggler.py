"""Who is slow (issue 29), from Python: a DDP-style trainer on backend "pshard" that never steps
the servers' optimizer marks its steps with pshard.report_step; its rank 1 sleeps in every step,
and the coordinator's status (pshardctl --json status) must name rank 1 as the slowest, with
compute medians that say why. Only orderings and a loose ratio are asserted (busy machines)."""
import json
import os

from conftest import HERE, program, pshardrun


def test_report_step_names_the_slow_rank(tmp_path):
    p = pshardrun(3, os.path.join(HERE, "straggler_worker.py"),
                  [program("pshardctl"), str(tmp_path), "1", "0.15", "25"], timeout=240)
    assert p.returncode == 0, p.stdout[-6000:]
    status = json.loads((tmp_path / "status.json").read_text())
    s = status["straggler"]
    assert s["rank"] == 1, s
    assert s["ratio"] > 1.3, s
    assert s["slow"], s
    ranks = {r["rank"]: r for r in s["ranks"]}
    assert set(ranks) == {0, 1, 2}, s
    assert ranks[1]["compute_seconds"] > ranks[0]["compute_seconds"], s
    assert ranks[0]["wait_seconds"] > ranks[1]["wait_seconds"], s
    assert all(r["window"] >= 10 for r in ranks.values()), s
