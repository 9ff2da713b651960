"""Resharding for JAX: ``NamedSharding``/``PartitionSpec`` -> MCR-DL layouts, and
``reshard`` on this process's local tile (eager, and under ``jax.jit`` through the
host callback every non-MPI call of mcrdl_jax uses, in the same comm order).

JAX splits uneven dimensions in blocks of ``ceil(n / k)`` over the product of the named
axes (the first one major): the layout's ``"flat"`` chunking.
"""
from __future__ import annotations

import jax
import numpy as np

import mcrdl_core as _core
from mcrdl_core import dtypes as _dt
from mcrdl_core.base.errors import InvalidArgumentError
from mcrdl_core.reshard import Layout, Mesh
from mcrdl_core.reshard.layout import box_shape


def layout(sharding, mesh=None, ranks=None) -> Layout:
    """A Layout from a ``jax.sharding.NamedSharding``, or from a ``PartitionSpec`` with
    ``mesh`` (a JAX ``Mesh`` or a :class:`mcrdl_core.reshard.Mesh`).

    The global rank of each device of a JAX mesh is its ``process_index`` (one device
    per process, as with ``jax.distributed``), unless ``ranks`` (an integer array of the
    mesh's shape) says otherwise."""
    from jax.sharding import NamedSharding, PartitionSpec

    if isinstance(sharding, NamedSharding):
        spec, mesh = sharding.spec, sharding.mesh
    elif isinstance(sharding, PartitionSpec):
        spec = sharding
        if mesh is None:
            raise InvalidArgumentError("layout: a PartitionSpec needs mesh= (a JAX Mesh or a "
                                       "mcrdl_core.reshard.Mesh)")
    else:
        raise InvalidArgumentError(f"layout: expected a NamedSharding or a PartitionSpec, got "
                                   f"{type(sharding).__name__}")
    if not isinstance(mesh, Mesh):
        names = tuple(mesh.axis_names)
        devices = np.asarray(mesh.devices)
        if ranks is None:
            ranks = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices)
            if len(np.unique(ranks)) != ranks.size:
                raise InvalidArgumentError(
                    "layout: several devices of the JAX mesh belong to one process; pass ranks= "
                    "(the global rank of each mesh position)")
        ranks = np.asarray(ranks)
        if ranks.shape != devices.shape:
            raise InvalidArgumentError(f"layout: ranks has shape {ranks.shape}, the mesh "
                                       f"{devices.shape}; give one rank per mesh position")
        mesh = Mesh(ranks, names)
    entries = []
    for e in tuple(spec):
        if e is not None and not isinstance(e, (str, tuple, list)):
            raise InvalidArgumentError(f"layout: PartitionSpec entry {e!r} is not supported; use "
                                       "None, an axis name or a tuple of axis names")
        entries.append(e)
    return Layout(mesh, entries, "flat")


def _as_layout(x, what: str) -> Layout:
    if isinstance(x, Layout):
        return x
    try:
        return layout(x)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def reshard(x, src, dst, global_shape, *, dtype=None, method: str = "broadcast",
            balance: str = "lpt", backend: str | None = None, async_op: bool = False,
            **kwargs):
    """Move this process's tile ``x`` of a ``global_shape`` array laid out as ``src``
    to the layout ``dst``; returns this process's destination tile as a new JAX array
    (None outside the destination mesh; eagerly, or an empty array of shape (0,) under
    ``jit``). ``x`` is None (eager) outside the source mesh: pass ``dtype``.
    ``src``/``dst``: Layouts or NamedShardings. Other keywords as
    :func:`mcrdl_core.reshard`. Every process calls it. ``async_op=True``: every transfer
    is posted now and a :class:`~mcrdl_jax.Handle` returned; ``mcrdl_jax.wait`` gives the
    tile (eager and under jit, as the other non-blocking calls: docs/jax.md)."""
    from . import eager, host

    src_l, dst_l = _as_layout(src, "src"), _as_layout(dst, "dst")
    shape = tuple(int(n) for n in global_shape)
    if x is None and dtype is None:
        raise InvalidArgumentError("reshard: processes without a local array pass dtype=")
    np_dt = _dt.lookup(np.dtype(x.dtype if x is not None else dtype)).np_dtype
    box = dst_l.tile(shape, _core.get_rank())
    out_shape = box_shape(box) if box is not None else None
    call = dict(dtype=np_dt, method=method, balance=balance, backend=backend, **kwargs)

    def run(local):
        out = host.empty(out_shape, np_dt) if out_shape is not None else None
        _core.reshard(local, src_l, dst_l, shape, out=out, **call)
        return out

    from . import traced  # the package's rule: any active trace takes the traced path

    if async_op:
        return _reshard_async(x, traced(x) if x is not None else False, shape, np_dt, src_l,
                              dst_l, out_shape, call)

    if x is not None and traced(x):
        from .callback import host_call

        res_shape = out_shape if out_shape is not None else (0,)

        def fn(local):
            out = run(local if src_l.tile(shape, _core.get_rank()) is not None else None)
            return (out if out is not None else np.zeros(res_shape, np_dt),)

        return host_call(fn, [jax.ShapeDtypeStruct(res_shape, np_dt)], x,
                         what="reshard")[0]
    local = None if x is None else host.view(x)
    out = run(local)
    return None if out is None else eager.to_jax(out)


def _reshard_async(x, is_traced, shape, np_dt, src_l, dst_l, out_shape, call):
    """``reshard(..., async_op=True)``: the core's reshard with every stage issued now (in
    plan order, on every rank) and its waits left to the handle's wait."""
    from . import eager, host
    from . import nonblocking as nb

    rank = _core.get_rank()
    src_in = src_l.tile(shape, rank) is not None

    def start(local):
        out = host.empty(out_shape, np_dt) if out_shape is not None else None
        work, res = _core.reshard(local, src_l, dst_l, shape, out=out, async_op=True, **call)
        return work, res

    if not is_traced:
        eager.ready(*([] if x is None else [x]))
        work, res = start(None if x is None else host.view(x))
        return nb.handle(nb.register([work], lambda: [res], (x, res), "reshard"), "reshard")
    from .callback import host_call

    res_shape = out_shape if out_shape is not None else (0,)

    def begin(local):
        work, res = start(host.copy_of(local) if src_in else None)
        out = res if res is not None else np.zeros(res_shape, np_dt)
        return (np.int32(nb.register([work], lambda: [out], (out,), "reshard")),)

    (hid,) = host_call(begin, [jax.ShapeDtypeStruct((), np.int32)], jax.lax.stop_gradient(x),
                       what="start of reshard")
    return nb.handle(hid, "reshard", [jax.ShapeDtypeStruct(res_shape, np_dt)])
