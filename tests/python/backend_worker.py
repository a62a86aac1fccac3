"""Runs torch.distributed's collectives (the backend table, blocking and async, object
collectives, functional collectives, DTensor) on one backend and saves every result, so
test_backend.py compares backend "pshard" with gloo on the same script.

usage: backend_worker.py BACKEND OUT_DIR [INIT_FILE]
  BACKEND pshard: launched by pshardrun, pshard.init_process_group() (torch's default group on
  backend "pshard"); BACKEND pshard-torch: torch's own init_process_group(backend="pshard")
  with a FileStore at INIT_FILE (a plain torch script that only imports pshard); BACKEND gloo:
  RANK / WORLD_SIZE from the environment and a FileStore at INIT_FILE.
Writes OUT_DIR/rank-R.pt: {case name: tensor or list of tensors}, and {"error": ...} entries
for the cases whose operation raised (compared across backends as the fact that it raised).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

backend, out_dir = sys.argv[1], sys.argv[2]
if backend == "pshard":
    import pshard
    pshard.init_process_group()
else:
    if backend == "pshard-torch":
        import pshard  # noqa: F401  (registers the backend)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("pshard" if backend == "pshard-torch" else "gloo",
                            init_method="file://" + sys.argv[3], rank=rank, world_size=world)
rank, n = dist.get_rank(), dist.get_world_size()
assert dist.is_initialized()
GLOO = backend == "gloo"
R = dist.ReduceOp
results = {}


def case(name):
    def wrap(fn):
        try:
            results[name] = fn()
        except Exception as e:  # recorded: both backends must raise (or not) alike
            results[name] = {"error": type(e).__name__, "message": str(e)[:300]}
        return fn
    return wrap


def data(shape, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g) * 4 - 2).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 4, shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int64, torch.int32, torch.uint8]
for dt in FLOATS + INTS + [torch.bool]:
    for op in ("SUM", "PRODUCT", "MIN", "MAX"):
        @case(f"all_reduce {op} {dt}")
        def _(dt=dt, op=op):
            t = data((5, 3), dt, 1)
            if dt == torch.bool and GLOO and op in ("SUM", "PRODUCT"):
                # gloo has no bool sum/product: torch's meaning is any/all
                u = t.to(torch.uint8)
                dist.all_reduce(u, op=R.MAX if op == "SUM" else R.MIN)
                return u.to(torch.bool)
            dist.all_reduce(t, op=getattr(R, op))
            return t
for dt in INTS:
    for op in ("BAND", "BOR", "BXOR"):
        @case(f"all_reduce {op} {dt}")
        def _(dt=dt, op=op):
            t = data((7,), dt, 2)
            dist.all_reduce(t, op=getattr(R, op))
            return t


@case("all_reduce AVG")
def _():
    t = data((6,), torch.float32, 3)
    if GLOO:  # gloo has no AVG
        dist.all_reduce(t)
        return t / n
    dist.all_reduce(t, op=R.AVG)
    return t


@case("all_reduce PREMUL_SUM")
def _():
    t = data((6,), torch.float32, 4)
    if GLOO:
        t.mul_(0.25)
        dist.all_reduce(t)
        return t
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25))
    return t


@case("all_reduce non-contiguous")
def _():
    t = data((4, 6), torch.float32, 5).t()
    dist.all_reduce(t)
    return t.contiguous()


@case("all_reduce 3M floats")
def _():
    t = data((3 << 20,), torch.float32, 6)
    dist.all_reduce(t)
    return t


@case("all_reduce async wait")
def _():
    a, b = data((4,), torch.float32, 7), data((9,), torch.int64, 8)
    w1 = dist.all_reduce(a, async_op=True)
    w2 = dist.all_reduce(b, op=R.MAX, async_op=True)
    f1 = w1.get_future()
    w2.wait()
    w1.wait()
    return [a, b, torch.tensor([f1.done()])]


@case("all_reduce async future")
def _():
    a = data((4,), torch.float32, 9)
    fut = dist.all_reduce(a, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    return [fut.wait()[0], chained.wait()]


@case("all_reduce_coalesced")
def _():
    ts = [data((3,), torch.float32, 10), data((2, 2), torch.float32, 11)]
    dist.all_reduce_coalesced(ts)
    return ts


for root in range(n):
    @case(f"broadcast from {root}")
    def _(root=root):
        ts = [data((5,), torch.float32, 12), data((3, 2), torch.int32, 13).t(),
              data((4,), torch.complex64 if False else torch.float64, 14)]
        for t in ts:
            dist.broadcast(t, root)
        return [t.contiguous() for t in ts]

    @case(f"reduce to {root}")
    def _(root=root):
        t = data((6,), torch.float32, 15)
        dist.reduce(t, root)
        return t if rank == root else []  # (gloo leaves scratch values elsewhere)

    @case(f"gather to {root}")
    def _(root=root):
        t = data((3,), torch.float32, 16)
        lst = [torch.empty(3) for _ in range(n)] if rank == root else None
        dist.gather(t, lst, dst=root)
        return lst if rank == root else []

    @case(f"scatter from {root}")
    def _(root=root):
        out = torch.empty(4, dtype=torch.int64)
        lst = [torch.arange(4) + 10 * k for k in range(n)] if rank == root else None
        dist.scatter(out, lst, src=root)
        return out

    @case(f"objects from {root}")
    def _(root=root):
        objs = [{"rank": rank, "x": [rank] * 3}, "s" * (rank + 1)] if rank == root else [
            None, None]
        dist.broadcast_object_list(objs, src=root)
        gathered = [None] * n if rank == root else None
        dist.gather_object({"from": rank}, gathered, dst=root)
        got = [None]
        dist.scatter_object_list(got, [f"to {k}" for k in range(n)] if rank == root else None,
                                 src=root)
        return [torch.tensor(list(str((objs, gathered, got)).encode()))]


@case("all_gather list")
def _():
    t = data((2, 3), torch.float32, 17)
    out = [torch.empty(2, 3) for _ in range(n)]
    dist.all_gather(out, t)
    return out


@case("all_gather_into_tensor bf16 and bool")
def _():
    a, b = data((5,), torch.bfloat16, 18), data((4,), torch.bool, 19)
    oa, ob = torch.empty(n * 5, dtype=torch.bfloat16), torch.empty(n * 4, dtype=torch.bool)
    dist.all_gather_into_tensor(oa, a)
    dist.all_gather_into_tensor(ob, b)
    return [oa, ob]


@case("all_gather_into_tensor 2M async")
def _():
    a = data((2 << 20,), torch.float32, 20)
    out = torch.empty(n * a.numel())
    dist.all_gather_into_tensor(out, a, async_op=True).wait()
    return out


@case("all_gather_object")
def _():
    got = [None] * n
    dist.all_gather_object(got, {"rank": rank, "sq": rank * rank, "pad": "x" * (10 * rank)})
    return [torch.tensor(list(str(got).encode()))]


@case("reduce_scatter_tensor")
def _():
    t = data((n * 3, 2), torch.float32, 21)
    out = torch.empty(3, 2)
    dist.reduce_scatter_tensor(out, t)
    return out


@case("reduce_scatter_tensor MAX int64")
def _():
    t = data((n * 4,), torch.int64, 22)
    out = torch.empty(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, t, op=R.MAX)
    return out


@case("reduce_scatter list")
def _():
    ins = [data((3,), torch.float32, 23 + k) for k in range(n)]
    out = torch.empty(3)
    dist.reduce_scatter(out, ins)
    return out


@case("all_to_all_single equal")
def _():
    t = data((n * 2, 3), torch.float32, 30)
    out = torch.empty(n * 2, 3)
    dist.all_to_all_single(out, t)
    return out


@case("all_to_all_single uneven")
def _():
    # rank r sends r + k + 1 rows to rank k
    ins = [rank + k + 1 for k in range(n)]
    outs = [k + rank + 1 for k in range(n)]
    t = data((sum(ins), 2), torch.float32, 31)
    out = torch.empty(sum(outs), 2)
    dist.all_to_all_single(out, t, output_split_sizes=outs, input_split_sizes=ins)
    return out


@case("all_to_all list")
def _():
    ins = [data((3,), torch.int64, 32 + k) for k in range(n)]
    outs = [torch.empty(3, dtype=torch.int64) for k in range(n)]
    dist.all_to_all(outs, ins)
    return outs


@case("all_to_all list uneven")
def _():
    # gloo refuses tensors of different sizes; NCCL and pshard take them: checked against the
    # values every rank sends (data() is a function of the sender's rank)
    ins = [torch.arange(rank + k + 1) + 100 * rank + 10 * k for k in range(n)]
    outs = [torch.empty(k + rank + 1, dtype=torch.int64) for k in range(n)]
    dist.all_to_all(outs, ins)
    want = [torch.arange(k + rank + 1) + 100 * k + 10 * rank for k in range(n)]
    return torch.tensor([all(torch.equal(o, w) for o, w in zip(outs, want))])


@case("send recv ring")
def _():
    if n == 1:
        return []
    t = data((5,), torch.float32, 40)
    got = torch.empty(5)
    right, left = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:
        dist.send(t, right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(t, right)
    return got


@case("isend irecv")
def _():
    if n == 1:
        return []
    got = torch.empty(3, dtype=torch.int64)
    if rank == 0:
        ws = [dist.isend(torch.arange(3) + 100 * k, k) for k in range(1, n)]
        for w in ws:
            w.wait()
        return []
    dist.irecv(got, 0).wait()
    return got


@case("barrier and monitored_barrier")
def _():
    dist.barrier()
    dist.monitored_barrier()
    return torch.tensor([1])


@case("functional collectives")
def _():
    g = dist.group.WORLD
    a = fc.all_reduce(data((4,), torch.float32, 50), "sum", g)
    b = fc.all_gather_tensor(data((2, 2), torch.float32, 51), 0, g)
    c = fc.reduce_scatter_tensor(data((n * 2,), torch.float32, 52), "sum", 0, g)
    d = fc.all_to_all_single(data((n,), torch.float32, 53), None, None, g)
    return [x.wait() if hasattr(x, "wait") else x for x in (a, b, c, d)]


@case("DTensor")
def _():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (n,))
    local = data((2, 3), torch.float32, 60)
    d = DTensor.from_local(local, mesh, [Shard(0)])
    full = d.full_tensor()
    r = d.redistribute(mesh, [Replicate()]).to_local()
    s = (d * 2).sum().full_tensor()
    return [full, r, s]


@case("unsupported ReduceOp on bool AVG")
def _():
    t = data((3,), torch.bool, 70)
    dist.all_reduce(t, op=R.AVG)
    return t


# The cluster still works after the refused operations.
@case("after errors")
def _():
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t)
    return t


os.makedirs(out_dir, exist_ok=True)
torch.save(results, os.path.join(out_dir, f"rank-{rank}.pt"))
if backend.startswith("pshard"):  # how many tensors went through host copies (CUDA ones)
    import pshard._backend
    with open(os.path.join(out_dir, f"staged-{rank}.txt"), "w") as f:
        f.write(str(pshard._backend.staged_tensors))
dist.barrier()
if backend == "pshard":
    pshard.destroy_process_group()
else:
    dist.destroy_process_group()
print(f"rank {rank}: {len(results)} cases")
