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


def test_state_dict_round_trip(train, tmp_path):
    _, final, _ = train(dict(MLP, steps=3), 2)
    path = tmp_path / "sd.pt"
    torch.save(final, path)
    # A fresh model loads it before its first forward; gathered back it is the same.
    _, again, _ = train(dict(MLP, steps=0, load=str(path), seed=7), 2)
    assert set(again) == set(final)
    for k, v in final.items():
        assert torch.equal(again[k], v), k
