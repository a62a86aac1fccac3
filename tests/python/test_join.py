"""pshard.torch.Join for uneven inputs on a sharded model (torch's Join semantics)."""
import pytest

from test_oracle import check

MLP = {"model": "mlp", "steps": 10, "lr": 1e-2, "two_groups": True, "scheduler": True}


def test_uneven_inputs_match_contributor_average(train):
    cfg = dict(MLP, uneven=True, join="shadow")  # rank r has 10 + r batches
    results, final, _ = train(cfg, 3)
    check(results, final, cfg, 3)
    assert [len(r["losses"]) for r in results] == [10, 11, 12]
    assert [r["join"]["is_last_joiner"] for r in results] == [False, False, True]
    assert all(r["join"]["last_rank"] == 2 for r in results)


def test_rank_without_data(train):
    cfg = dict(MLP, join="shadow", empty_rank=1)
    results, final, _ = train(cfg, 3)
    check(results, final, cfg, 3)
    assert len(results[1]["losses"]) == 0


def test_throw_on_early_termination(train):
    cfg = dict(MLP, uneven=True, join="throw")
    results, _, out = train(cfg, 3)
    # As torch's Join: the rank that ran out of input raises too, after its 10 steps.
    e0 = results[0]["error"]
    assert len(results[0]["losses"]) == 10 and e0 is not None, results[0]
    assert e0["type"] == "JoinedError" and e0["message"] == "Rank 0 exhausted all inputs.", e0
    for r in results[1:]:
        e = r["error"]
        assert e is not None, r
        assert e["type"] == "JoinedError" and e["status"] == "PSHARD_ERR_JOINED", e
        assert "rank 0" in e["message"], e
        assert len(r["losses"]) <= 10


def test_disabled_join_is_plain(train):
    cfg = dict(MLP, join="disabled")
    results, final, _ = train(cfg, 2)
    check(results, final, cfg, 2)
    assert all(r["join"] is None for r in results)


def test_joined_rank_changes_no_reduction(tmp_path):
    """Rank 0 joins at once; ranks 1 and 2 all-reduce with every reduction: the result is
    theirs alone (the joined rank's server sends each reduction's identity)."""
    import json
    import os

    from conftest import HERE, pshardrun
    p = pshardrun(3, os.path.join(HERE, "join_coll_worker.py"), [str(tmp_path)])
    assert p.returncode == 0, p.stdout[-4000:]
    ranks = [2.0, 3.0]  # rank + 1 of the contributors
    want = {"SUM": [5.0, -5.0], "AVG": [2.5, -2.5], "PRODUCT": [6.0, 6.0],
            "MIN": [2.0, -3.0], "MAX": [3.0, -2.0],
            "BAND": [2 & 3, 11 & 10], "BOR": [2 | 3, 11 | 10], "BXOR": [2 ^ 3, 11 ^ 10]}
    assert sum(ranks) == 5.0
    assert json.loads((tmp_path / "rank-0.json").read_text()) == {}
    for r in (1, 2):
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        for step in (0, 1):
            for name, w in want.items():
                assert got[f"{name} {step}"] == w, (r, name, step, got)
            assert got[f"scatter {step}"] == [r * 10.0, float(step)], (r, got)
            # block k from rank k: zeros from the joined rank 0
            assert got[f"all_to_all {step}"] == [0.0, 10.0 + r, 20.0 + r], (r, got)
            assert "joined" in got[f"send to joined {step}"], got
            # (block r of arange(6) + 10 * rank, averaged over ranks 1 and 2)
            assert got[f"reduce_scatter {step}"] == [15.0 + 2 * r, 16.0 + 2 * r], got
            assert got[f"p2p {step}"] == ([0.0, 0.0] if r == 1 else [1.0, float(step)]), got
            assert got[f"all_to_all uneven {step}"] == (
                [0.0, 0.0, 11.0, 21.0, 22.0] if r == 1 else [0.0, 12.0, 13.0, 23.0]), (r, got)
            if r == 2:  # the root of the reduce: min over ranks 1 and 2 only
                assert got[f"reduce {step}"] == [2.0, -3.0], got
            if r == 1:  # the gather's root: rank 0's block is zeros
                assert got[f"gather {step}"] == [[0.0, 0.0], [1.0, float(step)],
                                                 [2.0, float(step)]], got


def test_joined_rank_shadows_its_groups(tmp_path):
    """Rank 0 joins at once; ranks 1..3 all-reduce on groups [0, 1], [1, 2, 3], [2, 3] and the
    world: nobody hangs, and each result is the contributors' alone."""
    import json
    import os

    from conftest import HERE, pshardrun
    p = pshardrun(4, os.path.join(HERE, "join_groups_worker.py"), [str(tmp_path)])
    assert p.returncode == 0, p.stdout[-4000:]
    members = {"01": [1], "123": [1, 2, 3], "23": [2, 3], "world": [1, 2, 3]}
    assert json.loads((tmp_path / "rank-0.json").read_text()) == {}
    for r in (1, 2, 3):
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        for step in (0, 1):
            for g, ranks in members.items():
                if r not in ranks:
                    assert not any(k.startswith(g + " ") for k in got), (r, g, got)
                    continue
                v = [x + 1.0 for x in ranks]
                want = {"SUM": sum(v), "AVG": sum(v) / len(v), "MAX": max(v)}
                for op, w in want.items():
                    neg = -min(v) if op == "MAX" else -w
                    assert got[f"{g} {op} {step}"] == [w, neg], (r, g, op, step, got)
            assert got[f"123 broadcast {step}"] == [3.0, float(step)], (r, got)
            if r == 1:
                msg = got[f"01 broadcast {step}"]
                assert "root" in msg and "joined" in msg, msg


@pytest.mark.parametrize("inputs", ["uneven", "even"])
def test_throw_mode_matches_torch(tmp_path, inputs):
    """Join(throw_on_early_termination=True) ends as torch's does (DDP + torch's Join on gloo,
    the same script): with uneven inputs every rank raises, the one that ran out of input with
    "Rank 0 exhausted all inputs.", at the same step, and no post hook runs; with even inputs
    nobody raises and the post hooks run. A collective after the block completes either way."""
    import json

    from conftest import HERE, pshardrun, run_gloo
    worker = HERE + "/join_throw_worker.py"
    runs = {}
    for backend in ("gloo", "pshard"):
        out = tmp_path / backend
        out.mkdir()
        args = [backend, str(out), str(tmp_path / f"{backend}-init"), inputs]
        if backend == "gloo":
            run_gloo(3, [worker, *args])
        else:
            p = pshardrun(3, worker, args)
            assert p.returncode == 0, p.stdout[-4000:]
        runs[backend] = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(3)]
    torch_runs, ps = runs["gloo"], runs["pshard"]
    for r in range(3):
        t, p = torch_runs[r], ps[r]
        assert p["steps"] == t["steps"] and p["post_hook"] == t["post_hook"], (r, t, p)
        assert p["after"] == t["after"] == 3.0, (r, t, p)
        assert (p["error"] is None) == (t["error"] is None), (r, t, p)
    if inputs == "uneven":
        assert torch_runs[0]["error"] == "RuntimeError: Rank 0 exhausted all inputs.", torch_runs
        assert ps[0]["error"] == "JoinedError: Rank 0 exhausted all inputs.", ps
        assert all("rank 0" in p["error"] for p in ps[1:]), ps
    else:
        assert all(p["error"] is None and p["post_hook"] for p in ps), ps


def test_main_hook_refused():
    """pshard does not run main hooks (its servers answer the others' collectives for a joined
    rank): a Joinable whose hook has one is refused when the Join is made, naming why."""
    import torch.distributed.algorithms.join as tj

    import pshard.torch as pt

    class Shadowing(tj.JoinHook):
        def main_hook(self):
            pass

    class Mine:
        def join_hook(self, **kwargs):
            return Shadowing()
    with pytest.raises(NotImplementedError, match="does not run main hooks"):
        pt.Join([Mine()])

    class PostOnly(tj.JoinHook):
        def post_hook(self, is_last_joiner):
            pass

    class Fine:
        def join_hook(self, **kwargs):
            return PostOnly()
    pt.Join([Fine()])  # a post hook alone is fine
