"""pshard's own checkpoints <-> torch.distributed.checkpoint, offline (python -m pshard.checkpoint):
a shard servers' checkpoint converted to DCP loads into torch's own model and optimizer with
the saving job's values; converted back it resumes on another world size exactly as the
original does; a DCP that torch alone wrote resumes in pshard with torch's values; bad input
is refused with a message that says what to do."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cases
import pshard._C as C
from pshard.checkpoint import from_dcp, to_dcp

MLP = {"model": "mlp", "lr": 1e-2, "two_groups": True, "scheduler": True, "optimizer": "adamw",
       "unused": True}


def sections(step_dir):
    """Every section of every parameter of a pshard checkpoint, and its skipped steps."""
    h, info = C.ckpt_open(str(step_dir))
    out = {}
    for i, (name, shape, skipped) in enumerate(info["params"]):
        for s, sec in enumerate(info["sections"]):
            n = 1
            for d in shape:
                n *= d
            buf = bytearray(4 * n)
            C.ckpt_read(h, s, i, buf)
            out[(name, sec)] = torch.frombuffer(buf, dtype=torch.float32).reshape(shape)
        out[(name, "skipped")] = skipped
    return info, out


def torch_load(dcp_dir, cfg, state_only=False):
    """The DCP loaded into a plain single-process model and torch.optim.AdamW (two groups)."""
    model = cases.make_model(dict(cfg, seed=99))
    opt = cases.make_optimizer(torch.optim, cases.param_groups(model, cfg), cfg)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": {"state": osd["state"]} if state_only else osd},
             checkpoint_id=str(dcp_dir), no_dist=True)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return model, opt, osd


def test_pshard_to_dcp_and_back(train, tmp_path):
    ck = tmp_path / "ck"
    first, saved, _ = train(dict(MLP, steps=5, save_at=5, optim_dump_at=5), 3,
                            extra=["--checkpoint-dir", str(ck)])
    assert all(r["error"] is None for r in first), first
    step_dir = ck / "step-00000005"
    out = tmp_path / "dcp"
    py = sys.executable
    p = subprocess.run([py, "-m", "pshard.checkpoint", "to-dcp", str(step_dir), str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "step 5" in p.stdout, p.stdout + p.stderr
    assert "Warning" not in p.stderr, p.stderr

    # Into torch's own model and AdamW, which has two param groups: the state only.
    model, opt, osd = torch_load(out, MLP, state_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    job = torch.load(next(tmp_path.glob("run-3-*")) / "optim-5.pt")  # the saving job's own
    for n, prm in model.named_parameters():
        mine = opt.state[prm]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[key], job["state"][n][key]), (n, key)
        assert float(mine["step"]) == float(job["state"][n]["step"]), n
    assert float(opt.state[model[0].spare.weight]["step"]) == 0
    assert [g["lr"] for g in opt.param_groups] == [MLP["lr"], MLP["lr"] * 0.5]

    # Back to pshard's format: every section and skipped count as the servers wrote them.
    root2 = tmp_path / "ck2"
    p = subprocess.run([py, "-m", "pshard.checkpoint", "from-dcp", str(out), str(root2)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    info1, a = sections(step_dir)
    info2, b = sections(root2 / "step-00000005")
    assert info2["step"] == 5 and info2["optimizer"]["kind"] == "adamw"
    assert [x[:2] for x in info1["params"]] == [x[:2] for x in info2["params"]]
    assert a.keys() == b.keys() and a[("0.spare.weight", "skipped")] == 5
    for k in a:
        assert (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]), k

    # Both resume on 2 ranks and train on identically.
    cfg = dict(MLP, steps=8)
    r1, f1, _ = train(cfg, 2, extra=["--resume", str(ck)])
    r2, f2, _ = train(cfg, 2, extra=["--resume", str(root2)])
    assert [r["start"] for r in r2] == [5, 5] and [r["losses"] for r in r1] == [r["losses"] for r in r2]
    for k, v in f1.items():
        assert torch.equal(f2[k], v), k

    # A committed step is never overwritten.
    p = subprocess.run([py, "-m", "pshard.checkpoint", "from-dcp", str(out), str(root2)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "already holds a committed checkpoint" in p.stderr, p.stderr


def test_torch_dcp_to_pshard(train, tmp_path):
    """A DCP written by torch alone (one process, torch.optim.AdamW, three steps; one
    parameter never gets a gradient) resumes in pshard on 2 ranks with exactly its values."""
    cfg = dict(MLP, scheduler=False)
    model = cases.make_model(cfg)
    opt = cases.make_optimizer(torch.optim, cases.param_groups(model, cfg), cfg)
    for s in range(3):
        x, y = cases.batch(cfg, 0, s)
        opt.zero_grad()
        cases.loss_of(model, cfg, x, y).backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    out = tmp_path / "torch-dcp"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out), no_dist=True)
    root = tmp_path / "ck"
    step_dir = from_dcp(out, root)
    assert step_dir.endswith("step-00000003")
    # Resumed, before any step: the weights and the optimizer state (torch's format) are
    # torch's, and the parameter torch never stepped has no state (pshard: step 0, zeros).
    res, final, _ = train(dict(cfg, steps=3, optim_dump_at=3), 2, extra=["--resume", str(root)])
    assert [r["start"] for r in res] == [3, 3], res
    for k, v in model.state_dict().items():
        assert torch.equal(final[k], v), k
    got = torch.load(next(tmp_path.glob("run-2-*")) / "optim-3.pt")
    for n, prm in model.named_parameters():
        if n.startswith("0.spare."):
            assert prm not in opt.state and float(got["state"][n]["step"]) == 0, n
            continue
        want = opt.state[prm]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][n][key], want[key]), (n, key)
        assert float(got["state"][n]["step"]) == float(want["step"]) == 3, n


def test_bad_input(tmp_path):
    # Not a checkpoint; then a shard file with one flipped byte.
    with pytest.raises(C.NotFoundError, match="manifest"):
        to_dcp(tmp_path, tmp_path / "x")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    d = tmp_path / "dcp"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d), no_dist=True)
    # A buffer (BatchNorm's int64 count) is not a parameter: name the parameters.
    with pytest.raises(ValueError, match="named_parameters"):
        from_dcp(d, tmp_path / "ck")
    # BatchNorm's running stats are float buffers: left out when params names the parameters.
    names = [n for n, _ in model.named_parameters()]
    step_dir = from_dcp(d, tmp_path / "ck", params=names)
    info, _ = sections(step_dir)
    assert [p[0] for p in info["params"]] == names and info["optimizer"]["kind"] == "adam"
    with pytest.raises(ValueError, match="not in"):
        from_dcp(d, tmp_path / "ck3", params=["nope.weight"])
    with pytest.raises(ValueError, match="below"):
        from_dcp(d, tmp_path / "ck4", params=names, step=0)
    with pytest.raises(ValueError, match="'lion'"):
        from_dcp(d, tmp_path / "ck5", params=names, optimizer="lion")
    # A DCP without a "model" entry.
    bare = tmp_path / "bare"
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(bare), no_dist=True)
    with pytest.raises(ValueError, match="no 'model"):
        from_dcp(bare, tmp_path / "ck6")
    # A corrupted shard file is caught by its checksum before anything is written.
    shard = os.path.join(step_dir, "shard-00000-of-00001.bin")
    data = bytearray(open(shard, "rb").read())
    data[5] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(C.InvalidArgumentError, match="checksum"):
        to_dcp(step_dir, tmp_path / "y")
    assert not (tmp_path / "y").exists()
