"""One parameter of a model sharded on pshard (FSDP2's FSDPParam).

fully_shard replaces each parameter with its **sharded parameter**: an nn.Parameter holding a
DTensor with Shard(0) placement (Replicate() first on an HSDP mesh) whose local tensor is this
rank's rows, torch.chunk's split as FSDP2's (the last ranks may own fewer rows or none). Until
the model is defined to the shard servers (its first forward) the local tensor is a copy in the
trainer; from then on it is a view of the fp32 master weights **in the shard server's memory**
(shared memory the server owns), so a torch.optim optimizer in the trainer updates the masters
in place and the next gather reads the update. In forward and backward the modules hold the
**unsharded parameter** instead: a plain nn.Parameter over the full buffer the shard server
gathers into (param_dtype), at a fixed address for the model's life (a reshard gives its pages
back, the next gather writes them again), so tensors autograd saved stay valid.
After a reduce-scatter the reduced gradient shard lives in the server's fp32 accumulator; the
sharded parameter's ``.grad`` is a DTensor over it.

A model on a GPU (**staged** parameters) has its unsharded parameter as a tensor of its own on
the model's device, whose storage is allocated and filled from the gathered buffer when its unit
is unsharded and freed (``resize_(0)``, FSDP2's way of keeping the tensor, and what autograd
saved of it, valid) when the unit reshards; its gradient is added into the full gradient buffer
before the reduce-scatter (FSDP2 copies out of its all-gather output and into its
reduce-scatter input alike). With GPU-resident shards those full buffers are the model region in
the shard server's GPU memory (device-to-device copies); with CPU offload, host memory. The tests
run the same path on the CPU (``PSHARD_TEST_EMULATE_DEVICE=1``).
"""
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["FSDPParam", "shard_rows", "make_sharded", "device_of", "local_dtensor"]


def local_dtensor(local, mesh, placements, shape, stride):
    """A DTensor over local as it is, wherever it is (FSDP2's _from_local_no_grad):
    DTensor.from_local would move a local tensor onto the mesh's device type (a CPU-offloaded
    shard onto the GPU of a cuda mesh), and the DTensor would then hold a copy instead of the
    shard server's memory."""
    spec = DTensorSpec(mesh, tuple(placements),
                       tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def shard_rows(d0, rank, size):
    """(first row, number of rows) of rank's shard of a dimension of d0 rows over size ranks:
    torch.chunk's split, which DTensor's Shard(0) and FSDP2 use (ceil(d0 / size) rows each)."""
    chunk = -(-d0 // size) if d0 else 0
    lo = min(d0, rank * chunk)
    return lo, min(d0, lo + chunk) - lo


def make_sharded(p, mesh, placements, shard_rank, shard_size, host=False):
    """The sharded parameter of p (a plain parameter): an nn.Parameter of a DTensor over mesh
    with placements whose local tensor is a copy of this rank's rows of p, on p's device, or
    with host (FSDP2's CPU offload) in host memory."""
    if p.dim() == 0:
        raise ValueError("fully_shard shards parameters on dim 0: a 0-dimensional parameter "
                         "cannot be sharded (give it a dimension of 1, or keep it out of the "
                         "model with ignored_params)")
    lo, rows = shard_rows(p.shape[0], shard_rank, shard_size)
    with torch.no_grad():
        # Where the shard servers' memory it becomes will be (a DTensor keeps its device): the
        # host with CPU offload, else p's device; the module computes on p's (device_of).
        local = p.detach()[lo:lo + rows].to("cpu" if host else p.device, copy=True).contiguous()
        d = local_dtensor(local, mesh, placements, p.shape, p.stride())
    sp = nn.Parameter(d, requires_grad=p.requires_grad)
    sp._pshard_device = p.device
    return sp


def device_of(sharded):
    """The device the module computes this parameter on (where it was before fully_shard)."""
    return getattr(sharded, "_pshard_device", torch.device("cpu"))


class FSDPParam:
    """One parameter: sharded (a DTensor nn.Parameter, what the modules hold outside forward
    and what optimizers and state dicts see), unsharded (the nn.Parameter over the gathered full
    buffer, what forward and backward use; None before the model is defined) and where it is
    registered (every (module, name) that holds it: tied parameters are one FSDPParam)."""

    def __init__(self, index, name, sharded, slots, mesh, placements, shard_rank, shard_size):
        self.index = index            # pshard parameter id
        self.name = name              # its first fully qualified name
        self.sharded = sharded
        self.slots = slots
        self.mesh = mesh
        self.placements = placements
        self.shard_rank, self.shard_size = shard_rank, shard_size
        self.unsharded = None
        self.grad_local = None        # this rank's fp32 gradient slice in the server's memory
        self.had_grad = False         # autograd produced a gradient in this backward
        self.gathered = None          # staged: () -> the gathered full buffer, while gathered
        self.filled = False           # staged: the unsharded storage holds the gathered values

    @property
    def frozen(self):
        return not self.sharded.requires_grad

    @property
    def staged(self):
        return self.gathered is not None

    def bind(self, full_view, master, grad, staged_on=None, gathered=None, dtype=None):
        """After the model's definition: the unsharded parameter over full_view (the stable full
        buffer), or with staged_on a device, a tensor of its own there (allocated and filled
        by fill() from what gathered() returns, the full buffer of dtype while the parameter
        is gathered; freed by free()); and the sharded parameter's local tensor moved onto master
        (this rank's fp32 master rows in the server's memory, 1-D), grad (the accumulator's, or
        None) kept for the sharded gradient. ValueError when the server's placement is not
        torch.chunk's."""
        shape = tuple(self.sharded.shape)
        lo, rows = shard_rows(shape[0], self.shard_rank, self.shard_size)
        local_shape = (rows,) + shape[1:]
        numel = 1
        for s in local_shape:
            numel *= s
        if master.numel() != numel:
            raise ValueError(f"parameter '{self.name}': the shard server holds {master.numel()} "
                             f"elements of it on this rank, DTensor's Shard(0) expects {numel}")
        if staged_on is None:
            self.unsharded = nn.Parameter(full_view.view(shape),
                                          requires_grad=self.sharded.requires_grad)
        else:
            self.gathered = gathered
            self.unsharded = nn.Parameter(
                torch.empty(shape, dtype=dtype, device=staged_on),
                requires_grad=self.sharded.requires_grad)
            self.free()
        self.unsharded._pshard_fsdp_param = self
        with torch.no_grad():
            self.sharded._local_tensor = master.view(local_shape)
        self.grad_local = grad.view(local_shape) if grad is not None else None

    def fill(self):
        """Staged: the unsharded parameter's storage back at its size, holding the gathered
        values (the gather has completed); a no-op when it holds them or is not staged. From
        host memory the copy is synchronous; from the server's GPU memory it is queued on the
        current stream, and the model synchronizes the device before the servers write that
        buffer again (Model.sync_device before every gather)."""
        if self.gathered is None or self.filled:
            return
        t = self.unsharded
        t.untyped_storage().resize_(t.numel() * t.element_size())
        # Refilling what autograd saved in forward is no modification of it (the same values
        # as then): the version counter stays, as FSDP2 keeps it across its all-gathers.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
            t.copy_(self.gathered().view(t.shape))
        self.filled = True

    def free(self):
        """Staged: gives the unsharded parameter's storage back (the tensor stays)."""
        if self.gathered is None:
            return
        self.unsharded.untyped_storage().resize_(0)
        self.filled = False

    def to_sharded(self):
        for module, name in self.slots:
            module._parameters[name] = self.sharded

    def to_unsharded(self):
        for module, name in self.slots:
            module._parameters[name] = self.unsharded

    def sharded_grad(self):
        """A DTensor over this rank's gradient slice in the server's memory."""
        shape = tuple(self.sharded.shape)
        return local_dtensor(self.grad_local, self.mesh, self.placements, shape,
                             self.sharded.stride())
