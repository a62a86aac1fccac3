"""Bad input gets a clear Python exception naming the cause, and the cluster stays usable."""
import os
import subprocess
import sys

import pytest
import torch

import pshard
from conftest import check_killed_trainer_named

MLP = {"model": "mlp", "steps": 3, "lr": 1e-2}


@pytest.mark.parametrize("fault,cls,words", [
    ("mismatch", None, ["0.weight", "[16, 8]", "[17, 8]"]),
    ("rename", None, ["extra"]),

    ("no_params", "InvalidArgumentError", ["no parameters"]),
])
def test_bad_model_then_training_works(train, fault, cls, words):
    results, final, _ = train(dict(MLP, fault=fault), 2)
    for r in results:
        e = r["fault_error"]
        assert e is not None, (fault, r)
        if cls:
            assert e["type"] == cls, e
        msg = e["message"].lower()
        for w in words:
            assert w.lower() in msg, e
        # The same cluster then trains the right model.
        assert r["error"] is None and len(r["losses"]) == 3, r
    assert final is not None


def test_step_before_backward(train):
    results, _, _ = train(dict(MLP, fault="step_first"), 2)
    for r in results:
        assert r["fault_error"] is None, r
        # step() before backward raised FailedPreconditionError; then the model trained on
        # and its loss fell.
        a, b = r["recovered"]
        assert b < a, r


def test_mismatch_names_ranks_and_parameter(train):
    results, _, _ = train(dict(MLP, fault="mismatch"), 2)
    msg = results[0]["fault_error"]["message"]
    assert "rank 1" in msg or "rank 0" in msg, msg


def test_unsupported_options_are_refused():
    import pshard.torch as pt
    p = [torch.nn.Parameter(torch.zeros(2))]
    for kw in ({"amsgrad": True}, {"maximize": True}, {"capturable": True}, {"fused": True},
               {"differentiable": True}):
        with pytest.raises(ValueError, match=list(kw)[0]):
            pt.optim.Adam(p, **kw)
    with pytest.raises(ValueError, match="nesterov|Nesterov"):
        pt.optim.SGD(p, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        pt.optim.AdamW(p, betas=(1.5, 0.9))
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh"):
        pt.fully_shard(m, mesh=object())
    with pytest.raises(TypeError, match="offload_policy"):
        pt.fully_shard(m, offload_policy=object())
    # torch's CPUOffloadPolicy is accepted (what pshard does anyway): only the missing
    # process group stops this one
    with pytest.raises(pshard.FailedPreconditionError, match="init_process_group"):
        pt.fully_shard(m, offload_policy=pt.CPUOffloadPolicy())
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2.*True"):
        pt.fully_shard(m, reshard_after_forward=2)
    with pytest.raises(NotImplementedError, match="shard_placement_fn"):
        pt.fully_shard(m, shard_placement_fn=lambda p: None)
    # a meta module has no values to shard: refused before anything is made of it
    with pytest.raises(ValueError, match="on meta.*to_empty"):
        pt.fully_shard(torch.nn.Linear(2, 2, device="meta"))
    # torch's own policy classes are the ones fully_shard takes
    from torch.distributed.fsdp import MixedPrecisionPolicy
    assert pt.MixedPrecisionPolicy is MixedPrecisionPolicy
    with pytest.raises(pshard.FailedPreconditionError, match="init_process_group"):
        pt.fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        pt.fully_shard("not a module")


def test_no_process_group():
    with pytest.raises(pshard.FailedPreconditionError, match="init_process_group"):
        pshard.get_rank()
    env = {k: v for k, v in os.environ.items() if k != "PSHARD_SERVER"}
    p = subprocess.run([sys.executable, "-c", "import pshard; pshard.init_process_group()"],
                       env=env, capture_output=True, text=True)
    assert p.returncode != 0 and "PSHARD_SERVER is not set" in p.stderr and "pshardrun" in \
        p.stderr, p.stderr
    with pytest.raises(ValueError, match="init_method"):
        pshard.init_process_group(init_method="tcp://127.0.0.1:1")


def test_trainer_killed_mid_step(cluster, tmp_path):
    c = cluster(3, lease_ms=2000, heartbeat_ms=500)
    check_killed_trainer_named(c, tmp_path, dict(MLP, steps=50, kill_rank=1, kill_step=3))
