"""A lost trainer of a pshard.torch model is replaced alone (issue 29): pshardrun
--max-restarts 1, rank 1 exits mid-run; the others catch pshard.StepAbortedError, resync and
go on; the replacement takes its server's state over and starts where they went on; the final
weights equal, bit for bit, a run of the same data that leaves the aborted step out."""
import json
import os

import pytest
import torch

from conftest import HERE, program, pshardrun


def test_lost_trainer_replaced(tmp_path):
    worker = os.path.join(HERE, "replace_worker.py")
    run = tmp_path / "replace"
    run.mkdir()
    p = pshardrun(3, worker, [str(run), "4", ""],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"])
    assert p.returncode == 0, p.stdout[-4000:]
    assert "replacing it (restart 1 of 1)" in p.stdout, p.stdout[-4000:]
    # pshardrun told the coordinator at once; nobody waited for the lost trainer's lease
    assert "was lost (pshardrun saw its process end: exited with status 3)" in p.stdout, \
        p.stdout[-4000:]
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


# Where rank 1 is lost in a torch.optim step, and the steps that then count nowhere (the data
# index the others skip): before the forward, or after the update but before the commit, the
# step itself; after the commit, the next one (the others count the step and are aborted in
# the next); after the copy of the values the step begins from, before the update, the step.
TORCH_LOSSES = {"forward": 4, "update": 4, "commit": 5, "backup": 4}


@pytest.mark.parametrize("where", sorted(TORCH_LOSSES))
def test_trainer_side_optimizer_replaced(tmp_path, where):
    """torch.optim.AdamW in the trainer (two groups, a LambdaLR): pshard.torch keeps its state
    in the shard server's shared memory with the values each step begins from, so the
    replacement recovers it and the step in flight counts on every rank or on none. The
    final weights (and lrs) equal a run that leaves the reported step out, bit for bit."""
    worker = os.path.join(HERE, "replace_worker.py")
    run = tmp_path / "replace"
    run.mkdir()
    p = pshardrun(3, worker, [str(run), "4", "", "torch", where],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"])
    assert p.returncode == 0, p.stdout[-4000:]
    assert "replacing it (restart 1 of 1)" in p.stdout, p.stdout[-4000:]
    lost = TORCH_LOSSES[where]
    first = [json.loads((run / f"rank-{r}-0.json").read_text()) for r in (0, 2)]
    repl = json.loads((run / "rank-1-1.json").read_text())
    assert all(f["aborted"] == [lost] for f in first), first
    assert repl["started_at"] == lost + 1 and repl["aborted"] == [], repl
    assert all(f["steps"] == 11 and f["lr"] == repl["lr"] for f in first + [repl]), \
        (first, repl)

    ref = tmp_path / "reference"
    ref.mkdir()
    p = pshardrun(3, worker, [str(ref), "-1", str(lost), "torch"])
    assert p.returncode == 0, p.stdout[-4000:]
    a, b = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_trainer_side_optimizer_not_kept(tmp_path):
    """A torch.optim optimizer that also steps a parameter outside the pshard model: that
    parameter lives only in the trainer, so its state is not kept, the trainer says why, and
    a lost trainer ends the job, the server naming why."""
    worker = os.path.join(HERE, "replace_worker.py")
    p = pshardrun(3, worker, [str(tmp_path), "4", "", "torch-extra"],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"])
    assert p.returncode != 0, p.stdout[-4000:]
    assert "cannot keep its torch.optim optimizer's state" in p.stdout, p.stdout[-4000:]
    assert "not replaceable: its own optimizer" in p.stdout, p.stdout[-4000:]


@pytest.mark.parametrize("optim", ["server", "torch"])
def test_hsdp_trainer_replaced(tmp_path, optim):
    """HSDP 2 x 2: the replica and shard rings are rebuilt with the world's after the abort,
    and the lost trainer of rank 1 is replaced as with FSDP; bit for bit as a run without the
    aborted step. The DeviceMesh's process groups (torch.distributed groups over pshard) work
    on every rank afterwards: the survivors' rebuilt, the replacement's made again."""
    worker = os.path.join(HERE, "replace_worker.py")
    run = tmp_path / "replace"
    run.mkdir()
    p = pshardrun(4, worker, [str(run), "4", "", optim, "", "2x2"],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"])
    assert p.returncode == 0, p.stdout[-4000:]
    assert "replacing it (restart 1 of 1)" in p.stdout, p.stdout[-4000:]
    first = [json.loads((run / f"rank-{r}-0.json").read_text()) for r in (0, 2, 3)]
    repl = json.loads((run / "rank-1-1.json").read_text())
    assert all(f["aborted"] == [4] for f in first), first
    assert repl["started_at"] == 5 and repl["aborted"] == [], repl
    # Every rank's all_reduce over each of the mesh's groups summed its members' values
    for f in first + [repl]:
        assert set(f["mesh_sums"]) == {"replicate", "shard"}, f
        assert all(got == want for got, want in f["mesh_sums"].values()), f

    ref = tmp_path / "reference"
    ref.mkdir()
    p = pshardrun(4, worker, [str(ref), "-1", "4", optim, "", "2x2"])
    assert p.returncode == 0, p.stdout[-4000:]
    a, b = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_hsdp_server_healed(tmp_path):
    """HSDP 2 x 2 with the shard servers' AdamW: rank 1's shard server is killed (SIGKILL)
    before step 4. pshardrun declares it lost and starts a new server and trainer for rank 1;
    the survivors abort the step, the new server takes rank 1 again and receives its shard and
    optimizer state from rank 3 (the other replica of shard index 1), and the job goes on
    without a checkpoint: the final weights equal, bit for bit, a run without step 4. The
    mesh's process groups work on every rank afterwards."""
    worker = os.path.join(HERE, "replace_worker.py")
    run = tmp_path / "heal"
    run.mkdir()
    p = pshardrun(4, worker, [str(run), "4", "", "server", "server", "2x2"],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"],
                  env={"REPLACE_WORKER_STATUS": program("pshardctl")})
    assert p.returncode == 0, p.stdout[-6000:]
    assert "replacing it and its trainer (restart 1 of 1)" in p.stdout, p.stdout[-6000:]
    assert "rank 1 healed from rank 3" in p.stdout, p.stdout[-6000:]
    # pshardctl status shows the heal on the new server and on the survivors
    status = json.loads((run / "status.json").read_text())
    heal = {s["rank"]: s["heal"] for s in status["servers"]}
    assert heal[1].startswith("rank 1 healed from rank 3 at step 4"), heal
    assert all(heal[r].startswith("rank 1 healed from a replica") and
               "pshardrun saw its process end: killed by signal 9" in heal[r]
               for r in (0, 2, 3)), heal
    assert "lost shard server (pshardrun saw its process end" in p.stdout, p.stdout[-6000:]
    first = [json.loads((run / f"rank-{r}-0.json").read_text()) for r in (0, 2, 3)]
    repl = json.loads((run / "rank-1-1.json").read_text())
    assert all(f["aborted"] == [4] for f in first), first
    assert repl["started_at"] == 5 and repl["aborted"] == [], repl
    for f in first + [repl]:
        assert set(f["mesh_sums"]) == {"replicate", "shard"}, f
        assert all(got == want for got, want in f["mesh_sums"].values()), f

    ref = tmp_path / "reference"
    ref.mkdir()
    p = pshardrun(4, worker, [str(ref), "-1", "4", "server", "", "2x2"])
    assert p.returncode == 0, p.stdout[-4000:]
    a, b = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_heal_refuses_another_model(tmp_path):
    """The replacement of a lost server's trainer defines another model than the replicas
    hold: its DefineModel is refused naming both fingerprints, and the job ends."""
    worker = os.path.join(HERE, "replace_worker.py")
    p = pshardrun(4, worker, [str(tmp_path), "4", "", "server", "server", "2x2"],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"],
                  env={"REPLACE_WORKER_OTHER_MODEL": "1"})
    assert p.returncode != 0, p.stdout[-6000:]
    assert "replacing it and its trainer (restart 1 of 1)" in p.stdout, p.stdout[-6000:]
    assert "rank 1's replacement trainer defines another model" in p.stdout, p.stdout[-6000:]
    assert "than its replicas hold" in p.stdout, p.stdout[-6000:]


def test_heal_source_lost_mid_copy(tmp_path):
    """The heal's source (rank 3) dies after it sent the header of its state
    (PSHARD_FAULT_INJECT=heal-send:4): the heal fails on the new server, naming the source and
    itself, and the job ends (its one restart was the heal)."""
    worker = os.path.join(HERE, "replace_worker.py")
    p = pshardrun(4, worker, [str(tmp_path), "4", "", "server", "server", "2x2"],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"],
                  env={"PSHARD_FAULT_INJECT": "heal-send:4"})
    assert p.returncode != 0, p.stdout[-6000:]
    assert "replacing it and its trainer (restart 1 of 1)" in p.stdout, p.stdout[-6000:]
    assert "killing this process at heal-send of step 4" in p.stdout, p.stdout[-6000:]
    assert "healing shard index 1 from rank 3 failed on rank 1" in p.stdout, p.stdout[-6000:]


@pytest.mark.parametrize("mesh,optim", [("", "server"), ("2x2", "torch")])
def test_server_loss_without_heal_restarts(tmp_path, mesh, optim):
    """Where no replica can heal a lost server (FSDP without replicas, or a torch.optim
    optimizer in the trainers, whose servers took back pshard/heal/capable at its first step),
    pshardrun --max-restarts names the lost server and restarts everything as before (here
    from step 0: no checkpoint), which then trains to the end."""
    worker = os.path.join(HERE, "replace_worker.py")
    n = 4 if mesh else 3
    p = pshardrun(n, worker, [str(tmp_path), "4", "", optim, "server", mesh],
                  extra=["--max-restarts", "1", "--lease-ms", "2000"])
    assert p.returncode == 0, p.stdout[-6000:]
    assert "replacing it and its trainer" not in p.stdout, p.stdout[-6000:]
    assert "first failure: shard server 1 (pid" in p.stdout, p.stdout[-6000:]
    assert "restart 1 of 1: starting" in p.stdout, p.stdout[-6000:]


def test_replacement_refuses_lost_running_statistics(tmp_path):
    """BatchNorm's running statistics lived only in the lost trainer: its replacement says so
    and the job fails, rather than going on with that rank's statistics back at their start."""
    worker = os.path.join(HERE, "replace_worker.py")
    p = pshardrun(3, worker, [str(tmp_path), "3", ""],
                  extra=["--max-restarts", "1", "--lease-ms", "2000",
                         "--replace-timeout-ms", "20000"],
                  env={"REPLACE_WORKER_BATCHNORM": "1"})
    assert p.returncode != 0, p.stdout[-4000:]
    assert "replacing it (restart 1 of 1)" in p.stdout, p.stdout[-4000:]
    assert "running statistics (1: BatchNorm buffers" in p.stdout, p.stdout[-4000:]


def test_checkpoint_keeps_the_aborted_steps(tmp_path):
    """A checkpoint saved after a replacement counts the aborted step in the data position: a
    job resumed from it starts its data where the first left off (resume_step = steps applied +
    steps aborted), not one step early."""
    worker = os.path.join(HERE, "replace_worker.py")
    ck, first, second = tmp_path / "ck", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    p = pshardrun(3, worker, [str(first), "4", ""],
                  extra=["--max-restarts", "1", "--lease-ms", "2000", "--checkpoint-dir", str(ck)],
                  env={"REPLACE_WORKER_SAVE": "1"})
    assert p.returncode == 0, p.stdout[-4000:]
    assert "replacing it (restart 1 of 1)" in p.stdout, p.stdout[-4000:]
    done = json.loads((first / "rank-0-0.json").read_text())
    assert done["aborted"] == [4] and done["steps"] == 11, done
    manifest = json.loads(next(ck.glob("step-*/manifest.json")).read_text())
    assert manifest["step"] == 11 and manifest["aborted_steps"] == 1, manifest

    p = pshardrun(3, worker, [str(second), "-1", ""], extra=["--resume", str(ck)])
    assert p.returncode == 0, p.stdout[-4000:]
    for r in range(3):
        again = json.loads((second / f"rank-{r}-0.json").read_text())
        assert again["started_at"] == 12 and again["steps"] == 11, again
