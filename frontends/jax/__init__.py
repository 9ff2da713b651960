"""mcrdl_jax: functional collectives on JAX arrays, eager, under ``jax.jit``, ``jax.grad``
and ``jax.vmap``.

Every call returns new arrays and never changes its inputs. Names follow the torch
frontend; shapes follow JAX conventions (``jax.lax.all_gather`` stacks on a new
leading axis unless ``tiled=True``; ``reduce_scatter`` splits the leading axis).

- Calls outside any JAX transformation take the eager path (``eager.py``): DLPack
  into the core, no copy on the way in or out (bfloat16 results: one copy), any backend.
- Calls inside one (``jit``, ``grad``, ``vmap``, a loop body), whether their arrays
  are traced or concrete (closed over), go through ``autodiff.py``, which gives every
  op its derivative and batching rule (run eagerly where the values are concrete, as
  under an eager ``grad``), to ``lowering.py``: the backend is
  chosen at trace time by the same selection as eager calls; MPI lowers to mpi4jax's
  primitives, every other case to an XLA host callback running the core. All of them
  share one ordered effect, so the calls of a jitted function run in program order on
  every rank.

``send`` returns a token, a float32 zero: under ``jax.grad`` make it part of what you
differentiate so that the cotangent comes back (see ``autodiff.py`` for the rules).
Before an eager call, work that jitted programs with communication left in flight is
waited for (``jax.effects_barrier``), so that eager and jitted calls on one
communicator never overlap. Each process passes arrays on one device: a CPU, or a CUDA
GPU (eager calls on GPU arrays: ``gpu.py``, any backend, nccl included; under ``jit``
they take the same lowering as CPU arrays).
"""
from __future__ import annotations

import jax

import mcrdl_core as _core
from mcrdl_core import ReduceOp  # noqa: F401  (public name)
from mcrdl_core.base import tags as _tags
from mcrdl_core.base.errors import InvalidArgumentError

from . import eager as _eager
from . import gpu as _gpu
from . import nonblocking as _nb
from .nonblocking import Handle, in_flight, wait, wait_all  # noqa: F401  (public names)
from .compat import check_internals, trace_state_clean
from .shapes import check_array as _check, leading_blocks

check_internals()  # the JAX internals of the jit path: a clear error now, not mid-trace
_trace_state_clean = trace_state_clean()


def _diff():
    """The traced path, imported on first use."""
    from . import autodiff
    _eager.saw_traced_call()
    return autodiff


def traced(*xs) -> bool:
    """True for traced arguments, and for any argument while a JAX transformation (jit,
    grad, vmap, a loop body) is tracing: an array closed over by a jitted function, or
    made inside it with NumPy, is concrete, but its communication belongs in the
    program (run once per execution), not run once while tracing and baked in."""
    return not _trace_state_clean() or any(isinstance(x, jax.core.Tracer) for x in xs)


_ARRAY = type(jax.numpy.zeros(()))  # the concrete array class (jaxlib's ArrayImpl)


def _path(*xs):
    """autodiff (inside a transformation) or eager (after the placement check and after
    in-flight jitted communication has finished). One concrete JAX array, the usual
    eager call, is recognised first, in about 0.3 µs of the general case's 2."""
    if len(xs) == 1 and type(xs[0]) is _ARRAY:
        if not _trace_state_clean():
            return _diff()
        return _gpu if _eager.ready(xs[0]) else _eager
    for i, x in enumerate(xs):
        _check(x, "x" if i == 0 else "like")
    if traced(*xs):
        return _diff()
    return _gpu if _eager.ready(*xs) else _eager


def _splits(s):
    return None if s is None else tuple(int(v) for v in s)


# --- collectives --------------------------------------------------------------------------
def all_reduce(x, op=ReduceOp.SUM, group=None, backend=None, compression=None,
               async_op: bool = False):
    """``compression``: allow a lossy codec, as in mcrdl_torch (docs/compression.md).
    ``async_op=True`` (every call takes it): a :class:`Handle`; :func:`wait` returns the
    result (eager and under jit: ``nonblocking.py``, docs/jax.md)."""
    if async_op:
        return _nb.call("all_reduce", (x,), (op, group, backend, compression))
    return _path(x).all_reduce(x, op, group, backend, compression)


def reduce(x, dst: int = 0, op=ReduceOp.SUM, group=None, backend=None,
           async_op: bool = False):
    """The reduction on ``dst``; the input, unchanged, elsewhere."""
    if async_op:
        return _nb.call("reduce", (x,), (dst, op, group, backend))
    return _path(x).reduce(x, dst, op, group, backend)


def broadcast(x, src: int = 0, group=None, backend=None, async_op: bool = False):
    if async_op:
        return _nb.call("broadcast", (x,), (src, group, backend))
    return _path(x).broadcast(x, src, group, backend)


def all_gather(x, group=None, backend=None, tiled: bool = False, compression=None,
               async_op: bool = False):
    """Shape (n, *x.shape), or (n * x.shape[0], ...) with ``tiled=True`` (not with
    ``async_op=True``: the handle's result is stacked; reshape it)."""
    if async_op:
        if tiled:
            raise InvalidArgumentError("mcrdl_jax.all_gather: tiled=True with async_op=True "
                                       "is not supported; reshape the waited result")
        return _nb.call("all_gather", (x,), (group, backend, compression))
    y = _path(x).all_gather(x, group, backend, compression)
    if tiled:
        y = y.reshape((y.shape[0] * x.shape[0], *x.shape[1:]) if x.ndim else (y.shape[0],))
    return y


def reduce_scatter(x, op=ReduceOp.SUM, group=None, backend=None, compression=None,
                   async_op: bool = False):
    """``x.shape[0]`` must be a multiple of the group size n; returns block i of the
    reduction, shape (x.shape[0] // n, ...), on group rank i."""
    if async_op:
        return _nb.call("reduce_scatter", (x,), (op, group, backend, compression))
    return _path(x).reduce_scatter(x, op, group, backend, compression)


def all_to_all(x, group=None, backend=None, input_split_sizes=None, output_split_sizes=None,
               compression=None, async_op: bool = False):
    """Split the leading axis into n blocks (or the given sizes) and exchange them.
    With uneven splits, ``output_split_sizes`` gives the rows this rank receives.
    ``compression``: allow a lossy codec for the blocks ("fp16", "bf16", "int8", "fp8";
    docs/compression.md); the backward pass uses the same codec."""
    if async_op:
        return _nb.call("all_to_all", (x,), (group, backend, _splits(input_split_sizes),
                                             _splits(output_split_sizes), compression))
    return _path(x).all_to_all(x, group, backend, _splits(input_split_sizes),
                               _splits(output_split_sizes), compression)


def gather(x, dst: int = 0, group=None, backend=None, async_op: bool = False):
    """Shape (n, *x.shape) on ``dst``; the input, unchanged, elsewhere."""
    if async_op:
        return _nb.call("gather", (x,), (dst, group, backend))
    return _path(x).gather(x, dst, group, backend)


def scatter(x, src: int = 0, group=None, backend=None, async_op: bool = False):
    """``x`` of shape (n, *s) on ``src`` (any array of that shape elsewhere): block i to
    group rank i, shape s."""
    _check(x)
    leading_blocks(x, _core.get_world_size(group), "scatter", exact=True)
    if async_op:
        return _nb.call("scatter", (x,), (src, group, backend))
    return _path(x).scatter(x, src, group, backend)


# --- point to point -----------------------------------------------------------------------
def send(x, dst: int, group=None, tag: int = 0, backend=None, async_op: bool = False):
    """Send ``x`` to ``dst``. Returns a token (float32 zero); under ``jax.grad`` include it
    in what you differentiate so that the cotangent is received back."""
    if async_op:
        return _nb.call("send", (x,), (dst, group, _tags.user_tag(tag, "send"), backend))
    return _path(x).send(x, dst, group, _tags.user_tag(tag, "send"), backend)


def recv(like, src: int | None = None, group=None, tag: int = 0, backend=None,
         async_op: bool = False):
    """A new array shaped and typed like ``like``, filled from ``src`` (any if None)."""
    if async_op:
        return _nb.call("recv", (like,), (src, group, _tags.user_tag(tag, "recv"), backend))
    return _path(like).recv(like, src, group, _tags.user_tag(tag, "recv"), backend)


def sendrecv(sendbuf, recvbuf_like, source: int, dest: int, group=None, tag: int = 0,
             backend=None, async_op: bool = False):
    """Send ``sendbuf`` to ``dest`` and receive an array like ``recvbuf_like`` from
    ``source``, both posted before either is waited on (no ordering deadlock)."""
    if async_op:
        return _nb.call("sendrecv", (sendbuf, recvbuf_like),
                        (source, dest, group, _tags.user_tag(tag, "sendrecv"), backend))
    return _path(sendbuf, recvbuf_like).sendrecv(sendbuf, recvbuf_like, source, dest, group,
                                                 _tags.user_tag(tag, "sendrecv"), backend)


def barrier(group=None, backend=None) -> None:
    """Always eager (it takes no array); waits for in-flight jitted communication first."""
    _eager.ready()
    _core.barrier(group, backend=backend)


def get_rank(group=None) -> int:
    return _core.get_rank(group)


def get_world_size(group=None) -> int:
    return _core.get_world_size(group)


def new_group(ranks=None, backend=None):
    return _core.new_group(ranks, backend=backend)


from .resharding import layout as reshard_layout, reshard  # noqa: E402  (docs/resharding.md)
