"""Checkpoints from Python: saved by the shard servers on 3 ranks, resumed on 2 (resharded),
and training goes on as if uninterrupted; full state dicts and safetensors round trips."""
import os
import subprocess
import sys

import torch

from test_oracle import check

MLP = {"model": "mlp", "lr": 1e-2, "two_groups": True, "scheduler": True, "optimizer": "adamw"}


def test_save_on_3_resume_on_2(train, tmp_path):
    ck = tmp_path / "ck"
    first, _, _ = train(dict(MLP, steps=6, save_at=6), 3, extra=["--checkpoint-dir", str(ck)])
    assert all(r["error"] is None for r in first), first
    assert first[0]["checkpoint"].endswith("step-00000006"), first[0]
    cfg = dict(MLP, steps=12)
    second, final, _ = train(cfg, 2, extra=["--resume", str(ck)])
    assert [r["start"] for r in second] == [6, 6]
    assert [len(r["losses"]) for r in second] == [6, 6]
    # One run as the reference: steps 0-5 on 3 ranks, 6-11 on 2, no interruption.
    merged = [{"losses": first[r]["losses"] + (second[r]["losses"] if r < 2 else []),
               "error": None} for r in range(3)]
    check(merged, final, dict(cfg, resume_world={"at": 6, "world": 2}), 3)

    # The checkpoint exported by pshardctl loads as initial weights (safetensors).
    st = tmp_path / "model.safetensors"
    ctl = os.path.join(os.path.dirname(sys.executable), "pshardctl")
    p = subprocess.run([ctl, "checkpoint", "export", "--format", "safetensors",
                        "--checkpoint-dir", str(ck), str(st)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    loaded, final2, _ = train(dict(MLP, steps=0, load_safetensors=str(st)), 2)
    from safetensors.torch import load_file
    ref = load_file(str(st))
    assert set(ref) <= set(final2)
    for k, v in ref.items():
        assert torch.equal(final2[k], v), k


def test_pshard_checkpoint_to_torch_optimizer_state(train, tmp_path):
    """A shard servers' checkpoint (pshardrun --checkpoint-dir) resumed on another world size
    gives the server-side AdamW's state back in torch's format (get_optimizer_state_dict, what
    dcp.save writes): exactly the state the saving job had, each parameter's step included
    (one parameter never had a gradient). That is the conversion from pshard's checkpoints to
    DCP; the other way, dcp.load then save_checkpoint (test_llama loads DCP into it)."""
    ck = tmp_path / "ck"
    cfg = dict(MLP, steps=5, save_at=5, optim_dump_at=5, unused=True)
    first, _, _ = train(cfg, 3, extra=["--checkpoint-dir", str(ck)])
    assert all(r["error"] is None for r in first), first
    second, _, _ = train(dict(cfg, steps=5, save_at=None), 2, extra=["--resume", str(ck)])
    assert [r["start"] for r in second] == [5, 5], second
    want = torch.load(next(tmp_path.glob("run-3-*")) / "optim-5.pt")  # (train's run dirs)
    got = torch.load(next(tmp_path.glob("run-2-*")) / "optim-5.pt")
    assert set(want["state"]) == set(got["state"]) and len(want["state"]) > 2
    steps = {}
    for k, st in want["state"].items():
        assert set(st) == {"exp_avg", "exp_avg_sq", "step"}, st.keys()
        for n, v in st.items():
            assert torch.equal(got["state"][k][n], v), (k, n)
        steps[k] = int(st["step"])
    assert steps["0.spare.weight"] == 0 and steps["0.weight"] == 5, steps
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]


def test_state_dict_round_trip(train, tmp_path):
    _, final, _ = train(dict(MLP, steps=3), 2)
    path = tmp_path / "sd.pt"
    torch.save(final, path)
    # A fresh model loads it before its first forward; gathered back it is the same.
    _, again, _ = train(dict(MLP, steps=0, load=str(path), seed=7), 2)
    assert set(again) == set(final)
    for k, v in final.items():
        assert torch.equal(again[k], v), k
