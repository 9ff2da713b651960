"""The jit path of mcrdl_jax: calls on traced values lower to mpi4jax primitives.

The backend is chosen at trace time, from the static shape and dtype, through the same
selection as eager calls (explicit > group default > MCRDL_BACKEND > table > policy).
Only MPI lowers so far: a call whose choice is another backend raises a clear error
(the XLA-callback path for Gloo/NCCL is the open part of the JAX issue). mpi4jax orders
its calls with JAX's ordered effects, so collectives in one jitted function run in
program order on every rank. mpi4jax refuses 16-bit floats: they travel as float32
(exact for data movement) and reductions run in float32, rounded once at the end,
as on the eager MPI path.
"""
from __future__ import annotations

import jax.numpy as jnp
import mpi4jax
import numpy as np
from mpi4py import MPI

import mcrdl_core as _core
from mcrdl_core import dtypes as _dt
from mcrdl_core import validate as _v
from mcrdl_core.api import _prepare
from mcrdl_core.buffer import CPU, Buffer
from mcrdl_core.errors import UnsupportedError
from mcrdl_core.ops import Op, ReduceOp

from .shapes import leading_blocks

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}


def _lower(op: Op, x, group, backend, reduce_op=None, nbytes=-1):
    """(group, mpi communicator, reduce op) for a traced call, or a clear error. The
    same checks and selection as an eager call, on a Buffer that is metadata only."""
    probe = Buffer(0, tuple(x.shape), _dt.lookup(np.dtype(x.dtype)), CPU)
    _v.dtype(probe, "x")
    _, g, be, reduce_op = _prepare(op, group, probe, backend, reduce_op, nbytes)
    if be.name != "mpi":
        raise UnsupportedError(
            f"mcrdl_jax: under jax.jit only the mpi backend lowers so far (through mpi4jax); "
            f"{op} on {probe.dtype.name}{list(x.shape)} chose '{be.name}'. Pass backend='mpi', "
            "or call outside jit")
    return g, be.comm(g), reduce_op


def _wide(x):
    """mpi4jax refuses 16-bit floats: widen to float32; returns (array, narrow-back)."""
    if x.dtype in (jnp.float16, jnp.bfloat16):
        return x.astype(jnp.float32), (lambda y, dt=x.dtype: y.astype(dt))
    return x, (lambda y: y)


def all_reduce(x, op, group, backend):
    g, comm, op = _lower(Op.ALL_REDUCE, x, group, backend, op)
    xw, back = _wide(x)
    y = mpi4jax.allreduce(xw, op=_MPI_OPS[op], comm=comm)
    return back(y / g.size if op is ReduceOp.AVG else y)


def reduce(x, dst, op, group, backend):
    g, comm, op = _lower(Op.REDUCE, x, group, backend, op)
    root = g.group_rank(dst, "dst")
    xw, back = _wide(x)
    y = mpi4jax.reduce(xw, op=_MPI_OPS[op], root=root, comm=comm)
    if g.rank != root:
        return x
    return back(y / g.size if op is ReduceOp.AVG else y)


def broadcast(x, src, group, backend):
    g, comm, _ = _lower(Op.BROADCAST, x, group, backend)
    xw, back = _wide(x)
    return back(mpi4jax.bcast(xw, root=g.group_rank(src, "src"), comm=comm))


def all_gather(x, group, backend, tiled):
    g, comm, _ = _lower(Op.ALL_GATHER, x, group, backend)
    xw, back = _wide(x)
    y = back(mpi4jax.allgather(xw, comm=comm))
    return y.reshape((g.size * x.shape[0], *x.shape[1:]) if x.ndim else (g.size,)) if tiled else y


def reduce_scatter(x, op, group, backend):
    """MPI's reduce-scatter built from mpi4jax's all-reduce and a static slice."""
    k = leading_blocks(x, _core.get_runtime().group(group).size, "reduce_scatter")
    g, comm, op = _lower(Op.REDUCE_SCATTER, x, group, backend, op, nbytes=k * x.dtype.itemsize
                         * int(np.prod(x.shape[1:], dtype=np.int64)))
    xw, back = _wide(x)
    y = mpi4jax.allreduce(xw, op=_MPI_OPS[op], comm=comm)[g.rank * k:(g.rank + 1) * k]
    return back(y / g.size if op is ReduceOp.AVG else y)


def all_to_all(x, group, backend, input_split_sizes, output_split_sizes):
    if input_split_sizes or output_split_sizes:
        raise UnsupportedError("mcrdl_jax: uneven all_to_all under jax.jit is not supported "
                               "(shapes must be static); call it outside jit")
    n = _core.get_runtime().group(group).size
    k = leading_blocks(x, n, "all_to_all")
    g, comm, _ = _lower(Op.ALL_TO_ALL, x, group, backend)
    xw, back = _wide(x)
    blocks = xw.reshape((n, k, *x.shape[1:]))
    return back(mpi4jax.alltoall(blocks, comm=comm).reshape(x.shape))


def gather(x, dst, group, backend):
    g, comm, _ = _lower(Op.GATHER, x, group, backend)
    root = g.group_rank(dst, "dst")
    xw, back = _wide(x)
    y = mpi4jax.gather(xw, root=root, comm=comm)
    return back(y) if g.rank == root else x


def scatter(x, src, group, backend):
    leading_blocks(x, _core.get_runtime().group(group).size, "scatter", exact=True)
    g, comm, _ = _lower(Op.SCATTER, x[0], group, backend)
    root = g.group_rank(src, "src")
    xw, back = _wide(x)
    # mpi4jax takes the whole (n, ...) array on the root and a block-shaped one elsewhere
    return back(mpi4jax.scatter(xw if g.rank == root else xw[0], root=root, comm=comm))


def send(x, dst, group, tag, backend):
    g, comm, _ = _lower(Op.SEND, x, group, backend)
    xw, _ = _wide(x)
    mpi4jax.send(xw, dest=g.group_rank(dst, "dst"), tag=tag, comm=comm)


def recv(like, src, group, tag, backend):
    g, comm, _ = _lower(Op.RECV, like, group, backend)
    if src is None:
        raise UnsupportedError("mcrdl_jax: recv from any source under jax.jit is not "
                               "supported; name the source rank")
    lw, back = _wide(like)
    return back(mpi4jax.recv(lw, source=g.group_rank(src, "src"), tag=tag, comm=comm))


def sendrecv(sendbuf, like, source, dest, group, tag, backend):
    g, comm, _ = _lower(Op.SEND, sendbuf, group, backend)
    sw, _ = _wide(sendbuf)
    lw, back = _wide(like)
    return back(mpi4jax.sendrecv(sw, lw, source=g.group_rank(source, "source"),
                                 dest=g.group_rank(dest, "dest"), sendtag=tag, recvtag=tag,
                                 comm=comm))

