"""Non-blocking calls of mcrdl_jax: ``async_op=True``, eager and under ``jax.jit``.

Every communicating call of mcrdl_jax (the collectives, ``send``/``recv``/``sendrecv``
and ``reshard``) takes ``async_op=True`` and returns a :class:`Handle` instead of its
result; ``mcrdl_jax.wait(handle)`` (or ``handle.wait()``) returns the result.

Eager (concrete arrays): the call is issued at once through the core's asynchronous
calls, as ``mcrdl_torch``'s ``async_op=True`` is, so the same ordering, mixing and
deadlock rules hold (several handles in flight, on different backends and groups);
``handle.is_completed()`` polls. The input's memory is held by the handle (a NumPy view
of the JAX buffer, which keeps the buffer alive: an input deleted while in flight is
kept until the call completes).

Under ``jax.jit`` (and in ``lax.scan``/``fori_loop`` bodies) a call is split in two
effectful host callbacks: the *start*, which issues the core's asynchronous call and
returns the handle's id (an int32 scalar, a traced value), and the *wait*, where the
result enters the program. Both carry mcrdl_jax's one ordered effect, so starts and
waits keep program order on every rank relative to every other communication call,
while XLA is free to run compute that depends on neither between them. The start
copies its operands (XLA owns their memory only for the callback's length).

Progress between start and wait is the libraries' own, never a Python thread polling:
Gloo's work runs on Gloo's threads, which sleep on their sockets; MPI moves a large
message between the two calls only with the library's asynchronous progress thread
(MPICH: ``MPICH_ASYNC_PROGRESS=1`` at launch; it occupies a core while work is in
flight), otherwise at the wait and at any other call's poll (docs/jax.md).

Gradients. The wait under a trace returns its result through a ``custom_vjp`` whose
backward rule is the blocking call's (``autodiff.py``), so ``jax.grad``/``vjp`` of a
split-phase call equal those of the blocking one (the backward communication is a
blocking call). The handle carries the call's inputs for that rule.

Rules (docs/jax.md, "Non-blocking calls"): a handle is waited once (twice: an
InvalidArgumentError, at trace time where one trace sees both waits, else when the
second wait runs); a handle never waited still completes (its call was issued on every
rank) and its result is dropped by :func:`wait_all`; handles may be waited in any order
(only the starts' order must agree across ranks, as for every call); a handle may leave
the jitted function that made it (it is a pytree of its id and inputs) and be waited
eagerly or in another jitted function of the same process.
"""
from __future__ import annotations

import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np

import mcrdl_core as _core
from mcrdl_core.base.errors import InvalidArgumentError, UnsupportedError
from mcrdl_core.base.ops import Op
from mcrdl_core.engine.progress import engine as _engine
from mcrdl_core.observe import debug as _debug

from . import eager, host

log = logging.getLogger("mcrdl.jax")

_TABLE: dict = {}  # handle id -> _Entry, from its start until its wait
_DONE: dict = {}  # recently waited ids -> what they were (for the double-wait message)
_IDS = itertools.count(1)
_WARN_AT = 1024  # handles outstanding before a warning that some are never waited


class _Entry:
    """One started call: its works, the arrays that hold its results (``outs``: a
    function returning them once the works are done) and what it is."""

    __slots__ = ("works", "outs", "keep", "what")

    def __init__(self, works, outs, keep, what):
        self.works = [w for w in works if w is not None]
        self.outs = outs
        self.keep = keep
        self.what = what


def _register(entry: _Entry) -> int:
    hid = next(_IDS) & 0x7FFFFFFF
    _TABLE[hid] = entry
    if len(_TABLE) == _WARN_AT:
        log.warning("mcrdl_jax: %d non-blocking calls started and not waited (the oldest: "
                    "%s); call mcrdl_jax.wait on each handle, or mcrdl_jax.wait_all()",
                    _WARN_AT, next(iter(_TABLE.values())).what)
    return hid


def _take(hid: int) -> _Entry:
    entry = _TABLE.pop(hid, None)
    if entry is None:
        what = _DONE.get(hid)
        if what is not None:
            raise InvalidArgumentError(
                f"mcrdl_jax.wait: the handle of {what} (id {hid}) was already waited; wait "
                "each handle once (its result is what the first wait returned)")
        raise InvalidArgumentError(
            f"mcrdl_jax.wait: no call of this process is in flight with handle id {hid}; a "
            "handle is waited once, in the process that started it")
    _DONE[hid] = entry.what
    if len(_DONE) > 4096:
        del _DONE[next(iter(_DONE))]
    return entry


def _finish(entry: _Entry, timeout=None) -> list:
    """Wait for ``entry``'s works (through the progress loop: every backend's work in
    flight is driven meanwhile) and return its results; a failed work raises."""
    if entry.works:
        _engine().wait(entry.works, timeout)
        for w in entry.works:  # done: re-raises a failed work's error
            w.wait(timeout)
    return entry.outs()


# --- the start of each op, on host arrays ------------------------------------------------
def _input(x, owned: bool):
    """What the core reads while the call is in flight: the array's own memory (eager:
    the view keeps JAX's buffer alive), or a copy (under jit XLA owns the operand only
    while the callback runs)."""
    return host.copy_of(x) if owned else host.view(x)


def _start(name: str, arrays, statics, owned: bool) -> _Entry:
    """Issue ``name`` asynchronously on host arrays; ``owned``: copy the inputs first."""
    c = _core
    if name in ("all_reduce", "reduce", "broadcast"):
        x = arrays[0]
        out = host.copy_of(x)  # these work in place, and JAX arrays are immutable
        if name == "all_reduce":
            op, group, backend, comp = statics
            w = c.all_reduce(out, op, group, async_op=True, backend=backend, compression=comp)
            return _Entry([w], lambda: [out], (out,), "all_reduce")
        if name == "reduce":
            dst, op, group, backend = statics
            src = host.copy_of(x) if owned else x  # off the root the result is the input
            w = c.reduce(out, dst, op, group, async_op=True, backend=backend)
            root = c.get_rank() == dst
            return _Entry([w], lambda: [out if root else src], (out, src), "reduce")
        src, group, backend = statics
        w = c.broadcast(out, src, group, async_op=True, backend=backend)
        return _Entry([w], lambda: [out], (out,), "broadcast")
    if name == "recv":
        like = arrays[0]
        src, group, tag, backend = statics
        out = host.empty(tuple(like.shape), host.np_dtype(like))
        w = c.recv(out, src, group, tag, async_op=True, backend=backend)
        return _Entry([w], lambda: [out], (out,), "recv")
    x = _input(arrays[0], owned)
    dt = host.np_dtype(arrays[0])
    if name == "all_gather":
        group, backend, comp = statics
        out = host.empty((host.size(group), *x.shape), dt)
        w = c.all_gather_into_tensor(out, x, group, async_op=True, backend=backend,
                                     compression=comp)
    elif name == "reduce_scatter":
        op, group, backend, comp = statics
        from .shapes import leading_blocks
        k = leading_blocks(x, host.size(group), "reduce_scatter")
        out = host.empty((k, *x.shape[1:]), dt)
        w = c.reduce_scatter_tensor(out, x, op, group, async_op=True, backend=backend,
                                    compression=comp)
    elif name == "all_to_all":
        group, backend, ins, outs_, comp = statics
        rows = sum(outs_) if outs_ else x.shape[0]
        out = host.empty((rows, *x.shape[1:]), dt)
        w = c.all_to_all_single(out, x, outs_ and list(outs_), ins and list(ins), group,
                                async_op=True, backend=backend, compression=comp)
    elif name == "gather":
        dst, group, backend = statics
        if c.get_rank() == dst:
            out = host.empty((host.size(group), *x.shape), dt)
            w = c.gather(x, list(out), dst, group, async_op=True, backend=backend)
        else:
            out = x if owned else arrays[0]  # off the root the result is the input
            w = c.gather(x, None, dst, group, async_op=True, backend=backend)
    elif name == "scatter":
        src, group, backend = statics
        out = host.empty(x.shape[1:], dt)
        blocks = list(x) if c.get_rank() == src else None
        w = c.scatter(out, blocks, src, group, async_op=True, backend=backend)
    elif name == "send":
        dst, group, tag, backend = statics
        w = c.send(x, dst, group, tag, async_op=True, backend=backend)
        out = np.zeros((), np.float32)  # the token
    elif name == "sendrecv":
        like = arrays[1]
        source, dest, group, tag, backend, recv_backend = statics
        out = host.empty(tuple(like.shape), host.np_dtype(like))
        ws = c.send(x, dest, group, tag, async_op=True, backend=backend)
        wr = c.recv(out, source, group, tag, async_op=True,
                    backend=backend if recv_backend is None else recv_backend)
        return _Entry([wr, ws], lambda: [out], (x, out), "sendrecv")
    else:  # pragma: no cover  (every public op is listed above)
        raise UnsupportedError(f"mcrdl_jax: no non-blocking {name}")
    return _Entry([w], lambda: [out], (x, out), name)


# --- the handle ---------------------------------------------------------------------------
class _Site:
    """The static part of a handle: the op, the results' shapes and dtypes, and what its
    derivative needs (``statics`` of the blocking call). Equal for equal calls, so that a
    handle can be a loop's carry (started before the loop and again in its body)."""

    __slots__ = ("name", "outs", "grad")

    def __init__(self, name, outs, grad):
        self.name, self.outs, self.grad = name, outs, grad

    def _key(self):
        outs = None if self.outs is None else tuple((tuple(o.shape), np.dtype(o.dtype))
                                                    for o in self.outs)
        return self.name, outs, self.grad

    def __eq__(self, other):
        return isinstance(other, _Site) and self._key() == other._key()

    def __hash__(self):
        try:
            return hash(self._key())
        except TypeError:  # an unhashable static: fall back to the name and shapes
            return hash(self._key()[:2])


@jax.tree_util.register_pytree_node_class
class Handle:
    """A non-blocking call in flight. ``wait()`` returns its result (once);
    ``is_completed()`` polls (eager handles only). A pytree of (id, inputs): it can be
    returned from a jitted function, carried through a loop, and waited later."""

    __slots__ = ("ident", "inputs", "site", "_waited")

    def __init__(self, ident, inputs, site):
        self.ident, self.inputs, self.site = ident, inputs, site
        self._waited = False

    def tree_flatten(self):
        return (self.ident, self.inputs), self.site

    @classmethod
    def tree_unflatten(cls, site, children):
        return cls(children[0], children[1], site)

    def wait(self):
        return wait(self)

    def is_completed(self) -> bool:
        if _traced(self.ident):
            raise InvalidArgumentError(
                "mcrdl_jax: Handle.is_completed() is for eager handles; under jit the result "
                "is available at mcrdl_jax.wait(handle)")
        entry = _TABLE.get(int(self.ident))
        if entry is None:
            return int(self.ident) in _DONE
        return all(w.test() for w in entry.works)

    def __repr__(self):
        return f"<mcrdl_jax.Handle of {self.site.name}>"


def _traced(v) -> bool:
    return isinstance(v, jax.core.Tracer)


def start_eager(name: str, arrays, statics) -> Handle:
    """An eager non-blocking call on concrete CPU arrays (after ``eager.ready``)."""
    entry = _start(name, arrays, statics, owned=False)
    return Handle(_register(entry), (), _Site(name, None, None))


def register(works, outs, keep, what: str) -> int:
    """The handle id of a call that another part of mcrdl_jax started itself (``reshard``):
    ``works`` in flight, ``outs`` a function returning its result arrays once they are done,
    ``keep`` what must stay alive until then, ``what`` its name in messages. ``wait``
    takes it back like the id of any other call."""
    return _register(_Entry(works, outs, keep, what))


def handle(ident, what: str, outs=None) -> Handle:
    """The Handle of a call registered by :func:`register`: ``ident`` its id (under jit,
    the int32 that the start callback returned), ``outs`` ShapeDtypeStructs of its results
    under a trace (None eager). Such a handle has no derivative rule."""
    return Handle(ident, (), _Site(what, outs, None))


def start_traced(name: str, arrays, statics, outs, grad=None) -> Handle:
    """A split-phase call under a trace: the start callback now, the wait later.
    ``outs``: ShapeDtypeStructs of the result; ``grad``: the blocking call's statics for
    its derivative (None: not differentiable)."""
    from .callback import host_call

    def start(*host_arrays):
        return (np.int32(_register(_start(name, host_arrays, statics, owned=True))),)

    ops = [jax.lax.stop_gradient(a) for a in arrays]
    (hid,) = host_call(start, [jax.ShapeDtypeStruct((), np.int32)], *ops,
                       what=f"start of {name}")
    return Handle(hid, tuple(arrays) if grad is not None else (), _Site(name, [outs], grad))


def wait(handle, timeout: float | None = None, after=None):
    """The result of a non-blocking call (a list or tuple of handles: a list of results).
    Eager: blocks until done (``timeout`` seconds, None: the runtime's own); under jit:
    where the result enters the program. A handle is waited once.

    ``after`` (under jit): arrays (a pytree) that XLA must compute before the wait runs:
    the compute to overlap with the call. XLA's scheduler is free to place independent
    compute after the wait (it does: docs/jax.md); ``after`` pins it in between (one
    element of each array becomes an operand of the wait). Ignored eagerly."""
    if isinstance(handle, (list, tuple)):
        return [wait(h, timeout, after) for h in handle]
    if not isinstance(handle, Handle):
        raise InvalidArgumentError(f"mcrdl_jax.wait: expected a Handle (from a call with "
                                   f"async_op=True), got {type(handle).__name__}")
    if handle._waited:
        raise InvalidArgumentError(f"mcrdl_jax.wait: this handle of {handle.site.name} was "
                                   "already waited; wait each handle once")
    handle._waited = True
    from . import traced

    if traced(handle.ident, *handle.inputs):
        return _wait_traced(handle, after)
    eager.ready()  # in-flight jitted work first (a handle that left its jit: its start)
    entry = _take(int(handle.ident))
    outs = _finish(entry, timeout)
    y = outs[0]
    if y is None or isinstance(y, jax.Array):  # (None: a reshard outside the destination)
        return y
    return eager.to_jax(y)


def _wait_traced(handle: Handle, after=None):
    from .callback import host_call

    site = handle.site
    if site.outs is None:
        raise InvalidArgumentError(
            "mcrdl_jax.wait: an eager handle waited inside a jitted function; wait it "
            "eagerly, or start the call inside the function")

    def fetch(hid, *_after):
        return tuple(np.asarray(o) for o in _finish(_take(int(hid))))

    ident = jnp.asarray(handle.ident, jnp.int32)
    # ``after``: one element of each array becomes an operand of the wait, a data
    # dependency XLA keeps (it drops optimization barriers before scheduling on CPU)
    pins = [jnp.ravel(a)[:1] for a in jax.tree_util.tree_leaves(after) if jnp.size(a)]
    (raw,) = host_call(fetch, site.outs, ident, *pins, what=f"wait of {site.name}")
    if site.grad is None or not handle.inputs:
        return raw
    return _attach(site.name, site.grad)(handle.inputs, raw)


def wait_all(timeout: float | None = None) -> int:
    """Wait for every non-blocking call of this process not yet waited and drop their
    results (handles never waited); returns how many there were. Their handles can no
    longer be waited."""
    eager.ready()
    n = 0
    while _TABLE:
        hid = next(iter(_TABLE))
        _finish(_take(hid), timeout)
        n += 1
    return n


def in_flight() -> int:
    """How many non-blocking calls of this process are started and not waited."""
    return len(_TABLE)


# --- derivatives: the blocking call's rule -----------------------------------------------
def _attach(name: str, statics):
    """``raw`` (the wait's result) as a function of the call's inputs whose derivative is
    the blocking call's: forward returns ``raw``; backward runs ``autodiff``'s rule."""
    from . import autodiff as ad

    bwd_rule, check = ad.RULES[name]
    role = f"backward of {name}"

    @jax.custom_vjp
    def attach(inputs, raw):
        return raw

    def fwd(inputs, raw):
        check(*statics)
        return raw, inputs

    def bwd(inputs, ct):
        with _debug.role(role):
            cts = tuple(bwd_rule(statics, inputs, ct))
        return cts, jnp.zeros_like(ct)

    attach.defvjp(fwd, bwd)
    return attach


# --- the public entry ---------------------------------------------------------------------
def call(name: str, arrays, statics) -> Handle:
    """``mcrdl_jax.<name>(..., async_op=True)``: the blocking call's ``statics`` (the
    order ``autodiff.py`` uses). Eager on concrete arrays, split-phase under a trace."""
    from . import traced
    from .shapes import check_array

    for i, a in enumerate(arrays):
        check_array(a, "x" if i == 0 else "like")
    if traced(*arrays):
        return _traced_call(name, tuple(arrays), tuple(statics))
    if eager.ready(*arrays):
        raise UnsupportedError(
            f"mcrdl_jax.{name}(async_op=True) on GPU arrays is not built yet; use the "
            "blocking call, or mcrdl_core's async calls on CuPy views (docs/jax.md)")
    if name == "sendrecv":
        statics = (*statics, None)
    return start_eager(name, arrays, statics)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _traced_call(name, arrays, st) -> Handle:
    """The trace-time part of a split-phase call: the blocking call's checks and backend
    selection (``lowering.lower``, debug signature included), then the start."""
    from . import lowering as L
    from .shapes import leading_blocks

    x = arrays[0]
    spec = _spec(x.shape, x.dtype)
    if name == "all_reduce":
        op, group, backend, comp = st
        g, be, op = L.lower(Op.ALL_REDUCE, x, group, backend, op)
        run = (op, g, be, comp)
    elif name == "reduce":
        dst, op, group, backend = st
        g, be, op = L.lower(Op.REDUCE, x, group, backend, op, root=(dst, "dst"))
        run = (dst, op, g, be)
    elif name == "broadcast":
        src, group, backend = st
        g, be, _ = L.lower(Op.BROADCAST, x, group, backend, root=(src, "src"))
        run = (src, g, be)
    elif name == "all_gather":
        group, backend, comp = st
        g, be, _ = L.lower(Op.ALL_GATHER, x, group, backend)
        spec, run = _spec((g.size, *x.shape), x.dtype), (g, be, comp)
    elif name == "reduce_scatter":
        op, group, backend, comp = st
        k = leading_blocks(x, _core.get_runtime().group(group).size, "reduce_scatter")
        block = k * int(np.prod(x.shape[1:], dtype=np.int64))
        g, be, op = L.lower(Op.REDUCE_SCATTER, x, group, backend, op,
                             nbytes=block * x.dtype.itemsize)
        spec, run = _spec((k, *x.shape[1:]), x.dtype), (op, g, be, comp)
    elif name == "all_to_all":
        group, backend, ins, outs, comp = st
        n = _core.get_runtime().group(group).size
        uneven = bool(ins or outs)
        if not uneven:
            leading_blocks(x, n, "all_to_all")
        rows = sum(outs) if outs else x.shape[0]
        g, be, _ = L.lower(Op.ALL_TO_ALL, x, group, backend, nbytes=None if uneven else -1,
                            counts=(tuple(outs or ()), tuple(ins or ())) if uneven else None)
        spec, run = _spec((rows, *x.shape[1:]), x.dtype), (g, be, ins, outs, comp)
    elif name == "gather":
        dst, group, backend = st
        g, be, _ = L.lower(Op.GATHER, x, group, backend, root=(dst, "dst"))
        if g.rank == g.group_rank(dst, "dst"):
            spec = _spec((g.size, *x.shape), x.dtype)
        run = (dst, g, be)
    elif name == "scatter":
        src, group, backend = st
        leading_blocks(x, _core.get_runtime().group(group).size, "scatter", exact=True)
        g, be, _ = L.lower(Op.SCATTER, x[0], group, backend, root=(src, "src"))
        spec, run = _spec(x.shape[1:], x.dtype), (src, g, be)
    elif name == "send":
        dst, group, tag, backend = st
        g, be, _ = L.lower(Op.SEND, x, group, backend, check=False)
        spec, run = _spec((), np.float32), (dst, g, tag, be)
    elif name == "recv":
        src, group, tag, backend = st
        g, be, _ = L.lower(Op.RECV, x, group, backend, check=False)
        run = (src, g, tag, be)
    elif name == "sendrecv":
        source, dest, group, tag, backend = st
        g, be, _ = L.lower(Op.SEND, x, group, backend, check=False)
        _, be_recv, _ = L.lower(Op.RECV, arrays[1], group, backend, check=False)
        spec, run = _spec(arrays[1].shape, arrays[1].dtype), (source, dest, g, tag, be, be_recv)
    else:  # pragma: no cover
        raise UnsupportedError(f"mcrdl_jax: no non-blocking {name}")
    return start_traced(name, arrays, run, spec, grad=st)
