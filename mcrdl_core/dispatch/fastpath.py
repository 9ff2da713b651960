"""The fast path: what a small host call costs, and what it skips.

Every op a training step is made of (all_reduce, broadcast, reduce,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single even and by split
sizes, send/recv blocking and async in any mix, barrier; the list forms of all_gather,
reduce_scatter and all_to_all, gather, scatter and batch_isend_irecv: see "list forms"
below) has an entry here that takes the call's
*facts* (addresses, element counts, dtype: what mcrdl_torch reads off a plain contiguous
CPU tensor without making a Buffer) and runs the call from a memo: once per key (op,
group, dtype, backend request, reduce op, root, and the size where a tuning table
decides) the general path's checks and selection run and the chosen backend hands out an
*issuer* (``Backend.fast_issuer``; all_reduce's ``fast_all_reduce``: a closure over the
communicator, datatype, op and root). Later calls of the key pay a dict lookup, the
per-call checks (group alive and not broken, root or peer in the group, counts that fit
the group, input and output apart), the issuer (one nonblocking MPI call) and the wait.
Where the backend has a compiled issuer (``Backend.fast_blocking``: the MPI backend's
``mpi_fast.c``), a blocking call alone on its rank issues and polls in one C call, and
only a request still unfinished after the spin comes back to Python for the engine.
The general path (``api.py``) calls the Buffer entry of the same function with its
Buffer, which fills the memo; the facts entries miss until it has. Shorter still, a
frontend's call whose key has a compiled issuer runs *bound* (see "Bound
calls" at the end): one closure per key of the frontend's own arguments, which keeps
only the per-call checks.

A call takes the general path instead (MISS, before anything is sent) where the fast
path could not keep the general path's guarantees: ``MCRDL_DEBUG`` (the cross-rank
checks), compression (``compression=`` or ``MCRDL_COMPRESSION``), device memory, a
backend without an issuer (Gloo, NCCL) or an op it needs more than one library call for
(16-bit float and AVG reductions finish on the host), deferred work pending, memory that
conflicts with work in flight (the general path orders it), bad input of any kind (the
general path raises its error). The all-reduce alone also steps aside whenever
anything is in flight. A blocking point-to-point or list-form call with other work in
flight is issued and registered as an async one (its memory checked against what is in
flight) and then waited, which spins in the compiled module while every work in flight
is MPI's, else waits through the engine.

The wait. With nothing else in flight, polling this one request *is* the progress
loop: a blocking call spins on ``Request.Test`` for at most ``MCRDL_SPIN_US`` µs,
holding the engine's ``poll_lock`` if it is free; if it is not done by then, the request
is wrapped in a Work and handed to the engine's ordinary wait (timeout, diagnostics,
broken groups, dead peers). With other work in flight, a blocking call waits through the
engine at once, which drives everything in flight; an async call registers its Work
with the memory it reads and writes, for the ordering of later calls. No MPI call that
can block is ever made.

Threads. "Nothing in flight" is read without a lock: another thread may issue right
after. The request is this call's own, so nobody else polls it; at worst the other
thread's work is not driven by this call for the spin's length, after which the
engine's wait polls everything.

Environment variables read on every call go through ``env_value`` (a lookup in
``os.environ``'s own bytes-keyed dict: 0.03 µs, where ``os.environ.get`` encodes the
name every time, about 1 µs). Where the time of one call goes is in docs/benchmarks.md
("Per-call overhead").
"""
from __future__ import annotations

import os
import time
from bisect import bisect_left as _bisect
from time import perf_counter as _now

from ctypes import addressof as _addressof
from ctypes import c_char as _c_char

from ..base.dtypes import BY_NP
from ..base.dtypes import dtype_class as _dtype_class
from ..base.ops import Op, ReduceOp
# the tags the fast path sends: a user's (a plain int in [0, USER_TAG_LIMIT)); any other
# (negative, not an int, the core's own) is the general path's to judge (tags.user_tag)
from ..base.tags import is_user_tag as _user_tag
from ..engine.progress import spin as _spin
from ..engine.work import conflicts as _conflicts
from ..observe import recorder as _rec
from . import selection as _sel
from . import validate as _v

#: returned when the fast path does not apply: the caller takes the general path
MISS = object()

# The flight recorder (observe/recorder.py): each plan carries its calls' static part
# (``_Plan.desc``, made once per memo key with the rule that chose the backend), and
# each call issued here, bound or not, makes one entry (``_note``: its sequence number
# on the group, the time, the element count the general path records too) and sets its
# end when a blocking call returns (``_end``); an async one keeps its Work. A bound
# closure's blocking issuer is wrapped (``_recording``) so that the entry is made and
# ended in the issue's own C call; one not done within its spin is ended by
# ``_end_of(desc)`` once its wait returns.
_REC = _rec.ON
_note, _end, _outcome, _undo = _rec.call, _rec.end, _rec.outcome, _rec.undo
_end_of = _rec.end_of


def _recording(blocking, desc, count_at: int, mul: int = 1, extra_at: tuple = ()):
    """A bound closure's blocking issuer, its calls recorded in the issue's own C call
    (``recorder.recorded``: the count at argument ``count_at`` of ``spin, ...`` times
    ``mul``, the extra at ``extra_at``); the issuer itself where the recorder is off or
    there is no compiled issuer."""
    if desc is None or blocking is None:
        return blocking
    return _rec.recorded(blocking, desc, count_at, mul, extra_at)


class _Plan(tuple):
    """A memo plan: (backend instance, issuer or None, reduce op, compiled issuer or
    None), with ``desc``, the flight recorder's static part of its calls (None where
    the recorder is off)."""

    desc = None


def _planned(rt, op, g, buf, backend, red, root, nbytes, be, issue, blocking) -> _Plan:
    plan = _Plan((be, issue, red, blocking))
    if _REC:
        rule = rt.select(op, g, buf, backend, red, nbytes, why=True)[1]
        plan.desc = _rec.describe(g, op, buf.dtype, be.name, None, None, rule, False, red,
                                  root)
    return plan

# os.environ's own dict (another platform without it: os.environ itself)
_ENV = getattr(os.environ, "_data", os.environ)


def env_key(name: str):
    """``name`` as ``env_value`` looks it up (encoded once, here)."""
    return os.environ.encodekey(name) if _ENV is not os.environ else name


def env_value(key):
    """The raw value of the variable ``env_key`` made ``key`` for, or None if unset
    (bytes on POSIX: for comparing and memo keys, not for parsing)."""
    return _ENV.get(key)


_COMPRESSION = env_key("MCRDL_COMPRESSION")


def compression_env() -> bool:
    """True if MCRDL_COMPRESSION asks for compression (set and not empty): one dict
    lookup, shared by this module and the api's general path."""
    return bool(_ENV.get(_COMPRESSION))


_TAG = "fast:all_reduce"  # first part of this module's keys in ``Runtime.choices``


def _plan(rt, g, buf, backend, op):
    """(backend instance, issuer or None, reduce op, compiled issuer or None) for this
    key, running the general path's checks and selection (which raise its errors)."""
    red = ReduceOp.coerce(op)
    _v.reduce_op(red, buf.dtype)
    be = rt.select(Op.ALL_REDUCE, g, buf, backend, red)
    if _sel.algorithm(rt, Op.ALL_REDUCE, g, buf, backend, reduce_op=red):
        return be, None, red, None  # the table names an algorithm: the general path runs it
    issue = be.fast_all_reduce(g, buf.dtype, red)
    blocking = None if issue is None else be.fast_blocking(Op.ALL_REDUCE, g, buf.dtype, red)
    return _planned(rt, Op.ALL_REDUCE, g, buf, backend, red, None, -1, be, issue, blocking)


def all_reduce(rt, buf, op, group, async_op: bool, backend):
    """The Buffer entry (``mcrdl_core.all_reduce``): like ``host_all_reduce``, and on the
    first call of a key it runs the general path's checks and fills the memo."""
    if buf.device.kind != "cpu":
        return MISS
    return host_all_reduce(rt, buf.ptr, buf.numel, buf.dtype, buf, op, group, async_op,
                           backend, buf)


def ndarray_all_reduce(rt, arr, op, group, async_op: bool, backend):
    """The NumPy entry (``mcrdl_core.all_reduce`` on an ndarray): the facts from the
    array's flags and the buffer protocol (about 0.6 µs; a Buffer costs 1.2); MISS for
    an array that is empty, not contiguous, read-only or of a dtype the buffer protocol
    cannot export (the general path then judges it)."""
    f = arr.flags
    dt = BY_NP.get(arr.dtype)
    if dt is None or dt.is_half or not (f.c_contiguous and f.writeable and arr.size):
        return MISS
    return host_all_reduce(rt, arr, arr.size, dt, arr, op, group, async_op, backend)


def host_all_reduce(rt, mem, count: int, dtype, owner, op, group, async_op: bool,
                    backend, buf=None, bind=None):
    """Issue and (blocking) complete an in-place all-reduce of ``count`` elements of
    ``dtype`` in host memory ``mem`` (an address, or an object MPI can read as a buffer:
    a NumPy array); return None (blocking) or the Work (async), or MISS if the general
    path must run.

    The facts entry, for frontends that have checked, as cheaply as their framework
    allows, that the memory is host memory, contiguous and writable (mcrdl_torch reads
    them off the tensor, mcrdl_core off a NumPy array's flags): no Buffer is made.
    ``owner`` is what keeps the memory alive while an async call is in flight. Without
    ``buf`` (the Buffer entry's), a key not memoized yet is a MISS: the caller's general
    path then checks the call and fills the memo. ``bind``: the frontend's key of a
    bound call (see "Bound calls" below), with ``mem`` an address."""
    if rt.observed or _ENV.get(_COMPRESSION):  # (compression_env(), inlined)
        return MISS
    g = rt.group(group)  # liveness and broken-group checks, every call
    if rt.table is not None and rt.table_decides(Op.ALL_REDUCE, g, backend):  # by size
        key = (_TAG, g, dtype, backend, op, count * dtype.itemsize)
    else:
        key = (_TAG, g, dtype, backend, op)
    choice = rt.choices
    try:
        plan = choice.get(key)
    except TypeError:  # an unhashable op argument: let the general path judge it
        return MISS
    if plan is None:
        if buf is None:
            return MISS
        plan = choice[key] = _plan(rt, g, buf, backend, op)
    be, issue, _, blocking = plan
    if bind is not None and _binds(rt.choices, bind, count * dtype.itemsize):
        _bind(rt, bind, plan, Op.ALL_REDUCE, g, backend, (op,), _bind_in_place, Op.ALL_REDUCE,
              dtype.itemsize, True, async_op, sized=(count * dtype.itemsize, dtype))
    eng = rt.engine
    if issue is None or eng.inflight or eng.pending:
        return MISS
    logging_on = rt.logger.enabled
    if logging_on:
        t0 = time.perf_counter()
    desc = plan.desc if plan.__class__ is _Plan else None
    if desc is not None:
        e = _note(desc, count)
    if async_op:  # (nothing in flight: no memory to check)
        nbytes = count * dtype.itemsize
        ptr = _address(mem)
        work = be.fast_launch(Op.ALL_REDUCE, g, issue, (mem, count),
                              ((ptr, ptr + nbytes, True),), (owner,), eng)
        if work is None:  # (cannot happen with nothing in flight; the general path judges)
            if desc is not None:
                _undo(e, desc)
            return MISS
        if desc is not None:
            _outcome(e, work)
        if logging_on:  # (if it completed meanwhile, add_finalizer records at once)
            work.add_finalizer(lambda: rt.logger.record("all_reduce", nbytes, be.name,
                                                        g.size, time.perf_counter() - t0))
        return work
    if blocking is not None:  # issue and poll in one compiled call
        left = blocking(eng.spin_s, mem, count)
        req = None if left is None else be.fast_request(left)
    else:
        req = None
        try:
            req = issue(mem, count)
            if _done_alone(eng, req):
                req = None
        except Exception as exc:  # the library failed it (a Python issuer's request)
            _library_failed(be, Op.ALL_REDUCE, g, req, (owner,), exc)
    if req is not None:  # not done within the spin: the engine's loop (timeout, diagnostics)
        be.work_of(Op.ALL_REDUCE, g, req, _address(mem), count * dtype.itemsize,
                   owner).wait()
    if desc is not None:
        _end(e)
    if logging_on:  # CommLogger.record's tuple, appended without the method call
        rt.logger.records.append(("all_reduce", count * dtype.itemsize, be.name, g.size,
                                  time.perf_counter() - t0))
    return None


def _done_alone(eng, req) -> bool:
    """Poll the request of a blocking call that is alone in flight on this rank until it
    completes, for at most the engine's spin time; True if it did. No poll lock: with
    nothing else in flight a progress thread has nothing to poll."""
    test = req.Test
    return test() or _spin(test, eng.spin_s)


def _library_failed(be, op, g, req, keep, exc):
    """Raise what the engine's wait raises for ``exc``, the library's error from a Python
    issuer's request (``req``; None if the issue itself failed) that the fast path
    issued or polled itself (a receive of more than its buffer holds): the request's
    Work completes with it, and its wait raises CommFailedError naming op, group and
    backend, and marks the group broken (``Work.wait``, ``faults.work_failed``), as on
    the general path. The compiled issuers hand such a Work back themselves."""
    work = be.fast_work(op, g, req, _NO_MEMORY, keep)
    work.complete(exc)
    work.wait()
    raise exc  # (the wait raised already)


def _spin_polling(eng, test) -> bool:
    """Spin on ``test`` for the engine's spin time, holding its ``poll_lock`` if free
    (so that a progress thread does not contend for the library meanwhile)."""
    polling = eng.poll_lock.acquire(False)
    try:
        return _spin(test, eng.spin_s)
    finally:
        if polling:
            eng.poll_lock.release()


def _address(mem) -> int:
    """The address for a Work's span: ``mem`` itself, or a NumPy array's data."""
    return mem if mem.__class__ is int else _addressof(_c_char.from_buffer(mem))


# --- every other op ----------------------------------------------------------------------
# The same memo and the same rules as the all-reduce above, for the ops the issue list
# of a training step is made of: broadcast, reduce, all_gather_into_tensor,
# reduce_scatter_tensor, all_to_all_single (even, and uneven by split sizes), send and
# recv (blocking and async), barrier. Each entry takes the call's facts (addresses,
# element counts, dtype) and returns None/the source rank (blocking), the Work (async)
# or MISS. Unlike the all-reduce, other work may be in flight: the call then checks its
# memory against what is in flight (a conflict is a MISS: the general path orders it)
# and a blocking call waits through the engine, which drives everything in flight.
# What these entries never do: run the debug checks (MCRDL_DEBUG is a MISS), compress
# (a ``compression=`` or MCRDL_COMPRESSION is a MISS where the op has codecs), touch
# device memory, or judge bad input (a count that does not fit the group, an alias of
# output and input, an unknown dtype: MISS, and the general path raises its error).

_T = {op: f"fast:{op.value}" for op in Op}  # first part of the memo keys, per op
_T_UNEVEN = "fast:all_to_all_v"
_T_SEND, _T_RECV = _T[Op.SEND], _T[Op.RECV]


def _plan_op(rt, op, g, buf, backend, red=None, root=None, nbytes=-1):
    """(backend instance, issuer or None, reduce op, compiled issuer or None) of one
    key: the general path's checks (which raise its errors) and selection, then the
    backend's issuers."""
    if red is not None:
        red = ReduceOp.coerce(red)
        _v.reduce_op(red, buf.dtype)
    be = rt.select(op, g, buf, backend, red, nbytes)
    if op is Op.ALL_TO_ALL and root is None and _sel.algorithm(rt, op, g, buf, backend, nbytes):
        return be, None, red, None  # the table names an algorithm: the general path runs it
    issue = be.fast_issuer(op, g, buf.dtype, red, root)
    blocking = None if issue is None else be.fast_blocking(op, g, buf.dtype, red, root)
    return _planned(rt, op, g, buf, backend, red, None if root == "v" else root, nbytes, be,
                    issue, blocking)


def _lookup(rt, tag, g, dtype, backend, extra, nbytes, buf, plan_args):
    """The memoized plan of a key, made from ``buf`` on its first call (None without
    ``buf``: the caller's general path makes it). Keys carry the size only where a
    tuning table decides (as ``Runtime.select`` does). ``plan_args`` starts with the op."""
    if rt.table is not None and rt.table_decides(plan_args[0], g, backend):  # by size
        key = (tag, g, dtype, backend, extra, nbytes)
    else:
        key = (tag, g, dtype, backend, extra)
    choice = rt.choices
    try:
        plan = choice.get(key)
    except TypeError:  # an unhashable argument: let the general path judge it
        return None
    if plan is None and buf is not None:
        plan = choice[key] = _plan_op(rt, *plan_args)
    return plan


def _run(rt, plan, op, g, args, keep, async_op, nbytes, rlo, rhi, wlo, whi,
         source=False):
    """``_issue_run``, and the flight recorder's entry of the call (taken back where it
    was not issued: MISS)."""
    desc = getattr(plan, "desc", None)
    if desc is None:  # (the recorder is off)
        return _issue_run(rt, plan, op, g, args, keep, async_op, nbytes, rlo, rhi, wlo, whi,
                          source)
    count, extra = _FACTS[op](args, g)
    e = _note(desc, count, extra)
    done = _issue_run(rt, plan, op, g, args, keep, async_op, nbytes, rlo, rhi, wlo, whi,
                      source)
    if done is MISS:
        _undo(e, desc)
    elif async_op:
        _outcome(e, done)
    else:
        _end(e)
    return done


def _a2a_facts(args, g):
    """all_to_all's element count and splits, as the general path records them: the
    input's elements (even: a block per rank; by split sizes; the list form's first
    block)."""
    if len(args) == 3:
        return args[2] * g.size, None
    if len(args) == 8:
        return args[4], (args[6], args[7])
    return args[3][0], None


#: (element count, extra) of a call from its issuer's arguments, per op: the count the
#: general path records (its Call's buffer), so every path of one call records alike
_FACTS = {Op.BROADCAST: lambda a, g: (a[1], None), Op.REDUCE: lambda a, g: (a[1], None),
          Op.ALL_REDUCE: lambda a, g: (a[1], None),
          Op.ALL_GATHER: lambda a, g: (a[2], None), Op.REDUCE_SCATTER: lambda a, g: (a[2], None),
          Op.GATHER: lambda a, g: (a[2], None), Op.SCATTER: lambda a, g: (a[2], None),
          Op.SEND: lambda a, g: (a[1], (a[2], a[3])), Op.RECV: lambda a, g: (a[1], (a[2], a[3])),
          Op.BARRIER: lambda a, g: (1, None), Op.ALL_TO_ALL: _a2a_facts}


def _issue_run(rt, plan, op, g, args, keep, async_op, nbytes, rlo, rhi, wlo, whi,
               source=False):
    """Issue the ``plan``'s call on ``args`` and finish it: register it (async) or
    complete it (blocking: poll the request alone while nothing else is in flight, else
    the engine's wait). ``[rlo, rhi)`` is the memory the call reads, ``[wlo, whi)`` what
    it writes (empty: equal bounds). Returns the Work (async), None (blocking; a
    receive's source group rank if ``source``), or MISS, before anything is issued, if
    memory conflicts with work in flight or deferred work is pending."""
    be, issue, _, blocking = plan
    eng = rt.engine
    inflight = eng.inflight
    if not (async_op or inflight or eng.pending or rt.logger.enabled):
        # the common case, first and lean: a blocking call alone on this rank, issued
        # and polled by the compiled issuer if there is one, then the engine's wait
        # with its timeout if it did not complete within the spin
        if blocking is not None:
            left = blocking(eng.spin_s, *args)
            if left is None or (source and left.__class__ is int):
                return left  # done (a receive: its source)
            if left is False:  # an issuer that judges its arguments refused them
                return MISS
            req = be.fast_request(left)
        else:
            req = None
            try:
                req = issue(*args)
                if req is False:
                    return MISS
                if _done_alone(eng, req):
                    return req.source() if source else None
            except Exception as exc:  # the library failed it (a Python issuer's request)
                _library_failed(be, op, g, req, keep, exc)
        be.fast_work(op, g, req, ((rlo, rhi, False), (wlo, whi, True)), keep).wait()
        return req.source() if source else None
    if inflight or async_op:
        spans = ((rlo, rhi, False), (wlo, whi, True))
        if eng.pending or (inflight and _conflicts(inflight, spans)):
            return MISS
    elif eng.pending:
        return MISS
    # the logger's record of this call, timed from before the issue
    record = rt.logger.start(op.value, nbytes, be.name, g.size) if rt.logger.enabled else None
    if async_op:
        # issued and registered by the backend's launch (the MPI backend's: one C call)
        work = be.fast_launch(op, g, issue, args, spans, keep, eng)
        if work is None:  # the issuer refused its arguments (memory was checked above)
            return MISS
        if record is not None:  # (if it completed meanwhile, add_finalizer records at once)
            work.add_finalizer(record)
        return work
    try:
        req = issue(*args)
    except Exception as exc:  # the library refused the issue (a Python issuer)
        _library_failed(be, op, g, None, keep, exc)
    if req is False:
        return MISS
    if not inflight:
        try:
            done = _spin_polling(eng, req.Test)
        except Exception as exc:  # the library failed it (a Python issuer's request)
            _library_failed(be, op, g, req, keep, exc)
        # (a compiled issuer's Work that its library failed at the issue is done, with
        # its error: its wait raises it)
        if not done or getattr(req, "error", None) is not None:
            be.fast_work(op, g, req, ((rlo, rhi, False), (wlo, whi, True)), keep).wait()
        elif getattr(req, "finalizers", None):  # a staged output: into its blocks now
            be.fast_work(op, g, req, ((rlo, rhi, False), (wlo, whi, True)), keep).complete()
        if record is not None:
            record()
        return req.source() if source else None
    work = be.fast_work(op, g, req, spans, keep)
    if record is not None:
        work.add_finalizer(record)
    work.wait()
    return req.source() if source else None


def _in_place(rt, op, ptr, count, dtype, owner, root, what, red, group, async_op, backend,
              buf, bind):
    """A rooted in-place op (broadcast, reduce) of ``count`` elements at ``ptr``; ``root``
    is a global rank (``what`` names the argument in errors)."""
    if rt.observed:
        return MISS
    g = rt.group(group)
    rank = g.group_rank(root, what)
    nbytes = count * dtype.itemsize
    plan = _lookup(rt, _T[op], g, dtype, backend, (red, rank), nbytes, buf,
                   (op, g, buf, backend, red, rank))
    if plan is None or plan[1] is None:
        return MISS
    if bind is not None and _binds(rt.choices, bind, nbytes):
        _bind(rt, bind, plan, op, g, backend, (red, root), _bind_in_place, op, dtype.itemsize,
              False, async_op, sized=(nbytes, dtype))
    return _run(rt, plan, op, g, (ptr, count), (owner,), async_op, nbytes, 0, 0,
                ptr, ptr + nbytes)


def broadcast(rt, ptr, count, dtype, owner, src, group, async_op, backend, buf=None,
              bind=None):
    """In-place broadcast of ``count`` elements at ``ptr`` from global rank ``src``."""
    return _in_place(rt, Op.BROADCAST, ptr, count, dtype, owner, src, "src", None, group,
                     async_op, backend, buf, bind)


def reduce(rt, ptr, count, dtype, owner, dst, op, group, async_op, backend, buf=None,
           bind=None):
    """In-place reduce of ``count`` elements at ``ptr`` onto global rank ``dst``."""
    return _in_place(rt, Op.REDUCE, ptr, count, dtype, owner, dst, "dst", op, group, async_op,
                     backend, buf, bind)


def _apart(out_ptr, out_bytes, in_ptr, in_bytes) -> bool:
    return not (out_bytes and in_bytes and out_ptr < in_ptr + in_bytes
                and in_ptr < out_ptr + out_bytes)


def _block_op(rt, op, small_ptr, small_count, big_ptr, big_count, dtype, owners, red, group,
              async_op, backend, buf, gathers, bind):
    """all_gather (``gathers``: the small block is the input) or reduce_scatter (the
    small block is the output) of one block per rank: ``big_count`` = group size x
    ``small_count``, the two apart in memory."""
    if rt.observed or _ENV.get(_COMPRESSION):
        return MISS
    g = rt.group(group)
    isz = dtype.itemsize
    small, big = small_count * isz, big_count * isz
    if big_count != g.size * small_count or not _apart(big_ptr, big, small_ptr, small):
        return MISS
    plan = _lookup(rt, _T[op], g, dtype, backend, red, small, buf, (op, g, buf, backend, red))
    if plan is None or plan[1] is None:
        return MISS
    if bind is not None and _binds(rt.choices, bind, small):
        _bind(rt, bind, plan, op, g, backend, (red,), _bind_blocks, op, dtype.itemsize, gathers,
              async_op, sized=(small, dtype))
    args = (big_ptr, small_ptr, small_count) if gathers else (small_ptr, big_ptr, small_count)
    if gathers:  # reads the small block, writes the big one
        return _run(rt, plan, op, g, args, owners, async_op, big, small_ptr,
                    small_ptr + small, big_ptr, big_ptr + big)
    return _run(rt, plan, op, g, args, owners, async_op, big, big_ptr,
                big_ptr + big, small_ptr, small_ptr + small)


def all_gather(rt, out_ptr, out_count, in_ptr, in_count, dtype, owners, group, async_op,
               backend, buf=None, bind=None):
    """``all_gather_into_tensor``: ``in_count`` elements at ``in_ptr`` from every rank
    into ``out_count`` (= group size x ``in_count``) at ``out_ptr``."""
    return _block_op(rt, Op.ALL_GATHER, in_ptr, in_count, out_ptr, out_count, dtype, owners,
                     None, group, async_op, backend, buf, True, bind)


def reduce_scatter(rt, out_ptr, out_count, in_ptr, in_count, dtype, owners, op, group,
                   async_op, backend, buf=None, bind=None):
    """``reduce_scatter_tensor``: ``in_count`` (= group size x ``out_count``) elements
    at ``in_ptr`` reduced across ranks, this rank's block into ``out_ptr``."""
    return _block_op(rt, Op.REDUCE_SCATTER, out_ptr, out_count, in_ptr, in_count, dtype, owners,
                     op, group, async_op, backend, buf, False, bind)


def all_to_all(rt, out_ptr, out_count, out_rows, in_ptr, in_count, in_rows, dtype, owners,
               out_splits, in_splits, group, async_op, backend, buf=None, bind=None):
    """``all_to_all_single``: even (no split sizes: one ``MPI_Ialltoall``) or by split
    sizes along dim 0 (``MPI_Ialltoallv``); ``*_rows`` are the tensors' dim 0. Uneven
    splits are judged by the issuer, which sends nothing where they do not fit."""
    if rt.observed or _ENV.get(_COMPRESSION):
        return MISS
    g = rt.group(group)
    n = g.size
    isz = dtype.itemsize
    in_bytes, out_bytes = in_count * isz, out_count * isz
    if not _apart(out_ptr, out_bytes, in_ptr, in_bytes):
        return MISS
    bounds = (in_ptr, in_ptr + in_bytes, out_ptr, out_ptr + out_bytes)
    if not out_splits and not in_splits:  # even by its form
        if in_count != out_count or in_rows % n or out_rows % n:
            return MISS
        plan = _lookup(rt, _T[Op.ALL_TO_ALL], g, dtype, backend, None, in_bytes, buf,
                       (Op.ALL_TO_ALL, g, buf, backend, None, None, in_bytes))
        if plan is None or plan[1] is None:
            return MISS
        if bind is not None and _binds(rt.choices, bind, in_bytes):
            _bind(rt, bind, plan, Op.ALL_TO_ALL, g, backend, (), _bind_all_to_all, isz,
                  async_op, sized=(in_bytes, dtype))
        return _run(rt, plan, Op.ALL_TO_ALL, g, (out_ptr, in_ptr, in_count // n),
                    owners, async_op, in_bytes, *bounds)
    # under a table the key carries no size (None): the table's largest range decides,
    # as it does on the general path (an uneven call has no size every rank shares)
    plan = _lookup(rt, _T_UNEVEN, g, dtype, backend, None, None, buf,
                   (Op.ALL_TO_ALL, g, buf, backend, None, "v", None))
    if plan is None or plan[1] is None:
        return MISS
    if bind is not None and _binds(rt.choices, bind):  # (no size: one plan for all)
        _bind(rt, bind, plan, Op.ALL_TO_ALL, g, backend, (), _bind_all_to_all_v, isz,
              async_op)
    # the issuer judges the splits (False, nothing sent, where they do not fit: MISS)
    return _run(rt, plan, Op.ALL_TO_ALL, g, (out_ptr, out_count, out_rows, in_ptr, in_count,
                                             in_rows, out_splits or None, in_splits or None),
                owners, async_op, in_bytes, *bounds)


def send(rt, ptr, count, dtype, owner, dst, tag, group, async_op, backend, buf=None,
         bind=None):
    """Send ``count`` elements at ``ptr`` to global rank ``dst``."""
    if rt.observed or not _user_tag(tag):
        return MISS
    g = rt.group(group)
    peer = g.group_rank(dst, "dst")
    nbytes = count * dtype.itemsize
    plan = _lookup(rt, _T[Op.SEND], g, dtype, backend, None, nbytes, buf,
                   (Op.SEND, g, buf, backend))
    if plan is None or plan[1] is None:
        return MISS
    if bind is not None and _binds(rt.choices, bind, nbytes):
        _bind(rt, bind, plan, Op.SEND, g, backend, (dst,), _bind_p2p, Op.SEND, dtype.itemsize,
              peer, async_op, sized=(nbytes, dtype))
    return _run(rt, plan, Op.SEND, g, (ptr, count, peer, tag), (owner,),
                async_op, nbytes, ptr, ptr + nbytes, 0, 0)


def recv(rt, ptr, count, dtype, owner, src, tag, group, async_op, backend, buf=None,
         bind=None):
    """Blocking: the sender's global rank; async: the Work (its ``result()`` is that)."""
    if rt.observed or not _user_tag(tag):
        return MISS
    g = rt.group(group)
    peer = None if src is None else g.group_rank(src, "src")
    nbytes = count * dtype.itemsize
    plan = _lookup(rt, _T[Op.RECV], g, dtype, backend, None, nbytes, buf,
                   (Op.RECV, g, buf, backend))
    if plan is None or plan[1] is None:
        return MISS
    if bind is not None and _binds(rt.choices, bind, nbytes):
        _bind(rt, bind, plan, Op.RECV, g, backend, (src,), _bind_p2p, Op.RECV, dtype.itemsize,
              peer, async_op, sized=(nbytes, dtype))
    done = _run(rt, plan, Op.RECV, g, (ptr, count, peer, tag), (owner,), async_op,
                nbytes, 0, 0, ptr, ptr + nbytes, True)
    if done is MISS or not async_op:  # blocking: the source's group rank
        return done if done is MISS else g.ranks[done]
    return done  # (its ``value``: the source's global rank, see ``Backend.fast_work``)


def barrier(rt, group, async_op, backend, probe, bind=None):
    """A barrier with nothing in flight on this rank (else MISS: the general path makes
    it wait for the group's earlier collectives). ``probe``: the general path's probe
    buffer, which the first call of a key selects with. ``bind``: the frontend's key."""
    if rt.observed or rt.engine.inflight:
        return MISS
    g = rt.group(group)
    plan = _lookup(rt, _T[Op.BARRIER], g, None, backend, None, 0, probe,
                   (Op.BARRIER, g, probe, backend))
    if plan is None or plan[1] is None:
        return MISS
    if bind is not None and _binds(rt.choices, bind):  # (size 0: one plan for all)
        _bind(rt, bind, plan, Op.BARRIER, g, backend, (), _bind_barrier, async_op)
    return _run(rt, plan, Op.BARRIER, g, (), (), async_op, 0, 0, 0, 0, 0)


# --- list forms, gather, scatter ----------------------------------------------------------
# all_gather (a list of outputs), reduce_scatter (a list of inputs), all_to_all (lists of
# both), gather and scatter (the root's list): their entries take the list side as
# *list facts*, ``(addresses, element counts, the common count or -1, run, lo, hi,
# spans)`` of the list's tensors (``run``: one after another in list order, each where
# the previous one ends; ``[lo, hi)``: the span of the non-empty ones; ``spans``: each
# one's ``(lo, hi, writes)``), as mcrdl_torch reads them in one C call and
# ``list_facts`` reads them off Buffers. They issue the general path's
# library call (the same key, plan and issuer as all_gather_into_tensor and
# reduce_scatter_tensor for the first two; all_to_all's is MPI_Ialltoallv with no
# selection size, as the general path's), on the list's memory as it is where MPI can
# take it (a run apart from the other side; all_to_all's blocks by displacements), else
# staged in the compiled issuer (``mpi_fast.c``): packed before the issue, copied into
# the blocks when the request completes (a finalizer of its Work when it is async or
# outlasts the spin). Staging is compiled only: without the compiled module these forms
# take the general path. A list of the wrong length or of sizes that disagree is a
# MISS, and the general path raises its error before anything is sent. Memory ordering
# uses the span ``[lo, hi)`` of the list (conservative: it may cover memory between the
# blocks).
_T_LIST = "fast:all_to_all_list"


def list_facts(bufs, writes: bool):
    """The list facts of host Buffers that are contiguous (the general path's; the call
    writes them where ``writes``), or None where one is not host memory."""
    ptrs, counts, spans = [], [], []
    run, nxt, lo, hi = True, None, 0, 0
    for b in bufs:
        if b.device.kind != "cpu":
            return None
        p, c = b.ptr, b.numel
        ptrs.append(p)
        counts.append(c)
        if nxt is not None and p != nxt:
            run = False
        nxt = p + b.nbytes
        spans.append((p, nxt, writes))
        if c:
            lo, hi = (p, nxt) if lo == hi else (min(lo, p), max(hi, nxt))
    common = counts[0] if counts and counts.count(counts[0]) == len(counts) else -1
    return tuple(ptrs), tuple(counts), common, run and bool(ptrs), lo, hi, tuple(spans)


def _apart_of(lo, hi, ptr, nbytes) -> bool:
    return not nbytes or lo == hi or hi <= ptr or ptr + nbytes <= lo


def _prep_gathered(fixed, lf, ptr, count, exact=False):
    """all_gather's list (``fixed``: (n, item size, True)) and gather's (its third item
    True at the root only; elsewhere the list is ignored): (args, spans, logged bytes)
    for ``(out, inp, count)``, or None for a list that does not fit. The spans give the
    list's span ``[lo, hi)``, or each block where ``exact`` and the blocks are not one
    run (for the memory checks against work in flight: a span over other memory
    between the blocks would order the call after work that does not touch them)."""
    n, isz, mine = fixed
    blk = count * isz
    if not mine:
        return (None, ptr, count), ((ptr, ptr + blk, False), (0, 0, True)), n * blk
    if lf is None:
        return None
    ptrs, _, common, run, lo, hi, blocks = lf
    if len(ptrs) != n or common != count:
        return None
    out = ptrs[0] if run and _apart_of(lo, hi, ptr, blk) else ptrs
    if exact and not run:
        return (out, ptr, count), ((ptr, ptr + blk, False), *blocks), n * blk
    return (out, ptr, count), ((ptr, ptr + blk, False), (lo, hi, True)), n * blk


def _prep_scattered(fixed, lf, ptr, count, exact=False):
    """reduce_scatter's list and scatter's (as ``_prep_gathered``, the list being read):
    (args, spans, logged bytes) for ``(out, inp, count)``, or None."""
    n, isz, mine = fixed
    blk = count * isz
    if not mine:
        return (ptr, None, count), ((0, 0, False), (ptr, ptr + blk, True)), n * blk
    if lf is None:
        return None
    ptrs, _, common, run, lo, hi, blocks = lf
    if len(ptrs) != n or common != count:
        return None
    inp = ptrs[0] if run and _apart_of(lo, hi, ptr, blk) else ptrs
    if exact and not run:
        return (ptr, inp, count), (*blocks, (ptr, ptr + blk, True)), n * blk
    return (ptr, inp, count), ((lo, hi, False), (ptr, ptr + blk, True)), n * blk


def _prep_exchanged(fixed, olf, ilf, _=None, exact=False):
    """all_to_all's two lists: (args, spans, logged bytes) for ``(outs, out_counts, ins,
    in_counts)`` (the issuer judges the counts), or None; spans as ``_prep_gathered``'s."""
    n, isz, _ = fixed
    if olf is None or ilf is None:
        return None
    optrs, ocounts, _, orun, olo, ohi, oblocks = olf
    iptrs, icounts, _, irun, ilo, ihi, iblocks = ilf
    if len(optrs) != n or len(iptrs) != n:
        return None
    if exact:  # (a run's span is exact already)
        spans = (((ilo, ihi, False),) if irun else iblocks) + (((olo, ohi, True),) if orun
                                                                 else oblocks)
    else:
        spans = ((ilo, ihi, False), (olo, ohi, True))
    return (optrs, ocounts, iptrs, icounts), spans, sum(icounts) * isz


def _listed(rt, plan, op, g, prep, fixed, x, y, z, owners, async_op, backend, bind, size,
            dtype, key_args=()):
    """Run a list form's call (``prep(fixed, x, y, z)``'s), binding the frontend key
    ``bind`` first (``size``: the selection size, None where there is none). Async, or
    with other work in flight, it is issued and registered by the backend's launch
    against exact spans (a conflict is a MISS), and a blocking one then waited."""
    if plan is None or plan[3] is None:  # (staging is compiled only)
        return MISS
    if bind is not None and _binds(rt.choices, bind, size):
        _bind(rt, bind, plan, op, g, backend, key_args, _bind_listed, op, prep, fixed,
              async_op, sized=None if size is None else (size, dtype))
    eng = rt.engine
    if async_op or eng.inflight:
        if eng.pending or rt.logger.enabled:
            return MISS  # (the general path orders, records)
        args, spans, _ = prep(fixed, x, y, z, True)
        work = plan[0].fast_launch(op, g, plan[1], args, spans, owners, eng)
        if work is None:
            return MISS
        desc = getattr(plan, "desc", None)
        e = None if desc is None else _note(desc, *_FACTS[op](args, g))
        if async_op:
            if e is not None:
                _outcome(e, work)
            return work
        work.wait()
        if e is not None:
            _end(e)
        return None
    args, ((rlo, rhi, _), (wlo, whi, _)), nbytes = prep(fixed, x, y, z)
    return _run(rt, plan, op, g, args, owners, async_op, nbytes, rlo, rhi, wlo, whi)


def all_gather_list(rt, lf, in_ptr, in_count, dtype, owners, group, async_op, backend,
                    buf=None, bind=None):
    """``all_gather(tensor_list, tensor)``: ``in_count`` elements at ``in_ptr`` from every
    rank into the blocks of list facts ``lf``."""
    if rt.observed or _ENV.get(_COMPRESSION):
        return MISS
    g = rt.group(group)
    fixed = (g.size, dtype.itemsize, True)
    if _prep_gathered(fixed, lf, in_ptr, in_count) is None:
        return MISS
    blk = in_count * dtype.itemsize
    plan = _lookup(rt, _T[Op.ALL_GATHER], g, dtype, backend, None, blk, buf,
                   (Op.ALL_GATHER, g, buf, backend, None))
    return _listed(rt, plan, Op.ALL_GATHER, g, _prep_gathered, fixed, lf, in_ptr, in_count,
                   owners, async_op, backend, bind, blk, dtype)


def reduce_scatter_list(rt, lf, out_ptr, out_count, dtype, owners, op, group, async_op,
                        backend, buf=None, bind=None):
    """``reduce_scatter(output, input_list)``: the blocks of list facts ``lf`` reduced
    across ranks, this rank's into ``out_count`` elements at ``out_ptr``."""
    if rt.observed or _ENV.get(_COMPRESSION):
        return MISS
    g = rt.group(group)
    fixed = (g.size, dtype.itemsize, True)
    if _prep_scattered(fixed, lf, out_ptr, out_count) is None:
        return MISS
    blk = out_count * dtype.itemsize
    plan = _lookup(rt, _T[Op.REDUCE_SCATTER], g, dtype, backend, op, blk, buf,
                   (Op.REDUCE_SCATTER, g, buf, backend, op))
    return _listed(rt, plan, Op.REDUCE_SCATTER, g, _prep_scattered, fixed, lf, out_ptr,
                   out_count, owners, async_op, backend, bind, blk, dtype, (op,))


def all_to_all_list(rt, olf, ilf, dtype, owners, group, async_op, backend, buf=None,
                    bind=None):
    """``all_to_all(output_tensor_list, input_tensor_list)``: selected with no size, as
    the general path does (``api.all_to_all``), on every rank alike."""
    if rt.observed or _ENV.get(_COMPRESSION):
        return MISS
    g = rt.group(group)
    fixed = (g.size, dtype.itemsize, True)
    if _prep_exchanged(fixed, olf, ilf) is None:
        return MISS
    plan = _lookup(rt, _T_LIST, g, dtype, backend, None, None, buf,
                   (Op.ALL_TO_ALL, g, buf, backend, None, "list", None))
    return _listed(rt, plan, Op.ALL_TO_ALL, g, _prep_exchanged, fixed, olf, ilf, None, owners,
                   async_op, backend, bind, None, dtype)


def _rooted(rt, op, prep, lf, ptr, count, dtype, owners, root, what, group, async_op, backend,
            buf, bind):
    """gather (``prep``: ``_prep_gathered``) and scatter: ``lf`` the list facts of the
    root's list (None: none given; ignored elsewhere), ``root`` a global rank."""
    if rt.observed:
        return MISS
    g = rt.group(group)
    rank = g.group_rank(root, what)
    fixed = (g.size, dtype.itemsize, g.rank == rank)
    if prep(fixed, lf, ptr, count) is None:
        return MISS
    blk = count * dtype.itemsize
    plan = _lookup(rt, _T[op], g, dtype, backend, rank, blk, buf, (op, g, buf, backend, None, rank))
    return _listed(rt, plan, op, g, prep, fixed, lf, ptr, count, owners, async_op, backend, bind,
                   blk, dtype, (root,))


def gather(rt, lf, in_ptr, in_count, dtype, owners, dst, group, async_op, backend, buf=None,
           bind=None):
    """``gather(tensor, gather_list, dst)``: ``lf`` the list facts of ``gather_list``
    (read at the root only; None: none given)."""
    return _rooted(rt, Op.GATHER, _prep_gathered, lf, in_ptr, in_count, dtype, owners, dst,
                   "dst", group, async_op, backend, buf, bind)


def scatter(rt, lf, out_ptr, out_count, dtype, owners, src, group, async_op, backend,
            buf=None, bind=None):
    """``scatter(tensor, scatter_list, src)``: ``lf`` the list facts of ``scatter_list``
    (read at the root only; None: none given)."""
    return _rooted(rt, Op.SCATTER, _prep_scattered, lf, out_ptr, out_count, dtype, owners, src,
                   "src", group, async_op, backend, buf, bind)


def batch(rt, items, group, backend, bufs=None):
    """``batch_isend_irecv`` of ``items``, ``(sends, ptr, count, dtype, peer (global),
    tag, owner)`` each: every op planned as a single isend/irecv of its buffer is (the
    same memo: a message's two ends select alike, from the table's "send" entry), then
    all issued and registered (``fast_launch``), one Work each. MISS, before anything is
    issued, where any op cannot go (no compiled issuer, a tag that is not a user's, a
    peer outside the group, memory that conflicts with work in flight or with another op
    of the batch where one of them writes, an observer or the logger on, deferred
    work): the general path then checks, orders and issues the batch. ``bufs``: the
    general path's Buffers, which fill the memo."""
    begun = _batch_begin(rt, group, backend)
    if begun is None:
        return MISS
    g, eng, decides = begun
    choice = rt.choices
    todo = []
    spans = []
    for i, (sends, ptr, count, dtype, peer, tag, owner) in enumerate(items):
        hit = _batch_op_plan(rt, g, choice, sends, dtype, peer, tag, count, backend, decides,
                             None if bufs is None else bufs[i])
        if hit is None or not _batch_add(todo, spans, hit, sends, ptr, count, tag, owner):
            return MISS
    return _batch_launch(g, eng, todo, spans)


def _batch_begin(rt, group, backend):
    """(group, engine, whether a table decides p2p by size) for a batch on the fast
    path, or None where it steps aside (an observer, the logger on, deferred work).
    Send and recv share one answer of ``table_decides``: both select from the table's
    "send" entry (selection._P2P_KEYS)."""
    if rt.observed or rt.logger.enabled:
        return None
    g = rt.group(group)
    eng = rt.engine
    if eng.pending:
        return None
    return g, eng, rt.table is not None and rt.table_decides(Op.SEND, g, backend)


def _batch_add(todo, spans, hit, sends, ptr, count, tag, owner) -> bool:
    """Add one op (its ``_batch_op_plan``) to a batch's ``todo``; False where its memory
    meets another op's of the batch and one of them writes (the general path orders it)."""
    plan, op, p, isz, desc = hit
    end = ptr + count * isz
    for lo, hi, writes in spans:
        if (writes or not sends) and lo < end and ptr < hi:
            return False
    span = (ptr, end, not sends)
    spans.append(span)
    todo.append((plan, op, ptr, count, p, tag, span, owner, desc))
    return True


def _batch_launch(g, eng, todo, spans):
    """Issue and register every op of a batch (one Work each, with its recorder entry),
    or MISS, before anything is issued, where its memory meets work in flight."""
    if eng.inflight and _conflicts(eng.inflight, spans):
        return MISS
    works = []
    for plan, op, ptr, count, p, tag, span, owner, desc in todo:
        work = plan[0].fast_launch(op, g, plan[1], (ptr, count, p, tag), (span,), (owner,), eng)
        works.append(work)
        if desc is not None:
            _note(desc, count, (p, tag), work)
    return works


_T_BATCH = "fast:batch_isend_irecv"  # a group's and backend's memo of batch ops
_BATCH_MEMO_MAX = 256  # ops remembered per memo (peers x tags x dtypes x sizes), then it starts over


def batch_ops(rt, ops, backend, facts, dtypes, plain):
    """``batch_isend_irecv`` of the frontend's ``ops`` (a non-empty list of the core's
    ``P2POp``), read in one loop: ``facts(tensor)`` gives ``(address, count)`` of a
    plain contiguous host tensor of a type in ``plain`` (else None), ``dtypes`` maps the
    framework's dtype to the core's. The same calls as ``batch`` (same plans, checks and
    launches), but each op's plan, peer's group rank and entry description come from a
    memo of the group and backend keyed by what fixes them (send or receive, dtype,
    peer, tag, and the size where a tuning table decides), so that a batch the program
    issues every step pays, per op, a facts read, a dict lookup, the span checks and the
    launch. An op not in the memo yet is judged as ``batch`` judges it; MISS (nothing
    issued) wherever ``batch`` would return it, or where the memo has no plan yet (the
    general path, through ``batch``, makes it)."""
    group = ops[0].group
    begun = _batch_begin(rt, group, backend)
    if begun is None:
        return MISS
    g, eng, decides = begun
    choice = rt.choices
    mkey = (_T_BATCH, g, backend)
    try:
        memo = choice.get(mkey)
    except TypeError:  # an unhashable backend argument: the general path judges it
        return MISS
    if memo is None or len(memo) > _BATCH_MEMO_MAX:
        memo = choice[mkey] = {}
    cls = ops[0].__class__
    todo = []
    spans = []
    for o in ops:
        t = o.tensor
        if o.__class__ is not cls or o.group is not group or t.__class__ not in plain:
            return MISS
        f = facts(t)
        if f is None:
            return MISS
        ptr, count = f
        sends, tag = o.is_send, o.tag
        k = (sends, t.dtype, o.peer, tag, count if decides else None)
        try:
            hit = memo.get(k)
        except TypeError:  # an unhashable peer or tag: the general path judges it
            return MISS
        if hit is None:
            hit = _batch_op_plan(rt, g, choice, sends, dtypes.get(t.dtype), o.peer, tag,
                                 count, backend, decides)
            if hit is None:
                return MISS
            memo[k] = hit
        if not _batch_add(todo, spans, hit, sends, ptr, count, tag, t):
            return MISS
    return _batch_launch(g, eng, todo, spans)


def _batch_op_plan(rt, g, choice, sends, dtype, peer, tag, count, backend, decides,
                   buf=None):
    """(plan, op, peer's group rank, item size, entry description) of one op of a
    batch, from the memo of single isends and irecvs (made from ``buf``, the general
    path's Buffer, where it has no plan yet), or None where the batch steps aside for
    it (no dtype, not a user's tag, a peer outside the group, no plan, no compiled
    issuer)."""
    if dtype is None or not _user_tag(tag):
        return None
    try:
        p = g.group_rank(peer)
    except _v.InvalidArgumentError:  # (the general path raises it, naming the op)
        return None
    tag_ = _T_SEND if sends else _T_RECV
    key = ((tag_, g, dtype, backend, None, count * dtype.itemsize) if decides
           else (tag_, g, dtype, backend, None))
    try:
        plan = choice.get(key)
    except TypeError:  # an unhashable argument: let the general path judge it
        return None
    op = Op.SEND if sends else Op.RECV
    if plan is None and buf is not None:
        plan = choice[key] = _plan_op(rt, op, g, buf, backend)
    if plan is None or plan[3] is None:
        return None
    return (plan, op, p, dtype.itemsize, getattr(plan, "desc", None))



# --- bound calls -------------------------------------------------------------------------
# The frontends' shortest path. A frontend key is a call's own arguments that fix
# everything but the memory (op, the framework's dtype, root or peer, reduce op, group,
# backend, async): where its plan has a compiled issuer, the entry above that serves a
# call of it (the first call of a key fills the memo through the general path, the next
# one comes here) binds a closure over what the key fixes (the group, the root's or
# peer's group rank, the issuers; where a tuning table decides by size, one closure per
# range of the table's entry, "Calls by table range" below) and stores it in
# ``Runtime.choices`` under the frontend's key, so that whatever drops the plans
# (``set_table``, ``set_override``, ``destroy``) drops the closures too. A later call
# of the key gets the closure with one dict lookup and pays only the checks that can
# change from call to call: runtime usable, group not broken, no observer, nothing
# deferred, the logger off for an async call (a blocking one records itself, with the
# op, bytes, backend and ranks its entry would record), no MCRDL_COMPRESSION (ops with
# codecs), counts that fit the group, input and output apart, and then either nothing
# in flight (blocking) or no memory conflict with what is in flight (async). Where one
# fails the closure returns MISS before anything is sent, and the frontend calls the
# entry above, which handles that case (or the general path, which raises its error).
# What a bound call sends and how a blocking one waits for a request still unfinished
# after the spin is the entry's; an async one is checked against the memory in flight,
# issued and registered by the backend's ``fast_launch`` (bound with the closure).


_KEYABLE = (int, str, ReduceOp, type(None))


_ABSENT = object()
_OPEN = [float("inf")]  # the bounds of a table entry of one range, open-ended


def _binds(choices, bind, size=None) -> bool:
    """Whether an entry serving a call of the frontend key ``bind`` (of selection size
    ``size`` where its memo key carries one) binds it: the key was never asked, or it
    holds a call by table range (``_ranged_*``) without a closure for this call's range
    yet. A key that holds a closure, or None (not bindable), stays as it is; so does a
    range whose plan cannot be bound (``_never``). Cheap, since every call that a bound
    key sends back (work in flight, an async call with the logger on) comes here."""
    cur = choices.get(bind, _ABSENT)
    if cur is _ABSENT:
        return True
    calls = None if cur is None else getattr(cur, "calls", None)
    return calls is not None and size is not None and calls[_bisect(cur.bounds, size)] is None


def _never(*args):
    """The closure of a table range whose plan cannot be bound: the entries serve it."""
    return MISS


def _bind(rt, bind, plan, op, g, backend, args, make, *make_args, sized=None) -> None:
    """Store under the frontend's key ``bind`` the closure ``make(rt, g, plan,
    *make_args)`` where the key may be bound (a compiled issuer), else None, so that
    the entries ask once per key. ``sized``: (selection size, dtype) of a call whose
    memo key carries its size where a tuning table decides. Where the table then has
    an entry of several ranges for the op, the key holds a call by table range instead
    (``_ranged_*``): one closure per range of the entry, each made from the first call
    in its range, since every size in a range gets the same choice
    (``TuningTable.bounds``). An entry of one open-ended range (what ``mcrdl tune``
    writes where one backend wins at every size) chooses alike for every size: a plain
    closure, as for a named backend. Nothing is stored where a key argument (root,
    peer, reduce op) is of a kind that does not compare by value (not an int, a str, a
    ReduceOp or None: a 0-d tensor given as a root is hashed by identity, and would add
    a key on every call)."""
    if not all(a.__class__ in _KEYABLE for a in args):
        return
    choices = rt.choices
    cur = choices.get(bind, _ABSENT)
    bounds = None
    if sized is not None and rt.table is not None and rt.table_decides(op, g, backend):
        bounds = rt.table.bounds(op.value, g.size, "cpu", _dtype_class(sized[1]),
                                 rt.bootstrap.hosts_in(g.ranks))
    if bounds is None or bounds == _OPEN:  # one plan serves every call of the key
        if cur is _ABSENT:
            choices[bind] = make(rt, g, plan, *make_args) if plan[3] is not None else None
        return
    if cur is _ABSENT:
        cur = choices[bind] = _RANGED[make](bounds, *make_args)
    elif not hasattr(cur, "calls"):
        return
    i = _bisect(bounds, sized[0])
    if cur.calls[i] is None:
        cur.calls[i] = make(rt, g, plan, *make_args) if plan[3] is not None else _never


def _bind_in_place(rt, g, plan, op, isz, codecs, async_op):
    """all_reduce (``codecs``: MCRDL_COMPRESSION applies; async steps aside while
    anything is in flight, as its entry does), broadcast, reduce:
    ``call(ptr, count, owner)``."""
    be, issue, _, blocking = plan
    eng = rt.engine
    launch = be.fast_launch  # (bound once: the MPI backend's is one C call)
    alone = not async_op or op is Op.ALL_REDUCE
    name, bname, size = op.value, be.name, g.size  # (a logger record's fields)
    desc = getattr(plan, "desc", None)  # (None: the recorder is off)
    blocking = _recording(blocking, desc, 2)  # (spin, ptr, count)

    def call(ptr, count, owner):
        logging_on = rt.logger.enabled
        if (rt.unusable is not None or g.broken is not None or rt.observed
                or (alone and eng.inflight) or eng.pending or (async_op and logging_on)
                or (codecs and _ENV.get(_COMPRESSION))):
            return MISS
        if async_op:  # (spans: only the memory it touches; an empty span never conflicts)
            work = launch(op, g, issue, (ptr, count), ((ptr, ptr + count * isz, True),),
                          (owner,), eng)
            if work is None:
                return MISS
            if desc is not None:
                _note(desc, count, None, work)
            return work
        if logging_on:
            t0 = _now()
        left = blocking(eng.spin_s, ptr, count)
        if left is not None:  # not done within the spin: the engine's wait
            be.fast_work(op, g, be.fast_request(left), ((0, 0, False),
                         (ptr, ptr + count * isz, True)), (owner,)).wait()
            if desc is not None:
                _end_of(desc)
        if logging_on:
            rt.logger.records.append((name, count * isz, bname, size, _now() - t0))
        return None
    return call


def _bind_blocks(rt, g, plan, op, isz, gathers, async_op):
    """all_gather_into_tensor (``gathers``) and reduce_scatter_tensor:
    ``call(out_ptr, out_count, in_ptr, in_count, owners)``."""
    be, issue, _, blocking = plan
    eng = rt.engine
    launch = be.fast_launch  # (bound once: the MPI backend's is one C call)
    n = g.size
    name, bname = op.value, be.name
    desc = getattr(plan, "desc", None)  # (None: the recorder is off)
    blocking = _recording(blocking, desc, 3)  # (spin, out, in, count per rank)

    def call(out_ptr, out_count, in_ptr, in_count, owners):
        small, big = (in_count, out_count) if gathers else (out_count, in_count)
        out_end, in_end = out_ptr + out_count * isz, in_ptr + in_count * isz
        logging_on = rt.logger.enabled
        if (big != n * small or (small and out_ptr < in_end and in_ptr < out_end)
                or rt.unusable is not None or g.broken is not None or rt.observed
                or (not async_op and eng.inflight) or eng.pending or (async_op and logging_on)
                or _ENV.get(_COMPRESSION)):
            return MISS
        if async_op:
            work = launch(op, g, issue, (out_ptr, in_ptr, small),
                          ((in_ptr, in_end, False), (out_ptr, out_end, True)), owners, eng)
            if work is None:
                return MISS
            if desc is not None:
                _note(desc, small, None, work)
            return work
        if logging_on:
            t0 = _now()
        left = blocking(eng.spin_s, out_ptr, in_ptr, small)
        if left is not None:
            be.fast_work(op, g, be.fast_request(left), ((in_ptr, in_end, False),
                         (out_ptr, out_end, True)), owners).wait()
            if desc is not None:
                _end_of(desc)
        if logging_on:  # (the entry's figure: the big block's bytes)
            rt.logger.records.append((name, big * isz, bname, n, _now() - t0))
        return None
    return call


def _bind_all_to_all(rt, g, plan, isz, async_op):
    """all_to_all_single without split sizes:
    ``call(out_ptr, out_count, out_rows, in_ptr, in_count, in_rows, owners)``."""
    be, issue, _, blocking = plan
    eng = rt.engine
    launch = be.fast_launch  # (bound once: the MPI backend's is one C call)
    n = g.size
    desc = getattr(plan, "desc", None)  # (None: the recorder is off)
    # (spin, out, in, count per rank): the entry's count is the input's, n blocks
    blocking = _recording(blocking, desc, 3, n)

    bname = be.name

    def call(out_ptr, out_count, out_rows, in_ptr, in_count, in_rows, owners):
        out_end, in_end = out_ptr + out_count * isz, in_ptr + in_count * isz
        logging_on = rt.logger.enabled
        if (in_count != out_count or in_rows % n or out_rows % n
                or (in_count and out_ptr < in_end and in_ptr < out_end)
                or rt.unusable is not None or g.broken is not None or rt.observed
                or (not async_op and eng.inflight) or eng.pending or (async_op and logging_on)
                or _ENV.get(_COMPRESSION)):
            return MISS
        if async_op:
            work = launch(Op.ALL_TO_ALL, g, issue, (out_ptr, in_ptr, in_count // n),
                          ((in_ptr, in_end, False), (out_ptr, out_end, True)), owners, eng)
            if work is None:
                return MISS
            if desc is not None:
                _note(desc, in_count, None, work)
            return work
        if logging_on:
            t0 = _now()
        left = blocking(eng.spin_s, out_ptr, in_ptr, in_count // n)
        if left is not None:
            be.fast_work(Op.ALL_TO_ALL, g, be.fast_request(left), ((in_ptr, in_end, False),
                         (out_ptr, out_end, True)), owners).wait()
            if desc is not None:
                _end_of(desc)
        if logging_on:
            rt.logger.records.append(("all_to_all", in_count * isz, bname, n, _now() - t0))
        return None
    return call


def _bind_all_to_all_v(rt, g, plan, isz, async_op):
    """all_to_all_single by split sizes (the issuer judges them): ``call(out_ptr,
    out_count, out_rows, in_ptr, in_count, in_rows, out_splits, in_splits, owners)``."""
    be, issue, _, blocking = plan
    eng = rt.engine
    launch = be.fast_launch  # (bound once: the MPI backend's is one C call)

    bname, size = be.name, g.size
    desc = getattr(plan, "desc", None)  # (None: the recorder is off)

    def call(out_ptr, out_count, out_rows, in_ptr, in_count, in_rows, out_splits, in_splits,
             owners):
        out_end, in_end = out_ptr + out_count * isz, in_ptr + in_count * isz
        logging_on = rt.logger.enabled
        if ((in_count and out_count and out_ptr < in_end and in_ptr < out_end)
                or rt.unusable is not None or g.broken is not None or rt.observed
                or (not async_op and eng.inflight) or eng.pending or (async_op and logging_on)
                or _ENV.get(_COMPRESSION)):
            return MISS
        if async_op:
            work = launch(Op.ALL_TO_ALL, g, issue, (out_ptr, out_count, out_rows, in_ptr,
                                                    in_count, in_rows, out_splits, in_splits),
                          ((in_ptr, in_end, False), (out_ptr, out_end, True)), owners, eng)
            if work is None:
                return MISS
            if desc is not None:
                _note(desc, in_count, (out_splits, in_splits), work)
            return work
        if logging_on:
            t0 = _now()
        e = None if desc is None else _note(desc, in_count, (out_splits, in_splits))
        left = blocking(eng.spin_s, out_ptr, out_count, out_rows, in_ptr, in_count, in_rows,
                        out_splits, in_splits)
        if left is False:  # (splits that do not fit: nothing was sent)
            if e is not None:
                _undo(e, desc)
            return MISS
        if left is not None:
            be.fast_work(Op.ALL_TO_ALL, g, be.fast_request(left), ((in_ptr, in_end, False),
                         (out_ptr, out_end, True)), owners).wait()
        if e is not None:
            _end(e)
        if logging_on:
            rt.logger.records.append(("all_to_all", in_count * isz, bname, size, _now() - t0))
        return None
    return call


#: a barrier's spans, as ``_run`` gives them: it reads and writes no memory
_NO_MEMORY = ((0, 0, False), (0, 0, True))


def _bind_barrier(rt, g, plan, async_op):
    """barrier: ``call()``, only with nothing in flight on this rank (as its entry)."""
    be, issue, _, blocking = plan
    eng = rt.engine
    launch = be.fast_launch  # (bound once: the MPI backend's is one C call)

    bname, size = be.name, g.size
    desc = getattr(plan, "desc", None)  # (None: the recorder is off)
    blocking = _recording(blocking, desc, -1)  # (spin): count 1

    def call():
        logging_on = rt.logger.enabled
        if (rt.unusable is not None or g.broken is not None or rt.observed or eng.inflight
                or eng.pending or (async_op and logging_on)):
            return MISS
        if async_op:
            work = launch(Op.BARRIER, g, issue, (), _NO_MEMORY, (), eng)
            if work is None:
                return MISS
            if desc is not None:
                _note(desc, 1, None, work)
            return work
        if logging_on:
            t0 = _now()
        left = blocking(eng.spin_s)
        if left is not None:  # not done within the spin: the engine's wait
            be.fast_work(Op.BARRIER, g, be.fast_request(left), _NO_MEMORY, ()).wait()
            if desc is not None:
                _end_of(desc)
        if logging_on:
            rt.logger.records.append(("barrier", 0, bname, size, _now() - t0))
        return None
    return call


def _bind_p2p(rt, g, plan, op, isz, peer, async_op):
    """send, recv (``peer`` None: any source): ``call(ptr, count, tag, owner)``; a
    blocking receive returns the sender's global rank, an async one's Work has it as
    ``value``."""
    be, issue, _, blocking = plan
    eng = rt.engine
    launch = be.fast_launch  # (bound once: the MPI backend's is one C call)
    ranks = g.ranks
    receives = op is Op.RECV
    name, bname, size = op.value, be.name, g.size
    desc = getattr(plan, "desc", None)  # (None: the recorder is off)
    if desc is not None:  # this closure's peer in its entries' desc, the tag their extra
        desc = desc[:_rec.D_ROOT] + (peer,)  # (an int: no tuple made per call)
    blocking = _recording(blocking, desc, 2, 1, (4,))  # (spin, ptr, count, peer, tag)

    def call(ptr, count, tag, owner):
        logging_on = rt.logger.enabled
        if (not _user_tag(tag) or rt.unusable is not None or g.broken is not None
                or rt.observed or eng.pending or (async_op and logging_on)):
            return MISS
        end = ptr + count * isz
        if async_op or eng.inflight:  # (a receive's Work has the source as ``value``)
            work = launch(op, g, issue, (ptr, count, peer, tag), ((ptr, end, receives),),
                          (owner,), eng)
            if work is None:
                return MISS
            if async_op:
                if desc is not None:
                    _note(desc, count, tag, work)
                return work
            e = None if desc is None else _note(desc, count, tag)
            # blocking with other work in flight: registered like an async call (its
            # memory checked against what is in flight), then waited (the compiled spin
            # while every work in flight is MPI's, else the engine's wait)
            if logging_on:
                t0 = _now()
            work.wait()
            if e is not None:
                _end(e)
            if logging_on:
                rt.logger.records.append((name, count * isz, bname, size, _now() - t0))
            return work.value if receives else None
        if logging_on:
            t0 = _now()
        left = blocking(eng.spin_s, ptr, count, peer, tag)
        if left is None or left.__class__ is int:
            done = None if left is None else ranks[left]
        else:
            req = be.fast_request(left)
            be.fast_work(op, g, req, ((0, 0, False), (ptr, end, True)) if receives
                         else ((ptr, end, False), (0, 0, True)), (owner,)).wait()
            done = ranks[req.source()] if receives else None
            if desc is not None:
                _end_of(desc)
        if logging_on:
            rt.logger.records.append((name, count * isz, bname, size, _now() - t0))
        return done
    return call


def _bind_listed(rt, g, plan, op, prep, fixed, async_op):
    """The list forms, gather and scatter: ``call(x, y, z, owners)`` with ``prep``'s
    arguments (list facts, an address, a count; all_to_all: its two list facts).
    Blocking with other work in flight, it is issued and registered as an async call
    is (``fast_launch``: a memory conflict is a MISS), then waited (``Work.wait``: the
    compiled spin where every work in flight is MPI's, else the engine's wait)."""
    be, issue, _, blocking = plan
    eng = rt.engine
    launch = be.fast_launch  # (bound once: the MPI backend's is one C call)
    name, bname, size = op.value, be.name, g.size
    desc, facts = getattr(plan, "desc", None), _FACTS[op]
    # blocking alone: recorded in the compiled issuer's call (spin, out, ptr, count); the
    # list all-to-all's count is its first block's, its entry made here
    wrapped = desc is not None and blocking is not None and op is not Op.ALL_TO_ALL
    if wrapped:
        blocking = _recording(blocking, desc, 3)

    def call(x, y, z, owners):
        logging_on = rt.logger.enabled
        if (rt.unusable is not None or g.broken is not None or rt.observed or eng.pending
                or (async_op and logging_on) or _ENV.get(_COMPRESSION)):
            return MISS
        launched = async_op or eng.inflight  # (then exact spans: checked against those)
        prepared = prep(fixed, x, y, z, launched)
        if prepared is None:
            return MISS
        args, spans, nbytes = prepared
        if logging_on:
            t0 = _now()
        if launched:
            work = launch(op, g, issue, args, spans, owners, eng)
            if work is None:
                return MISS
            if async_op:
                if desc is not None:
                    _note(desc, *facts(args, g), work)
                return work
            e = None if desc is None else _note(desc, *facts(args, g))
            work.wait()
            if e is not None:
                _end(e)
        else:
            e = None if desc is None or wrapped else _note(desc, *facts(args, g))
            left = blocking(eng.spin_s, *args)
            if left is False:  # (counts the issuer refused: nothing was sent)
                if e is not None:
                    _undo(e, desc)
                return MISS
            if left is not None:  # not done within the spin: the engine's wait
                be.fast_work(op, g, be.fast_request(left), spans, owners).wait()
                if wrapped:
                    _end_of(desc)
            if e is not None:
                _end(e)
        if logging_on:
            rt.logger.records.append((name, nbytes, bname, size, _now() - t0))
        return None
    return call


# --- calls by table range ----------------------------------------------------------------
# Where a tuning table decides by size, a frontend key holds one of these instead of a
# closure: it finds the call's range in the table entry's bounds (``bisect_left``, as
# ``TuningTable.lookup`` does) and runs that range's closure, or returns MISS where the
# range has none yet (the entry then makes it, ``_bind``) or cannot have one (a range
# that chose a backend without a compiled issuer, or an algorithm: ``_never``). The
# selection size is the one the entries key their plans by.


def _ranged_in_place(bounds, op, isz, codecs, async_op):
    calls = [None] * (len(bounds) + 1)

    def call(ptr, count, owner):
        c = calls[_bisect(bounds, count * isz)]
        return MISS if c is None else c(ptr, count, owner)
    call.calls, call.bounds = calls, bounds
    return call


def _ranged_blocks(bounds, op, isz, gathers, async_op):
    calls = [None] * (len(bounds) + 1)

    def call(out_ptr, out_count, in_ptr, in_count, owners):
        c = calls[_bisect(bounds, (in_count if gathers else out_count) * isz)]
        return MISS if c is None else c(out_ptr, out_count, in_ptr, in_count, owners)
    call.calls, call.bounds = calls, bounds
    return call


def _ranged_all_to_all(bounds, isz, async_op):
    calls = [None] * (len(bounds) + 1)

    def call(out_ptr, out_count, out_rows, in_ptr, in_count, in_rows, owners):
        c = calls[_bisect(bounds, in_count * isz)]
        return MISS if c is None else c(out_ptr, out_count, out_rows, in_ptr, in_count,
                                        in_rows, owners)
    call.calls, call.bounds = calls, bounds
    return call


def _ranged_p2p(bounds, op, isz, peer, async_op):
    calls = [None] * (len(bounds) + 1)

    def call(ptr, count, tag, owner):
        c = calls[_bisect(bounds, count * isz)]
        return MISS if c is None else c(ptr, count, tag, owner)
    call.calls, call.bounds = calls, bounds
    return call


def _ranged_listed(bounds, op, prep, fixed, async_op):
    calls = [None] * (len(bounds) + 1)
    isz = fixed[1]

    def call(x, y, z, owners):
        c = calls[_bisect(bounds, z * isz)]
        return MISS if c is None else c(x, y, z, owners)
    call.calls, call.bounds = calls, bounds
    return call


_RANGED = {_bind_in_place: _ranged_in_place, _bind_blocks: _ranged_blocks,
           _bind_all_to_all: _ranged_all_to_all, _bind_p2p: _ranged_p2p,
           _bind_listed: _ranged_listed}
