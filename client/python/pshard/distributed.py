"""Collectives on torch tensors through this trainer's shard server, with torch.distributed's
names: all_reduce, reduce, broadcast, all_gather_into_tensor, all_gather, gather, scatter,
all_to_all_single, all_to_all, barrier. While some trainers have joined
(pshard.torch.Join), their ranks contribute the reduction's identity (zeros for a sum, ones for
a product, -inf for a max, ...) and an average is over the others.

Process groups as torch's: new_group, new_subgroups, new_subgroups_by_enumeration and
init_device_mesh make groups over some of the ranks (every rank calls them, in the same order);
every collective takes ``group=``, with ``src``/``dst`` still global ranks (or ``group_src`` /
``group_dst``, group ranks). On a rank that is not in the group a collective does nothing and
returns None, with torch's warning.

Tensors must be on the CPU, of dtype float32, bfloat16, float16, float64, int64, int32, uint8
or bool (sum and max are "any", product and min "all"); non-contiguous
tensors are handled through a contiguous copy. ``async_op=True`` runs the operation at once
and returns a completed Work. Errors are pshard.Error subclasses (PeerLostError, TimeoutError,
DesyncError, ...) with pshard's message, or TypeError/ValueError for bad arguments.
"""
import datetime
import enum
import operator
import warnings

import torch

import pshard

__all__ = ["ReduceOp", "all_reduce", "reduce", "broadcast", "all_gather_into_tensor",
           "all_gather", "gather", "scatter", "all_to_all_single", "all_to_all", "barrier",
           "get_rank", "get_world_size", "group", "GroupMember", "ProcessGroup", "new_group",
           "new_subgroups", "new_subgroups_by_enumeration", "get_process_group_ranks",
           "get_group_rank", "get_global_rank", "DeviceMesh", "init_device_mesh", "send", "recv",
           "isend", "irecv", "reduce_scatter_tensor", "reduce_scatter"]

get_rank = pshard.get_rank
get_world_size = pshard.get_world_size
group = pshard.group
GroupMember = pshard.GroupMember
ProcessGroup = pshard.ProcessGroup

# libpshard makes at most this many groups in one call (pshard_new_groups).
_GROUPS_PER_CALL = 64
_BACKENDS = (None, "pshard", "gloo", "nccl", "cpu:gloo", "cuda:nccl", "cpu:gloo,cuda:nccl")


def _group_options(timeout, backend, pg_options, what):
    """The groups' collective timeout in ms (0: the shard servers') after checking the options
    torch's group functions take."""
    if backend not in _BACKENDS:
        raise ValueError(f"{what}: unknown backend {backend!r}")
    if pg_options is not None:
        raise ValueError(f"{what}: pg_options are not supported (the shard servers' backend is "
                         "chosen when they start)")
    if timeout is None:
        return 0
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"{what}: timeout must be a datetime.timedelta, not "
                        f"{type(timeout).__name__}")
    ms = int(timeout.total_seconds() * 1000)
    if ms <= 0:
        raise ValueError(f"{what}: timeout must be positive")
    return ms


def _group_ranks(ranks, world, what):
    """ranks sorted (as torch's new_group sorts them), after checking that they are distinct
    ranks of the world and not none at all; ValueError (TypeError) naming the bad one."""
    try:
        rs = sorted(operator.index(r) for r in ranks)
    except TypeError:
        raise TypeError(f"{what}: ranks must be a sequence of int ranks, not {ranks!r}") from None
    if not rs:
        raise ValueError(f"{what}: ranks is empty; a group needs at least one rank")
    for a, b in zip(rs, rs[1:]):
        if a == b:
            raise ValueError(f"{what}: ranks list must not contain duplicate entries, got "
                             f"{list(ranks)} (rank {a} is repeated)")
    for r in (rs[0], rs[-1]):
        if not 0 <= r < world:
            raise ValueError(f"{what}: rank {r} is out of range; valid ranks are 0 to "
                             f"{world - 1} (ranks {list(ranks)})")
    return rs


def _make_groups(rank_lists, timeout_ms, desc=None):
    """One ProcessGroup per sorted, checked list of ranks, or GroupMember.NON_GROUP_MEMBER for
    the lists without this trainer. Collective: the shard servers make all of them in one call
    (one per 64 groups); a list of every rank is the default group, made by nobody."""
    c = pshard._get_client()
    out = [None] * len(rank_lists)
    todo = [i for i, rs in enumerate(rank_lists) if len(rs) < c.world_size]
    for i, rs in enumerate(rank_lists):
        if len(rs) == c.world_size:
            out[i] = group.WORLD
    for at in range(0, len(todo), _GROUPS_PER_CALL):
        part = todo[at:at + _GROUPS_PER_CALL]
        handles = c.new_groups([rank_lists[i] for i in part], timeout_ms)
        for i, h in zip(part, handles):
            out[i] = (ProcessGroup(rank_lists[i], h, desc) if h.rank >= 0
                      else GroupMember.NON_GROUP_MEMBER)
    return out


def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None):
    """torch's new_group: a process group of the world ranks in ranks (sorted; None or every
    rank: the default group, group.WORLD). Every rank must call it, with the same ranks and in
    the same order as its other group calls (else DesyncError); the ranks not in the group get
    GroupMember.NON_GROUP_MEMBER. timeout (a datetime.timedelta) bounds each of the group's
    collectives (default: the shard servers' collective timeout). ValueError, before any
    exchange, for an empty list, a repeated rank or one out of range, and for
    use_local_synchronization=True (only the members would call it) unless ranks are every
    rank."""
    ms = _group_options(timeout, backend, pg_options, "new_group")
    if ranks is None:
        return group.WORLD
    world = get_world_size()
    rs = _group_ranks(ranks, world, "new_group")
    if use_local_synchronization and len(rs) < world:
        raise ValueError("new_group: use_local_synchronization=True is not supported for a "
                         "group of some of the ranks: every rank takes part in making it")
    return _make_groups([rs], ms, group_desc)[0]


def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None,
                                 pg_options=None, group_desc=None):
    """torch's: one group per list of ranks (the lists must not overlap; a rank may be in
    none), all made in one exchange. Returns (the group of this rank or None, every group, with
    GroupMember.NON_GROUP_MEMBER for those without this rank)."""
    what = "new_subgroups_by_enumeration"
    ms = _group_options(timeout, backend, pg_options, what)
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    world = get_world_size()
    lists = [_group_ranks(rs, world, what) for rs in ranks_per_subgroup_list]
    seen = {}
    for rs in lists:
        for r in rs:
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both subgroup {seen[r]} and {rs}")
            seen[r] = rs
    subgroups = _make_groups(lists, ms, group_desc)
    me = get_rank()
    cur = next((g for g, rs in zip(subgroups, lists) if me in rs), None)
    return cur, subgroups


def new_subgroups(group_size=None, group=None, timeout=None, backend=None, pg_options=None,
                  group_desc=None):
    """torch's: the ranks of group (default: the world) cut into consecutive subgroups of
    group_size ranks. Returns (this rank's subgroup, every subgroup)."""
    if group_size is None:
        raise ValueError("new_subgroups: pass group_size (the default, the number of devices "
                         "per machine, does not apply to pshard's CPU collectives)")
    group_size = operator.index(group_size)
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    ranks = get_process_group_ranks(group)
    if len(ranks) < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size "
                         f"({len(ranks)})")
    if len(ranks) % group_size:
        raise ValueError(f"The world size ({len(ranks)}) must be divisible by "
                         f"'group_size={group_size}'")
    return new_subgroups_by_enumeration(
        [ranks[i:i + group_size] for i in range(0, len(ranks), group_size)], timeout=timeout,
        backend=backend, pg_options=pg_options, group_desc=group_desc)


def get_process_group_ranks(group_):
    """The global ranks of group_ (None: the default group, every rank), in group-rank order."""
    if pshard._is_non_member(group_):
        raise ValueError("GroupMember.NON_GROUP_MEMBER has no ranks (this rank is not in that "
                         "group)")
    return pshard._resolve_group(group_)._world_ranks()


def get_group_rank(group_, global_rank):
    """global_rank's rank in group_ (the default group: the same)."""
    ranks = get_process_group_ranks(group_)
    if global_rank not in ranks:
        raise ValueError(f"Global rank {global_rank} is not part of group {group_} "
                         f"(ranks {ranks})")
    return ranks.index(global_rank)


def get_global_rank(group_, group_rank):
    """The global rank of group_'s rank group_rank (the default group: the same)."""
    ranks = get_process_group_ranks(group_)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"Group rank {group_rank} is not part of group {group_} (group ranks "
                         f"0..{len(ranks) - 1})")
    return ranks[group_rank]


# pshard_op_t's numbers (CollectiveRequest.op), for Client.collective_start.
_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, "barrier": 5, "reduce": 6,
        "gather": 7, "scatter": 8, "all_to_all": 9, "send": 10, "recv": 11}


class _Target:
    """Where a collective runs: the client, the group's pshard._C.Group (None: the world), the
    group's size, this trainer's rank in it, and the ProcessGroup. With async_op its C calls
    are queued (Client.collective_start, behind everything issued before) and the copies that
    follow them wait for the Work's wait()."""
    __slots__ = ("c", "h", "size", "rank", "pg", "works", "after")

    def __init__(self, c, h, size, rank, pg):
        self.c, self.h, self.size, self.rank, self.pg = c, h, size, rank, pg
        self.works = self.after = None

    def start(self, async_op):
        if async_op:
            self.works, self.after = [], []
        return self

    def run(self, op, now, send, recv, count, dt, reduce=0, root=0, tag=0):
        """One C call: now() (blocking), or queued under async_op."""
        if self.works is None:
            now()
        else:
            self.works.append(self.c.collective_start(_OPS[op], send, recv, count, dt, reduce,
                                                      root, self.h, tag))

    def then(self, fn):
        """fn() once the calls before it finished: now, or at the Work's wait()."""
        if self.works is None:
            fn()
        else:
            self.after.append(fn)

    def done(self):
        return None if self.works is None else _Work(self.works, self.after)


class _Work:
    """What async_op=True returns (torch's Work): wait() blocks until the collective's queued
    calls finished, raises the first error, and completes the outputs; is_completed() says
    whether they finished (and then completes the outputs too)."""

    def __init__(self, works, after):
        self._works, self._after, self._error = works, after, None

    def wait(self, timeout=None):
        for w in self._works:
            try:
                w.wait()
            except Exception as e:  # every call is waited for; the first error is raised
                self._error = self._error or e
        self._works = []
        if self._error is not None:
            self._after = []
            raise self._error
        after, self._after = self._after, []
        for fn in after:
            fn()
        return True

    def is_completed(self):
        """True once every queued call finished (the outputs are then complete; an error is
        kept for wait() to raise)."""
        if not all(w.is_completed() for w in self._works):
            return False
        try:
            self.wait()
        except Exception:
            pass
        return True


def _target(group_, op_name):
    """The _Target of group_ for op_name, or None (with torch's warning) when this trainer is
    not in the group."""
    if not pshard._is_non_member(group_):
        pg = pshard._resolve_group(group_)
        c = pshard._get_client()
        if pg._ranks is None:
            return _Target(c, None, c.world_size, c.rank, pg)
        rank = pg.rank()
        if rank >= 0:
            return _Target(c, pg._handle, pg.size(), rank, pg)
    me = pshard._get_client().rank
    warnings.warn(f"Running {op_name} on global rank {me} which does not belong to the given "
                  "group.", stacklevel=3)
    return None


def _root(t, value, group_value, what):
    """The root's group rank, from a global rank value or a group rank group_value (exactly one
    of them; what is "src" or "dst")."""
    gwhat = "group_" + what
    if group_value is not None:
        if value is not None:
            raise ValueError(f"Can't specify both {what} and {gwhat}")
        gr = _int_rank(group_value, gwhat)
        if not 0 <= gr < t.size:
            raise ValueError(f"{gwhat} {gr} is not a rank of the group (size {t.size})")
        return gr
    if value is None:
        raise ValueError(f"Must specify {what} or {gwhat}")
    v = _int_rank(value, what)
    if t.h is None:
        if not 0 <= v < t.size:
            raise ValueError(f"{what} {v} is not a rank (world size {t.size})")
        return v
    ranks = t.pg._world_ranks()
    if v not in ranks:
        raise ValueError(f"{what} {v} is not in the group (ranks {ranks})")
    return ranks.index(v)


def _int_rank(value, what):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int rank, not {type(value).__name__}")
    return value


def _then(work, fn):
    """fn() after work (what a collective returned: None when it ran, else its _Work), which
    is returned."""
    if work is None:
        fn()
        return None
    work._after.append(fn)
    return work


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
           torch.int64: "int64", torch.float64: "fp64", torch.int32: "int32",
           torch.uint8: "uint8", torch.bool: "uint8"}
_INTEGER = ("int64", "int32", "uint8")
# Pieces of this many bytes at most go through the shard server's scratch region at once
# (PSHARD_SCRATCH_BYTES, 16 MiB by default).
_CHUNK_BYTES = 4 << 20


class ReduceOp(enum.Enum):
    """torch.distributed.ReduceOp's reductions, with its numbers. all_reduce also takes torch's
    own ReduceOp members (by name). BAND, BOR and BXOR are for int64 tensors."""
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7


def _reduce_op(op):
    """Our ReduceOp for op: one of ours, or torch.distributed's (matched by name)."""
    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", None)
    if not isinstance(name, str):
        # torch.distributed.ReduceOp.SUM is a RedOpType in some versions: str() ends in its name
        name = str(op).rsplit(".", 1)[-1]
    try:
        return ReduceOp[name]
    except KeyError:
        raise ValueError(f"op {op!r} is not supported; use one of "
                         f"{', '.join('ReduceOp.' + m.name for m in ReduceOp)}") from None


def _dtype_of(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}; pshard's collectives take CPU tensors")
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"{what} has dtype {t.dtype}; supported: float32, bfloat16, float16, "
                        "float64, int64, int32, uint8, bool") from None


def _flat_pieces(t):
    """Contiguous 1-D pieces of t's elements (views of t when it is contiguous)."""
    flat = t.view(-1)
    step = max(1, _CHUNK_BYTES // max(1, t.element_size()))
    return [flat[i:i + step] for i in range(0, flat.numel(), step)]


def _in_place(t, tensor, fn):
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    for piece in _flat_pieces(work.detach()):
        fn(piece)
    if work is not tensor:
        t.then(lambda: tensor.copy_(work))


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces tensor over the ranks of group (default: all) in place: op is a ReduceOp (SUM,
    AVG, PRODUCT, MIN, MAX; BAND, BOR, BXOR for int64), ours or torch.distributed's."""
    t = _target(group, "all_reduce")
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(tensor, "tensor")
    op = _check_op(op, dt, tensor)
    _in_place(t, tensor, lambda piece: t.run(
        "all_reduce", lambda: t.c.all_reduce(piece, dt, op.value, t.h), piece, piece,
        piece.numel(), dt, reduce=op.value))
    return t.done()


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copies the tensor of rank src (a global rank; or group_src, a rank of group) into every
    rank's tensor."""
    t = _target(group, "broadcast")
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(tensor, "tensor")
    root = _root(t, src, group_src, "src")
    _in_place(t, tensor, lambda piece: t.run(
        "broadcast", lambda: t.c.broadcast(piece, dt, root, t.h), piece, piece, piece.numel(),
        dt, root=root))
    return t.done()


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenates every rank's input_tensor (in group-rank order) into output_tensor, whose
    first dimension (or element count) is the group's size times the input's."""
    t = _target(group, "all_gather_into_tensor")
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(input_tensor, "input_tensor")
    if _dtype_of(output_tensor, "output_tensor") != dt:
        raise TypeError("output_tensor and input_tensor must have the same dtype")
    n = t.size
    if output_tensor.numel() != n * input_tensor.numel():
        raise ValueError(f"output_tensor has {output_tensor.numel()} elements; it needs "
                         f"{'world' if t.h is None else 'group'}_size ({n}) x "
                         f"{input_tensor.numel()}")
    src = input_tensor.detach().contiguous().view(-1)
    out = output_tensor if output_tensor.is_contiguous() else output_tensor.contiguous()
    out_flat = out.detach().view(n, -1)
    step = max(1, _CHUNK_BYTES // max(1, src.element_size() * (n + 1)))
    for i in range(0, max(src.numel(), 1), step):
        piece = src[i:i + step]
        if piece.numel() == 0:
            break
        recv = torch.empty(n * piece.numel(), dtype=src.dtype)
        t.run("all_gather", lambda: t.c.all_gather(recv, piece, dt, t.h), piece, recv,
              piece.numel(), dt)
        t.then(lambda i=i, piece=piece, recv=recv:
               out_flat[:, i:i + piece.numel()].copy_(recv.view(n, -1)))
    if out is not output_tensor:
        t.then(lambda: output_tensor.copy_(out))
    return t.done()


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Every rank's tensor into tensor_list (the group's size tensors like tensor, in group-rank
    order); equal sizes only."""
    t = _target(group, "all_gather")
    if t is None:
        return None
    dt = _dtype_of(tensor, "tensor")
    if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != t.size:
        raise ValueError(f"tensor_list must be a list of {t.size} tensors (the group's size)")
    n = tensor.numel()
    for i, o in enumerate(tensor_list):
        if _dtype_of(o, f"tensor_list[{i}]") != dt or o.numel() != n:
            raise ValueError(f"tensor_list[{i}] must have tensor's dtype {tensor.dtype} and its "
                             f"{n} elements (uneven sizes are not supported)")
    flat = torch.empty(t.size * n, dtype=tensor.dtype)
    work = all_gather_into_tensor(flat, tensor, group=group, async_op=async_op)

    def copy_out():
        for k, o in enumerate(tensor_list):
            o.copy_(flat[k * n:(k + 1) * n].view_as(o))
    return _then(work, copy_out)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces input over the ranks of group (default: all) and scatters the result: input
    holds the group's size blocks of output's size (block k for group rank k, along dim 0),
    output gets the reduction of every rank's block for this rank. op as all_reduce's."""
    t = _target(group, "reduce_scatter_tensor")
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(input, "input")
    if _dtype_of(output, "output") != dt:
        raise TypeError("output and input must have the same dtype")
    op = _check_op(op, dt, input)
    n = t.size
    if input.numel() != n * output.numel():
        raise ValueError(f"input has {input.numel()} elements; it needs "
                         f"{'world' if t.h is None else 'group'}_size ({n}) x output's "
                         f"{output.numel()}")
    src = input.detach().contiguous().view(n, -1)
    out = output if output.is_contiguous() else output.contiguous()
    flat = out.detach().view(-1)
    step = max(1, _CHUNK_BYTES // max(1, src.element_size() * (n + 1)))
    for i in range(0, flat.numel(), step):
        piece = flat[i:i + step]
        send = src[:, i:i + piece.numel()].contiguous()
        t.run("reduce_scatter",
              lambda piece=piece, send=send: t.c.reduce_scatter_tensor(piece, send, dt,
                                                                       op.value, t.h),
              send, piece, piece.numel(), dt, reduce=op.value)
    if out is not output:
        t.then(lambda: output.copy_(out))
    return t.done()


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """reduce_scatter_tensor with the blocks as a list: input_list[k] (output's size and dtype)
    goes to group rank k."""
    t = _target(group, "reduce_scatter")
    if t is None:
        return None
    if not isinstance(input_list, (list, tuple)) or len(input_list) != t.size:
        raise ValueError(f"input_list must be a list of {t.size} tensors (the group's size)")
    dt = _dtype_of(output, "output")
    for i, x in enumerate(input_list):
        if _dtype_of(x, f"input_list[{i}]") != dt or x.numel() != output.numel():
            raise ValueError(f"input_list[{i}] must have output's dtype {output.dtype} and its "
                             f"{output.numel()} elements")
    stacked = torch.cat([x.detach().reshape(-1) for x in input_list])
    return reduce_scatter_tensor(output, stacked, op=op, group=group, async_op=async_op)


def _check_op(op, dt, tensor):
    """The reduction to run on tensor (of pshard dtype dt): op itself, or for bool tensors
    (one byte, 0 or 1) the byte reduction that gives torch's result (sum -> max, product ->
    min)."""
    op = _reduce_op(op)
    if op is ReduceOp.AVG and dt in _INTEGER:
        raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, not {tensor.dtype}")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dt not in _INTEGER:
        raise TypeError(f"ReduceOp.{op.name} needs an integer or bool tensor, not "
                        f"{tensor.dtype}")
    if tensor.dtype == torch.bool:
        op = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}.get(op, op)
    return op


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """Reduces tensor over the ranks of group into rank dst's tensor (a global rank; or
    group_dst, a rank of group), in place there; the others' tensors are left as they were. op
    as all_reduce's."""
    t = _target(group, "reduce")
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(tensor, "tensor")
    op = _check_op(op, dt, tensor)
    root = _root(t, dst, group_dst, "dst")
    # (only dst's pieces are written; the others' stay as they were)
    _in_place(t, tensor, lambda piece: t.run(
        "reduce", lambda: t.c.reduce(piece, dt, op.value, root, t.h), piece, piece,
        piece.numel(), dt, reduce=op.value, root=root))
    return t.done()


def _rooted_list(t, lst, tensor, what, root, name):
    """The root's list of the group's size tensors shaped and typed like tensor; None
    elsewhere."""
    if t.rank != root:
        return None
    if lst is None or len(lst) != t.size:
        raise ValueError(f"{what} must be a list of {t.size} tensors (the "
                         f"{'world' if t.h is None else 'group'} size) on the {name} rank")
    dt = _dtype_of(tensor, "tensor")
    for i, x in enumerate(lst):
        if _dtype_of(x, f"{what}[{i}]") != dt or x.numel() != tensor.numel():
            raise ValueError(f"{what}[{i}] must have tensor's dtype {tensor.dtype} and its "
                             f"{tensor.numel()} elements")
    return lst


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """Collects every rank's tensor into rank dst's gather_list (the group's size tensors like
    tensor, in group-rank order); dst is a global rank (default 0), or group_dst a rank of
    group. The other ranks pass gather_list=None."""
    t = _target(group, "gather")
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(tensor, "tensor")
    root = _root(t, 0 if dst is None and group_dst is None else dst, group_dst, "dst")
    outs = _rooted_list(t, gather_list, tensor, "gather_list", root, "dst")
    n = t.size
    src = tensor.detach().contiguous().view(-1)
    step = max(1, _CHUNK_BYTES // max(1, src.element_size() * (n + 1)))
    for i in range(0, max(src.numel(), 1), step):
        piece = src[i:i + step]
        if piece.numel() == 0:
            break
        recv = torch.empty(n * piece.numel(), dtype=src.dtype) if outs is not None else None
        t.run("gather", lambda: t.c.gather_to(recv, piece, dt, root, t.h), piece, recv,
              piece.numel(), dt, root=root)
        if outs is not None:
            def copy_out(i=i, piece=piece, recv=recv):
                for r, o in enumerate(recv.view(n, -1)):
                    outs[r].view(-1)[i:i + piece.numel()].copy_(o)
            t.then(copy_out)
    return t.done()


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """Copies scatter_list[r] of rank src (the group's size tensors like tensor) into the
    tensor of group rank r; src is a global rank (default 0), or group_src a rank of group. The
    other ranks pass scatter_list=None."""
    t = _target(group, "scatter")
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(tensor, "tensor")
    root = _root(t, 0 if src is None and group_src is None else src, group_src, "src")
    ins = _rooted_list(t, scatter_list, tensor, "scatter_list", root, "src")
    n = t.size
    out = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = out.detach().view(-1)
    srcs = [x.detach().contiguous().view(-1) for x in ins] if ins is not None else None
    step = max(1, _CHUNK_BYTES // max(1, flat.element_size() * (n + 1)))
    for i in range(0, max(flat.numel(), 1), step):
        piece = flat[i:i + step]
        if piece.numel() == 0:
            break
        send = (torch.cat([x[i:i + piece.numel()] for x in srcs]) if srcs is not None
                else None)
        t.run("scatter", lambda: t.c.scatter_from(piece, send, dt, root, t.h), send, piece,
              piece.numel(), dt, root=root)
    if out is not tensor:
        t.then(lambda: tensor.copy_(out))
    return t.done()


def _splits(splits, rows, n, name):
    """Split sizes (rows of dim 0 per group rank) as a list of n ints adding up to rows; None
    means equal splits."""
    if splits is None:
        if rows % n:
            raise ValueError(f"dim 0 ({rows}) must be a multiple of the group size {n} when "
                             f"{name} is not given")
        return [rows // n] * n
    try:
        out = [int(x) for x in splits]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of integers, not {splits!r}") from None
    if len(out) != n or any(x < 0 for x in out) or sum(out) != rows:
        raise ValueError(f"{name} {out} must give the group's {n} ranks non-negative row counts "
                         f"adding up to dim 0 ({rows})")
    return out


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """Splits input along dim 0 into the group's size blocks (input_split_sizes rows each, or
    equal ones), sends block k to group rank k, and concatenates the blocks received (block k
    from group rank k, output_split_sizes rows) into output. Costs the group's size times the
    data of a direct exchange (the blocks travel in an all-gather): meant for small tensors for
    now. With uneven splits the ranks first exchange their split sizes, and each checks that
    what every rank sends is what its receiver expects (a ValueError on every rank otherwise);
    a rank that has joined sends zeros of the size its receivers expect."""
    t = _target(group, "all_to_all_single")
    if t is None:
        return None
    dt = _dtype_of(input, "input")
    if _dtype_of(output, "output") != dt:
        raise TypeError("output and input must have the same dtype")
    n = t.size
    rows = input.shape[0] if input.dim() > 0 else 1
    orows = output.shape[0] if output.dim() > 0 else 1
    if tuple(input.shape[1:]) != tuple(output.shape[1:]):
        raise ValueError(f"input ({tuple(input.shape)}) and output ({tuple(output.shape)}) must "
                         "have the same shape beyond dim 0")
    ins = _splits(input_split_sizes, rows, n, "input_split_sizes")
    outs = _splits(output_split_sizes, orows, n, "output_split_sizes")
    if input_split_sizes is None and output_split_sizes is None or (
            len(set(ins)) == 1 and ins == outs):
        return _all_to_all_equal(t, output, input, dt, async_op)
    # Every rank's splits, both ways, with a 1 that a joined rank (zeros) lacks.
    mine = torch.tensor([1] + ins + outs, dtype=torch.int64)
    table = torch.empty(n * (2 * n + 1), dtype=torch.int64)
    all_gather_into_tensor(table, mine, group=group)
    table = table.view(n, 2 * n + 1).tolist()
    active = [row[0] == 1 for row in table]
    for src in range(n):
        for dst in range(n):
            if active[src] and active[dst] and table[src][1 + dst] != table[dst][1 + n + src]:
                raise ValueError(
                    f"all_to_all_single: group rank {src} sends {table[src][1 + dst]} rows to "
                    f"group rank {dst}, which expects {table[dst][1 + n + src]} "
                    "(input_split_sizes and output_split_sizes disagree)")
    row = input[0].numel() if input.dim() > 0 else 1
    most = max(sum(r[1:1 + n]) for r in table)
    send = torch.zeros(most * row, dtype=input.dtype)
    send[:rows * row] = input.detach().contiguous().view(-1)
    got = torch.empty(n * most * row, dtype=input.dtype)
    work = all_gather_into_tensor(got, send, group=group, async_op=async_op)

    def copy_out():
        blocks = got.view(n, most * row)
        out = output if output.is_contiguous() else output.contiguous()
        flat = out.detach().view(-1)
        at = 0
        for src in range(n):
            k = outs[src] * row
            if active[src]:
                off = sum(table[src][1:1 + t.rank]) * row
                flat[at:at + k].copy_(blocks[src, off:off + k])
            else:
                flat[at:at + k].zero_()
            at += k
        if out is not output:
            output.copy_(out)
    return _then(work, copy_out)


def _all_to_all_equal(t, output, input, dt, async_op):
    t.start(async_op)
    n = t.size
    if input.numel() != output.numel() or input.numel() % n:
        raise ValueError(f"input ({tuple(input.shape)}) and output ({tuple(output.shape)}) "
                         f"must have the same size, with dim 0 a multiple of the "
                         f"{'world' if t.h is None else 'group'} size {n}")
    src = input.detach().contiguous().view(n, -1)
    out = output if output.is_contiguous() else output.contiguous()
    out_view = out.detach().view(n, -1)
    blk = src.shape[1]
    step = max(1, _CHUNK_BYTES // max(1, src.element_size() * n * 2))
    for i in range(0, blk, step):
        send = src[:, i:i + step].contiguous()
        recv = torch.empty_like(send)
        t.run("all_to_all", lambda: t.c.all_to_all(recv, send, dt, t.h), send, recv,
              send.numel() // n, dt)
        t.then(lambda i=i, recv=recv: out_view[:, i:i + step].copy_(recv))
    if out is not output:
        t.then(lambda: output.copy_(out))
    return t.done()


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Sends input_tensor_list[k] to group rank k and receives group rank k's into
    output_tensor_list[k] (the group's size tensors each, of one dtype; their sizes may differ,
    each output the size its sender's input has)."""
    t = _target(group, "all_to_all")
    if t is None:
        return None
    n = t.size
    if len(output_tensor_list) != n or len(input_tensor_list) != n:
        raise ValueError(f"all_to_all needs {'world' if t.h is None else 'group'}_size ({n}) "
                         "tensors in each list")
    dt = _dtype_of(input_tensor_list[0], "input_tensor_list[0]")
    for what, lst in (("input_tensor_list", input_tensor_list),
                      ("output_tensor_list", output_tensor_list)):
        for i, x in enumerate(lst):
            if _dtype_of(x, f"{what}[{i}]") != dt:
                raise ValueError(f"{what}[{i}] must have the dtype of input_tensor_list[0]")
    ins = [x.numel() for x in input_tensor_list]
    outs = [x.numel() for x in output_tensor_list]
    flat_in = torch.cat([x.detach().reshape(-1) for x in input_tensor_list])
    flat_out = torch.empty(sum(outs), dtype=flat_in.dtype)
    even = len(set(ins)) == 1 and ins == outs
    work = all_to_all_single(flat_out, flat_in, output_split_sizes=None if even else outs,
                             input_split_sizes=None if even else ins, group=group,
                             async_op=async_op)

    def copy_out():
        at = 0
        for x, k in zip(output_tensor_list, outs):
            x.copy_(flat_out[at:at + k].view_as(x))
            at += k
    return _then(work, copy_out)


def _p2p(name, tensor, peer_value, group, tag, group_peer, async_op):
    t = _target(group, name)
    if t is None:
        return None
    t.start(async_op)
    dt = _dtype_of(tensor, "tensor")
    what = "dst" if name == "send" else "src"
    peer = _root(t, peer_value, group_peer, what)
    if peer == t.rank:
        raise ValueError(f"Invalid {'destination' if name == 'send' else 'source'} rank: it "
                         "should not be the same as the rank of the current process")
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < 1 << 32:
        raise ValueError(f"tag must be an integer in [0, 2**32), not {tag!r}")
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    for piece in _flat_pieces(work.detach()):
        t.run(name, lambda piece=piece: t.c.p2p(_OPS[name], piece, dt, peer, tag, t.h),
              piece if name == "send" else None, piece if name == "recv" else None,
              piece.numel(), dt, root=peer, tag=tag)
    if name == "recv" and work is not tensor:
        t.then(lambda: tensor.copy_(work))
    return t


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Sends tensor to rank dst (a global rank; or group_dst, a rank of group), whose matching
    recv (same tag, same number of elements and dtype) takes it. Each pair of ranks matches its
    sends and recvs in issue order, one after another: when two ranks exchange, one must send
    first and the other receive first (both sending first is a DesyncError). Returns once the
    peer received it."""
    _p2p("send", tensor, dst, group, tag, group_dst, False)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """Receives into tensor what rank src (a global rank; or group_src, a rank of group) sends
    with the same tag; returns src's global rank. src=None (any sender) is not supported: name
    the sender."""
    if src is None and group_src is None:
        raise ValueError("recv from any source (src=None) is not supported: pass src")
    t = _p2p("recv", tensor, src, group, tag, group_src, False)
    return None if t is None else t.pg._world_ranks()[_root(t, src, group_src, "src")]


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """send, queued behind what was issued before; returns a Work (its wait() returns once the
    peer received it)."""
    t = _p2p("send", tensor, dst, group, tag, group_dst, True)
    return None if t is None else t.done()


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """recv, queued behind what was issued before; returns a Work (tensor holds the data after
    its wait()). Queued work runs in issue order: an irecv waits for its sender before
    anything issued after it runs."""
    if src is None and group_src is None:
        raise ValueError("irecv from any source (src=None) is not supported: pass src")
    t = _p2p("recv", tensor, src, group, tag, group_src, True)
    return None if t is None else t.done()


def barrier(group=None, async_op=False, device_ids=None):
    """Returns once every rank of group (default: all) has entered the barrier."""
    t = _target(group, "barrier")
    if t is None:
        return None
    t.start(async_op)
    t.run("barrier", lambda: t.c.barrier(t.h), None, None, 0, "fp32")
    return t.done()


from ._device_mesh import DeviceMesh, init_device_mesh  # noqa: E402  (uses _make_groups)
