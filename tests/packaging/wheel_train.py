"""A trainer for the installed wheel's smoke test (tests/packaging/test_wheel.sh), on pshard's
own Python API and numpy, no torch: least-squares regression of a 2-layer linear model sharded
over the job's shard servers, plain SGD on the servers. Every rank also replays the same
training in numpy alone (the servers average the ranks' gradients, so the reference's gradient
is the mean over all ranks' batches) and exits 1 unless its losses match the reference at every
step and fall to under a hundredth of the first. Prints one line per rank:
``wheel_train rank R/N: loss FIRST -> LAST over S steps, max relative |loss - reference| D``.

Run under pshardrun: ``pshardrun --nproc 2 -- python wheel_train.py``.
"""
import sys

import numpy as np

import pshard

STEPS = 40
LR = 0.05
BATCH = 32
SHAPES = {"w1": (12, 8), "w2": (1, 12)}  # rows of w1 split over the servers, w2 padded


def data(world):
    """Every rank's batches, the same on every rank (one seed): rank r trains on xs[r]."""
    rng = np.random.default_rng(1234)
    teacher1 = rng.standard_normal(SHAPES["w1"]).astype(np.float32) / 3
    teacher2 = rng.standard_normal(SHAPES["w2"]).astype(np.float32) / 3
    xs = rng.standard_normal((world, BATCH, 8)).astype(np.float32)
    ys = (xs @ teacher1.T) @ teacher2.T
    init1 = rng.standard_normal(SHAPES["w1"]).astype(np.float32) / 3
    init2 = rng.standard_normal(SHAPES["w2"]).astype(np.float32) / 3
    return xs, ys, init1, init2


def loss_and_grads(w1, w2, x, y):
    """Mean squared error of y ~ (x w1^T) w2^T and its gradients, in float32 as the servers."""
    h = x @ w1.T
    err = h @ w2.T - y
    loss = float(np.mean(err * err))
    d_out = (2.0 / err.size) * err
    g2 = d_out.T @ h
    g1 = (d_out @ w2).T @ x
    return loss, g1.astype(np.float32), g2.astype(np.float32)


def reference(xs, ys, init1, init2, rank):
    """This rank's losses when one process trains on the average of every rank's gradients."""
    w1, w2 = init1.copy(), init2.copy()
    losses = []
    for _ in range(STEPS):
        grads1, grads2 = [], []
        for r in range(len(xs)):
            loss, g1, g2 = loss_and_grads(w1, w2, xs[r], ys[r])
            if r == rank:
                losses.append(loss)
            grads1.append(g1)
            grads2.append(g2)
        w1 = w1 - np.float32(LR) * np.mean(grads1, axis=0)
        w2 = w2 - np.float32(LR) * np.mean(grads2, axis=0)
    return losses


def view(buf, shape):
    """A numpy view of one of the client's fp32 buffers (full parameter or gradient)."""
    return np.frombuffer(buf, dtype=np.float32).reshape(shape)


def main():
    pshard.init_process_group()
    client = pshard._get_client()
    rank, world = client.rank, client.world_size
    xs, ys, init1, init2 = data(world)
    names = list(SHAPES)
    client.define_model(names, [SHAPES[n] for n in names], optimizer="sgd",
                        init=[init1, init2] if rank == 0 else None)
    losses = []
    for _ in range(STEPS):
        client.gather(None)
        w1 = view(client.param_buffer(0), SHAPES["w1"]).copy()
        w2 = view(client.param_buffer(1), SHAPES["w2"]).copy()
        loss, g1, g2 = loss_and_grads(w1, w2, xs[rank], ys[rank])
        losses.append(loss)
        view(client.grad(0), SHAPES["w1"])[...] = g1
        view(client.grad(1), SHAPES["w2"])[...] = g2
        client.reduce_scatter(None)
        client.step(lr=LR)
    pshard.destroy_process_group()

    want = reference(xs, ys, init1, init2, rank)
    diff = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, want))
    print(f"wheel_train rank {rank}/{world}: loss {losses[0]:.6f} -> {losses[-1]:.6f} over "
          f"{STEPS} steps, max relative |loss - reference| {diff:.2e}", flush=True)
    if diff > 1e-4:
        print(f"wheel_train rank {rank}: losses {losses} differ from the reference {want}",
              file=sys.stderr)
        return 1
    if not losses[-1] < losses[0] / 100:
        print(f"wheel_train rank {rank}: the loss did not fall a hundredfold: {losses}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
