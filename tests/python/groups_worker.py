"""Trainer for test_groups.py, on 4 ranks: pshard.distributed's process groups (new_group,
new_subgroups, new_subgroups_by_enumeration, init_device_mesh) and every collective with
group=, against the values each rank computes itself from every rank's seeded data. Writes
OUTDIR/rank-R.json with the checks that failed (none expected) and the desync error's text.
With "quick" as the second argument only the groups' collectives run (the remote path)."""
import datetime
import json
import os
import sys
import warnings

import torch

import pshard
import pshard.distributed as dist

torch.set_num_threads(1)
NON = dist.GroupMember.NON_GROUP_MEMBER


def data(rank, n, dtype, salt):
    g = torch.Generator().manual_seed(rank * 7 + salt)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (n,), generator=g)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


class Checks:
    def __init__(self):
        self.failed = []
        self.count = 0

    def expect(self, name, ok):
        self.count += 1
        if not ok:
            self.failed.append(name)

    def raises(self, name, fn, exc, *words):
        """fn() raises exc with every word in its message."""
        self.count += 1
        try:
            fn()
        except exc as e:
            if not all(w in str(e) for w in words):
                self.failed.append(f"{name}: message {str(e)!r} lacks {words}")
            return e
        except Exception as e:  # noqa: BLE001 (reported as a failed check)
            self.failed.append(f"{name}: {type(e).__name__}: {e}")
            return None
        self.failed.append(f"{name} was accepted")
        return None


def group_collectives(ck, rank, world, ranks, g):
    """Every collective on group g (the world ranks ranks) against local references; a rank
    not in ranks gets None from each and its tensors stay as they were."""
    member = rank in ranks
    if not member:
        return  # torch's collectives on a group without this rank are not called there
    n_g = len(ranks)
    tag = "".join(map(str, ranks))
    for dtype in (torch.float32, torch.int64):
        for n in (0, 1, 7):
            salt = n + 3 * len(tag)
            mine = data(rank, n, dtype, salt)
            ins = {r: data(r, n, dtype, salt) for r in ranks}
            wide = {r: v.double() if dtype.is_floating_point else v for r, v in ins.items()}
            name = f"{tag} {dtype} {n}"
            ops = [("sum", dist.ReduceOp.SUM, sum(wide.values()))]
            ops.append(("max", dist.ReduceOp.MAX, torch.stack(list(wide.values())).amax(0)
                        if n else wide[ranks[0]]))
            if dtype.is_floating_point:
                ops.append(("avg", dist.ReduceOp.AVG, sum(wide.values()) / n_g))
            for opname, op, want in ops:
                x = mine.clone()
                res = dist.all_reduce(x, op=op, group=g)
                if member:
                    ok = (torch.allclose(x.double(), want, rtol=1e-5, atol=1e-5)
                          if dtype.is_floating_point else torch.equal(x, want))
                    ck.expect(f"all_reduce {opname} {name}", ok and res is None)
                else:
                    ck.expect(f"non-member all_reduce {name}", res is None and
                              torch.equal(x, mine))
            if not member:
                # Every other collective returns at once, touching nothing.
                x = mine.clone()
                outs = [torch.zeros(n, dtype=dtype) for _ in ranks]
                got = [dist.broadcast(x, src=ranks[0], group=g),
                       dist.all_gather_into_tensor(torch.zeros(n_g * n, dtype=dtype), x,
                                                   group=g),
                       dist.all_gather(outs, x, group=g),
                       dist.reduce(x, dst=ranks[0], group=g),
                       dist.gather(x, None, dst=ranks[0], group=g),
                       dist.scatter(x, None, src=ranks[0], group=g),
                       dist.all_to_all_single(torch.zeros(n_g * n, dtype=dtype),
                                              torch.zeros(n_g * n, dtype=dtype), group=g),
                       dist.all_to_all(outs, [x] * n_g, group=g),
                       dist.barrier(group=g, async_op=True)]
                ck.expect(f"non-member collectives {name}", all(r is None for r in got) and
                          torch.equal(x, mine))
                continue
            for src in ranks:
                x = mine.clone()
                dist.broadcast(x, src, group=g)
                ck.expect(f"broadcast {name} from {src}", torch.equal(x, ins[src]))
            x = mine.clone()
            dist.broadcast(x, group=g, group_src=n_g - 1)
            ck.expect(f"broadcast group_src {name}", torch.equal(x, ins[ranks[-1]]))
            o = torch.full((n_g * n,), -7, dtype=dtype)
            dist.all_gather_into_tensor(o, mine, group=g)
            ck.expect(f"all_gather_into_tensor {name}",
                      torch.equal(o, torch.cat([ins[r] for r in ranks])))
            outs = [torch.full((n,), -7, dtype=dtype) for _ in ranks]
            dist.all_gather(outs, mine, group=g)
            ck.expect(f"all_gather {name}", all(torch.equal(o, ins[r])
                                                for o, r in zip(outs, ranks)))
            for dst in ranks:
                x = mine.clone()
                dist.reduce(x, dst, op=dist.ReduceOp.SUM, group=g)
                want = sum(wide.values())
                ok = (torch.allclose(x.double(), want, rtol=1e-5, atol=1e-5)
                      if dtype.is_floating_point else torch.equal(x, want))
                ck.expect(f"reduce {name} to {dst}", ok if rank == dst else
                          torch.equal(x, mine))
                outs = [torch.full((n,), -7, dtype=dtype) for _ in ranks]
                dist.gather(mine, outs if rank == dst else None, dst=dst, group=g)
                if rank == dst:
                    ck.expect(f"gather {name} to {dst}",
                              all(torch.equal(o, ins[r]) for o, r in zip(outs, ranks)))
                got = torch.full((n,), -7, dtype=dtype)
                blocks = [data(dst * 10 + k, n, dtype, salt) for k in range(n_g)]
                dist.scatter(got, blocks if rank == dst else None, src=dst, group=g)
                ck.expect(f"scatter {name} from {dst}",
                          torch.equal(got, blocks[ranks.index(rank)]))
            got = torch.full((n,), -7, dtype=dtype)
            blocks = [data(50 + k, n, dtype, salt) for k in range(n_g)]
            dist.scatter(got, blocks if rank == ranks[0] else None, group=g, group_src=0)
            ck.expect(f"scatter group_src {name}", torch.equal(got, blocks[ranks.index(rank)]))
            # all_to_all: block k of group rank j is data(j*10 + k)
            me = ranks.index(rank)
            send = torch.cat([data(me * 10 + k, n, dtype, salt) for k in range(n_g)])
            recv = torch.full_like(send, -7)
            dist.all_to_all_single(recv, send, group=g)
            want = torch.cat([data(j * 10 + me, n, dtype, salt) for j in range(n_g)])
            ck.expect(f"all_to_all_single {name}", torch.equal(recv, want))
            outs = [torch.full((n,), -7, dtype=dtype) for _ in ranks]
            dist.all_to_all(outs, [data(me * 10 + k, n, dtype, salt) for k in range(n_g)],
                            group=g)
            ck.expect(f"all_to_all {name}", all(torch.equal(o, data(j * 10 + me, n, dtype, salt))
                                                for j, o in enumerate(outs)))
            ck.expect(f"barrier {name}", dist.barrier(group=g) is None)
    if member and n_g < world:
        outside = next(r for r in range(world) if r not in ranks)
        ck.raises(f"src outside {tag}", lambda: dist.broadcast(torch.zeros(1), outside, group=g),
                  ValueError, f"Global rank {outside} is not part of group")
        ck.raises(f"dst outside {tag}", lambda: dist.reduce(torch.zeros(1), outside, group=g),
                  ValueError, f"Global rank {outside} is not part of group")
        ck.raises(f"group_src {tag}", lambda: dist.broadcast(torch.zeros(1), group=g,
                                                             group_src=n_g), ValueError)
        ck.raises(f"src and group_src {tag}", lambda: dist.broadcast(
            torch.zeros(1), rank, group=g, group_src=0), ValueError, "both")
        ck.raises(f"all_gather size {tag}", lambda: dist.all_gather_into_tensor(
            torch.zeros(world), torch.zeros(1), group=g), ValueError)


def bad_arguments(ck, rank, world):
    """Refused with a clear error: torch's own argument checks of its group functions (every
    rank calls them, so one torch let through would still not hang), then libpshard's checks
    of Client.new_groups, which only ranks 0 and 2 make: one that reached the shard servers
    would hang or desync the barrier after it."""
    for name, fn in [
        ("duplicate", lambda: dist.new_group([3, 1, 1])),
        ("rank = world", lambda: dist.new_group([0, world])),
        ("overlap", lambda: dist.new_subgroups_by_enumeration([[0, 1], [1, 2]])),
        ("no subgroups", lambda: dist.new_subgroups_by_enumeration([])),
        ("subgroup size", lambda: dist.new_subgroups(3)),
        ("mesh names", lambda: dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",))),
    ]:
        ck.raises(name, fn, Exception)
    if rank not in (0, 2):
        return
    c = pshard._get_client()
    for name, fn, exc, words in [
        ("C out of order", lambda: c.new_groups([[0, 1], [2, 1]]), ValueError,
         ("group 1", "rank 1 comes after rank 2")),
        ("C repeated", lambda: c.new_groups([[0, 0]]), ValueError, ("rank 0 is repeated",)),
        ("C empty", lambda: c.new_groups([[0], []]), ValueError, ("group 1 is empty",)),
        ("C range", lambda: c.new_groups([[world]]), ValueError,
         (f"rank {world} is not a rank",)),
        ("C huge rank", lambda: c.new_groups([[2 ** 40]]), ValueError, ("is not a rank",)),
        ("C none", lambda: c.new_groups([]), ValueError, ("1 to 64",)),
        ("C too many", lambda: c.new_groups([[0]] * 65), ValueError, ("1 to 64",)),
        ("C timeout", lambda: c.new_groups([[0]], -1), ValueError, ("negative",)),
        ("C group type", lambda: c.barrier(3), TypeError, ("Group",)),
    ]:
        e = ck.raises(name, fn, exc, *words)
        if e is not None and name != "C group type":
            ck.expect(f"{name} status", getattr(e, "status", "") == "PSHARD_ERR_INVALID_ARGUMENT")


def main():
    out = sys.argv[1]
    quick = len(sys.argv) > 2 and sys.argv[2] == "quick"
    pshard.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    ck = Checks()
    warnings.simplefilter("ignore")  # torch's "does not belong to the given group"
    if not quick:
        bad_arguments(ck, rank, world)
    dist.barrier()

    g13 = dist.new_group([3, 1], timeout=datetime.timedelta(seconds=60))
    g012 = dist.new_group([0, 1, 2], group_desc="first three")
    g2 = dist.new_group([2])
    for ranks, g in (([1, 3], g13), ([0, 1, 2], g012), ([2], g2)):
        member = rank in ranks
        ck.expect(f"new_group {ranks} member", (g is not NON) == member)
        ck.expect(f"get_rank {ranks}", dist.get_rank(g) ==
                  (ranks.index(rank) if member else -1))
        ck.expect(f"get_world_size {ranks}", dist.get_world_size(g) ==
                  (len(ranks) if member else -1))
        if member:
            ck.expect(f"size {ranks}", g.size() == len(ranks) and
                      g.rank() == ranks.index(rank))
            ck.expect(f"group ranks {ranks}", dist.get_process_group_ranks(g) == ranks)
            ck.expect(f"global ranks {ranks}", [dist.get_global_rank(g, k)
                                                for k in range(len(ranks))] == ranks)
            ck.expect(f"group rank {ranks}", [dist.get_group_rank(g, r) for r in ranks] ==
                      list(range(len(ranks))))
            other = next(r for r in range(world) if r not in ranks)
            ck.raises(f"get_group_rank outside {ranks}", lambda: dist.get_group_rank(g, other),
                      ValueError, str(other))
            ck.raises(f"get_global_rank outside {ranks}",
                      lambda: dist.get_global_rank(g, len(ranks)), ValueError)
    every = dist.new_group([3, 2, 1, 0])
    ck.expect("WORLD", dist.get_process_group_ranks(every) == [0, 1, 2, 3] and
              dist.GroupMember.WORLD is
              dist.group.WORLD and dist.get_rank(dist.group.WORLD) == rank)
    for ranks, g in (([1, 3], g13), ([0, 1, 2], g012), ([2], g2)):
        group_collectives(ck, rank, world, ranks, g)
    group_collectives(ck, rank, world, list(range(world)), dist.group.WORLD)
    if quick:
        finish(out, rank, ck, None)
        return

    # new_subgroups_by_enumeration: one exchange, the groups without this rank as
    # NON_GROUP_MEMBER; new_subgroups: consecutive blocks.
    cur, subs = dist.new_subgroups_by_enumeration([[2, 0], [1, 3]])
    mine = [0, 2] if rank % 2 == 0 else [1, 3]
    ck.expect("enumeration groups", len(subs) == 2 and subs[rank % 2] is cur and
              subs[1 - rank % 2] is NON and dist.get_process_group_ranks(cur) == mine)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=cur)
    ck.expect("enumeration all_reduce", x.item() == sum(r + 1 for r in mine))
    cur, subs = dist.new_subgroups(group_size=2)
    ck.expect("new_subgroups", dist.get_process_group_ranks(cur) == [rank // 2 * 2,
                                                                      rank // 2 * 2 + 1])
    cur, subs = dist.new_subgroups_by_enumeration([[3]])
    ck.expect("enumeration without this rank", (cur is None) == (rank != 3) and
              len(subs) == 1)

    # init_device_mesh: rows are "shard" groups, columns "replicate" groups.
    mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    row, col = rank // 2, rank % 2
    ck.expect("mesh tensor", torch.equal(mesh.mesh, torch.arange(4, dtype=torch.int).view(2, 2))
              and mesh.ndim == 2 and mesh.shape == (2, 2) and mesh.size() == 4 and
              mesh.size(1) == 2 and mesh.mesh_dim_names == ("replicate", "shard") and
              mesh.device_type == "cpu")
    ck.expect("mesh coordinate", list(mesh.get_coordinate()) == [row, col])
    ck.expect("mesh local ranks", mesh.get_local_rank("shard") == col and
              mesh.get_local_rank(0) == row and mesh.get_rank() == rank)
    shard, rep = mesh["shard"], mesh["replicate"]
    ck.expect("sub-mesh", shard.mesh.tolist() == [row * 2, row * 2 + 1] and
              rep.mesh.tolist() == [col, col + 2] and shard.ndim == 1 and
              shard.mesh_dim_names == ("shard",) and shard.get_local_rank() == col and
              list(shard.get_coordinate()) == [col] and list(rep.get_coordinate()) == [row])
    ck.expect("sub-mesh groups", shard.get_group() is mesh.get_group("shard") and
              rep.get_group() is mesh.get_group(0) and
              mesh.get_all_groups() == [rep.get_group(), shard.get_group()])
    ck.expect("mesh group ranks",
              dist.get_process_group_ranks(shard.get_group()) == [row * 2, row * 2 + 1] and
              dist.get_process_group_ranks(rep.get_group()) == [col, col + 2])
    x = torch.tensor([float(rank + 1), 10.0 ** rank])
    dist.all_reduce(x, group=mesh["shard"].get_group())
    ck.expect("shard all_reduce", x.tolist() == [float(row * 2 + 1 + row * 2 + 2),
                                                  10.0 ** (row * 2) + 10.0 ** (row * 2 + 1)])
    x = torch.tensor([float(rank + 1), 10.0 ** rank])
    dist.all_reduce(x, group=mesh["replicate"].get_group())
    ck.expect("replicate all_reduce", x.tolist() == [float(col + 1 + col + 3),
                                                      10.0 ** col + 10.0 ** (col + 2)])
    ck.raises("transposed sub-mesh (torch refuses it)", lambda: mesh["shard", "replicate"],
              KeyError, "ascending")
    ck.raises("mesh_dim needed", lambda: mesh.get_group(), RuntimeError, "mesh_dim")
    ck.raises("unknown dim name", lambda: mesh["tp"], KeyError, "tp")
    flat = dist.init_device_mesh("cpu", (world,))
    ck.expect("1-D mesh is the world", flat.get_group() is dist.group.WORLD and
              flat.get_local_rank() == rank)

    # A group's handle used by a rank not in it (libpshard's own check); its members use it.
    h13 = pshard._get_client().new_groups([[1, 3]])[0]
    ck.expect("Group", h13.ranks == (1, 3) and h13.size == 2 and
              h13.rank == (-1 if rank not in (1, 3) else [1, 3].index(rank)))
    if rank in (1, 3):
        pshard._get_client().barrier(h13)
    else:
        ck.raises("not in the group", lambda: pshard._get_client().barrier(h13),
                  pshard.FailedPreconditionError, f"(rank {rank}) is not in the group (ranks 1, 3)")
    dist.barrier()

    # Groups made in a different order on different ranks: torch gives both the same name;
    # each is still its own group on the shard servers (the ranks are part of its key), never
    # a mix of the two.
    desync = None
    first = [0, 1] if rank < 2 else [2, 3]
    g = dist.new_group(first)
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=g)
    ck.expect("groups made in a different order stay apart", x.item() == float(sum(first)))

    # After a new init_process_group the old groups are refused (libpshard knows the client
    # that made a group), and the new session works.
    pshard.destroy_process_group()
    pshard.init_process_group()
    if rank in (1, 3):
        ck.raises("stale group", lambda: dist.all_reduce(torch.ones(1), group=g13),
                  ValueError, "not initialized")
    x = torch.ones(1)
    dist.all_reduce(x)
    ck.expect("world after init again", x.item() == world)
    finish(out, rank, ck, desync)


def finish(out, rank, ck, desync):
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"failed": ck.failed, "checks": ck.count, "desync": desync}, f)
    pshard.destroy_process_group()


if __name__ == "__main__":
    main()
