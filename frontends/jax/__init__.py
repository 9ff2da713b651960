"""mcrdl_jax: functional collectives on JAX arrays, eager and under ``jax.jit``.

Every call returns new arrays and never changes its inputs. Names follow the torch
frontend; shapes follow JAX conventions (``jax.lax.all_gather`` stacks on a new
leading axis unless ``tiled=True``; ``reduce_scatter`` splits the leading axis).

Eager path: the input goes into the core through DLPack with no copy. Results are
written into fresh 64-byte-aligned host buffers and handed to JAX through DLPack,
again with no copy. Two exceptions: bfloat16 results are copied once (DLPack from
NumPy has no bfloat16), and ops that work in place in the core (all_reduce, reduce,
broadcast) first copy the input into the result buffer, since JAX arrays are immutable.

Under ``jax.jit`` (traced inputs) the backend is chosen at trace time from the static
shape and dtype, and MPI calls lower to mpi4jax primitives (``traced.py``). Calls that
choose another backend, uneven all-to-all, and recv from any source raise a clear error
under jit for now; ``barrier()`` takes no array and always runs eagerly. The XLA-callback
path for Gloo, autodiff rules and vmap are the open part of the JAX issue. CPU arrays
only, until the backends handle CUDA buffers.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import mcrdl_core as _core
from mcrdl_core import ReduceOp  # noqa: F401  (public name)
from mcrdl_core import dtypes as _dt
from mcrdl_core.errors import InvalidArgumentError

from .shapes import leading_blocks

ALIGN = 64  # bytes; JAX adopts host memory without a copy at this alignment


def _traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _tr():
    """The jit path, imported on first use (it needs mpi4jax)."""
    try:
        from . import traced
    except ImportError as exc:
        raise InvalidArgumentError(f"mcrdl_jax under jax.jit needs mpi4jax ({exc}); install the "
                                   "'mcr-dl[jax]' extra, or call outside jit") from exc
    return traced


def _check(x, what: str = "x"):
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise InvalidArgumentError(f"mcrdl_jax: {what} must be a JAX (or NumPy) array, got "
                                   f"{type(x).__name__}")
    return x


def _empty(shape, dtype) -> np.ndarray:
    """Uninitialized host memory aligned to ALIGN bytes."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + nbytes].view(dt).reshape(shape)


def _np_dtype(x):
    return _dt.lookup(np.dtype(x.dtype)).np_dtype


def _to_jax(arr: np.ndarray):
    if arr.dtype == _dt.bfloat16.np_dtype:
        return jnp.asarray(arr)  # one copy: DLPack from NumPy has no bfloat16
    return jax.dlpack.from_dlpack(arr)


def _copy_of(x) -> np.ndarray:
    out = _empty(x.shape, _np_dtype(x))
    out[...] = _core.as_buffer(x).host()
    return out


def _size(group) -> int:
    return _core.get_world_size(group)


# --- collectives --------------------------------------------------------------------------
def all_reduce(x, op=ReduceOp.SUM, group=None, backend=None):
    if _traced(x):
        return _tr().all_reduce(x, op, group, backend)
    out = _copy_of(_check(x))
    _core.all_reduce(out, op, group, backend=backend)
    return _to_jax(out)


def reduce(x, dst: int = 0, op=ReduceOp.SUM, group=None, backend=None):
    """The reduction on ``dst``; the input, unchanged, elsewhere."""
    if _traced(x):
        return _tr().reduce(x, dst, op, group, backend)
    out = _copy_of(_check(x))
    _core.reduce(out, dst, op, group, backend=backend)
    return _to_jax(out) if _core.get_rank() == dst else x


def broadcast(x, src: int = 0, group=None, backend=None):
    if _traced(x):
        return _tr().broadcast(x, src, group, backend)
    out = _copy_of(_check(x))
    _core.broadcast(out, src, group, backend=backend)
    return _to_jax(out)


def all_gather(x, group=None, backend=None, tiled: bool = False):
    """Shape (n, *x.shape), or (n * x.shape[0], ...) with ``tiled=True``."""
    if _traced(x):
        return _tr().all_gather(x, group, backend, tiled)
    _check(x)
    n = _size(group)
    out = _empty((n, *x.shape), _np_dtype(x))
    _core.all_gather_into_tensor(out, x, group, backend=backend)
    if tiled:
        out = out.reshape((n * x.shape[0], *x.shape[1:]) if x.ndim else (n,))
    return _to_jax(out)


def reduce_scatter(x, op=ReduceOp.SUM, group=None, backend=None):
    """``x.shape[0]`` must be a multiple of the group size n; returns block i of the
    reduction, shape (x.shape[0] // n, ...), on group rank i."""
    if _traced(x):
        return _tr().reduce_scatter(x, op, group, backend)
    _check(x)
    k = leading_blocks(x, _size(group), "reduce_scatter")
    out = _empty((k, *x.shape[1:]), _np_dtype(x))
    _core.reduce_scatter_tensor(out, x, op, group, backend=backend)
    return _to_jax(out)


def all_to_all(x, group=None, backend=None, input_split_sizes=None, output_split_sizes=None):
    """Split the leading axis into n blocks (or the given sizes) and exchange them.
    With uneven splits, ``output_split_sizes`` gives the rows this rank receives."""
    if _traced(x):
        return _tr().all_to_all(x, group, backend, input_split_sizes, output_split_sizes)
    _check(x)
    rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
    out = _empty((rows, *x.shape[1:]), _np_dtype(x))
    _core.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group,
                            backend=backend)
    return _to_jax(out)


def gather(x, dst: int = 0, group=None, backend=None):
    """Shape (n, *x.shape) on ``dst``; the input, unchanged, elsewhere."""
    if _traced(x):
        return _tr().gather(x, dst, group, backend)
    _check(x)
    n = _size(group)
    me = _core.get_rank()
    outs = None
    if me == dst:
        stacked = _empty((n, *x.shape), _np_dtype(x))
        outs = list(stacked)
    _core.gather(x, outs, dst, group, backend=backend)
    return _to_jax(stacked) if me == dst else x


def scatter(x, src: int = 0, group=None, backend=None):
    """``x`` of shape (n, *s) on ``src`` (any array of that shape elsewhere): block i to
    group rank i, shape s."""
    if _traced(x):
        return _tr().scatter(x, src, group, backend)
    _check(x)
    leading_blocks(x, _size(group), "scatter", exact=True)
    out = _empty(x.shape[1:], _np_dtype(x))
    blocks = list(_core.as_buffer(x).host()) if _core.get_rank() == src else None
    _core.scatter(out, blocks, src, group, backend=backend)
    return _to_jax(out)


# --- point to point -----------------------------------------------------------------------
def send(x, dst: int, group=None, tag: int = 0, backend=None) -> None:
    if _traced(x):
        return _tr().send(x, dst, group, tag, backend)
    _core.send(_check(x), dst, group, tag, backend=backend)


def recv(like, src: int | None = None, group=None, tag: int = 0, backend=None):
    """A new array shaped and typed like ``like``, filled from ``src`` (any if None)."""
    if _traced(like):
        return _tr().recv(like, src, group, tag, backend)
    _check(like, "like")
    out = _empty(like.shape, _np_dtype(like))
    _core.recv(out, src, group, tag, backend=backend)
    return _to_jax(out)


def sendrecv(sendbuf, recvbuf_like, source: int, dest: int, group=None, tag: int = 0,
             backend=None):
    """Send ``sendbuf`` to ``dest`` and receive an array like ``recvbuf_like`` from
    ``source``, both posted before either is waited on (no ordering deadlock)."""
    if _traced(sendbuf, recvbuf_like):
        return _tr().sendrecv(sendbuf, recvbuf_like, source, dest, group, tag, backend)
    _check(sendbuf, "sendbuf")
    _check(recvbuf_like, "recvbuf_like")
    out = _empty(recvbuf_like.shape, _np_dtype(recvbuf_like))
    ws = _core.send(sendbuf, dest, group, tag, async_op=True, backend=backend)
    wr = _core.recv(out, source, group, tag, async_op=True, backend=backend)
    wr.wait()
    ws.wait()
    return _to_jax(out)


def barrier(group=None, backend=None) -> None:
    _core.barrier(group, backend=backend)


def get_rank(group=None) -> int:
    return _core.get_rank(group)


def get_world_size(group=None) -> int:
    return _core.get_world_size(group)


def new_group(ranks=None, backend=None):
    return _core.new_group(ranks, backend=backend)
