"""The eager path of mcrdl_jax for arrays on a GPU: the same ops and signatures as
``eager.py``, on CUDA memory, through any backend (nccl, or mpi and gloo staged through
pinned host memory: docs/gpu.md).

Inputs enter the core through DLPack as CuPy views of the JAX arrays (no copy; the
core only reads them); results are written into fresh CuPy arrays on the input's GPU
and handed to JAX through DLPack, again with no copy. Ops that work in place in the core
(all_reduce, reduce, broadcast) first copy the input, since JAX arrays are immutable.
DLPack carries the stream order both ways: JAX's pending writes are ordered before
CuPy's current stream, where MCR-DL issues, and JAX's stream waits for CuPy's before it
reads a result. dtypes CuPy lacks (bfloat16, the float8 types) travel as unsigned
integers of their width, with the real dtype given to the core, so reductions are
computed on the real values.

Under ``jax.jit`` GPU arrays need nothing of this module: MPI lowers to mpi4jax's
primitives (which copy through the host unless the MPI library is CUDA-aware) and the
other backends to a host callback (``lowering.py``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mcrdl_core as _core
from mcrdl_core import dtypes as _dt
from mcrdl_core.memory import cuda as _cuda
from mcrdl_core.memory.buffer import Buffer, Device

from .eager import token
from .host import size as _size
from .shapes import leading_blocks

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def device_of(x) -> int:
    """The CUDA ordinal of a single-device JAX array."""
    return next(iter(x.devices())).local_hardware_id


def _native(dtype) -> bool:
    """Whether CuPy has this dtype (NumPy's own); bfloat16 and float8 are not."""
    return np.dtype(dtype).isbuiltin == 1


class _Call:
    """One eager call's device, dtype and memory helpers."""

    def __init__(self, x):
        self.cp = _cuda.cupy()
        self.index = device_of(x)
        self.dtype = np.dtype(x.dtype)
        self.real = _dt.lookup(self.dtype)
        self.native = _native(self.dtype)
        self.store = self.dtype if self.native else np.dtype(_UINT[self.dtype.itemsize])

    def view(self, x):
        """A CuPy array over ``x``'s memory (the core only reads it)."""
        if x.size == 0:
            return self.cp.empty(x.shape, self.store)
        if not self.native:
            x = jax.lax.bitcast_convert_type(x, self.store)
        return self.cp.from_dlpack(x)

    def empty(self, shape):
        return self.cp.empty(tuple(shape), self.store)

    def copy_of(self, x):
        return self.view(x).copy()

    def buf(self, arr) -> Buffer:
        """The core's Buffer over a CuPy array, with the real dtype."""
        return Buffer(arr.data.ptr, arr.shape, self.real, Device("cuda", self.index),
                      owner=arr)

    def to_jax(self, arr):
        if arr.size == 0:  # DLPack of zero bytes: make the empty result directly
            return jax.device_put(np.zeros(arr.shape, self.dtype), _jax_device(self.index))
        y = jax.dlpack.from_dlpack(arr)
        return y if self.native else jax.lax.bitcast_convert_type(y, self.dtype)


def _jax_device(index: int):
    """The JAX device of CUDA ordinal ``index``."""
    for d in jax.local_devices():
        if d.platform == "gpu" and d.local_hardware_id == index:
            return d
    return jax.local_devices(backend="gpu")[0]


def _rank() -> int:
    return _core.get_rank()


def all_reduce(x, op, group, backend, compression=None):
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        out = c.copy_of(x)
        _core.all_reduce(c.buf(out), op, group, backend=backend, compression=compression)
        return c.to_jax(out)


def reduce(x, dst, op, group, backend):
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        out = c.copy_of(x)
        _core.reduce(c.buf(out), dst, op, group, backend=backend)
        return c.to_jax(out) if _rank() == dst else x


def broadcast(x, src, group, backend):
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        out = c.copy_of(x)
        _core.broadcast(c.buf(out), src, group, backend=backend)
        return c.to_jax(out)


def all_gather(x, group, backend, compression=None):
    """Stacked: shape (n, *x.shape)."""
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        out = c.empty((_size(group), *x.shape))
        _core.all_gather_into_tensor(c.buf(out), c.buf(c.view(x)), group, backend=backend,
                                     compression=compression)
        return c.to_jax(out)


def reduce_scatter(x, op, group, backend, compression=None):
    k = leading_blocks(x, _size(group), "reduce_scatter")
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        out = c.empty((k, *x.shape[1:]))
        _core.reduce_scatter_tensor(c.buf(out), c.buf(c.view(x)), op, group,
                                    backend=backend, compression=compression)
        return c.to_jax(out)


def all_to_all(x, group, backend, input_split_sizes=None, output_split_sizes=None,
               compression=None):
    if not (input_split_sizes or output_split_sizes):
        leading_blocks(x, _size(group), "all_to_all")
    rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        out = c.empty((rows, *x.shape[1:]))
        _core.all_to_all_single(c.buf(out), c.buf(c.view(x)),
                                output_split_sizes and list(output_split_sizes),
                                input_split_sizes and list(input_split_sizes), group,
                                backend=backend, compression=compression)
        return c.to_jax(out)


def gather(x, dst, group, backend):
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        mine = c.buf(c.view(x))
        if _rank() != dst:
            _core.gather(mine, None, dst, group, backend=backend)
            return x
        stacked = c.empty((_size(group), *x.shape))
        _core.gather(mine, [c.buf(row) for row in stacked], dst, group, backend=backend)
        return c.to_jax(stacked)


def scatter(x, src, group, backend):
    leading_blocks(x, _size(group), "scatter", exact=True)
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        out = c.empty(x.shape[1:])
        blocks = [c.buf(row) for row in c.view(x)] if _rank() == src else None
        _core.scatter(c.buf(out), blocks, src, group, backend=backend)
        return c.to_jax(out)


def send(x, dst, group, tag, backend):
    c = _Call(x)
    with c.cp.cuda.Device(c.index):
        _core.send(c.buf(c.view(x)), dst, group, tag, backend=backend)
    return token()


def recv(like, src, group, tag, backend):
    c = _Call(like)
    with c.cp.cuda.Device(c.index):
        out = c.empty(like.shape)
        _core.recv(c.buf(out), src, group, tag, backend=backend)
        return c.to_jax(out)


def sendrecv(sendbuf, like, source, dest, group, tag, backend):
    """Both posted before either is waited on, so a ring of them cannot deadlock."""
    cs, cr = _Call(sendbuf), _Call(like)
    with cr.cp.cuda.Device(cr.index):
        out = cr.empty(like.shape)
        ws = _core.send(cs.buf(cs.view(sendbuf)), dest, group, tag, async_op=True,
                        backend=backend)
        wr = _core.recv(cr.buf(out), source, group, tag, async_op=True, backend=backend)
        wr.wait()
        ws.wait()
        return cr.to_jax(out)
