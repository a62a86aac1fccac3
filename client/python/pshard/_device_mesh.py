"""torch.distributed.device_mesh's init_device_mesh and DeviceMesh over pshard's process
groups (torch's own DeviceMesh needs a torch process group): a mesh of world ranks with one
process group per dimension, made by every rank, one exchange per dimension. Re-exported by
pshard.distributed."""
import math
import operator

import torch

import pshard

__all__ = ["DeviceMesh", "init_device_mesh"]

_DEVICE_TYPES = ("cpu", "cuda")


def _dim_rank_lists(mesh, dim):
    """The ranks of every group along dim of mesh (one per position of the other dims, in
    torch's order), each sorted as new_group sorts them."""
    rows = mesh.swapdims(-1, dim).reshape(-1, mesh.size(dim))
    return [sorted(int(r) for r in row) for row in rows]


class DeviceMesh:
    """torch's DeviceMesh over pshard's process groups: mesh is a tensor of distinct world
    ranks; each dimension has one process group per line along it, and get_group(dim) is the
    one of this rank. Making one is collective (every rank, same mesh): each dimension's
    groups are made in one exchange. Indexing by dimension names gives the sub-mesh through this
    rank, whose groups are this mesh's (no exchange)."""

    def __init__(self, device_type, mesh, *, mesh_dim_names=None, _groups=None):
        if device_type not in _DEVICE_TYPES:
            raise ValueError(f"device_type {device_type!r} is not supported: use 'cpu' or "
                             "'cuda' (without a device index)")
        self.device_type = device_type
        mesh = (mesh.detach().to("cpu", torch.int) if isinstance(mesh, torch.Tensor)
                else torch.tensor(mesh, dtype=torch.int))
        if mesh.dim() == 0:
            raise ValueError("mesh must have at least one dimension")
        world = pshard.get_world_size()
        flat = mesh.reshape(-1).tolist()
        if len(set(flat)) != len(flat) or any(not 0 <= r < world for r in flat):
            raise ValueError(f"mesh {mesh.tolist()} must hold distinct ranks of 0..{world - 1}")
        if mesh_dim_names is not None:
            mesh_dim_names = tuple(mesh_dim_names)
            if len(mesh_dim_names) != mesh.dim():
                raise ValueError(f"mesh_dim_names {mesh_dim_names} must name each of the mesh's "
                                 f"{mesh.dim()} dimensions")
            if len(set(mesh_dim_names)) != len(mesh_dim_names) or not all(
                    isinstance(n, str) for n in mesh_dim_names):
                raise ValueError(f"mesh_dim_names {mesh_dim_names} must be distinct strings")
        self.mesh = mesh
        self.mesh_dim_names = mesh_dim_names
        me = pshard.get_rank()
        at = (mesh == me).nonzero()
        self._coordinate = at[0].tolist() if at.numel() else None
        if _groups is not None:
            self._groups = list(_groups)
            return
        from .distributed import _make_groups
        self._groups = []
        for d in range(mesh.dim()):
            lists = _dim_rank_lists(mesh, d)
            groups = _make_groups(lists, 0, f"mesh_dim_{self._dim_name(d)}")
            mine = [g for g, rs in zip(groups, lists) if me in rs]
            self._groups.append(mine[0] if mine else pshard.GroupMember.NON_GROUP_MEMBER)

    def _dim_name(self, d):
        return self.mesh_dim_names[d] if self.mesh_dim_names else str(d)

    def _dim(self, mesh_dim, what):
        """The index of mesh_dim (an int or a dimension's name; None for a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim > 1:
                raise RuntimeError(f"Found the DeviceMesh have {self.ndim} dimensions. Optional "
                                   f"kwarg `mesh_dim` needs to be specified when "
                                   f"device_mesh.ndim > 1 ({what}).")
            return 0
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"Mesh dimension '{mesh_dim}' does not exist. Available mesh "
                               f"dimensions are: mesh_dim_names={self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        d = operator.index(mesh_dim)
        if not -self.ndim <= d < self.ndim:
            raise IndexError(f"mesh_dim {d} is out of range for a {self.ndim}-D mesh")
        return d % self.ndim

    @property
    def ndim(self):
        return self.mesh.dim()

    @property
    def shape(self):
        return tuple(self.mesh.shape)

    def size(self, mesh_dim=None):
        """The number of ranks of the mesh, or along mesh_dim."""
        return self.mesh.numel() if mesh_dim is None else self.mesh.size(
            self._dim(mesh_dim, "size"))

    def get_group(self, mesh_dim=None):
        """The process group of this rank along mesh_dim (an int or a name; may be left out
        for a 1-D mesh)."""
        return self._groups[self._dim(mesh_dim, "get_group")]

    def get_all_groups(self):
        """This rank's process group of every dimension, in order."""
        return list(self._groups)

    def get_local_rank(self, mesh_dim=None):
        """This rank's rank in its group along mesh_dim."""
        return pshard.get_rank(self.get_group(mesh_dim))

    def get_rank(self):
        """This trainer's global rank."""
        return pshard.get_rank()

    def get_coordinate(self):
        """This rank's index along each dimension, or None when the mesh does not hold it."""
        return None if self._coordinate is None else list(self._coordinate)

    def __getitem__(self, mesh_dim_names):
        """The sub-mesh over the named dimensions (a name or a tuple of names) through this
        rank, whose groups are this mesh's."""
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if not self.mesh_dim_names:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names")
        dims = [self._dim(n, "__getitem__") for n in names]
        if len(set(dims)) != len(dims):
            raise KeyError(f"mesh_dim_names {names} repeat a dimension")
        if self._coordinate is None:
            raise RuntimeError("this rank is not in the mesh: it has no sub-mesh")
        index = [slice(None) if d in dims else self._coordinate[d] for d in range(self.ndim)]
        kept = [d for d in range(self.ndim) if d in dims]
        sub = self.mesh[tuple(index)].permute([kept.index(d) for d in dims])
        return DeviceMesh(self.device_type, sub.contiguous(), mesh_dim_names=names,
                          _groups=[self._groups[d] for d in dims])

    def __repr__(self):
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, backend_override=None):
    """torch's init_device_mesh: a DeviceMesh over every rank, laid out row-major in mesh_shape
    (whose product must be the world size), with each dimension's process groups. Collective:
    every rank calls it with the same arguments."""
    if backend_override is not None:
        raise ValueError("backend_override is not supported: the shard servers' backend is "
                         "chosen when they start")
    if device_type not in _DEVICE_TYPES:
        raise ValueError(f"device_type {device_type!r} is not supported: use 'cpu' or 'cuda' "
                         "(without a device index)")
    try:
        shape = tuple(operator.index(s) for s in mesh_shape)
    except TypeError:
        raise TypeError(f"mesh_shape must be a tuple of ints, not {mesh_shape!r}") from None
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"mesh_shape {shape} must be one or more positive sizes")
    world = pshard.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(f"mesh_shape {shape} holds {math.prod(shape)} ranks; the world has "
                         f"{world}")
    if mesh_dim_names is not None and len(tuple(mesh_dim_names)) != len(shape):
        raise ValueError(f"mesh_shape {shape} and mesh_dim_names {tuple(mesh_dim_names)} should "
                         "have the same length")
    mesh = torch.arange(world, dtype=torch.int).view(shape)
    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names)
