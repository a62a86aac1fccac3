"""Trainer for test_keyed_groups.py, on 4 ranks: keyed process groups (Client.new_groups with
key=, torch's new_group contract: only the members call, naming the group with a shared key),
through pshard._C directly. Groups {0,1}, {2,3} and {1,2} are made by their members in
different orders on different ranks; their all_reduces are checked against the sums; two groups
of the same ranks under different keys both work; a repeated key and a non-member's call are
refused; a member that never comes fails the others before their timeout_ms, naming it, and
the same key then works once every member comes; the all-ranks NewGroups still works beside
the keyed groups. Writes OUTDIR/rank-R.json with the
checks that failed (none expected) and the missing member's error text."""
import hashlib
import json
import os
import sys

import torch

import pshard

torch.set_num_threads(1)
ALL_REDUCE = 3  # pshard_op_t


class Checks:
    def __init__(self):
        self.failed = []
        self.count = 0

    def expect(self, name, ok):
        self.count += 1
        if not ok:
            self.failed.append(name)

    def raises(self, name, fn, exc, *words):
        """fn() raises exc with every word in its message; returns the message."""
        self.count += 1
        try:
            fn()
        except exc as e:
            if not all(w in str(e) for w in words):
                self.failed.append(f"{name}: message {str(e)!r} lacks {words}")
            return str(e)
        except Exception as e:  # noqa: BLE001 (reported as a failed check)
            self.failed.append(f"{name}: {type(e).__name__}: {e}")
            return None
        self.failed.append(f"{name} was accepted")
        return None


def all_reduce(c, value, group, n=5):
    """The sum over group (None: the world) of every member's full((n,), value)."""
    send = torch.full((n,), float(value))
    recv = torch.empty(n)
    c.collective_start(ALL_REDUCE, send, recv, n, "fp32", 0, 0, group).wait()
    return recv


def sum_check(ck, c, name, group, ranks, rank, salt):
    """all_reduce on group of (rank + 1) * salt on every member, against the sum."""
    got = all_reduce(c, (rank + 1) * salt, group)
    want = float(sum((r + 1) * salt for r in ranks))
    ck.expect(f"{name}: sum {got.tolist()} != {want}", torch.equal(got, torch.full((5,), want)))


def keyed(c, key, ranks, timeout_ms=0):
    gs = c.new_groups([ranks], timeout_ms, key=key)
    assert len(gs) == 1 and list(gs[0].ranks) == ranks, gs
    return gs[0]


def main():
    out = sys.argv[1]
    pshard.init_process_group()
    c = pshard._get_client()
    rank, world = c.rank, c.world_size
    assert world == 4, world
    ck = Checks()
    res = {"missing_error": None}
    # torch's own names: the counter (use_local_synchronization=False) and the hashed one.
    key_a, key_b = "1", hashlib.sha1(b"2_3_2").hexdigest()
    key_c = "groups/1-2 \u00e9 " + "x" * 200  # any string: hashed into the store's names
    A, B, C = [0, 1], [2, 3], [1, 2]

    # 1. Members only, in different orders: rank 1 makes A then C, rank 2 makes C then B (so
    # rank 3 waits in B for rank 2, which waits in C for rank 1, which waits in A for rank 0).
    # Ranks outside a group never call for it.
    mine = {}
    order = {0: ["A"], 1: ["A", "C"], 2: ["C", "B"], 3: ["B"]}[rank]
    spec = {"A": (key_a, A), "B": (key_b, B), "C": (key_c, C)}
    for name in order:
        mine[name] = keyed(c, *spec[name])
        ck.expect(f"{name}: group rank", mine[name].rank == spec[name][1].index(rank))
    # Their collectives, again in different orders (C's members reduce on it first).
    for name in reversed(order) if rank in C else order:
        sum_check(ck, c, name, mine[name], spec[name][1], rank, 1)
    all_reduce(c, 0, None)  # the world: everyone is past the groups' creation

    # 2. The same ranks under another key: a distinct group; both work, interleaved.
    pair = A if rank in A else B
    first = mine["A" if rank in A else "B"]
    other = keyed(c, f"again-{pair[0]}{pair[1]}", pair)
    for salt in (10, 100, 1000):
        sum_check(ck, c, f"first {salt}", first, pair, rank, salt)
        sum_check(ck, c, f"other {salt}", other, pair, rank, salt + 1)

    # 3. A key this session already made: refused at once, naming it.
    ck.raises("repeated key", lambda: keyed(c, *spec["A" if rank in A else "B"]),
              pshard.InvalidArgumentError, "already exists")
    # 4. A non-member's call: refused, naming the rank (the members do not call).
    if rank == 3:
        ck.raises("non-member", lambda: keyed(c, "outsiders", [0, 1]),
                  pshard.InvalidArgumentError, "rank 3 is not a member", "outsiders")
    all_reduce(c, 0, None)

    # 5. A member that never comes: rank 3 does not make "quartet"; the others fail within
    # their timeout_ms with an error naming the group and the missing rank. Rank 3's world
    # all_reduce below waits until they are through.
    if rank != 3:
        res["missing_error"] = ck.raises(
            "missing member", lambda: keyed(c, "quartet", [0, 1, 2, 3], timeout_ms=3000),
            pshard.TimeoutError, "quartet", "rank 3")
    all_reduce(c, 0, None)
    # ... and the same key again, by every member this time: the failed attempt left nothing
    # behind (no group, no address a member would dial).
    quartet = keyed(c, "quartet", [0, 1, 2, 3], timeout_ms=30000)
    sum_check(ck, c, "quartet", quartet, [0, 1, 2, 3], rank, 3)

    # 6. The all-ranks NewGroups beside the keyed groups: its ids never name a keyed group (a
    # collision would run these sums over the wrong ranks).
    g02, g13 = c.new_groups([[0, 2], [1, 3]])
    agreed = g02 if rank in (0, 2) else g13
    sum_check(ck, c, "agreed", agreed, list(agreed.ranks), rank, 7)
    sum_check(ck, c, "keyed after agreed", first, pair, rank, 9)
    later = keyed(c, f"later-{pair[0]}{pair[1]}", pair)
    sum_check(ck, c, "keyed made after agreed", later, pair, rank, 11)
    sum_check(ck, c, "agreed again", agreed, list(agreed.ranks), rank, 13)
    got = all_reduce(c, rank + 1, None)
    ck.expect("world", torch.equal(got, torch.full((5,), 10.0)))

    res.update(failed=ck.failed, checks=ck.count)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
