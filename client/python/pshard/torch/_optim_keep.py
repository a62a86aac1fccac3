"""A torch.optim optimizer's state, kept where a replacement trainer finds it (issue 29 §1).

With pshard-server --trainer-replace-ms (pshardrun --max-restarts), a lost trainer is replaced
alone: the replacement takes its shard server's state over. The sharded parameters are the
server's memory already, but a torch.optim optimizer's state is the trainer's. So, while the
server allows a replacement, pshard.torch keeps that state in a shared-memory object the server
names (and removes with the model): the state's tensors are moved into it and the optimizer
updates them there in place; before each step the values the step starts from (this rank's
parameter shards and that state) are copied aside in the same object.

A step counts once every rank's shard server counted it (the commit, Client.step_trainer, after
the optimizer ran). A trainer lost before its commit leaves a step that no rank counts; one lost
after leaves a step every rank counts (the servers settle a commit that an abort cut short the
same way everywhere). The state says which: "stepping" (the copy holds the values before step
N+1, the live ones may be anything between) or "idle" (the live values are those after step N).
A survivor whose commit failed learns from resync which way it went; a replacement compares the
kept step with its server's count. Either keeps the live values or restores the copy.

The object: a fixed header (magic last, so a half-written object is never taken), the layout as
JSON (the optimizer's class and groups, each state tensor's place, the parameters' copies), two
status slots written in turn (JSON with a sequence number and a CRC: a write cut short leaves the
other), then the data. A new layout (the first step creates the state; an optimizer that
replaces a tensor instead of updating it) goes into a new object under the other of the two
names before the old one is removed; a replacement opens the newest valid one.

Everything read back is checked (sizes, offsets, dtypes, ids): the object is a file in
/dev/shm, not trusted."""
import json
import mmap
import os
import stat
import struct
import zlib

import torch
from torch.distributed.tensor import DTensor

import pshard

__all__ = ["KeptState", "open_kept"]

MAGIC = b"PSHDOPT1"
# magic, layout offset, layout length, status slots' offset, one slot's size, data offset,
# generation
HEADER = struct.Struct("<8sQQQQQQ")
SLOT = struct.Struct("<QQI4x")  # sequence number, length, CRC-32 of the JSON after it
ALIGN = 64
MAX_LAYOUT = 64 << 20
MAX_DIM = 1 << 40
SCALARS = (bool, int, float, str, type(None))
DTYPES = {str(d).split(".")[1]: d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def _up(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(dtype, shape):
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def _dtype_name(t):
    return str(t.dtype).split(".")[1]


def _path(name):
    return "/dev/shm/" + name.lstrip("/")


def _scalar_ok(v):
    return isinstance(v, SCALARS) and (not isinstance(v, str) or len(v) < 4096)


def _ints(v, lo=0):
    return isinstance(v, list) and all(isinstance(x, int) and lo <= x < MAX_DIM for x in v)


class _Unkeepable(Exception):
    """The optimizer's state cannot be kept; the message says why."""


class _Object:
    """One mapped object: its layout, its status and views of its data (offsets in the layout
    are from the start of the data)."""

    def __init__(self, name, mm, header):
        self.name, self.mm = name, mm
        _magic, self.layout_off, self.layout_len, self.slot_off, self.slot_size, \
            self.data_off, self.gen = header
        self.layout = None
        self.seq = 0
        self.status = None

    def view(self, off, dtype, shape):
        n = _nbytes(dtype, shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=self.data_off + off)
        return t.view(dtype).reshape(shape)

    def addr(self, off):
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=1,
                                offset=self.data_off + off).data_ptr()

    def write_status(self, status):
        body = json.dumps(status, separators=(",", ":")).encode()
        if SLOT.size + len(body) > self.slot_size:
            raise _Unkeepable(f"the optimizer's scalar state ({len(body)} bytes of JSON) "
                              "outgrew its place")
        seq = self.seq + 1
        at = self.slot_off + (seq % 2) * self.slot_size
        struct.pack_into("<Q", self.mm, at, 0)  # not valid while it is written
        self.mm[at + SLOT.size:at + SLOT.size + len(body)] = body
        SLOT.pack_into(self.mm, at, 0, len(body), zlib.crc32(body))
        struct.pack_into("<Q", self.mm, at, seq)  # the sequence number last
        self.seq, self.status = seq, status

    def read_status(self):
        best = None
        for i in range(2):
            at = self.slot_off + i * self.slot_size
            seq, n, crc = SLOT.unpack_from(self.mm, at)
            if seq == 0 or n > self.slot_size - SLOT.size:
                continue
            body = bytes(self.mm[at + SLOT.size:at + SLOT.size + n])
            if zlib.crc32(body) != crc:
                continue
            try:
                st = json.loads(body)
            except ValueError:
                continue
            if isinstance(st, dict) and (best is None or seq > best[0]):
                best = (seq, st)
        if best is None:
            raise _Unkeepable(f"{self.name} holds no valid status")
        self.seq, self.status = best

    def close(self, unlink):
        self.mm = None  # views keep the mapping until they go
        if unlink:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass


def _create(name, layout, data_bytes, slot_hint, gen):
    """A new object under name (a leftover of that name goes first), not yet whole."""
    body = json.dumps(layout, separators=(",", ":")).encode()
    if len(body) > MAX_LAYOUT:
        raise _Unkeepable(f"the optimizer's state has too many entries ({len(body)} bytes of "
                          "layout)")
    layout_off = _up(HEADER.size)
    slot_off = _up(layout_off + len(body))
    slot_size = _up(SLOT.size + max(4096, 4 * slot_hint))
    data_off = _up(slot_off + 2 * slot_size)
    total = data_off + data_bytes
    path = _path(name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, total)  # a full /dev/shm fails here, not as a SIGBUS
        except OSError as e:
            os.unlink(path)
            raise _Unkeepable(f"cannot make {name} of {total} bytes: {e}") from None
        mm = mmap.mmap(fd, total)
    finally:
        os.close(fd)
    mm[layout_off:layout_off + len(body)] = body
    obj = _Object(name, mm, (b"", layout_off, len(body), slot_off, slot_size, data_off, gen))
    obj.layout = layout
    return obj


def _publish(obj):
    """The header, magic included, last: from here on the object is whole."""
    HEADER.pack_into(obj.mm, 0, MAGIC, obj.layout_off, obj.layout_len, obj.slot_off,
                     obj.slot_size, obj.data_off, obj.gen)


def _open(name):
    """The object name, mapped and checked; None when there is none or it is not whole."""
    try:
        fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
                st.st_size < HEADER.size:
            raise _Unkeepable(f"{name} is not a shared-memory object of this user")
        mm = mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)
    header = HEADER.unpack_from(mm, 0)
    if header[0] != MAGIC:
        return None  # its maker was lost before it was whole
    obj = _Object(name, mm, header)
    size = len(mm)
    if not (HEADER.size <= obj.layout_off and obj.layout_len <= MAX_LAYOUT and
            obj.layout_off + obj.layout_len <= obj.slot_off and obj.slot_size > SLOT.size and
            obj.slot_off + 2 * obj.slot_size <= obj.data_off <= size):
        raise _Unkeepable(f"{name}: its header does not fit the object")
    try:
        obj.layout = json.loads(bytes(mm[obj.layout_off:obj.layout_off + obj.layout_len]))
    except ValueError:
        raise _Unkeepable(f"{name}: its layout is not JSON") from None
    _check_layout(obj, size - obj.data_off)
    obj.read_status()
    return obj


def _check_layout(obj, data_bytes):
    lay = obj.layout

    def fits(off, dtype, shape):
        if not isinstance(off, int) or off < 0 or off % ALIGN or \
                off + _nbytes(dtype, shape) > data_bytes:
            raise _Unkeepable(f"{obj.name}: an entry lies outside the object")

    if not isinstance(lay, dict) or not isinstance(lay.get("entries"), list) or \
            not isinstance(lay.get("params"), list) or not isinstance(lay.get("class"), str) \
            or not isinstance(lay.get("groups"), list) or \
            not all(_ints(g) for g in lay["groups"]):
        raise _Unkeepable(f"{obj.name}: its layout is malformed")
    for e in lay["entries"]:
        if not isinstance(e, dict) or not isinstance(e.get("id"), int) or \
                not isinstance(e.get("key"), str) or e.get("dtype") not in DTYPES or \
                not _ints(e.get("shape")) or len(e["shape"]) > 16 or \
                (e.get("dt") is not None and not (isinstance(e["dt"], dict) and
                                                  _ints(e["dt"].get("shape")) and
                                                  _ints(e["dt"].get("stride")))):
            raise _Unkeepable(f"{obj.name}: a state entry is malformed")
        fits(e.get("off"), DTYPES[e["dtype"]], e["shape"])
        fits(e.get("boff"), DTYPES[e["dtype"]], e["shape"])
    for p in lay["params"]:
        if not isinstance(p, dict) or not isinstance(p.get("id"), int) or \
                not isinstance(p.get("numel"), int) or not 0 <= p["numel"] < MAX_DIM:
            raise _Unkeepable(f"{obj.name}: a parameter entry is malformed")
        fits(p.get("boff"), torch.float32, [p["numel"]])


def open_kept(model, names):
    """The state that the trainer this one replaces kept: a KeptState over the newest whole
    object of names (its step not yet settled), or None when it kept none.
    pshard.FailedPreconditionError when one is there but cannot be used."""
    found = []
    for i, name in enumerate(names):
        try:
            obj = _open(name)
        except _Unkeepable as e:
            raise pshard.FailedPreconditionError(
                f"the lost trainer's optimizer state cannot be read: {e}") from None
        if obj is not None:
            found.append((obj.gen, i, obj))
    if not found:
        return None
    found.sort(key=lambda t: t[0])
    for _, _, older in found[:-1]:
        older.close(unlink=True)
    _, i, obj = found[-1]
    nparams = len(model.fsdp_params)
    if any(not 0 <= e["id"] < nparams for e in obj.layout["entries"]) or \
            any(not 0 <= p["id"] < nparams for p in obj.layout["params"]):
        raise pshard.FailedPreconditionError(
            "the lost trainer's optimizer state names parameters this model does not have")
    k = KeptState(model, names)
    k.obj, k.cur = obj, i
    k.pending_load = True
    return k


class KeptState:
    """The kept state of the torch.optim optimizer of one model (see the module's doc)."""

    def __init__(self, model, names):
        self.model = model
        self.names = names
        self.obj = None          # the current object
        self.cur = 0             # the index in names it is under
        self.opt = None          # the optimizer whose state this is
        self.pending_load = False
        self.unsettled = False   # a commit failed: resync settles it

    # ---- what the optimizer holds ----

    def _params(self, opt):
        """{pshard id: sharded parameter} of this model in opt, and opt's groups as id lists.
        _Unkeepable when opt steps parameters outside every pshard model."""
        mine = {id(fp.sharded): fp.index for fp in self.model.fsdp_params}
        by_id, groups = {}, []
        for g in opt.param_groups:
            ids = []
            for p in g["params"]:
                i = mine.get(id(p))
                if i is None:
                    if getattr(p, "_pshard_model_ref", None) is None:
                        raise _Unkeepable(
                            "the optimizer also steps parameters outside the pshard model "
                            "(ignored_params, or another module's): they live only in the "
                            "trainer, and a replacement would start them afresh")
                    continue  # another pshard model's: kept with that model
                ids.append(i)
                by_id[i] = p
            groups.append(ids)
        return by_id, groups

    def _state(self, opt, by_id):
        """opt's state of this model's parameters: tensors as (id, key, value, local tensor)
        in id and key order, and scalars as {str(id): {key: value}}."""
        tensors, scalars = [], {}
        for i, p in sorted(by_id.items()):
            for key, v in opt.state.get(p, {}).items():
                if not isinstance(key, str):
                    raise _Unkeepable(f"its state has a key that is not a string ({key!r})")
                if isinstance(v, DTensor):
                    local = v.to_local()
                elif isinstance(v, torch.Tensor):
                    local = v
                elif _scalar_ok(v):
                    scalars.setdefault(str(i), {})[key] = v
                    continue
                else:
                    raise _Unkeepable(f"its state '{key}' is a {type(v).__name__}, neither a "
                                      "tensor nor a number")
                if local.device.type != "cpu" or local.layout != torch.strided or \
                        _dtype_name(local) not in DTYPES:
                    raise _Unkeepable(f"its state '{key}' is a {local.dtype} tensor on "
                                      f"{local.device} (kept: dense CPU tensors)")
                tensors.append((i, key, v, local))
        return tensors, scalars

    def _matches(self, tensors):
        """Whether opt's state tensors are exactly the current object's live entries."""
        obj = self.obj
        if obj is None:
            return False
        dropped = set(obj.status.get("dropped", ()))
        live = [e for n, e in enumerate(obj.layout["entries"]) if n not in dropped]
        if len(live) != len(tensors):
            return False
        for e, (i, key, v, local) in zip(live, tensors):
            if e["id"] != i or e["key"] != key or list(local.shape) != e["shape"] or \
                    _dtype_name(local) != e["dtype"] or not local.is_contiguous() or \
                    (local.numel() and local.data_ptr() != obj.addr(e["off"])) or \
                    (e.get("dt") is not None) != isinstance(v, DTensor):
                return False
        return True

    def _rebuild(self, opt, groups, tensors, scalars, in_step):
        """Moves opt's state into a new object (opt's state then holds views of it) under the
        other name, and removes the current one. in_step (between the update and the commit):
        the copies of the values the step began from and the status go along; entries the
        step made are marked fresh (a roll-back drops them)."""
        old = self.obj
        prev = {}
        if in_step and old is not None:
            dropped = set(old.status.get("dropped", ()))
            prev = {(e["id"], e["key"]): e for n, e in enumerate(old.layout["entries"])
                    if n not in dropped}
        entries, fresh, at = [], [], 0
        for n, (i, key, v, local) in enumerate(tensors):
            size = _up(_nbytes(local.dtype, local.shape))
            dt = {"shape": list(v.shape), "stride": list(v.stride())} \
                if isinstance(v, DTensor) else None
            entries.append({"id": i, "key": key, "dtype": _dtype_name(local),
                            "shape": list(local.shape), "dt": dt, "off": at, "boff": at + size})
            at += 2 * size
            q = prev.get((i, key))
            if in_step and (q is None or q["shape"] != entries[-1]["shape"] or
                            q["dtype"] != entries[-1]["dtype"]):
                fresh.append(n)
        params = []
        for fp in self.model.fsdp_params:
            numel = fp.sharded.to_local().numel()
            params.append({"id": fp.index, "numel": numel, "boff": at})
            at += _up(4 * numel)
        layout = {"class": type(opt).__name__, "groups": groups, "entries": entries,
                  "params": params}
        nxt = 1 - self.cur if old is not None else self.cur
        obj = _create(self.names[nxt], layout, at, len(json.dumps(scalars)),
                      old.gen + 1 if old is not None else 1)
        try:
            for e, (i, key, v, local) in zip(entries, tensors):
                obj.view(e["off"], local.dtype, local.shape).copy_(local)
            if in_step and old is not None:
                for n, e in enumerate(entries):
                    if n not in fresh:
                        q = prev[(e["id"], e["key"])]
                        dt = DTYPES[e["dtype"]]
                        obj.view(e["boff"], dt, e["shape"]).copy_(
                            old.view(q["boff"], dt, q["shape"]))
                olds = {q["id"]: q for q in old.layout["params"]}
                for p in params:
                    q = olds.get(p["id"])
                    if q is None or q["numel"] != p["numel"]:
                        raise _Unkeepable("the model's shards changed under the optimizer")
                    obj.view(p["boff"], torch.float32, [p["numel"]]).copy_(
                        old.view(q["boff"], torch.float32, [q["numel"]]))
                st = {k: v for k, v in old.status.items() if k != "dropped"}
                st["fresh"] = fresh
            else:
                st = {"phase": "idle", "step": self.model.step, "scalars": scalars}
            obj.write_status(st)
            _publish(obj)
        except BaseException:
            obj.close(unlink=True)
            raise
        for e, (i, key, v, local) in zip(entries, tensors):
            view = obj.view(e["off"], local.dtype, local.shape)
            if isinstance(v, DTensor):
                view = DTensor.from_local(view, v.device_mesh, v.placements, run_check=False,
                                          shape=v.shape, stride=v.stride())
            opt.state[self._param(i)][key] = view
        if old is not None:
            old.close(unlink=True)
        self.obj, self.cur = obj, nxt

    def _param(self, i):
        return self.model.fsdp_params[i].sharded

    def _bind(self, opt, in_step):
        by_id, groups = self._params(opt)
        tensors, scalars = self._state(opt, by_id)
        if self.obj is None or not self._matches(tensors) or \
                groups != self.obj.layout["groups"] or type(opt).__name__ != \
                self.obj.layout["class"]:
            self._rebuild(opt, groups, tensors, scalars, in_step)
        return scalars

    # ---- a step ----

    def before_step(self, opt):
        """Before opt steps the model (its gradients are in): a replacement's new optimizer
        takes the lost trainer's state, the values the step starts from are copied aside and
        the step is marked in flight. Returns None, or why the state cannot be kept (then
        nothing is kept from here on)."""
        try:
            if self.opt is None:
                self.opt = opt
            elif self.opt is not opt:
                raise _Unkeepable("two optimizers step this model")
            if self.pending_load:
                self._load(opt)
            scalars = self._bind(opt, in_step=False)
            obj = self.obj
            dropped = set(obj.status.get("dropped", ()))
            src, dst = [], []
            for n, e in enumerate(obj.layout["entries"]):
                if n not in dropped:
                    dt = DTYPES[e["dtype"]]
                    src.append(obj.view(e["off"], dt, e["shape"]))
                    dst.append(obj.view(e["boff"], dt, e["shape"]))
            for p in obj.layout["params"]:
                src.append(self.model.fsdp_params[p["id"]].sharded.to_local().reshape(-1))
                dst.append(obj.view(p["boff"], torch.float32, [p["numel"]]))
            src = [t for t in src if t.numel()]
            dst = [t for t in dst if t.numel()]
            if src:
                with torch.no_grad():
                    torch._foreach_copy_(dst, src)
            obj.write_status({"phase": "stepping", "step": self.model.step + 1,
                              "scalars": scalars, "bscalars": scalars,
                              "dropped": sorted(dropped), "fresh": []})
            return None
        except _Unkeepable as e:
            self.drop()
            return str(e)

    def after_update(self, opt):
        """After opt updated the values, before the commit: state tensors the step made move
        into the object, and the status gets the scalars after the update. Returns None, or
        why the state cannot be kept."""
        try:
            scalars = self._bind(opt, in_step=True)
            st = dict(self.obj.status)
            st["scalars"] = scalars
            self.obj.write_status(st)
            return None
        except _Unkeepable as e:
            self.drop()
            return str(e)

    def committed(self, step):
        """Every rank counted the step: the live values are step's."""
        st = self.obj.status
        self.obj.write_status({"phase": "idle", "step": step, "scalars": st.get("scalars", {})})
        self.unsettled = False

    def settle(self, server_step):
        """After resync (a commit that failed), or at a replacement's take-over, with the
        servers' step count: keeps the live values or restores the copies (on the servers'
        shards too). pshard.FailedPreconditionError when the kept state belongs to no step
        the servers know."""
        st = self.obj.status
        phase, step = st.get("phase"), st.get("step")
        if phase not in ("idle", "stepping") or not isinstance(step, int):
            raise pshard.FailedPreconditionError("the kept optimizer state has no valid status")
        if phase == "stepping" and step == server_step + 1:
            self._rollback()
        elif step == server_step:
            self.obj.write_status({"phase": "idle", "step": step,
                                   "scalars": st.get("scalars", {}),
                                   "dropped": st.get("dropped", [])})
        else:
            raise pshard.FailedPreconditionError(
                f"the kept optimizer state is of step {step} ({phase}) while the shard servers "
                f"are at step {server_step}: it belongs to no step they know (was a checkpoint "
                "loaded without a step since?); restart the job from a checkpoint")
        self.unsettled = False

    def _rollback(self):
        obj, opt = self.obj, self.opt
        st = obj.status
        dropped = set(st.get("dropped", ()))
        fresh = set(st.get("fresh", ()))
        for n, e in enumerate(obj.layout["entries"]):
            if n in dropped:
                continue
            if n in fresh:  # made by the step rolled back
                dropped.add(n)
                if opt is not None:
                    opt.state[self._param(e["id"])].pop(e["key"], None)
                continue
            dt = DTYPES[e["dtype"]]
            obj.view(e["off"], dt, e["shape"]).copy_(obj.view(e["boff"], dt, e["shape"]))
        with torch.no_grad():
            for p in obj.layout["params"]:
                local = self._param(p["id"]).to_local()
                if local.numel() != p["numel"]:
                    raise pshard.FailedPreconditionError(
                        "the kept optimizer state does not fit this model's shards")
                if p["numel"]:
                    local.view(-1).copy_(obj.view(p["boff"], torch.float32, [p["numel"]]))
        scalars = st.get("bscalars", {})
        if opt is not None:
            for i, kv in scalars.items():
                opt.state[self._param(int(i))].update(kv)
        obj.write_status({"phase": "idle", "step": st["step"] - 1, "scalars": scalars,
                          "dropped": sorted(dropped)})

    def _load(self, opt):
        """A replacement's first step: its new optimizer takes the lost trainer's state."""
        lay, st = self.obj.layout, self.obj.status
        by_id, groups = self._params(opt)
        if type(opt).__name__ != lay["class"] or groups != lay["groups"]:
            raise pshard.FailedPreconditionError(
                f"the replacement's optimizer ({type(opt).__name__}, parameter groups by id "
                f"{groups}) is not the lost trainer's ({lay['class']}, {lay['groups']}): create "
                "the same optimizer over the same parameters")
        if any(opt.state.get(p) for p in by_id.values()):
            raise pshard.FailedPreconditionError(
                "the replacement's optimizer already has state: the lost trainer's goes into a "
                "new optimizer, at its first step")
        dropped = set(st.get("dropped", ()))
        for n, e in enumerate(lay["entries"]):
            if n in dropped:
                continue
            fp = self.model.fsdp_params[e["id"]]
            view = self.obj.view(e["off"], DTYPES[e["dtype"]], e["shape"])
            if e.get("dt") is not None:
                view = DTensor.from_local(view, fp.mesh, fp.placements, run_check=False,
                                          shape=torch.Size(e["dt"]["shape"]),
                                          stride=tuple(e["dt"]["stride"]))
            opt.state[by_id[e["id"]]][e["key"]] = view
        scalars = st.get("scalars", {})
        if not isinstance(scalars, dict):
            raise pshard.FailedPreconditionError("the kept optimizer state is malformed")
        for i, kv in scalars.items():
            if not i.isdigit() or int(i) not in by_id or not isinstance(kv, dict) or \
                    not all(_scalar_ok(v) for v in kv.values()):
                raise pshard.FailedPreconditionError(
                    "the kept optimizer state's numbers name a parameter it does not hold")
            opt.state[by_id[int(i)]].update(kv)
        self.pending_load = False

    def drop(self):
        """Keeps nothing from here on: the objects go (the server then replaces no trainer of
        this model)."""
        if self.obj is not None:
            self.obj.close(unlink=True)
            self.obj = None
        for name in self.names:
            try:
                os.unlink(_path(name))
            except FileNotFoundError:
                pass
