"""Resharding for PyTorch: DTensor placements -> MCR-DL layouts, and ``reshard``.

``layout(device_mesh, placements)`` converts a DTensor layout (``Shard(d)``,
``Replicate()``; several mesh dimensions may shard one tensor dimension, applied in
mesh-dimension order, as DTensor does) into a :class:`mcrdl_core.reshard.Layout` with
DTensor's nested uneven chunking. ``reshard`` moves a tensor between two layouts,
possibly on different meshes (which DTensor's ``redistribute`` refuses): DTensor in,
DTensor out on the destination mesh.
"""
from __future__ import annotations

import torch

import mcrdl_core as _core
from mcrdl_core.base.errors import InvalidArgumentError, UnsupportedError
from mcrdl_core.reshard import Layout, Mesh
from mcrdl_core.reshard.layout import box_shape

from .tensors import to_buffer


def layout(device_mesh, placements, ndim: int | None = None) -> Layout:
    """A Layout from a DTensor ``DeviceMesh`` and its placements (one per mesh dim).
    ``ndim``: the tensor's number of dimensions (needed only for negative ``Shard``
    dims)."""
    from torch.distributed.tensor import Replicate, Shard

    ranks = device_mesh.mesh.tolist()
    names = device_mesh.mesh_dim_names or tuple(f"d{i}" for i in range(device_mesh.ndim))
    placements = tuple(placements)
    if len(placements) != device_mesh.ndim:
        raise InvalidArgumentError(f"{len(placements)} placements for a {device_mesh.ndim}-d "
                                   "DeviceMesh; give one per mesh dimension")
    spec: dict = {}
    for axis, p in zip(names, placements):
        if type(p) is Shard:
            d = p.dim
            if d < 0:
                if ndim is None:
                    raise InvalidArgumentError(f"placement {p} has a negative dim; pass ndim=")
                d += ndim
            spec.setdefault(d, []).append(axis)
        elif isinstance(p, Replicate):
            continue
        elif isinstance(p, Shard):
            raise UnsupportedError(f"placement {p!r} (strided sharding) is not supported; "
                                   "redistribute to Shard/Replicate on the mesh first")
        else:
            raise UnsupportedError(f"placement {p!r} is not supported (a Partial value must be "
                                   "reduced first: dtensor.redistribute(mesh, [Replicate(), "
                                   "...]) on its own mesh)")
    n = max(spec, default=-1) + 1
    return Layout(Mesh(ranks, names), [tuple(spec.get(d, ())) for d in range(n)], "nested")


def _as_layout(x, what: str):
    """(Layout, DeviceMesh or None, placements or None) from a Layout or (mesh, placements)."""
    if isinstance(x, Layout):
        return x, None, None
    if isinstance(x, tuple) and len(x) == 2:
        return layout(x[0], x[1]), x[0], tuple(x[1])
    raise InvalidArgumentError(f"{what} must be a mcrdl_core.reshard.Layout or a (DeviceMesh, "
                               f"placements) pair, got {type(x).__name__}")


def reshard(tensor, src=None, dst=None, global_shape=None, *, dtype=None,
            method: str = "broadcast", balance: str = "lpt", backend: str | None = None,
            **kwargs):
    """Move a sharded tensor to another layout, possibly on another mesh.

    ``tensor``: a DTensor (its mesh and placements are ``src``, its shape the global
    shape), or this rank's local tile with ``src`` and ``global_shape`` given, or None on
    ranks outside the source mesh (pass ``dtype``). ``src``/``dst``: Layouts or
    ``(DeviceMesh, placements)``. Returns on destination ranks a DTensor when ``dst`` is
    a (DeviceMesh, placements) pair, else the local tile as a tensor; None elsewhere.
    Other keywords as :func:`mcrdl_core.reshard`. Every rank of the world calls it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        if src is not None:
            raise InvalidArgumentError("reshard: a DTensor carries its own layout; drop src")
        src = (tensor.device_mesh, tensor.placements)
        global_shape = tuple(tensor.shape)
        local = tensor.to_local()
    else:
        local = tensor
    if src is None or dst is None or global_shape is None:
        raise InvalidArgumentError("reshard: pass src, dst and global_shape (or a DTensor and "
                                   "dst)")
    src_l = _as_layout(src, "src")[0]
    dst_l, dst_mesh, dst_places = _as_layout(dst, "dst")
    shape = tuple(int(n) for n in global_shape)
    if local is not None:
        tdtype, device = local.dtype, local.device
        inp = to_buffer(local)
    else:
        if dtype is None:
            raise InvalidArgumentError("reshard: ranks without a local tensor pass dtype=")
        tdtype, device, inp = dtype, torch.device("cpu"), None
    rank = _core.get_rank()
    box = dst_l.tile(shape, rank)
    out = torch.empty(box_shape(box), dtype=tdtype, device=device) if box is not None else None
    core_dtype = to_buffer(torch.empty(0, dtype=tdtype)).dtype
    _core.reshard(inp, src_l, dst_l, shape, dtype=core_dtype, method=method, balance=balance,
                  backend=backend, out=None if out is None else to_buffer(out), **kwargs)
    if out is None or dst_mesh is None:
        return out
    contiguous = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out, dst_mesh, dst_places, run_check=False,
                              shape=torch.Size(shape), stride=contiguous)
