"""A lost trainer of a pshard.torch model is replaced alone (issue 29): pshardrun
--max-restarts 1, rank 1 exits mid-run; the others catch pshard.StepAbortedError, resync and
go on; the replacement takes its server's state over and starts where they went on; the final
weights equal, bit for bit, a run of the same data that leaves the aborted step out."""
import json
import os

import torch

from conftest import HERE, pshardrun


def test_lost_trainer_replaced(tmp_path):
    worker = os.path.join(HERE, "replace_worker.py")
    run = tmp_path / "replace"
    run.mkdir()
    p = pshardrun(3, worker, [str(run), "4", ""],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"])
    assert p.returncode == 0, p.stdout[-4000:]
    assert "replacing it (restart 1 of 1)" in p.stdout, p.stdout[-4000:]
    first = [json.loads((run / f"rank-{r}-0.json").read_text()) for r in (0, 2)]
    repl = json.loads((run / "rank-1-1.json").read_text())
    assert all(f["aborted"] == [4] for f in first), first
    assert repl["started_at"] == 5 and repl["aborted"] == [], repl
    assert all(f["steps"] == 11 for f in first + [repl]), (first, repl)

    ref = tmp_path / "reference"
    ref.mkdir()
    p = pshardrun(3, worker, [str(ref), "-1", "4"])
    assert p.returncode == 0, p.stdout[-4000:]
    a, b = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_trainer_side_optimizer_not_replaced(tmp_path):
    """A torch.optim optimizer in the trainer held state only the lost trainer had (and the
    others may have stepped already): no replacement takes over, the job fails naming why."""
    worker = os.path.join(HERE, "replace_worker.py")
    p = pshardrun(3, worker, [str(tmp_path), "4", "", "torch"],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"])
    assert p.returncode != 0, p.stdout[-4000:]
    assert "not replaceable: its own optimizer" in p.stdout, p.stdout[-4000:]
