"""FULL_SHARD holds only the units in flight; parameters are views of shared memory."""
import json
import os

import pytest

from conftest import HERE, pshardrun


def run(tmp_path, mode):
    out = tmp_path / mode
    out.mkdir()
    p = pshardrun(2, os.path.join(HERE, "mem_worker.py"), [mode, str(out)])
    assert p.returncode == 0, p.stdout[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mem")
    return run(tmp, "full"), run(tmp, "grad_op")


def test_full_shard_holds_only_units_in_flight(both):
    full, grad_op = both
    for r in full:
        blk, root = r["block_bytes"], r["root_bytes"]
        total = root + 8 * blk
        peak = r["stats"]["peak_in_use_bytes"]
        # The root unit, the unit running, the one prefetched and one more in the gather
        # bound (max 2 in flight), each with its gradient at most; far from all 8 blocks.
        bound = 2 * (root + 3 * blk) + 4096
        assert peak <= bound, (peak, bound, total)
        assert peak < total, (peak, total)
        assert r["stats"]["peak_gathers_in_flight"] <= 2
    for r in grad_op:
        # SHARD_GRAD_OP keeps every unit gathered through backward.
        assert r["stats"]["peak_in_use_bytes"] >= r["root_bytes"] + 8 * r["block_bytes"]


def test_parameters_are_views_of_shared_memory(both):
    for r in both[0] + both[1]:
        # Every parameter's storage is its fixed shared-memory buffer, the same every step:
        # gathers write in place, nothing is copied into torch-owned memory.
        for addrs in r["addrs"]:
            assert addrs == r["buffers"]
        # The sharded parameters (DTensors) hold the shard server's masters, not a copy.
        for locs in r["locals"]:
            assert locs == r["masters"]


def test_shard_views_are_the_servers_masters(tmp_path):
    """Client.shard_view: this rank's rows of the initial values, as a 1-D fp32 tensor on the
    shard server's memory; writing it changes what every rank gathers."""
    out = tmp_path / "views"
    out.mkdir()
    p = pshardrun(2, os.path.join(HERE, "shard_view_worker.py"), [str(out)])
    assert p.returncode == 0, p.stdout[-4000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        w, b = r["views"]
        # w (5 x 3): rank 0 rows 0-2, rank 1 rows 3-4; b (1 row): rank 0 only.
        assert (w["offset"], w["numel"]) == ((0, 9) if r["rank"] == 0 else (9, 6)), w
        assert b["numel"] == (1 if r["rank"] == 0 else 0), b
        for v in (w, b):
            assert v["master_ok"] and v["grad_zero"], v
            assert v["shape"] == [v["numel"]] and v["dtype"] == "torch.float32", v
        assert r["bad_index"] == "InvalidArgumentError"
        assert r["step"] == 1
        assert r["gathered_ok"]
