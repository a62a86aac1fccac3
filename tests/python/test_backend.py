"""torch.distributed on backend "pshard" against gloo: the same script (backend_worker.py: every
collective of the backend table, async, object and functional collectives, DTensor) runs on
torch's gloo and on pshard's shard servers, and every rank's results must agree (exactly for
data movement and integer reductions, to a rounding of the dtype for floating-point sums)."""
import os

import pytest
import torch

from conftest import HERE, pshardrun, run_gloo

WORKER = os.path.join(HERE, "backend_worker.py")


def flat(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for e in v for x in flat(e)]
    return [v]


def same(u, v):
    if not isinstance(u, torch.Tensor):
        return u == v
    if u.dtype != v.dtype or u.shape != v.shape:
        return False
    if not u.dtype.is_floating_point:
        return torch.equal(u, v)
    # Sums of several ranks round differently in gloo's ring and pshard's; allow a rounding or
    # two of the dtype (bfloat16's eps is 2**-7) on top of float32's.
    eps = torch.finfo(u.dtype).eps
    scale = max(1.0, float(u.abs().max()) if u.numel() else 1.0)
    return torch.allclose(u.double(), v.double(), rtol=4 * eps, atol=4 * eps * scale)


def compare(gloo_dir, ps_dir, world):
    bad = []
    for r in range(world):
        want = torch.load(gloo_dir / f"rank-{r}.pt")
        got = torch.load(ps_dir / f"rank-{r}.pt")
        assert set(want) == set(got), set(want) ^ set(got)
        for name, w in want.items():
            g = got[name]
            werr = isinstance(w, dict)
            gerr = isinstance(g, dict)
            if werr and not gerr and "uneven" in name:
                # gloo refuses tensors of different sizes; pshard (as NCCL) takes them, and the
                # worker checked the values itself
                if not (isinstance(g, torch.Tensor) and bool(g.all())):
                    bad.append((r, name, "pshard's uneven result is wrong"))
                continue
            if werr or gerr:
                if werr != gerr:
                    bad.append((r, name, w if werr else "ok", g if gerr else "ok"))
                continue
            fw, fg = flat(w), flat(g)
            if len(fw) != len(fg) or not all(same(a, b) for a, b in zip(fw, fg)):
                bad.append((r, name, str(fw)[:300], str(fg)[:300]))
    assert not bad, bad


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_pshard_matches_gloo(tmp_path, world):
    """pshard.init_process_group() (torch's default group on backend "pshard", its store the
    coordinator's) against gloo."""
    gloo_dir, ps_dir = tmp_path / "gloo", tmp_path / "pshard"
    run_gloo(world, [WORKER, "gloo", str(gloo_dir), str(tmp_path / "gloo-init")])
    p = pshardrun(world, WORKER, ["pshard", str(ps_dir)])
    assert p.returncode == 0, p.stdout[-4000:]
    compare(gloo_dir, ps_dir, world)


@pytest.mark.parametrize("world", [2, 3])
def test_torch_init_on_pshard_matches_gloo(tmp_path, world):
    """torch's own init_process_group(backend="pshard") in a script that only imports pshard
    (a FileStore here, to show any torch store works)."""
    gloo_dir, ps_dir = tmp_path / "gloo", tmp_path / "pshard"
    run_gloo(world, [WORKER, "gloo", str(gloo_dir), str(tmp_path / "gloo-init")])
    p = pshardrun(world, WORKER, ["pshard-torch", str(ps_dir), str(tmp_path / "ps-init")])
    assert p.returncode == 0, p.stdout[-4000:]
    compare(gloo_dir, ps_dir, world)


def test_device_tensors_through_host_copies_match_gloo(tmp_path):
    """CUDA tensors go through host copies (inputs copied out, outputs copied back after the
    collective, asynchronous Works included); PSHARD_TEST_EMULATE_DEVICE=1 stages every tensor
    alike, so the same comparison with gloo covers that path without a GPU."""
    world = 3
    gloo_dir, ps_dir = tmp_path / "gloo", tmp_path / "pshard"
    run_gloo(world, [WORKER, "gloo", str(gloo_dir), str(tmp_path / "gloo-init")])
    p = pshardrun(world, WORKER, ["pshard", str(ps_dir)],
                  env={"PSHARD_TEST_EMULATE_DEVICE": "1"})
    assert p.returncode == 0, p.stdout[-4000:]
    compare(gloo_dir, ps_dir, world)
    staged = [int((ps_dir / f"staged-{r}.txt").read_text()) for r in range(world)]
    assert all(n > 50 for n in staged), staged
