"""pshard.torch.Join for uneven inputs on a sharded model (torch's Join semantics)."""
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
    assert results[0]["error"] is None and len(results[0]["losses"]) == 10
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
