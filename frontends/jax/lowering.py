"""The jit path of mcrdl_jax: what a call on traced values becomes inside the program.

The backend is chosen at trace time, from the static shape and dtype, through the same
selection as eager calls (explicit > group default > MCRDL_BACKEND > table > policy).
Then:

- ``mpi`` lowers to mpi4jax's primitives wherever mpi4jax has the op (every op but
  uneven all-to-all and recv from any source). mpi4jax refuses 16-bit floats: they
  travel as float32 (exact for data movement) and reductions run in float32, rounded
  once at the end, as on the eager MPI path.
- everything else (Gloo, the two MPI cases above, any other backend) becomes one host
  callback (``callback.py``) that runs the eager path of the core on that backend.

mpi4jax's primitives and the callbacks share one ordered effect, so the calls of one
jitted function run in program order on every rank. With ``MCRDL_DEBUG=1`` every
collective also compares its signature (op, backend, dtype, shape, root) across the
group when it is traced, so a shape that differs between ranks is an error at trace
time instead of a hang or garbage at run time.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mcrdl_core as _core
from mcrdl_core.base import config as _config
from mcrdl_core.observe import debug as _debug
from mcrdl_core.observe import recorder as _rec
from mcrdl_core import dtypes as _dt
from mcrdl_core.dispatch import fastpath as _fast
from mcrdl_core.dispatch import validate as _v
from mcrdl_core.dispatch.pipeline import prepare
from mcrdl_core.memory.buffer import CPU, Buffer
from mcrdl_core.base.ops import Op, ReduceOp

from . import host
from .callback import MPI4JAX as mpi4jax  # None: every call goes through the host callback
from .callback import host_call
from .shapes import leading_blocks

if mpi4jax is not None:
    from mpi4py import MPI

    _MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD,
                ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND,
                ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}


def _probe(x) -> Buffer:
    """A Buffer that is metadata only (shape and dtype of a traced value)."""
    buf = Buffer(0, tuple(x.shape), _dt.lookup(np.dtype(x.dtype)), CPU)
    _v.dtype(buf, "x")
    return buf


def lower(op: Op, x, group, backend, reduce_op=None, nbytes=-1, root=None, check=True,
           counts=None, host_side=False):
    """(group, backend name, reduce op) for a traced call: the same checks and selection
    as an eager call, and in debug mode the cross-rank signature check (collectives),
    once now, at trace time, and again each time the program runs, in program order
    just before the call (``_debug_at_run_time``). A call lowered to mpi4jax is
    recorded by the flight recorder now, once (``host_side``: it runs in the host
    callback instead, whose core call is recorded at each run). ``root``: (global rank, argument
    name) of a rooted op."""
    probe = _probe(x)
    rt, g, be, reduce_op = prepare(op, group, probe, backend, reduce_op, nbytes)
    if _rec.ON and _via_mpi4jax(be.name) and not (counts or host_side):
        _record_lowered(rt, op, g, probe, backend, reduce_op, nbytes, root)
    if rt.observed and check:
        sig = dict(reduce_op=reduce_op, root=None if root is None else g.group_rank(*root),
                   # an uneven all-to-all's ranks hold different element counts; its
                   # split counts are what must agree (as the eager call checks them)
                   count=None if counts else probe.numel, counts=counts,
                   shape=None if counts else probe.shape,
                   role_name=_debug.current_role())
        rt.before(g, op, be, probe, **sig)
        _debug_at_run_time(rt, g, op, be, probe, sig)
    return g, be.name, reduce_op


def _record_lowered(rt, op, g, probe, backend, reduce_op, nbytes, root) -> None:
    """The flight recorder's entry of a call lowered to mpi4jax's primitive (state
    "lowered", once per trace: its runs happen inside XLA, where MCR-DL sees none of
    them; calls through the host callback are recorded at each run by the core)."""
    rule = rt.select(op, g, probe, backend, reduce_op, nbytes, why=True)[1]
    _rec.lowered(_rec.describe(g, op, probe.dtype, "mpi", "mpi4jax", None, rule, False,
                               reduce_op, None if root is None else g.group_rank(*root)),
                 probe.numel)


def _debug_at_run_time(rt, g, op, be, probe, sig) -> None:
    """Debug mode under jit: the signature check as a host callback on the comm token.
    A jitted program is traced once and run many times, and which collectives a run
    issues can differ between ranks (under ``jax.grad``, a rank whose objective does not
    depend on a collective's output skips its backward call): checked at run time, the
    n-th call of one rank meets the n-th call of the others, and a different op, shape
    or role (forward call against "backward of ...") is a MismatchError on every rank."""
    def check():
        rt.before(g, op, be, probe, **sig)
        return ()

    host_call(check, [], what=f"debug check of {op.value}")


def _via_mpi4jax(be_name: str) -> bool:
    """Whether a traced MPI call lowers to mpi4jax's primitive. mpi4jax blocks inside
    MPI with no timeout, so a peer that never makes the call hangs the program there
    (and a signal cannot interrupt it); ``MCRDL_JAX_MPI4JAX=0`` trades its speed for
    the host callback, where every wait has ``MCRDL_TIMEOUT`` and its diagnostics."""
    return be_name == "mpi" and mpi4jax is not None and _config.get("MCRDL_JAX_MPI4JAX")


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _callback(fn, outs, *args, what):
    """One host callback; ``outs``: ShapeDtypeStructs of its results."""
    res = host_call(fn, outs, *args, what=what)
    return res[0] if len(outs) == 1 else res


def _wide(x):
    """For reductions: mpi4jax refuses 16-bit floats, so they are reduced in float32, as
    on the eager MPI path (the same bytes on the wire); returns (array, narrow-back)."""
    if x.dtype in (jnp.float16, jnp.bfloat16):
        return x.astype(jnp.float32), (lambda y, dt=x.dtype: y.astype(dt))
    return x, (lambda y: y)


def _bits(x):
    """For data movement: 16-bit floats travel as their uint16 bit patterns, exact and
    byte-for-byte what an eager peer sends or expects; returns (array, back)."""
    if x.dtype in (jnp.float16, jnp.bfloat16):
        return (jax.lax.bitcast_convert_type(x, jnp.uint16),
                lambda y, dt=x.dtype: jax.lax.bitcast_convert_type(y, dt))
    return x, (lambda y: y)


def _avg(y, op, n):
    return y / n if op is ReduceOp.AVG else y


def _comm(g):
    return _core.get_runtime().backend("mpi").comm(g)


def _compressed(op: Op, x, compression, reduce_op=None) -> bool:
    """Whether the call compresses (the keyword, else MCRDL_COMPRESSION), decided and
    checked at trace time: a compressed call runs the core's algorithm in the host
    callback, on any backend (mpi4jax has no compressed collectives)."""
    if compression is None and not _fast.compression_env():
        return False
    from mcrdl_core.compress import resolve

    return resolve(compression, op, _probe(x).dtype, reduce_op) is not None


def all_reduce(x, op, group, backend, compression=None):
    g, be, op = lower(Op.ALL_REDUCE, x, group, backend, op,
                       host_side=compression is not None or _fast.compression_env())
    if not _via_mpi4jax(be) or _compressed(Op.ALL_REDUCE, x, compression, op):
        return _callback(lambda a: (host.all_reduce(a, op, g, be, compression),),
                         [_spec(x.shape, x.dtype)], x, what="all_reduce")
    xw, back = _wide(x)
    return back(_avg(mpi4jax.allreduce(xw, op=_MPI_OPS[op], comm=_comm(g)), op, g.size))


def reduce(x, dst, op, group, backend):
    g, be, op = lower(Op.REDUCE, x, group, backend, op, root=(dst, "dst"))
    root = g.group_rank(dst, "dst")
    if not _via_mpi4jax(be):
        def run(a):
            y = host.reduce(a, dst, op, g, be)
            return (a if y is None else y,)
        return _callback(run, [_spec(x.shape, x.dtype)], x, what="reduce")
    xw, back = _wide(x)
    y = mpi4jax.reduce(xw, op=_MPI_OPS[op], root=root, comm=_comm(g))
    return back(_avg(y, op, g.size)) if g.rank == root else x


def broadcast(x, src, group, backend):
    g, be, _ = lower(Op.BROADCAST, x, group, backend, root=(src, "src"))
    if not _via_mpi4jax(be):
        return _callback(lambda a: (host.broadcast(a, src, g, be),), [_spec(x.shape, x.dtype)],
                         x, what="broadcast")
    xw, back = _bits(x)
    return back(mpi4jax.bcast(xw, root=g.group_rank(src, "src"), comm=_comm(g)))


def all_gather(x, group, backend, compression=None):
    """Stacked, shape (n, *x.shape); the public function tiles."""
    g, be, _ = lower(Op.ALL_GATHER, x, group, backend,
                      host_side=compression is not None or _fast.compression_env())
    if not _via_mpi4jax(be) or _compressed(Op.ALL_GATHER, x, compression):
        return _callback(lambda a: (host.all_gather(a, g, be, compression),),
                         [_spec((g.size, *x.shape), x.dtype)], x, what="all_gather")
    xw, back = _bits(x)
    return back(mpi4jax.allgather(xw, comm=_comm(g)))


def reduce_scatter(x, op, group, backend, compression=None):
    """On every backend, MPI included, a host callback running the core's reduce-scatter
    (MPI: ``Ireduce_scatter_block``), so that each rank receives only its 1/n block of
    the reduction. mpi4jax has no reduce-scatter; its all-reduce and a slice would
    deliver the whole reduction (n times the result) to every rank."""
    k = leading_blocks(x, _core.get_runtime().group(group).size, "reduce_scatter")
    block = k * int(np.prod(x.shape[1:], dtype=np.int64))
    g, be, op = lower(Op.REDUCE_SCATTER, x, group, backend, op,
                       nbytes=block * x.dtype.itemsize, host_side=True)
    if compression is not None or _fast.compression_env():
        _compressed(Op.REDUCE_SCATTER, x, compression, op)  # its refusals, at trace time
    return _callback(lambda a: (host.reduce_scatter(a, op, g, be, compression),),
                     [_spec((k, *x.shape[1:]), x.dtype)], x, what="reduce_scatter")


def all_to_all(x, group, backend, input_split_sizes=None, output_split_sizes=None,
               compression=None):
    n = _core.get_runtime().group(group).size
    uneven = bool(input_split_sizes or output_split_sizes)
    counts = None
    if uneven:
        # splits are static: check them at trace time, as the eager call would
        rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
        counts = (_v.splits(output_split_sizes, _probe(jax.ShapeDtypeStruct(
            (rows, *x.shape[1:]), x.dtype)), n, "output_split_sizes"),
            _v.splits(input_split_sizes, _probe(x), n, "input_split_sizes"))
    else:
        k = leading_blocks(x, n, "all_to_all")
        rows = x.shape[0]
    g, be, _ = lower(Op.ALL_TO_ALL, x, group, backend, nbytes=None if uneven else -1,
                      counts=counts, host_side=compression is not None or _fast.compression_env())
    if uneven or not _via_mpi4jax(be) or _compressed(Op.ALL_TO_ALL, x, compression):
        # uneven splits are host-side work on every backend (mpi4jax has no alltoallv),
        # and so are compressed ones (the core's codec in the callback)
        return _callback(lambda a: (host.all_to_all(a, g, be, input_split_sizes,
                                                    output_split_sizes, compression),),
                         [_spec((rows, *x.shape[1:]), x.dtype)], x, what="all_to_all")
    xw, back = _bits(x)
    blocks = xw.reshape((n, k, *x.shape[1:]))
    return back(mpi4jax.alltoall(blocks, comm=_comm(g)).reshape(x.shape))


def gather(x, dst, group, backend):
    g, be, _ = lower(Op.GATHER, x, group, backend, root=(dst, "dst"))
    root = g.group_rank(dst, "dst")
    out = (g.size, *x.shape) if g.rank == root else tuple(x.shape)
    if not _via_mpi4jax(be):
        def run(a):
            y = host.gather(a, dst, g, be)
            return (a if y is None else y,)
        return _callback(run, [_spec(out, x.dtype)], x, what="gather")
    xw, back = _bits(x)
    y = mpi4jax.gather(xw, root=root, comm=_comm(g))
    return back(y) if g.rank == root else x


def scatter(x, src, group, backend):
    leading_blocks(x, _core.get_runtime().group(group).size, "scatter", exact=True)
    g, be, _ = lower(Op.SCATTER, x[0], group, backend, root=(src, "src"))
    root = g.group_rank(src, "src")
    if not _via_mpi4jax(be):
        return _callback(lambda a: (host.scatter(a, src, g, be),),
                         [_spec(x.shape[1:], x.dtype)], x, what="scatter")
    xw, back = _bits(x)
    # mpi4jax takes the whole (n, ...) array on the root and a block-shaped one elsewhere
    return back(mpi4jax.scatter(xw if g.rank == root else xw[0], root=root, comm=_comm(g)))


def send(x, dst, group, tag, backend):
    g, be, _ = lower(Op.SEND, x, group, backend, check=False)
    if not _via_mpi4jax(be):
        _callback(lambda a: (host.send(a, dst, g, tag, be),)[:0], [], x, what="send")
    else:
        xw, _ = _bits(x)
        mpi4jax.send(xw, dest=g.group_rank(dst, "dst"), tag=tag, comm=_comm(g))
    return jnp.zeros((), jnp.float32)  # the token (see autodiff.py)


def recv(like, src, group, tag, backend):
    g, be, _ = lower(Op.RECV, like, group, backend, check=False, host_side=src is None)
    if src is None or not _via_mpi4jax(be):  # any-source: host side on every backend
        return _callback(lambda: (host.recv(like.shape, like.dtype, src, g, tag, be),),
                         [_spec(like.shape, like.dtype)], what="recv")
    lw, back = _bits(like)
    return back(mpi4jax.recv(lw, source=g.group_rank(src, "src"), tag=tag, comm=_comm(g)))


def sendrecv(sendbuf, like, source, dest, group, tag, backend):
    """Each direction selects its own backend from its own size, as the eager call does
    (the peer sees a send or a recv of that size and picks the same). Both on MPI:
    mpi4jax's sendrecv; otherwise one callback posting both before waiting on either."""
    g, be, _ = lower(Op.SEND, sendbuf, group, backend, check=False)
    _, be_recv, _ = lower(Op.RECV, like, group, backend, check=False)
    if not (_via_mpi4jax(be) and _via_mpi4jax(be_recv)):
        return _callback(lambda a: (host.sendrecv(a, like.shape, like.dtype, source, dest, g,
                                                  tag, be, be_recv),),
                         [_spec(like.shape, like.dtype)], sendbuf, what="sendrecv")
    sw, _ = _bits(sendbuf)
    lw, back = _bits(like)
    return back(mpi4jax.sendrecv(sw, lw, source=g.group_rank(source, "source"),
                                 dest=g.group_rank(dest, "dest"), sendtag=tag, recvtag=tag,
                                 comm=_comm(g)))
