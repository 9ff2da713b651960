"""The eager implementations of mcrdl_jax's ops, on host arrays.

Each function takes arrays that DLPack can describe (JAX arrays, or the NumPy arrays an
XLA host callback hands over), runs the core's call, and returns new NumPy arrays
allocated 64-byte aligned, so that JAX can adopt them without a copy. ``None`` means
"this rank's result is its input, unchanged" (``reduce`` and ``gather`` off the root).
Both the eager API (``eager.py``) and the jit callback path (``lowering.py``) call
these, so the two cannot drift apart.
"""
from __future__ import annotations

import math

import jax
import numpy as np

import mcrdl_core as _core
from mcrdl_core import dtypes as _dt

from .shapes import leading_blocks

ALIGN = 64  # bytes; JAX adopts host memory without a copy at this alignment


def view(x):
    """A CPU JAX array as a read-only NumPy view of its memory (no copy, about 1 µs
    against about 17 through DLPack); anything else as it is."""
    if isinstance(x, jax.Array):  # the frontend checked: one CPU device
        return np.asarray(x)
    return x


def empty(shape, dtype) -> np.ndarray:
    """Uninitialized host memory aligned to ALIGN bytes."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + nbytes].view(dt).reshape(shape)


def np_dtype(x):
    return _dt.lookup(np.dtype(x.dtype)).np_dtype


SMALL = 4096  # bytes: below this a plain copy is cheaper than aligned memory JAX adopts


def copy_of(x) -> np.ndarray:
    """A writable copy of ``x``: 64-byte aligned (JAX adopts it without a copy), or,
    below SMALL bytes, a plain NumPy copy (one call; JAX then copies the few bytes,
    which costs less than allocating aligned memory and adopting it)."""
    v = view(x)
    if v.nbytes < SMALL and isinstance(v, np.ndarray):
        return np.array(v)
    out = empty(x.shape, np_dtype(x))
    out[...] = v
    return out


def size(group) -> int:
    return _core.get_world_size(group)


def all_reduce(x, op, group, backend, compression=None):
    out = copy_of(x)
    _core.all_reduce(out, op, group, backend=backend, compression=compression)
    return out


def reduce(x, dst, op, group, backend):
    out = copy_of(x)
    _core.reduce(out, dst, op, group, backend=backend)
    return out if _core.get_rank() == dst else None


def broadcast(x, src, group, backend):
    out = copy_of(x)
    _core.broadcast(out, src, group, backend=backend)
    return out


def all_gather(x, group, backend, compression=None):
    """Stacked: shape (n, *x.shape)."""
    out = empty((size(group), *x.shape), np_dtype(x))
    _core.all_gather_into_tensor(out, view(x), group, backend=backend, compression=compression)
    return out


def reduce_scatter(x, op, group, backend, compression=None):
    k = leading_blocks(x, size(group), "reduce_scatter")
    out = empty((k, *x.shape[1:]), np_dtype(x))
    _core.reduce_scatter_tensor(out, view(x), op, group, backend=backend,
                                compression=compression)
    return out


def all_to_all(x, group, backend, input_split_sizes=None, output_split_sizes=None,
               compression=None):
    if not (input_split_sizes or output_split_sizes):
        leading_blocks(x, size(group), "all_to_all")
    rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
    out = empty((rows, *x.shape[1:]), np_dtype(x))
    _core.all_to_all_single(out, view(x), output_split_sizes and list(output_split_sizes),
                            input_split_sizes and list(input_split_sizes), group,
                            backend=backend, compression=compression)
    return out


def gather(x, dst, group, backend):
    n = size(group)
    if _core.get_rank() != dst:
        _core.gather(view(x), None, dst, group, backend=backend)
        return None
    stacked = empty((n, *x.shape), np_dtype(x))
    _core.gather(view(x), list(stacked), dst, group, backend=backend)
    return stacked


def scatter(x, src, group, backend):
    leading_blocks(x, size(group), "scatter", exact=True)
    out = empty(x.shape[1:], np_dtype(x))
    blocks = list(view(x)) if _core.get_rank() == src else None
    _core.scatter(out, blocks, src, group, backend=backend)
    return out


def send(x, dst, group, tag, backend):
    _core.send(view(x), dst, group, tag, backend=backend)


def recv(shape, dtype, src, group, tag, backend):
    out = empty(tuple(shape), dtype)
    _core.recv(out, src, group, tag, backend=backend)
    return out


def sendrecv(sendbuf, shape, dtype, source, dest, group, tag, backend, recv_backend=None):
    """Both posted before either is waited on, so a ring of them cannot deadlock.
    ``recv_backend``: the receive's backend when it differs from the send's (the jit
    path selects each direction from its own size); default: ``backend``."""
    out = empty(tuple(shape), dtype)
    ws = _core.send(view(sendbuf), dest, group, tag, async_op=True, backend=backend)
    wr = _core.recv(out, source, group, tag, async_op=True,
                    backend=backend if recv_backend is None else recv_backend)
    wr.wait()
    ws.wait()
    return out
