"""Trainer for test_distributed.py: pshard.distributed's collectives against the values every
rank can compute itself (each rank's data comes from a seed). Writes OUTDIR/rank-R.json with
the checks that failed (none expected)."""
import json
import os
import sys

import torch

import pshard
import pshard.distributed as dist

torch.set_num_threads(1)


def data(rank, n, dtype, salt):
    g = torch.Generator().manual_seed(rank * 7 + salt)
    if dtype in (torch.int64, torch.int32):
        return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def main():
    out = sys.argv[1]
    pshard.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = []

    def expect(name, ok):
        if not ok:
            failed.append(name)

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        # 0, 1, a prime, and more than one 4 MiB piece (2.5M fp32 elements).
        for n in (0, 1, 97, 2_500_001 if dtype == torch.float32 else 1001):
            salt = n % 1000
            t = data(rank, n, dtype, salt)
            want = sum(data(r, n, torch.float64 if dtype.is_floating_point else dtype, salt)
                       .to(torch.float64) for r in range(world))
            x = t.clone()
            dist.all_reduce(x)
            tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3,
                   torch.int64: 0}[dtype]
            expect(f"all_reduce {dtype} {n}", torch.allclose(x.double(), want, rtol=tol,
                                                             atol=tol * world))
            if dtype.is_floating_point:
                x = t.clone()
                dist.all_reduce(x, op=dist.ReduceOp.AVG)
                expect(f"avg {dtype} {n}", torch.allclose(x.double(), want / world, rtol=tol,
                                                          atol=tol))
            for src in range(world):
                x = t.clone()
                dist.broadcast(x, src)
                expect(f"broadcast {dtype} {n} {src}", torch.equal(x, data(src, n, dtype, salt)))
            o = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(o, t)
            expect(f"all_gather {dtype} {n}",
                   torch.equal(o, torch.cat([data(r, n, dtype, salt) for r in range(world)])))
    # The other reductions against torch's own element-wise ones, ours and torch's ReduceOp.
    import torch.distributed as tdist
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for n in (0, 1, 97, 1001):
            salt = 3 + n % 100
            ins = [data(r, n, dtype, salt) for r in range(world)]
            ops = [("product", dist.ReduceOp.PRODUCT), ("min", dist.ReduceOp.MIN),
                   ("max", tdist.ReduceOp.MAX)]
            if dtype == torch.int64:
                ops += [("band", dist.ReduceOp.BAND), ("bor", dist.ReduceOp.BOR),
                        ("bxor", dist.ReduceOp.BXOR)]
            for name, op in ops:
                want = ins[0].double() if dtype.is_floating_point else ins[0].clone()
                for y in ins[1:]:
                    y = y.double() if dtype.is_floating_point else y
                    want = {"product": torch.mul, "min": torch.minimum, "max": torch.maximum,
                            "band": torch.bitwise_and, "bor": torch.bitwise_or,
                            "bxor": torch.bitwise_xor}[name](want, y)
                x = ins[rank].clone()
                dist.all_reduce(x, op=op)
                if dtype.is_floating_point and name == "product":
                    # fp32 products in another order, rounded once to the dtype.
                    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
                    ok = torch.allclose(x.double(), want, rtol=tol, atol=1e-6)
                elif dtype.is_floating_point:
                    ok = torch.equal(x.double(), want)
                else:
                    ok = torch.equal(x, want)
                expect(f"{name} {dtype} {n}", ok)
    # reduce, gather, scatter to and from every rank; sizes past one 4 MiB piece.
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (0, 1, 97, 1_200_001 if dtype == torch.float32 else 1001):
            salt = 11 + n % 100
            ins = [data(r, n, dtype, salt) for r in range(world)]
            for root in range(world):
                x = ins[rank].clone()
                op = dist.ReduceOp.MAX
                dist.reduce(x, root, op=op)
                want = ins[0].clone()
                for y in ins[1:]:
                    want = torch.maximum(want, y)
                expect(f"reduce {dtype} {n} to {root}",
                       torch.equal(x, want if rank == root else ins[rank]))
                outs = [torch.full((n,), -7, dtype=dtype) for _ in range(world)]
                dist.gather(ins[rank], outs if rank == root else None, dst=root)
                if rank == root:
                    expect(f"gather {dtype} {n} to {root}",
                           all(torch.equal(o, i) for o, i in zip(outs, ins)))
                got = torch.full((n,), -7, dtype=dtype)
                blocks = [data(root * 10 + r, n, dtype, salt) for r in range(world)]
                dist.scatter(got, blocks if rank == root else None, src=root)
                expect(f"scatter {dtype} {n} from {root}", torch.equal(got, blocks[rank]))
    # all_to_all_single and all_to_all, past one 4 MiB piece; equal splits given explicitly.
    for dtype in (torch.float32, torch.int64, torch.bool):
        for rows_per in (0, 1, 3, 400_003 if dtype == torch.float32 else 7):
            salt = 31 + rows_per % 100
            mine = data(rank, world * rows_per * 2, dtype, salt).view(world * rows_per, 2)
            res = torch.full_like(mine, 0)
            splits = [rows_per] * world if rows_per % 2 else None
            dist.all_to_all_single(res, mine, output_split_sizes=splits,
                                   input_split_sizes=splits)
            want = torch.cat([data(r, world * rows_per * 2, dtype, salt)
                              .view(world, rows_per, 2)[rank] for r in range(world)])
            expect(f"all_to_all_single {dtype} {rows_per}", torch.equal(res, want))
    # Uneven splits (all_to_all_single's input/output_split_sizes): rank s sends
    # S[s][d] rows of 2 to rank d, some of them none.
    S = [[(s * 3 + d * 5 + 1) % 4 for d in range(world)] for s in range(world)]
    for dtype in (torch.float32, torch.int64):
        sent = [data(s, sum(S[s]) * 2, dtype, 77).view(-1, 2) for s in range(world)]
        res = torch.full((sum(S[s][rank] for s in range(world)), 2), -7, dtype=dtype)
        dist.all_to_all_single(res, sent[rank], output_split_sizes=[S[s][rank] for s in
                                                                    range(world)],
                               input_split_sizes=S[rank])
        want = torch.cat([sent[s][sum(S[s][:rank]):sum(S[s][:rank + 1])] for s in range(world)])
        expect(f"all_to_all_single uneven {dtype}", torch.equal(res, want))
    # The list form with sizes that differ: rank s sends s + d + 1 elements to rank d.
    ins = [torch.full((rank + d + 1,), float(rank * 10 + d)) for d in range(world)]
    outs = [torch.zeros(s + rank + 1) for s in range(world)]
    dist.all_to_all(outs, ins)
    expect("all_to_all uneven lists", all(torch.equal(o, torch.full((s + rank + 1,),
                                                                     float(s * 10 + rank)))
                                          for s, o in enumerate(outs)))
    ins = [torch.full((3,), float(rank * 10 + k)) for k in range(world)]
    outs = [torch.zeros(3) for _ in range(world)]
    dist.all_to_all(outs, ins)
    expect("all_to_all lists", all(torch.equal(o, torch.full((3,), float(k * 10 + rank)))
                                   for k, o in enumerate(outs)))
    # A non-contiguous scatter target and gather source.
    m = torch.zeros(4, 6)
    dist.scatter(m.t(), [torch.full((6, 4), float(r)) for r in range(world)] if rank == 0
                 else None, src=0)
    expect("scatter non-contiguous", torch.equal(m, torch.full((4, 6), float(rank))))
    # float64, int32, uint8 and bool against torch's own reductions; broadcast and gather.
    for dtype in (torch.float64, torch.int32, torch.uint8, torch.bool):
        for n in (0, 1, 97, 1001):
            salt = 23 + n % 100
            ins = [data(r, n, dtype, salt) for r in range(world)]
            wide = [t.to(torch.int64) if not dtype.is_floating_point else t for t in ins]
            ops = {"SUM": lambda a, b: a + b, "PRODUCT": lambda a, b: a * b,
                   "MIN": torch.minimum, "MAX": torch.maximum}
            if not dtype.is_floating_point:
                ops.update(BAND=torch.bitwise_and, BOR=torch.bitwise_or, BXOR=torch.bitwise_xor)
            for name, fn in ops.items():
                want = wide[0]
                for y in wide[1:]:
                    want = fn(want, y)
                # torch's results in the dtype: integers wrap, bools are any / all
                want = want.bool() if dtype == torch.bool else want.to(dtype)
                if dtype == torch.bool and name in ("MIN", "PRODUCT", "BAND"):
                    want = torch.stack(ins).all(0) if n else want
                x = ins[rank].clone()
                dist.all_reduce(x, op=getattr(dist.ReduceOp, name))
                ok = (torch.allclose(x, want, rtol=1e-12, atol=1e-12) if dtype.is_floating_point
                      else torch.equal(x, want))
                expect(f"{name} {dtype} {n}", ok)
            if dtype.is_floating_point:
                x = ins[rank].clone()
                dist.all_reduce(x, op=dist.ReduceOp.AVG)
                expect(f"avg {dtype} {n}", torch.allclose(x, sum(ins) / world, rtol=1e-12,
                                                          atol=1e-12))
            x = ins[rank].clone()
            dist.broadcast(x, world - 1)
            expect(f"broadcast {dtype} {n}", torch.equal(x, ins[world - 1]))
            o = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(o, ins[rank])
            expect(f"all_gather {dtype} {n}", torch.equal(o, torch.cat(ins)))
    # Non-contiguous in place; 2-D all_gather output.
    m = data(rank, 60, torch.float32, 5).view(6, 10)
    tv = m.t()
    dist.all_reduce(tv)
    want = sum(data(r, 60, torch.float32, 5).view(6, 10) for r in range(world))
    expect("non-contiguous", torch.allclose(m, want, rtol=1e-5, atol=1e-5))
    o = torch.empty(world, 3)
    dist.all_gather_into_tensor(o, torch.full((3,), float(rank)))
    expect("2-d gather", torch.equal(o, torch.arange(world, dtype=torch.float32)[:, None]
                                     .expand(world, 3)))
    dist.barrier()
    # The default group by name, as torch code passes it; new_group of every rank is it.
    x = torch.ones(2)
    dist.all_reduce(x, group=dist.group.WORLD)
    expect("group.WORLD", torch.equal(x, torch.full((2,), float(world))))
    g = dist.new_group(list(reversed(range(world))))
    expect("new_group of every rank", g.size() == world and g.rank() == rank and
           torch.distributed.get_backend(g) == "pshard")
    expect("group ranks", dist.get_process_group_ranks(g) == list(range(world)) and
           dist.get_group_rank(g, rank) == rank and dist.get_global_rank(g, rank) == rank)
    # Bad arguments: refused (by torch's checks or backend pshard's, each with its own
    # exception class), and the group keeps working.
    for name, fn, exc in [
        ("int16", lambda: dist.all_reduce(torch.zeros(3, dtype=torch.int16)), TypeError),
        ("avg of int32", lambda: dist.all_reduce(torch.zeros(3, dtype=torch.int32),
                                                 op=dist.ReduceOp.AVG), TypeError),
        ("list", lambda: dist.all_reduce([1.0]), TypeError),
        ("src", lambda: dist.broadcast(torch.zeros(2), world), ValueError),
        ("size", lambda: dist.all_gather_into_tensor(torch.zeros(1), torch.zeros(2)),
         ValueError),
        ("op", lambda: dist.all_reduce(torch.zeros(2), op="max"), ValueError),
        ("band of floats", lambda: dist.all_reduce(torch.zeros(2), op=dist.ReduceOp.BAND),
         TypeError),
        ("reduce dst", lambda: dist.reduce(torch.zeros(2), world), ValueError),
        ("gather list", lambda: dist.gather(torch.zeros(2), [torch.zeros(2)] * (world + 1),
                                            dst=rank), ValueError),
        ("gather list shape", lambda: dist.gather(torch.zeros(2), [torch.zeros(3)] * world,
                                                  dst=rank), ValueError),
        ("scatter src", lambda: dist.scatter(torch.zeros(2), None, src=-1), ValueError),
        ("uneven all_to_all", lambda: dist.all_to_all_single(
            torch.zeros(world + 1), torch.zeros(world + 1)) if world > 1 else
         (_ for _ in ()).throw(ValueError("one rank: nothing uneven")), ValueError),
        ("all_to_all sizes", lambda: dist.all_to_all_single(
            torch.zeros(2 * world), torch.zeros(4 * world)), ValueError),
        ("uneven splits", lambda: dist.all_to_all_single(
            torch.zeros(2 * world), torch.zeros(2 * world),
            input_split_sizes=[2 * world] + [0] * (world - 1)) if world > 1 else
         (_ for _ in ()).throw(ValueError("one rank: nothing uneven")), ValueError),
        ("scatter list missing", lambda: dist.scatter(torch.zeros(2), None, src=rank),
         ValueError),
        ("group", lambda: dist.all_reduce(torch.zeros(2), group=object()), ValueError),
        ("rank out of range", lambda: dist.new_group([world]), ValueError),
        ("duplicate ranks", lambda: dist.new_group([0, 0]), ValueError),
        ("send to self", lambda: dist.send(torch.zeros(2), rank), ValueError),
        ("recv from anyone", lambda: dist.recv(torch.zeros(2)), ValueError),
        ("send to nobody", lambda: dist.send(torch.zeros(2), world), ValueError),
        ("bad tag", lambda: dist.send(torch.zeros(2), (rank + 1) % world, tag=-1)
         if world > 1 else (_ for _ in ()).throw(ValueError("one rank")), ValueError),
    ]:
        try:
            fn()
            failed.append(f"{name} was accepted")
        except Exception as e:  # noqa: BLE001  (torch raises RuntimeError where pshard did not)
            if not str(e):
                failed.append(f"{name}: {type(e).__name__} without a message")
    x = torch.ones(4)
    dist.all_reduce(x)
    expect("after errors", torch.equal(x, torch.full((4,), float(world))))
    # reduce_scatter_tensor and reduce_scatter: counts 0, 1, 7 and past a 4 MiB piece; sum,
    # avg, max; int64 and fp32 (integer-valued, so the sums are exact).
    for dtype in (torch.int64, torch.float32):
        for n in (0, 1, 7, 1_200_001 if dtype == torch.int64 else 5):
            for op in ((dist.ReduceOp.SUM, dist.ReduceOp.MAX) if dtype == torch.int64 else
                       (dist.ReduceOp.SUM, dist.ReduceOp.AVG)):
                ins = [data(r, world * n, torch.int64, 60 + n % 50).to(dtype)
                       for r in range(world)]
                rs_out = torch.full((n,), -3, dtype=dtype)
                dist.reduce_scatter_tensor(rs_out, ins[rank], op=op)
                blocks = torch.stack([x.view(world, -1)[rank] for x in ins]) if n else None
                want = (torch.zeros(0, dtype=dtype) if not n else
                        blocks.max(0).values if op == dist.ReduceOp.MAX else
                        # (the servers scale by fp32(1 / world), as the collectives do)
                        blocks.sum(0) * torch.tensor(1 / world, dtype=torch.float32)
                        if op == dist.ReduceOp.AVG else blocks.sum(0))
                expect(f"reduce_scatter_tensor {dtype} {n} {op.name}", torch.equal(rs_out, want))
    lst = [torch.full((2,), float(rank * 10 + k)) for k in range(world)]
    rs_out = torch.zeros(2)
    dist.reduce_scatter(rs_out, lst)
    expect("reduce_scatter list", torch.equal(rs_out, torch.full((2,), float(
        sum(r * 10 + rank for r in range(world))))))
    w = dist.reduce_scatter_tensor(rs_out, torch.ones(2 * world), async_op=True)
    w.wait()
    expect("async reduce_scatter", torch.equal(rs_out, torch.full((2,), float(world))))
    # send / recv around the ring (even ranks send first, odd ones receive first), one past a
    # 4 MiB piece, with tags; then the same with isend / irecv.
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for n, dtype, tag in ((7, torch.float32, 0), (600_001, torch.int64, 5)):
            mine = data(rank, n, dtype, 40 + tag)
            got = torch.full((n,), -1, dtype=dtype)
            if rank % 2 == 0:
                dist.send(mine, nxt, tag=tag)
                who = dist.recv(got, prv, tag=tag)
            else:
                who = dist.recv(got, prv, tag=tag)
                dist.send(mine, nxt, tag=tag)
            expect(f"recv {n} from {prv}", torch.equal(got, data(prv, n, dtype, 40 + tag)) and
                   who == prv)
        got = torch.zeros(3, 2)[:, 0]  # not contiguous: completed at wait()
        works = ([dist.isend(torch.full((3,), rank * 1.0), nxt), dist.irecv(got, prv)]
                 if rank % 2 == 0 else
                 [dist.irecv(got, prv), dist.isend(torch.full((3,), rank * 1.0), nxt)])
        for w in reversed(works):
            w.wait()
        expect("irecv", torch.equal(got, torch.full((3,), prv * 1.0)))
        # Ranks 0 and 1 both send first: a DesyncError naming both sides, not a hang; their
        # pair's communicator is then rebuilt and the next exchange works.
        if rank < 2:
            try:
                dist.send(torch.ones(4), 1 - rank, tag=3)
                expect("both sending is refused", False)
            except pshard.DesyncError as e:
                expect("both sending names send/recv", "send/recv" in str(e))
            box = torch.zeros(4)
            if rank == 0:
                dist.send(torch.arange(4.0), 1)
            else:
                dist.recv(box, 0)
            expect("after the desync", rank == 0 or torch.equal(box, torch.arange(4.0)))
    # async_op=True: several collectives in flight at once (one past a 4 MiB piece), a
    # blocking one issued behind them, then waited out of order: every result as the blocking
    # forms give, and the blocking one ran after the queued ones on every rank.
    big = data(rank, 1_500_000, torch.int64, 3)
    red = big.clone()
    w1 = dist.all_reduce(red, op=dist.ReduceOp.MAX, async_op=True)
    small = data(rank, 7, torch.int64, 6)
    gathered = torch.full((world, 7), -1, dtype=torch.int64)
    w2 = dist.all_gather_into_tensor(gathered, small, async_op=True)
    bc = data(rank, 5, torch.float32, 8)[::1].clone()
    w3 = dist.broadcast(bc, src=world - 1, async_op=True)
    a2a = torch.zeros(world * 2)
    w4 = dist.all_to_all_single(a2a, torch.arange(world * 2.0) + 100 * rank, async_op=True)
    w5 = dist.barrier(async_op=True)
    after = torch.ones(3)
    dist.all_reduce(after)
    expect("async: the blocking one behind the queue", torch.equal(after,
                                                                   torch.full((3,), world * 1.0)))
    for w in (w2, w5, w4, w1, w3):
        expect("async wait returns True", w.wait() is True)
        # (torch forwards only wait() and get_future() to a Python backend's Work, so
        # is_completed() cannot report pshard's completion: the Future does)
        expect("async future done after wait", w.get_future().done())
    want = data(0, 1_500_000, torch.int64, 3)
    for r in range(1, world):
        want = torch.maximum(want, data(r, 1_500_000, torch.int64, 3))
    expect("async all_reduce", torch.equal(red, want))
    expect("async all_gather_into_tensor",
           torch.equal(gathered, torch.stack([data(r, 7, torch.int64, 6) for r in range(world)])))
    expect("async broadcast", torch.equal(bc, data(world - 1, 5, torch.float32, 8)))
    expect("async all_to_all_single",
           torch.equal(a2a, torch.tensor([100.0 * s + 2 * rank + k for s in range(world)
                                          for k in range(2)])))
    # An operation in flight whose tensors are resized before wait() (torch's Works hold what
    # they use): 8 MB each, memory the allocator unmaps when a resize frees it. A resized input
    # still sends what it held at the call; a resized output gets no result and wait() says so
    # (the new memory is left as the caller filled it); the group works on afterwards.
    n = 1_000_000
    src = data(rank, n, torch.int64, 9)
    inp, gathered = src.clone(), torch.zeros(world * n, dtype=torch.int64)
    w = dist.all_gather_into_tensor(gathered, inp, async_op=True)
    inp.resize_(3 * n)
    inp.fill_(-5)
    expect("resized input: wait", w.wait() is True)
    expect("resized input: sent as it was at the call",
           torch.equal(gathered, torch.cat([data(r, n, torch.int64, 9) for r in range(world)])))
    res = src.clone()
    w = dist.all_reduce(res, async_op=True)
    res.resize_(3 * n)
    res.fill_(7)
    try:
        w.wait()
        expect("resized output: wait raises", False)
    except pshard.FailedPreconditionError as e:
        expect("resized output: the error says why", "resized" in str(e))
    expect("resized output: the new memory untouched", bool((res == 7).all()))
    again = torch.ones(3)
    dist.all_reduce(again)
    expect("after a resized output", torch.equal(again, torch.full((3,), world * 1.0)))
    # More queued than the scratch region (16 MiB) holds: 24 all_reduces of 1 MiB and 80 small
    # ones (more than its 64 places), a blocking all_gather of 8 MiB behind them that makes
    # room by moving finished results, then more queued ones; waited for in a shuffled order.
    salts = range(20, 44)
    pending = []
    for s in salts:
        t = data(rank, 262_144, torch.int32, s)
        pending.append((f"queued 1 MiB {s}", t, dist.all_reduce(t, async_op=True), s, 262_144))
    for s in range(100, 180):
        t = data(rank, 3, torch.int32, s)
        pending.append((f"queued small {s}", t, dist.all_reduce(t, async_op=True), s, 3))
    n = 1_048_576 // world
    gathered = torch.empty(world * n, dtype=torch.int64)
    dist.all_gather_into_tensor(gathered, data(rank, n, torch.int64, 11))
    expect("blocking among queued ones", torch.equal(
        gathered, torch.cat([data(r, n, torch.int64, 11) for r in range(world)])))
    for s in range(50, 60):
        t = data(rank, 262_144, torch.int32, s)
        pending.append((f"queued after {s}", t, dist.all_reduce(t, async_op=True), s, 262_144))
    order = torch.randperm(len(pending), generator=torch.Generator().manual_seed(5)).tolist()
    for i in order:
        name, t, w, s, m = pending[i]
        w.wait()
        want = sum(data(r, m, torch.int32, s).long() for r in range(world)).to(torch.int32)
        expect(name, torch.equal(t, want))
    # Staged collectives of 10, 12 and 4 MiB straight on the client (all_reduce, op 3): the
    # second waits on the heap and, when it runs, moves the first's result and the third's
    # queued send bytes out of its way.
    c = pshard._world.current()
    big = [(data(rank, m, torch.int32, 60 + m % 7), m) for m in (2_621_440, 3_145_728, 1_048_576)]
    works = [(t, c.collective_start(3, t, t, m, "int32", 0, 0, None, 0, True), m)
             for t, m in big]
    for t, w, m in reversed(works):
        w.wait()
        want = sum(data(r, m, torch.int32, 60 + m % 7).long() for r in range(world))
        expect(f"staged {m * 4} bytes", torch.equal(t, want.to(torch.int32)))
    # Leaving with a Work not yet waited for: the client closes once it is (a nonzero exit
    # here fails the test).
    last = torch.ones(5)
    w = dist.all_reduce(last, async_op=True)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"failed": failed}, f)
    pshard.destroy_process_group()
    assert w.wait() is True and torch.equal(last, torch.full((5,), world * 1.0)), last


main()
