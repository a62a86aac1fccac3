"""init_process_group(timeout=) is the default group's collective timeout, as torch's is: with
rank 1 late, rank 0's barrier fails after the timeout, and the operation is aborted on every
rank (rank 1's barrier and all_reduce fail too; no sum ever includes rank 0's value), as on
torch's gloo; pshard's error also names the rank that was waited for."""
import json

import pytest

from conftest import HERE, pshardrun, run_gloo

WORKER = HERE + "/timeout_worker.py"
T = 4.0


def results(out):
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def check_aborted_everywhere(res):
    r0, r1 = res
    assert r0["barrier"] != "ok" and r0["barrier_s"] >= 0.9 * T, r0
    assert isinstance(r0["all_reduce"], str), r0  # failed: never a sum without rank 1
    assert r1["barrier"] != "ok", r1
    assert isinstance(r1["all_reduce"], str), r1  # never 3.0, rank 0's value included


def test_gloo(tmp_path):
    run_gloo(2, [WORKER, "torch", "gloo", str(tmp_path), str(tmp_path / "init"), str(T)])
    check_aborted_everywhere(results(tmp_path))


@pytest.mark.parametrize("api", ["torch", "pshard"])
def test_pshard(tmp_path, api):
    p = pshardrun(2, WORKER, [api, "pshard", str(tmp_path), str(tmp_path / "init"), str(T)],
                  timeout=300)
    assert p.returncode == 0, p.stdout[-4000:]
    res = results(tmp_path)
    check_aborted_everywhere(res)
    assert "rank 1" in res[0]["barrier"] and "Timeout" in res[0]["barrier"], res[0]
