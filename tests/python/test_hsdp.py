"""HSDP (FSDP's HYBRID_SHARD, FSDP2's 2-D mesh): fully_shard(mesh=init_device_mesh("cpu",
(R, S), mesh_dim_names=("replicate", "shard"))) on R * S ranks matches the single-process
reference like plain FSDP; the parameter all-gathers stay inside the shard groups; a
checkpoint written by replica 0 loads on another mesh and on plain FSDP."""
import re

import pytest

from test_oracle import check

MLP = {"model": "mlp", "steps": 8, "lr": 1e-2, "two_groups": True, "scheduler": True,
       "clip": 0.5}

# One line per collective (PSHARD_LOG_SUBSYS=coll): op, counts, communicator, its size.
COLL = re.compile(r"coll (\w+) seq \d+ .*?\(communicator (\S+) generation \d+, rank \d+ of (\d+)")


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4), (4, 1), (2, 1)])
def test_hsdp_matches_reference(train, tmp_path, mesh):
    world = mesh[0] * mesh[1]
    cfg = dict(MLP, mesh=list(mesh), all_final=True)
    results, final, out = train(cfg, world, env={"PSHARD_LOG": "info",
                                                 "PSHARD_LOG_SUBSYS": "coll"})
    check(results, final, cfg, world)
    if mesh[0] > 1:
        _replicas_equal(tmp_path, mesh)
    seen = {}
    for op, comm, size in COLL.findall(out):
        seen.setdefault(comm, set()).add((op, int(size)))
    assert seen, out[-3000:]
    if mesh[0] > 1:
        # The shard groups gather the parameters; the replicate groups only all-reduce the
        # gradients; the world ring carries the per-operation agreements (tiny all-gathers)
        # and nothing else of the model.
        shard = {c: v for c, v in seen.items() if re.fullmatch(r"hsdp\d+s\d+", c)}
        rep = {c: v for c, v in seen.items() if re.fullmatch(r"hsdp\d+r\d+", c)}
        assert len(shard) == mesh[0] and len(rep) == mesh[1], seen
        for v in shard.values():
            assert ("all_gather", mesh[1]) in v or mesh[1] == 1, v
            assert all(size == mesh[1] for _, size in v), v
        for v in rep.values():
            assert {op for op, _ in v} == {"all_reduce"}, v
            assert all(size == mesh[0] for _, size in v), v
        assert not any(op == "reduce_scatter" for op, _ in seen.get("shard", ())), seen


def test_hsdp_accumulate_without_all_reduce(train):
    """set_requires_all_reduce(False) on the micro-batches but the last (FSDP2's HSDP gradient
    accumulation): the step's gradients are the sums over every micro-batch and rank."""
    cfg = dict(MLP, mesh=[2, 2], accum=3, accum_all_reduce=True)
    results, final, _ = train(cfg, 4)
    check(results, final, cfg, 4)


def test_hsdp_bf16(train, tmp_path):
    """bf16 gathers and gradient reductions on a (2, 2) mesh (the replicas' all-reduce then
    runs per parameter): within bf16's precision of an fp64 reference."""
    cfg = dict(MLP, mesh=[2, 2], param_dtype="bfloat16", reference_fp64=True, clip=None,
               optimizer="sgd", lr=0.1, all_final=True)
    results, final, _ = train(cfg, 4)
    check(results, final, cfg, 4, rtol=2e-2, atol=2e-2, watol=2e-2)
    _replicas_equal(tmp_path, (2, 2))


def _replicas_equal(tmp_path, mesh):
    """Every replica holds bit for bit the same weights (the full state dicts its ranks
    gathered from their own shard group, in the newest run under tmp_path)."""
    import os

    import torch
    run = max(tmp_path.glob("run-*"), key=os.path.getmtime)
    sds = [torch.load(os.path.join(run, f"final-{r}.pt")) for r in range(mesh[0] * mesh[1])]
    for r, sd in enumerate(sds):
        for k, v in sd.items():
            assert torch.equal(v, sds[r % mesh[1]][k]), (r, k)


def test_hsdp_checkpoint_loads_on_another_mesh(train, tmp_path):
    ck = tmp_path / "ck"
    cfg = dict(MLP, steps=4, save_at=4, optimizer="adamw", clip=None)
    first, _, _ = train(dict(cfg, mesh=[2, 2]), 4, extra=["--checkpoint-dir", str(ck)])
    assert all(r["error"] is None for r in first), first
    # Every rank reports the same directory; replica 0 wrote it.
    assert len({r["checkpoint"] for r in first}) == 1, first
    cont = dict(cfg, steps=8, save_at=None)
    for mesh, world in (([1, 2], 2), (None, 2), ([2, 1], 2)):
        c = dict(cont, mesh=mesh) if mesh else cont
        second, final, _ = train(c, world, extra=["--resume", str(ck)])
        assert [r["start"] for r in second] == [4] * world, (mesh, second)
        merged = [{"losses": first[r]["losses"] + (second[r]["losses"] if r < world else []),
                   "error": None} for r in range(4)]
        check(merged, final, dict(cont, resume_world={"at": 4, "world": world}), 4)


def test_hsdp_uneven_inputs_join(train):
    """Join on the 2-D mesh: rank r has 8 + r batches; a joined rank's server keeps taking
    part in its shard group's gathers and its replicate group's all-reduces."""
    cfg = dict(MLP, mesh=[2, 2], uneven=True, join="shadow", clip=None)
    results, final, _ = train(cfg, 4)
    check(results, final, cfg, 4)
    assert [len(r["losses"]) for r in results] == [8, 9, 10, 11]
    assert all(r["join"]["last_rank"] == 3 for r in results)


def test_hsdp_trainer_killed_is_named(cluster, tmp_path):
    """A trainer killed mid-step on a (2, 2) mesh: every other rank fails with PeerLostError
    naming it, whether it shares a group with it (ranks 0 and 3) or not (rank 2)."""
    from conftest import check_killed_trainer_named
    c = cluster(4, lease_ms=2000, heartbeat_ms=500)
    check_killed_trainer_named(c, tmp_path, dict(MLP, steps=50, mesh=[2, 2], kill_rank=1,
                                                 kill_step=3))
