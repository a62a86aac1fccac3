"""The core oracle: models trained with pshard.torch on N ranks match plain torch in one
process, with torch.optim, on the union of the ranks' batches (losses and final weights)."""
import json

import pytest
import torch

import cases
from conftest import metric, run_trainers


def mean_losses(results):
    steps = max(len(r["losses"]) for r in results)
    out = []
    for s in range(steps):
        vals = [r["losses"][s] for r in results if s < len(r["losses"])]
        out.append(sum(vals) / len(vals))
    return out


def check(results, final, cfg, world, rtol=1e-5, atol=1e-6, watol=1e-5):
    """Losses within rtol (relative, plus atol), final weights within watol (absolute) and
    rtol: Adam turns the rounding noise of gradients that are zero in exact arithmetic (GPT-2's
    key bias) into steps of a few 1e-6."""
    for r in results:
        assert r is not None and r["error"] is None, r
    ref_losses, ref_sd = cases.reference(cfg, world)
    got = mean_losses(results)
    assert len(got) == len(ref_losses)
    for s, (a, b) in enumerate(zip(got, ref_losses)):
        assert abs(a - b) <= rtol * abs(b) + atol, f"step {s}: pshard {a} torch {b}"
    assert final is not None
    assert set(final) == set(ref_sd), set(final) ^ set(ref_sd)
    for k, v in ref_sd.items():
        torch.testing.assert_close(final[k].to(v.dtype), v, rtol=rtol, atol=watol,
                                   msg=lambda m, k=k: f"{k}: {m}")
    k = max(1, len(ref_losses) // 4)
    assert sum(ref_losses[-k:]) < sum(ref_losses[:k])  # it trained


MLP = {"model": "mlp", "steps": 20, "lr": 1e-2, "two_groups": True, "scheduler": True,
       "clip": 0.5}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_mlp_adamw_groups_scheduler_clip(train, world):
    results, final, _ = train(MLP, world)
    check(results, final, MLP, world)
    assert len(results[0]["norms"]) == 20


@pytest.mark.parametrize("variant", [
    {"optimizer": "sgd", "momentum": 0.9, "reshard_after_forward": False},
    {"optimizer": "adam", "accum": 3},
    {"freeze": True},
    # FSDP2's set_gradient_divide_factor: the sum over 2 ranks divided by 5, not 2
    # (SGD: Adam's update hardly changes when every gradient is scaled alike)
    {"optimizer": "sgd", "momentum": 0.9, "divide_factor": 5.0, "clip": None},
    # MixedPrecisionPolicy(reduce_dtype=torch.float16): each rank's gradient rounded to fp16
    {"reduce_fp16": True, "accum": 2},
])
def test_mlp_variants(train, variant):
    cfg = dict(MLP, **variant)
    results, final, _ = train(cfg, 2)
    check(results, final, cfg, 2)


def test_unused_parameters_left_alone(train):
    """Parameters of a unit that runs but never used in forward: their .grad is None on every
    rank, so torch's AdamW leaves them alone (no weight decay, no state, no step), and so do
    pshard's servers; their step counts in the optimizer's state dict say so."""
    cfg = dict(MLP, unused=True)
    results, final, _ = train(cfg, 2)
    check(results, final, cfg, 2)
    init = cases.make_model(cfg)
    for k in ("0.spare.weight", "0.spare.bias"):
        assert torch.equal(final[k], init.state_dict()[k]), k
    steps = results[0]["param_steps"]
    assert sorted(steps.values()) == [0, 0] + [20] * (len(steps) - 2), steps
    assert results[0]["state_steps"] == sorted(steps.values()), results[0]


def test_metric_all_reduce_after_backward(train):
    """dist.all_reduce of the loss between backward and the step, the usual logging: it
    runs after the reduce-scatters still queued on each rank (issue order), so no rank's
    server sees it overtake one (which would be a desync), and training is unchanged."""
    cfg = dict(MLP, log_loss=True)
    results, final, _ = train(cfg, 3)
    check(results, final, cfg, 3)
    for s in range(cfg["steps"]):
        want = sum(r["losses"][s] for r in results) / 3
        for r in results:
            assert abs(r["mean_losses"][s] - want) <= 1e-6 * abs(want), (s, r["mean_losses"][s])


def test_mlp_fsdp1_layout_refused(train):
    """pshard.torch's parameters are DTensors sharded on dim 0: the flat fsdp1 layout (whose
    shards are not rows) is refused with a message saying so, not run wrongly."""
    _, _, out = train(MLP, 2, env={"PSHARD_LAYOUT": "fsdp1"}, expect_ok=False)
    assert "the flat fsdp1 layout is for C trainers" in out, out[-3000:]


GPT2 = {"model": "gpt2", "steps": 20, "lr": 3e-3, "two_groups": True, "scheduler": True,
        "clip": 1.0, "batch": 2, "seq": 16}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gpt2_tied(train, world):
    results, final, _ = train(GPT2, world)
    check(results, final, GPT2, world)
    assert "lm_head.weight" in final and torch.equal(final["lm_head.weight"],
                                                     final["transformer.wte.weight"])


def test_gpt2_bf16_params(train):
    cfg = dict(GPT2, param_dtype="bfloat16", reference_fp64=True, clip=0)
    results, final, _ = train(cfg, 2)
    # bf16 gathers (8 bits of mantissa) against an fp64 reference: within 2e-2 relative.
    check(results, final, cfg, 2, rtol=2e-2, atol=2e-2, watol=2e-2)


@pytest.mark.parametrize("cfg", [
    dict(MLP, accum=2),
    dict(MLP, optimizer="sgd", momentum=0.9, reshard_after_forward=False, clip=None),
    dict(GPT2, param_dtype="bfloat16", reference_fp64=True, clip=0, steps=8),
], ids=["mlp-adamw-accum", "mlp-sgd-keep-root", "gpt2-bf16"])
def test_emulated_gpu_trainer(train, cfg):
    """The GPU trainer's path on the tests' stand-in for a GPU (PSHARD_TEST_EMULATE_DEVICE=1):
    the shard servers keep the shards in (emulated) device memory that the trainers open by
    its handle, and the trainers stage their unsharded parameters in tensors of their own
    (storage filled from the gathered buffer at unshard, freed at reshard) and add their
    gradients into the host buffers, as for a model on a GPU; the same numbers as plain torch."""
    results, final, _ = train(cfg, 2, env={"PSHARD_TEST_EMULATE_DEVICE": "1"})
    assert [(r["memory"], r["staged"], r["staged_bytes"]) for r in results] == \
        [("emulated", True, 0)] * 2, results
    if cfg.get("param_dtype") == "bfloat16":
        check(results, final, cfg, 2, rtol=2e-2, atol=2e-2, watol=2e-2)
    else:
        check(results, final, cfg, 2)


def train_on(c, out, cfg):
    """Runs worker.py with cfg on every rank of cluster c, into the new folder out: the results
    per rank (each has "error", None when it trained)."""
    out.mkdir()
    (out / "cfg.json").write_text(json.dumps(cfg))
    run_trainers(c, "worker.py", [str(out / "cfg.json"), str(out)], out)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(c.n)]


def train_emulated_cluster(cluster, tmp_path, shard_memory, cfg):
    """MLP training on 2 shard servers started with --shard-memory shard_memory, the tests'
    stand-in for a GPU enabled (PSHARD_TEST_EMULATE_DEVICE=1): (cluster, results per rank),
    after checking them against plain torch."""
    c = cluster(2, metrics=True, server_args=["--shard-memory", shard_memory],
                env={"PSHARD_TEST_EMULATE_DEVICE": "1"})
    results = train_on(c, tmp_path / "out", cfg)
    check(results, torch.load(tmp_path / "out" / "final.pt"), cfg, 2)
    return c, results


def test_gpu_shards_on_tcp_staged_through_host(cluster, tmp_path):
    """--shard-memory gpu on the tcp backend (several servers sharing one GPU, where NCCL takes
    one rank per GPU), on the tests' stand-in for a GPU: each server keeps its shards, and the
    trainer's model region (the full buffers it computes from), in device memory, and copies
    what the tcp collectives move through host memory (a gather's slice in and full buffer out,
    a reduce-scatter's full gradient in and slice out), which its /metrics counts; the numbers
    are plain torch's. Every parameter is reduce-scattered once a step in fp32 and gathered at
    least once, so per step at least the model's full size in fp32 goes each way, and this
    rank's elements once more to the device."""
    cfg = MLP
    c, results = train_emulated_cluster(cluster, tmp_path, "gpu", cfg)
    assert [(r["memory"], r["region"], r["staged"]) for r in results] == \
        [("emulated", "emulated", True)] * 2, results
    full = results[0]["full_elements"]
    for r in range(2):
        text = c.scrape(f"s{r}")
        elements = metric(text, "pshard_shard_elements")
        to_host = metric(text, "pshard_shard_device_staged_bytes_total", direction="to_host")
        to_device = metric(text, "pshard_shard_device_staged_bytes_total",
                           direction="to_device")
        assert elements and 0 < elements < full, text
        # gathers' full buffers and reduce-scatters' slices come back
        assert to_device >= cfg["steps"] * (full + elements) * 4, (r, to_device, elements)
        # full gradients go out, and gathers' slices
        assert to_host >= cfg["steps"] * (full + elements) * 4, (r, to_host, elements)
        # pshardctl status says the same (the server's Status RPC)
        st = c.ctl("status", "--json")
        assert st.returncode == 0, st.stdout + st.stderr
        mine = [x for x in json.loads(st.stdout)["servers"] if x.get("server_rank") == r]
        assert [x["device_staged_bytes"] for x in mine] == \
            [{"to_host": to_host, "to_device": to_device}], mine


def test_device_region_pool_too_small_fails_clearly(cluster, tmp_path):
    """The model region in the servers' (emulated) GPU memory is a pool sized at the
    definition; one too small for a parameter (PSHARD_DEVICE_POOL_BYTES) fails the gather on
    every rank with an error naming the sizes and that variable, instead of hanging or writing
    outside it. The servers keep serving: a trainer of the default size trains after it."""
    c = cluster(2, server_args=["--shard-memory", "gpu"],
                env={"PSHARD_TEST_EMULATE_DEVICE": "1", "PSHARD_DEVICE_POOL_BYTES": "1024"})
    for res in train_on(c, tmp_path / "small", dict(MLP, steps=2)):
        e = res["error"]
        assert e is not None and e["type"] == "OutOfMemoryError", e
        assert "1024-byte pool cannot fit" in e["message"], e
        assert "PSHARD_DEVICE_POOL_BYTES" in e["message"], e
    c.env.pop("PSHARD_DEVICE_POOL_BYTES")
    results = train_on(c, tmp_path / "again", MLP)
    check(results, torch.load(tmp_path / "again" / "final.pt"), MLP, 2)
    assert [r["region"] for r in results] == ["emulated"] * 2, results


def test_shard_memory_host_keeps_host_shards(cluster, tmp_path):
    """--shard-memory host: host shards even where the tests' stand-in for a GPU would be
    used; nothing is staged."""
    c, results = train_emulated_cluster(cluster, tmp_path, "host", MLP)
    assert [r["memory"] for r in results] == ["host"] * 2, results
    for r in range(2):
        text = c.scrape(f"s{r}")
        for d in ("to_host", "to_device"):
            assert metric(text, "pshard_shard_device_staged_bytes_total", direction=d) == 0
