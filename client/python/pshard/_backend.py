"""The torch.distributed backend "pshard": torch's process-group operations on the shard servers'
collectives.

``import pshard`` registers it (``torch.distributed.Backend.register_backend``, device "cpu"),
so ``torch.distributed.init_process_group(backend="pshard")``, ``new_group``,
``init_device_mesh``, DTensor, DDP, torch's own ``fully_shard`` and DCP run their collectives
through this trainer's shard server: with its descriptor check (ranks that run different
operations get a DesyncError naming both), its timeouts naming the rank that did not answer,
Join shadowing for ranks that ran out of input, its flight recorder and metrics.

Every operation of torch's backend table is here; each returns a pshard Work (``_work.py``). A
blocking call (``opts.asyncOp`` false) runs in this thread; an asynchronous one is queued on the
client's thread behind everything this trainer issued before. Tensors are CPU tensors, or
CUDA tensors, which move through host copies (the servers' collectives take host memory from
the trainer: correct, not fast; ``backend="cpu:pshard,cuda:nccl"`` sends CUDA tensors to NCCL
instead); reductions take float32, bfloat16, float16, float64, int64, int32, uint8 and bool (and complex
for sums), data movement takes any dtype (its bytes move). What pshard cannot do (a CUDA tensor,
an unsupported reduction or dtype, recv from any source) raises at once, saying what to use.
"""
import datetime
import os
import warnings

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _CBackend
from torch._C._distributed_c10d import ReduceOp

from . import _world
from ._C import FailedPreconditionError
from ._work import Work

__all__ = ["ProcessGroupPshard", "register"]

BACKEND_NAME = "pshard"

# pshard_op_t's numbers (Client.collective_start).
_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, "barrier": 5,
        "reduce": 6, "gather": 7, "scatter": 8, "all_to_all": 9, "send": 10, "recv": 11}
# The dtypes the shard servers reduce (bool travels as uint8).
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
           torch.float64: "fp64", torch.int64: "int64", torch.int32: "int32",
           torch.uint8: "uint8", torch.bool: "uint8"}
_INTEGER = (torch.int64, torch.int32, torch.uint8, torch.bool)
_R = ReduceOp.RedOpType
# torch's reductions by pshard_reduce_t number (types.h numbers them as torch does).
_REDUCE = {_R.SUM: 0, _R.AVG: 1, _R.PRODUCT: 2, _R.MIN: 3, _R.MAX: 4, _R.BAND: 5, _R.BOR: 6,
           _R.BXOR: 7}
# At most this many bytes of one call go through the shard server's scratch region at once
# (PSHARD_SCRATCH_BYTES, 16 MiB by default, holds a call's input and output).
_CHUNK_BYTES = 4 << 20


# Tensors staged through host copies so far (CUDA ones; under PSHARD_TEST_EMULATE_DEVICE=1,
# the tests' stand-in for a GPU, every tensor): what the tests check the path ran by.
staged_tensors = 0
_warned = []
# Read once: every collective asks for each of its tensors.
_EMULATE = os.environ.get("PSHARD_TEST_EMULATE_DEVICE") == "1"


def _staged_here(t):
    if not isinstance(t, torch.Tensor):
        return False
    if t.device.type == "cuda":
        if not _warned:
            _warned.append(True)
            warnings.warn("backend pshard moves CUDA tensors through host memory (correct, not "
                          "fast); for collectives on NCCL initialise with backend="
                          "'cpu:pshard,cuda:nccl'", stacklevel=4)
        return True
    return _EMULATE and t.device.type == "cpu"


class _Stage:
    """Host copies of one operation's device tensors: host(t) gives the tensor the operation
    runs on (t itself when it is a host tensor), and finish(calls) copies the outputs back to
    their devices after everything else the operation does to them."""
    __slots__ = ("back",)

    def __init__(self):
        self.back = []

    def host(self, t, out=False, read=True):
        """t, or a host copy of it (read: with its values; out: copied back at the end)."""
        global staged_tensors
        if not _staged_here(t):
            return t
        staged_tensors += 1
        h = (t.detach().to("cpu", copy=True) if read
             else torch.empty(t.shape, dtype=t.dtype, device="cpu"))
        if out:
            self.back.append((t, h))
        return h

    def hosts(self, ts, out=False, read=True):
        return [self.host(t, out, read) for t in ts]

    def finish(self, calls):
        if self.back:
            pairs = self.back

            def copy_back():
                for t, h in pairs:
                    t.detach().copy_(h)
            calls.then(copy_back)


def _cpu(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}: backend pshard takes CPU and CUDA tensors "
                         "(use a backend of that device for it)")
    if t.is_sparse:
        raise ValueError(f"{what} is sparse: backend pshard takes dense tensors")
    return t


def _flat(t):
    """(t's elements as a contiguous 1-D tensor, a function that copies them back into t, or
    None when the flat tensor is a view of t)."""
    if t.is_contiguous():
        return t.detach().view(-1), None
    work = t.detach().contiguous().view(-1)
    return work, (lambda: t.detach().copy_(work.view_as(t)))


def _bytes(flat):
    """A 1-D contiguous tensor's bytes as uint8 (what data movement sends for any dtype)."""
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _reduction(op, tensors, what):
    """(pshard reduce number, prescale factor or None, the dtype the servers reduce) for torch's
    ReduceOp op on tensors of one dtype; TypeError/ValueError naming what pshard cannot do."""
    kind = op.op if hasattr(op, "op") else op
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"{what}: tensors of one operation must share a dtype ({dtype} and "
                            f"{t.dtype})")
    factor = None
    if kind == _R.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError(f"{what}: this torch ({torch.__version__}) does not show "
                             "PREMUL_SUM's factor to Python backends: scale the tensor and use "
                             "ReduceOp.SUM (torch 2.15 shows it)")
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        kind = _R.SUM
    if kind not in _REDUCE:
        raise ValueError(f"{what}: ReduceOp {kind} is not supported by backend pshard (SUM, AVG, "
                         "PRODUCT, MIN, MAX, PREMUL_SUM; BAND, BOR, BXOR on integers)")
    if dtype.is_complex:
        if kind not in (_R.SUM, _R.AVG):
            raise TypeError(f"{what}: complex tensors reduce with SUM, AVG or PREMUL_SUM only, "
                            f"not {kind}")
        dtype = torch.float64 if dtype == torch.complex128 else torch.float32
        if tensors[0].dtype not in (torch.complex64, torch.complex128):
            raise TypeError(f"{what}: dtype {tensors[0].dtype} is not supported by backend "
                            "pshard")
    elif dtype not in _DTYPES:
        raise TypeError(f"{what}: dtype {dtype} cannot be reduced by backend pshard (float32, "
                        "bfloat16, float16, float64, int64, int32, uint8, bool, complex); "
                        "convert the tensor first")
    if kind == _R.AVG and dtype in _INTEGER:
        raise TypeError(f"{what}: ReduceOp.AVG needs a floating-point tensor, not {dtype}")
    if factor is not None and dtype in _INTEGER:
        raise TypeError(f"{what}: PREMUL_SUM needs a floating-point tensor, not {dtype}")
    if kind in (_R.BAND, _R.BOR, _R.BXOR) and dtype not in _INTEGER:
        raise TypeError(f"{what}: ReduceOp.{kind.name} needs an integer or bool tensor, not "
                        f"{dtype}")
    if dtype == torch.bool:  # one byte, 0 or 1: sum is "any", product "all"
        kind = {_R.SUM: _R.MAX, _R.PRODUCT: _R.MIN}.get(kind, kind)
    return _REDUCE[kind], factor, dtype


def _as_reduced(flat):
    """flat (1-D contiguous) as the servers reduce it: complex as its real pairs."""
    return torch.view_as_real(flat).view(-1) if flat.dtype.is_complex else flat


class _Calls:
    """The pshard calls of one operation: run at once (blocking) or queued on the client's
    thread (asyncOp), and the copies that complete the outputs after them."""
    __slots__ = ("pg", "queued", "works", "after")

    def __init__(self, pg, opts, queued=None):
        self.pg = pg
        self.queued = bool(getattr(opts, "asyncOp", True)) if queued is None else queued
        self.works, self.after = [], []

    def run(self, op, send, recv, count, dt, reduce=0, root=0, tag=0):
        c, h = self.pg._client, self.pg._handle
        w = c.collective_start(_OPS[op], send, recv, count, dt, reduce, root, h, tag,
                               self.queued)
        if self.queued:
            self.works.append(w)
        else:
            w.wait()

    def then(self, fn):
        if fn is None:
            return
        if self.queued:
            self.after.append(fn)
        else:
            fn()

    def done(self, outputs):
        return Work(self.works, outputs, self.after)


def _in_place(calls, op, buf, reduce=0, root=0):
    """op (all_reduce, reduce, broadcast) on buf (1-D contiguous) in place, in pieces that fit
    the scratch region."""
    dt = _DTYPES[buf.dtype]
    step = _steps(buf.element_size())
    for i in range(0, buf.numel(), step):
        piece = buf[i:i + step]
        calls.run(op, piece, piece, piece.numel(), dt, reduce=reduce, root=root)


def _steps(per_elem_bytes):
    """Chunk length (elements) so that a call's buffers stay within _CHUNK_BYTES."""
    return max(1, _CHUNK_BYTES // max(1, per_elem_bytes))


def _python_backend_base():
    """The class this backend subclasses: torch's C++ Backend, whose binding takes a Python
    constructor (rank, size) in the torch pshard is tested with (2.15); torch 2.11 has none
    there, and a Python backend subclasses its ProcessGroup instead (the same constructor),
    which then names its group and devices itself, as torch 2.11's own Python process groups
    do (ProcessGroupPshard below)."""
    class _Probe(_CBackend):
        pass
    try:
        _Probe(0, 1)
        return _CBackend
    except TypeError:
        return dist.ProcessGroup


_BASE = _python_backend_base()


class ProcessGroupPshard(_BASE):
    """torch.distributed's backend on pshard's shard servers, for one process group: the world
    (handle None) or a group of some ranks (a pshard._C.Group its members made). Made by
    torch's init_process_group / new_group through the registered creator, not directly."""

    def __init__(self, client, handle, rank, size, ranks, timeout):
        super().__init__(rank, size)
        self._client = client
        self._handle = handle
        self._ranks = list(ranks)
        self._timeout = timeout

    # ---- identity ---------------------------------------------------------------------
    def getBackendName(self):
        return BACKEND_NAME

    if _BASE is not _CBackend:
        # torch 2.11: a ProcessGroup with no C++ backend of its own has neither a group name
        # (DeviceMesh asks) nor device types (DCP's async_save asks for the CPU) until told.
        @property
        def group_name(self):
            return dist.distributed_c10d._world.pg_names[self]

        @property
        def _device_types(self):
            return [torch.device("cpu"), torch.device("cuda")]

    def __repr__(self):
        return f"ProcessGroupPshard(rank={self.rank()}, size={self.size()}, ranks={self._ranks})"

    # ---- reductions -------------------------------------------------------------------
    def _all_reduce(self, calls, tensors, op, what):
        red, factor, _ = _reduction(op, tensors, what)
        for t in tensors:
            _cpu(t, what)
            flat, back = _flat(t)
            if factor is not None:
                flat.mul_(factor)
            _in_place(calls, "all_reduce", _as_reduced(flat), reduce=red)
            calls.then(back)

    def allreduce(self, tensors, opts):
        calls, st = _Calls(self, opts), _Stage()
        self._all_reduce(calls, st.hosts(tensors, out=True), opts.reduceOp, "allreduce")
        st.finish(calls)
        return calls.done(tensors)

    def allreduce_coalesced(self, tensors, opts):
        if not tensors:
            return Work()
        calls, st = _Calls(self, opts), _Stage()
        originals, tensors = tensors, st.hosts(tensors, out=True)
        red, factor, _ = _reduction(opts.reduceOp, tensors, "allreduce_coalesced")
        flat = torch.cat([_cpu(t, "allreduce_coalesced").detach().reshape(-1)
                          for t in tensors])
        if factor is not None:
            flat.mul_(factor)
        _in_place(calls, "all_reduce", _as_reduced(flat), reduce=red)

        def copy_out():
            at = 0
            for t in tensors:
                t.detach().copy_(flat[at:at + t.numel()].view_as(t))
                at += t.numel()
        calls.then(copy_out)
        st.finish(calls)
        return calls.done(originals)

    def reduce(self, tensors, opts):
        calls, st = _Calls(self, opts), _Stage()
        red, factor, _ = _reduction(opts.reduceOp, tensors, "reduce")
        root = opts.rootRank
        originals, tensors = tensors, st.hosts(tensors, out=self.rank() == root)
        for t in tensors:
            _cpu(t, "reduce")
            flat, back = _flat(t)
            if factor is not None:
                # the root's tensor is overwritten; the others' must stay as they were
                flat = flat.clone() if self.rank() != root else flat
                flat.mul_(factor)
            _in_place(calls, "reduce", _as_reduced(flat), reduce=red, root=root)
            if self.rank() == root:
                calls.then(back)
        st.finish(calls)
        return calls.done(originals)

    def _reduce_scatter_into(self, calls, output, input, op, what):
        red, factor, _ = _reduction(op, [output, input], what)
        _cpu(output, what)
        _cpu(input, what)
        n = self.size()
        if input.numel() != n * output.numel():
            raise ValueError(f"{what}: input has {input.numel()} elements; it needs the group "
                             f"size ({n}) x output's {output.numel()}")
        src = input.detach().reshape(-1)
        if factor is not None:
            src = src * factor
        src = _as_reduced(src.contiguous()).view(n, -1)
        out, back = _flat(output)
        out = _as_reduced(out)
        dt = _DTYPES[out.dtype]
        step = _steps(out.element_size() * (n + 1))
        for i in range(0, out.numel(), step):
            piece = out[i:i + step]
            send = src[:, i:i + piece.numel()].contiguous()
            calls.run("reduce_scatter", send, piece, piece.numel(), dt, reduce=red)
        calls.then(back)

    def reduce_scatter_single(self, output, input, opts):
        calls, st = _Calls(self, opts), _Stage()
        self._reduce_scatter_into(calls, st.host(output, out=True, read=False), st.host(input),
                                  opts.reduceOp, "reduce_scatter_tensor")
        st.finish(calls)
        return calls.done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        calls, st = _Calls(self, opts), _Stage()
        for o, i in zip(outputs, inputs, strict=True):
            self._reduce_scatter_into(calls, st.host(o, out=True, read=False), st.host(i),
                                      opts.reduceOp, "reduce_scatter_coalesced")
        st.finish(calls)
        return calls.done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts):
        calls, st = _Calls(self, opts), _Stage()
        n = self.size()
        for out, ins in zip(st.hosts(outputs, out=True, read=False),
                            [st.hosts(x) for x in input_lists], strict=True):
            if len(ins) != n:
                raise ValueError(f"reduce_scatter: input_list must hold {n} tensors (the group "
                                 f"size), not {len(ins)}")
            for k, x in enumerate(ins):
                if x.numel() != out.numel() or x.dtype != out.dtype:
                    raise ValueError(f"reduce_scatter: input_list[{k}] must have output's dtype "
                                     f"{out.dtype} and {out.numel()} elements")
            stacked = torch.cat([_cpu(x, "reduce_scatter").detach().reshape(-1) for x in ins])
            self._reduce_scatter_into(calls, out, stacked, opts.reduceOp, "reduce_scatter")
        st.finish(calls)
        return calls.done(outputs)

    # ---- data movement ----------------------------------------------------------------
    def broadcast(self, tensors, opts):
        calls, st = _Calls(self, opts), _Stage()
        root = opts.rootRank
        for t in st.hosts(tensors, out=self.rank() != root):
            _cpu(t, "broadcast")
            flat, back = _flat(t)
            _in_place(calls, "broadcast", _bytes(flat), root=root)
            calls.then(back)
        st.finish(calls)
        return calls.done(tensors)

    def _all_gather_into(self, calls, output, input, what):
        _cpu(output, what)
        _cpu(input, what)
        if output.dtype != input.dtype:
            raise TypeError(f"{what}: output ({output.dtype}) and input ({input.dtype}) must "
                            "share a dtype")
        n = self.size()
        if output.numel() != n * input.numel():
            raise ValueError(f"{what}: output has {output.numel()} elements; it needs the group "
                             f"size ({n}) x input's {input.numel()}")
        src = _bytes(input.detach().contiguous().view(-1))
        out, back = _flat(output)
        out_rows = _bytes(out).view(n, -1)
        step = _steps(n + 1)
        for i in range(0, src.numel(), step):
            piece = src[i:i + step]
            if i == 0 and piece.numel() == src.numel():
                # one call: the servers write the rows straight into the output
                calls.run("all_gather", piece, out_rows.view(-1), piece.numel(), "uint8")
                break
            recv = torch.empty(n * piece.numel(), dtype=torch.uint8)
            calls.run("all_gather", piece, recv, piece.numel(), "uint8")
            calls.then(lambda i=i, k=piece.numel(), recv=recv:
                       out_rows[:, i:i + k].copy_(recv.view(n, -1)))
        calls.then(back)

    def all_gather_single(self, output, input, opts):
        calls, st = _Calls(self, opts), _Stage()
        self._all_gather_into(calls, st.host(output, out=True, read=False), st.host(input),
                              "all_gather_into_tensor")
        st.finish(calls)
        return calls.done([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        calls, st = _Calls(self, opts), _Stage()
        for o, i in zip(outputs, inputs, strict=True):
            self._all_gather_into(calls, st.host(o, out=True, read=False), st.host(i),
                                  "all_gather_into_tensor_coalesced")
        st.finish(calls)
        return calls.done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts):
        calls, st = _Calls(self, opts), _Stage()
        n = self.size()
        for outs, inp in zip([st.hosts(x, out=True, read=False) for x in output_lists],
                             st.hosts(inputs), strict=True):
            _cpu(inp, "all_gather")
            if len(outs) != n:
                raise ValueError(f"all_gather: tensor_list must hold {n} tensors (the group "
                                 f"size), not {len(outs)}")
            for k, o in enumerate(outs):
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ValueError(f"all_gather: tensor_list[{k}] must have the input's dtype "
                                     f"{inp.dtype} and its {inp.numel()} elements (uneven sizes "
                                     "are not supported)")
            flat = torch.empty(n * inp.numel(), dtype=inp.dtype)
            self._all_gather_into(calls, flat, inp, "all_gather")

            def copy_out(outs=outs, flat=flat, m=inp.numel()):
                for k, o in enumerate(outs):
                    o.detach().copy_(flat[k * m:(k + 1) * m].view_as(o))
            calls.then(copy_out)
        st.finish(calls)
        return calls.done(output_lists)

    def allgather_coalesced(self, output_lists, input_list, opts):
        calls, st = _Calls(self, opts), _Stage()
        originals = output_lists
        output_lists = [st.hosts(x, out=True, read=False) for x in output_lists]
        input_list = st.hosts(input_list)
        n = self.size()
        if len(output_lists) != n:
            raise ValueError(f"all_gather_coalesced: output_tensor_lists must hold {n} lists "
                             "(the group size)")
        flat_in = torch.cat([_bytes(_cpu(t, "all_gather_coalesced").detach().contiguous()
                                    .view(-1)) for t in input_list])
        flat_out = torch.empty(n * flat_in.numel(), dtype=torch.uint8)
        self._all_gather_into(calls, flat_out, flat_in, "all_gather_coalesced")

        def copy_out():
            rows = flat_out.view(n, -1)
            for r in range(n):
                at = 0
                for k, t in enumerate(input_list):
                    nb = t.numel() * t.element_size()
                    o = output_lists[r][k]
                    o.detach().copy_(rows[r, at:at + nb].view(t.dtype).view_as(o))
                    at += nb
        calls.then(copy_out)
        st.finish(calls)
        return calls.done(originals)

    def _gather_into(self, calls, output, input, root, what):
        _cpu(input, what)
        n = self.size()
        src = _bytes(input.detach().contiguous().view(-1))
        me_root = self.rank() == root
        if me_root:
            _cpu(output, what)
            if output.numel() != n * input.numel() or output.dtype != input.dtype:
                raise ValueError(f"{what}: the root's output must hold the group size ({n}) x "
                                 f"the input's {input.numel()} elements of {input.dtype}")
            out, back = _flat(output)
            rows = _bytes(out).view(n, -1)
        step = _steps(n + 1)
        for i in range(0, src.numel(), step):
            piece = src[i:i + step]
            recv = torch.empty(n * piece.numel(), dtype=torch.uint8) if me_root else None
            calls.run("gather", piece, recv, piece.numel(), "uint8", root=root)
            if me_root:
                calls.then(lambda i=i, k=piece.numel(), recv=recv:
                           rows[:, i:i + k].copy_(recv.view(n, -1)))
        if me_root:
            calls.then(back)

    def gather(self, output_lists, inputs, opts):
        calls, st = _Calls(self, opts), _Stage()
        n, root = self.size(), opts.rootRank
        originals = output_lists
        if self.rank() == root:
            output_lists = [st.hosts(x, out=True, read=False) for x in output_lists]
        for k, inp in enumerate(st.hosts(inputs)):
            outs = output_lists[k] if self.rank() == root else None
            if outs is not None and len(outs) != n:
                raise ValueError(f"gather: gather_list must hold {n} tensors (the group size) on "
                                 "the destination rank")
            flat = torch.empty(n * inp.numel(), dtype=inp.dtype) if outs is not None else None
            self._gather_into(calls, flat, inp, root, "gather")
            if outs is not None:
                def copy_out(outs=outs, flat=flat, m=inp.numel()):
                    for r, o in enumerate(outs):
                        o.detach().copy_(flat[r * m:(r + 1) * m].view_as(o))
                calls.then(copy_out)
        st.finish(calls)
        return calls.done(originals)

    def gather_single(self, output, input, opts):
        calls, st = _Calls(self, opts), _Stage()
        root = opts.rootRank
        self._gather_into(calls, st.host(output, out=True, read=False) if self.rank() == root
                          else output, st.host(input), root, "gather_into_tensor")
        st.finish(calls)
        return calls.done([output])

    gather_into_tensor = gather_single

    def scatter(self, outputs, input_lists, opts):
        calls, st = _Calls(self, opts), _Stage()
        n, root = self.size(), opts.rootRank
        me_root = self.rank() == root
        originals = outputs
        outputs = st.hosts(outputs, out=True, read=False)
        if me_root:
            input_lists = [st.hosts(x) for x in input_lists]
        for k, out in enumerate(outputs):
            _cpu(out, "scatter")
            ins = input_lists[k] if me_root else None
            if me_root:
                if len(ins) != n:
                    raise ValueError(f"scatter: scatter_list must hold {n} tensors (the group "
                                     "size) on the source rank")
                for r, x in enumerate(ins):
                    if x.numel() != out.numel() or x.dtype != out.dtype:
                        raise ValueError(f"scatter: scatter_list[{r}] must have the output's "
                                         f"dtype {out.dtype} and {out.numel()} elements")
            flat, back = _flat(out)
            dst = _bytes(flat)
            srcs = ([_bytes(x.detach().contiguous().view(-1)) for x in ins] if me_root
                    else None)
            step = _steps(n + 1)
            for i in range(0, dst.numel(), step):
                piece = dst[i:i + step]
                send = (torch.cat([x[i:i + piece.numel()] for x in srcs]) if me_root else None)
                calls.run("scatter", send, piece, piece.numel(), "uint8", root=root)
            calls.then(back)
        st.finish(calls)
        return calls.done(originals)

    # ---- all-to-all -------------------------------------------------------------------
    def _splits(self, splits, rows, what):
        n = self.size()
        if splits is None or len(splits) == 0:
            if rows % n:
                raise ValueError(f"all_to_all_single: dim 0 ({rows}) must be a multiple of the "
                                 f"group size {n} when {what} is not given")
            return [rows // n] * n
        out = [int(x) for x in splits]
        if len(out) != n or any(x < 0 for x in out) or sum(out) != rows:
            raise ValueError(f"all_to_all_single: {what} {out} must give the group's {n} ranks "
                             f"non-negative row counts adding up to dim 0 ({rows})")
        return out

    def _all_to_all(self, calls, output, input, output_split_sizes, input_split_sizes):
        _cpu(output, "all_to_all_single")
        _cpu(input, "all_to_all_single")
        if output.dtype != input.dtype:
            raise TypeError("all_to_all_single: output and input must share a dtype")
        n = self.size()
        rows = input.shape[0] if input.dim() > 0 else 1
        orows = output.shape[0] if output.dim() > 0 else 1
        if tuple(input.shape[1:]) != tuple(output.shape[1:]):
            raise ValueError(f"all_to_all_single: input {tuple(input.shape)} and output "
                             f"{tuple(output.shape)} must have the same shape beyond dim 0")
        ins = self._splits(input_split_sizes, rows, "input_split_sizes")
        outs = self._splits(output_split_sizes, orows, "output_split_sizes")
        row = input.element_size()
        for d in input.shape[1:]:
            row *= d
        if len(set(ins)) == 1 and ins == outs:
            src = _bytes(input.detach().contiguous().view(-1)).view(n, -1)
            out, back = _flat(output)
            dst = _bytes(out).view(n, -1)
            blk = src.shape[1]
            step = _steps(2 * n)
            for i in range(0, blk, step):
                send = src[:, i:i + step].contiguous()
                recv = torch.empty_like(send)
                calls.run("all_to_all", send, recv, send.numel() // n, "uint8")
                calls.then(lambda i=i, recv=recv: dst[:, i:i + recv.shape[1]].copy_(recv))
            calls.then(back)
            return
        # Uneven: every rank's splits both ways (with a 1 a joined rank's zeros lack), checked
        # against each other, then the blocks travel in one all-gather (the group size times a
        # direct exchange's data: fine for small tensors, not yet for MoE-sized ones).
        mine = torch.tensor([1] + ins + outs, dtype=torch.int64)
        table = torch.empty(n * (2 * n + 1), dtype=torch.int64)
        self._all_gather_into(_Calls(self, None, queued=False), table, mine, "all_to_all_single")
        table = table.view(n, 2 * n + 1).tolist()
        active = [r[0] == 1 for r in table]
        me = self.rank()
        for s in range(n):
            for d in range(n):
                if active[s] and active[d] and table[s][1 + d] != table[d][1 + n + s]:
                    raise ValueError(
                        f"all_to_all_single: group rank {s} sends {table[s][1 + d]} rows to "
                        f"group rank {d}, which expects {table[d][1 + n + s]} "
                        "(input_split_sizes and output_split_sizes disagree)")
        most = max(sum(r[1:1 + n]) for r in table)
        send = torch.zeros(most * row, dtype=torch.uint8)
        send[:rows * row] = _bytes(input.detach().contiguous().view(-1))
        got = torch.empty(n * most * row, dtype=torch.uint8)
        self._all_gather_into(calls, got, send, "all_to_all_single")

        def copy_out():
            blocks = got.view(n, most * row)
            out, back = _flat(output)
            flat = _bytes(out)
            at = 0
            for s in range(n):
                k = outs[s] * row
                if active[s]:
                    off = sum(table[s][1:1 + me]) * row
                    flat[at:at + k].copy_(blocks[s, off:off + k])
                else:
                    flat[at:at + k].zero_()
                at += k
            if back is not None:
                back()
        calls.then(copy_out)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        calls, st = _Calls(self, opts), _Stage()
        self._all_to_all(calls, st.host(output, out=True, read=False), st.host(input),
                         output_split_sizes, input_split_sizes)
        st.finish(calls)
        return calls.done([output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts):
        n = self.size()
        if len(outputs) != n or len(inputs) != n:
            raise ValueError(f"all_to_all: both lists must hold {n} tensors (the group size)")
        st = _Stage()
        originals, outputs, inputs = outputs, st.hosts(outputs, out=True, read=False), \
            st.hosts(inputs)
        dtype = inputs[0].dtype
        for what, lst in (("input_tensor_list", inputs), ("output_tensor_list", outputs)):
            for k, x in enumerate(lst):
                _cpu(x, f"all_to_all {what}[{k}]")
                if x.dtype != dtype:
                    raise TypeError(f"all_to_all: {what}[{k}] must have dtype {dtype}")
        # as bytes, one row a byte: the splits are byte counts
        ins = [x.numel() * x.element_size() for x in inputs]
        outs = [x.numel() * x.element_size() for x in outputs]
        flat_in = torch.cat([_bytes(x.detach().contiguous().view(-1)) for x in inputs])
        flat_out = torch.empty(sum(outs), dtype=torch.uint8)
        even = len(set(ins)) == 1 and ins == outs
        calls = _Calls(self, opts)
        self._all_to_all(calls, flat_out, flat_in, None if even else outs,
                         None if even else ins)

        def copy_out():
            at = 0
            for x, k in zip(outputs, outs):
                x.detach().copy_(flat_out[at:at + k].view(dtype).view_as(x))
                at += k
        calls.then(copy_out)
        st.finish(calls)
        return calls.done(originals)

    # ---- point-to-point and barriers --------------------------------------------------
    def _p2p(self, name, tensors, peer, tag):
        if peer == self.rank():
            raise ValueError(f"{name}: the peer rank {peer} is this rank")
        if not 0 <= tag < 1 << 32:
            raise ValueError(f"{name}: tag must be in [0, 2**32), not {tag}")
        calls = _Calls(self, None)  # torch's send/recv are asynchronous: Works to wait on
        st = _Stage()
        originals = tensors
        tensors = st.hosts(tensors, out=name == "recv", read=name == "send")
        for t in tensors:
            _cpu(t, name)
            flat, back = _flat(t)
            buf = _bytes(flat)
            for i in range(0, buf.numel(), _CHUNK_BYTES):
                piece = buf[i:i + _CHUNK_BYTES]
                calls.run(name, piece if name == "send" else None,
                          piece if name == "recv" else None, piece.numel(), "uint8", root=peer,
                          tag=tag)
            if name == "recv":
                calls.then(back)
        st.finish(calls)
        return calls.done(originals)

    def send(self, tensors, dst, tag):
        return self._p2p("send", tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._p2p("recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        raise ValueError("recv from any source (src=None) is not supported by backend pshard: "
                         "pass src")

    def barrier(self, opts):
        calls = _Calls(self, opts)
        calls.run("barrier", None, None, 0, "fp32")
        return calls.done([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier whose failure names the rank that did not arrive (pshard's barrier already
        does: the servers' timeout or a lost rank's eviction says which)."""
        opts = dist.BarrierOptions()
        opts.asyncOp = False
        self.barrier(opts).wait()

    # ---- lifetime ---------------------------------------------------------------------
    def shutdown(self):
        """torch's destroy_process_group: the world's backend closes this trainer's pshard
        connection (pshard.destroy_process_group); a group's is forgotten."""
        if self._handle is None and _world.current() is self._client:
            _world.drop()
        self._handle = None

    def abort(self):
        self.shutdown()


def _timeout_ms(timeout):
    if timeout is None:
        return 0
    if isinstance(timeout, datetime.timedelta):
        ms = int(timeout.total_seconds() * 1000)
        return ms if ms > 0 else 0
    return 0


def _create(opts, backend_options):
    """torch's creator (extended API): the backend of the default group (global_ranks_in_group
    empty) connects this trainer to its shard server if pshard.init_process_group has not; a
    group of some ranks is made by its members' shard servers under torch's group name."""
    if backend_options is not None:
        raise ValueError("backend pshard takes no pg_options (its transport is the shard "
                         "servers' own: pshard-server --backend / --transport)")
    ranks = list(opts.global_ranks_in_group)
    client = _world.current()
    if client is None:
        if ranks:
            raise FailedPreconditionError(
                "backend pshard: the default process group is not a pshard one; initialize it "
                "with backend='pshard' first")
        client = _world.connect(rank=opts.group_rank, world_size=opts.group_size,
                                timeout=opts.timeout)
    world = client.world_size
    if not ranks or ranks == list(range(world)):
        if opts.group_size != world or opts.group_rank != (ranks.index(client.rank) if ranks
                                                           else client.rank):
            raise ValueError(f"backend pshard: the process group says rank {opts.group_rank} of "
                             f"{opts.group_size}, but this trainer is rank {client.rank} of the "
                             f"{world} shard servers")
        pg = ProcessGroupPshard(client, None, client.rank, world, range(world), opts.timeout)
        _world.keep(pg)  # torch holds the C++ side; the Python methods need the object
        return pg
    if ranks != sorted(ranks):
        raise ValueError(f"backend pshard: group ranks {ranks} must be in increasing order")
    # torch's group name, with the ranks: groups torch names alike (made in another order on
    # some ranks) stay apart on the servers
    key = f"{opts.group_id}:{','.join(map(str, ranks))}"
    handle = client.new_groups([ranks], _timeout_ms(opts.timeout), key=key)[0]
    pg = ProcessGroupPshard(client, handle, handle.rank, handle.size, ranks, opts.timeout)
    _world.keep(pg)
    return pg


def register():
    """Registers backend "pshard" with torch.distributed (once; devices: cpu and cuda, whose
    tensors move through host copies)."""
    if "PSHARD" not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
