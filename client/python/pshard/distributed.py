"""Collectives on torch tensors through this trainer's shard server, with torch.distributed's
names: all_reduce, reduce, broadcast, all_gather_into_tensor, gather, scatter,
all_to_all_single, all_to_all, barrier. While some trainers have joined
(pshard.torch.Join), their ranks contribute the reduction's identity (zeros for a sum, ones for
a product, -inf for a max, ...) and an average is over the others.

Tensors must be on the CPU, of dtype float32, bfloat16, float16, float64, int64, int32, uint8
or bool (sum and max are "any", product and min "all"); non-contiguous
tensors are handled through a contiguous copy. ``async_op=True`` runs the operation at once
and returns a completed Work. Errors are pshard.Error subclasses (PeerLostError, TimeoutError,
...) with pshard's message, or TypeError/ValueError for bad arguments.
"""
import enum

import torch

import pshard

__all__ = ["ReduceOp", "all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "gather",
           "scatter", "all_to_all_single", "all_to_all", "barrier", "get_rank",
           "get_world_size", "group", "ProcessGroup", "new_group", "get_process_group_ranks",
           "get_group_rank", "get_global_rank"]

get_rank = pshard.get_rank
get_world_size = pshard.get_world_size
group = pshard.group
ProcessGroup = pshard.ProcessGroup


def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None):
    """torch's new_group, for now only over every rank (ranks None or all of them), which is
    the default group: a subset of the ranks is a clear ValueError, not yet supported."""
    world = get_world_size()
    if ranks is None:
        return group.WORLD
    try:
        rs = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise TypeError(f"ranks must be a list of int ranks, not {ranks!r}") from None
    if len(set(rs)) != len(rs) or any(not 0 <= r < world for r in rs):
        raise ValueError(f"ranks {rs} must be distinct ranks of 0..{world - 1}")
    if sorted(rs) != list(range(world)):
        raise ValueError(f"new_group({rs}): groups over a subset of the {world} ranks are not "
                         "supported yet; only the group of every rank is")
    return group.WORLD


def get_process_group_ranks(group_):
    """The global ranks of group_ (the default group: every rank)."""
    pshard._no_group(None if group_ is group.WORLD else group_)
    return list(range(get_world_size()))


def get_group_rank(group_, global_rank):
    """global_rank's rank in group_ (the default group: the same)."""
    ranks = get_process_group_ranks(group_)
    if global_rank not in ranks:
        raise ValueError(f"rank {global_rank} is not in the group")
    return ranks.index(global_rank)


def get_global_rank(group_, group_rank):
    """The global rank of group_'s rank group_rank (the default group: the same)."""
    ranks = get_process_group_ranks(group_)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"group rank {group_rank} is not in 0..{len(ranks) - 1}")
    return ranks[group_rank]

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


class _DoneWork:
    """What async_op=True returns: the operation already ran."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


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


def _check(group):
    pshard._no_group(group)
    return pshard._get_client()


def _flat_pieces(t):
    """Contiguous 1-D pieces of t's elements (views of t when it is contiguous)."""
    flat = t.view(-1)
    step = max(1, _CHUNK_BYTES // max(1, t.element_size()))
    return [flat[i:i + step] for i in range(0, flat.numel(), step)]


def _in_place(tensor, fn):
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    for piece in _flat_pieces(work.detach()):
        fn(piece)
    if work is not tensor:
        tensor.copy_(work)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces tensor over all ranks in place: op is a ReduceOp (SUM, AVG, PRODUCT, MIN, MAX;
    BAND, BOR, BXOR for int64), ours or torch.distributed's."""
    c = _check(group)
    dt = _dtype_of(tensor, "tensor")
    op = _check_op(op, dt, tensor)
    _in_place(tensor, lambda piece: c.all_reduce(piece, dt, op.value))
    return _DoneWork() if async_op else None


def broadcast(tensor, src, group=None, async_op=False):
    """Copies rank src's tensor into every rank's tensor."""
    c = _check(group)
    dt = _dtype_of(tensor, "tensor")
    _in_place(tensor, lambda piece: c.broadcast(piece, dt, int(src)))
    return _DoneWork() if async_op else None


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenates every rank's input_tensor (in rank order) into output_tensor, whose first
    dimension (or element count) is world_size times the input's."""
    c = _check(group)
    dt = _dtype_of(input_tensor, "input_tensor")
    if _dtype_of(output_tensor, "output_tensor") != dt:
        raise TypeError("output_tensor and input_tensor must have the same dtype")
    world = c.world_size
    if output_tensor.numel() != world * input_tensor.numel():
        raise ValueError(f"output_tensor has {output_tensor.numel()} elements; it needs "
                         f"world_size ({world}) x {input_tensor.numel()}")
    src = input_tensor.detach().contiguous().view(-1)
    out = output_tensor if output_tensor.is_contiguous() else output_tensor.contiguous()
    out_flat = out.detach().view(world, -1)
    step = max(1, _CHUNK_BYTES // max(1, src.element_size() * (world + 1)))
    for i in range(0, max(src.numel(), 1), step):
        piece = src[i:i + step]
        if piece.numel() == 0:
            break
        recv = torch.empty(world * piece.numel(), dtype=src.dtype)
        c.all_gather(recv, piece, dt)
        out_flat[:, i:i + piece.numel()].copy_(recv.view(world, -1))
    if out is not output_tensor:
        output_tensor.copy_(out)
    return _DoneWork() if async_op else None


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


def _rank_arg(c, value, what):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int rank, not {type(value).__name__}")
    if not 0 <= value < c.world_size:
        raise ValueError(f"{what} {value} is not a rank (world size {c.world_size})")
    return value


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces tensor over all ranks into rank dst's tensor (in place there; the others'
    tensors are left as they were). op as all_reduce's."""
    c = _check(group)
    dt = _dtype_of(tensor, "tensor")
    op = _check_op(op, dt, tensor)
    dst = _rank_arg(c, dst, "dst")
    # (only dst's pieces are written; the others' stay as they were)
    _in_place(tensor, lambda piece: c.reduce(piece, dt, op.value, dst))
    return _DoneWork() if async_op else None


def _rooted_list(c, lst, tensor, what, root, name):
    """The root's list of world_size tensors shaped and typed like tensor; None elsewhere."""
    if c.rank != root:
        return None
    if lst is None or len(lst) != c.world_size:
        raise ValueError(f"{what} must be a list of world_size ({c.world_size}) tensors on "
                         f"rank {root} ({name})")
    dt = _dtype_of(tensor, "tensor")
    for i, t in enumerate(lst):
        if _dtype_of(t, f"{what}[{i}]") != dt or t.numel() != tensor.numel():
            raise ValueError(f"{what}[{i}] must have tensor's dtype {tensor.dtype} and its "
                             f"{tensor.numel()} elements")
    return lst


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """Collects every rank's tensor into rank dst's gather_list (world_size tensors like tensor,
    in rank order); the other ranks pass gather_list=None."""
    c = _check(group)
    dt = _dtype_of(tensor, "tensor")
    dst = _rank_arg(c, dst, "dst")
    outs = _rooted_list(c, gather_list, tensor, "gather_list", dst, "dst")
    world = c.world_size
    src = tensor.detach().contiguous().view(-1)
    step = max(1, _CHUNK_BYTES // max(1, src.element_size() * (world + 1)))
    for i in range(0, max(src.numel(), 1), step):
        piece = src[i:i + step]
        if piece.numel() == 0:
            break
        recv = torch.empty(world * piece.numel(), dtype=src.dtype) if outs is not None else None
        c.gather_to(recv, piece, dt, dst)
        if outs is not None:
            for r, o in enumerate(recv.view(world, -1)):
                outs[r].view(-1)[i:i + piece.numel()].copy_(o)
    return _DoneWork() if async_op else None


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """Copies scatter_list[r] of rank src (world_size tensors like tensor) into rank r's tensor;
    the other ranks pass scatter_list=None."""
    c = _check(group)
    dt = _dtype_of(tensor, "tensor")
    src = _rank_arg(c, src, "src")
    ins = _rooted_list(c, scatter_list, tensor, "scatter_list", src, "src")
    world = c.world_size
    out = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = out.detach().view(-1)
    srcs = [t.detach().contiguous().view(-1) for t in ins] if ins is not None else None
    step = max(1, _CHUNK_BYTES // max(1, flat.element_size() * (world + 1)))
    for i in range(0, max(flat.numel(), 1), step):
        piece = flat[i:i + step]
        if piece.numel() == 0:
            break
        send = (torch.cat([t[i:i + piece.numel()] for t in srcs]) if srcs is not None
                else None)
        c.scatter_from(piece, send, dt, src)
    if out is not tensor:
        tensor.copy_(out)
    return _DoneWork() if async_op else None


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """Splits input into world_size equal blocks along dim 0, sends block k to rank k, and
    concatenates the blocks received (block k from rank k) into output. Split sizes, when
    given, must be the equal ones: uneven splits are not supported yet. (Costs world_size
    times the data of a direct exchange: meant for small tensors for now.)"""
    c = _check(group)
    dt = _dtype_of(input, "input")
    if _dtype_of(output, "output") != dt:
        raise TypeError("output and input must have the same dtype")
    world = c.world_size
    rows = input.shape[0] if input.dim() > 0 else 1
    for name, splits in (("output_split_sizes", output_split_sizes),
                         ("input_split_sizes", input_split_sizes)):
        if splits is not None and (len(splits) != world or
                                   any(int(s) * world != rows for s in splits)):
            raise ValueError(f"{name} {list(splits)}: only equal splits of the {rows} rows "
                             f"over {world} ranks are supported for now")
    if input.numel() != output.numel() or input.numel() % world or rows % world:
        raise ValueError(f"input ({tuple(input.shape)}) and output ({tuple(output.shape)}) "
                         f"must have the same size, with dim 0 a multiple of the world size "
                         f"{world}")
    src = input.detach().contiguous().view(world, -1)
    out = output if output.is_contiguous() else output.contiguous()
    out_view = out.detach().view(world, -1)
    blk = src.shape[1]
    step = max(1, _CHUNK_BYTES // max(1, src.element_size() * world * 2))
    for i in range(0, blk, step):
        send = src[:, i:i + step].contiguous()
        recv = torch.empty_like(send)
        c.all_to_all(recv, send, dt)
        out_view[:, i:i + step].copy_(recv)
    if out is not output:
        output.copy_(out)
    return _DoneWork() if async_op else None


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Sends input_tensor_list[k] to rank k and receives rank k's into output_tensor_list[k]
    (world_size tensors each, all of one size and dtype)."""
    c = _check(group)
    world = c.world_size
    if len(output_tensor_list) != world or len(input_tensor_list) != world:
        raise ValueError(f"all_to_all needs world_size ({world}) tensors in each list")
    n = input_tensor_list[0].numel()
    dt = _dtype_of(input_tensor_list[0], "input_tensor_list[0]")
    for what, lst in (("input_tensor_list", input_tensor_list),
                      ("output_tensor_list", output_tensor_list)):
        for i, t in enumerate(lst):
            if _dtype_of(t, f"{what}[{i}]") != dt or t.numel() != n:
                raise ValueError(f"{what}[{i}] must have {n} elements of the same dtype "
                                 "(uneven sizes are not supported yet)")
    flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensor_list])
    flat_out = torch.empty_like(flat_in)
    all_to_all_single(flat_out, flat_in, group=group)
    for k, t in enumerate(output_tensor_list):
        t.copy_(flat_out[k * n:(k + 1) * n].view_as(t))
    return _DoneWork() if async_op else None


def barrier(group=None, async_op=False, device_ids=None):
    """Returns once every rank has entered the barrier."""
    _check(group).barrier()
    return _DoneWork() if async_op else None
