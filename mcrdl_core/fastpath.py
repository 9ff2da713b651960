"""The fast path of a small all-reduce: what one call costs, and what it skips.

Breakdown of one call before this module (``mcrdl_torch.all_reduce(t, backend="mpi")``
on a 2-float32 CPU tensor, one process, ``perf_counter_ns`` around the stages and
cProfile over 20 000 calls; raw ``Iallreduce`` + ``Test`` costs 0.9 µs on its own):

=====================================================  ======
stage                                                  µs
=====================================================  ======
frontend: torch.Tensor -> Buffer (``tensors.py``)      1.3
validate output (contiguous, writable, dtype)          0.4
resolve group, coerce + check the reduce op            0.8
select the backend (memo key of 5-6 Enum-hashed parts) 0.9
compression check (one environment lookup)             0.3
order (nothing in flight: one list test)               0.2
backend: cuda dispatch wrapper, ``_Reducible``,
``_spec`` (``MPI.buffer.fromaddress``), ``MPIWork``    3.5
finish + ``Work.wait``: an import per call, the
engine's lock, ``test``, ``_complete``, discard        2.5
=====================================================  ======

(about 11-12 µs of Python over the raw call; the machine measured here was shared, so
these are CPU time of the calling thread, ``time.thread_time``, which preemption does
not inflate, the 10th percentile of batches of 100 calls; cProfile ranked the same
stages).

After a first version of this module (same measure, one process): ``mcrdl_torch``
4.2-4.3 µs, async + ``wait()`` 6.3-6.5, ``mcrdl_core`` on NumPy 4.5.

Now (``timeit`` with ``time.thread_time``, best of 7 x 100 000 calls, quiet machine;
raw blocking ``Allreduce`` 0.58-0.61 µs):

=====================================================  ======
path                                                   µs
=====================================================  ======
the issuer alone: ``Iallreduce`` + ``Test``            0.9
``host_all_reduce`` (memo lookup, checks, lock, spin)  2.0
``mcrdl_torch.all_reduce`` explicit or auto            2.8-3.0
  of which the tensor's facts (``tensors.py``)         0.75
async + ``wait()``                                     4.1-4.2
comm logger on                                         3.4
``mcrdl_core.all_reduce`` on a NumPy array             2.6-2.7
``mcrdl_jax.all_reduce`` eager, + block_until_ready    21-27
  (JAX's own ``x + 1`` + block_until_ready: 18-21)
=====================================================  ======

Where the rest went: no Buffer for torch tensors or NumPy arrays (the *facts entry*
below: a tensor's address, count and dtype cost 0.75 µs where a Buffer and its checks
cost 1.5; a NumPy array is handed to MPI as itself, no ctypes address);
``Op``/``ReduceOp`` hash in C (Enum's own ``__hash__`` is Python: 0.4 µs a memo
lookup); ``DType.itemsize`` a plain attribute; an async call's Work made without its
constructor, its common attributes on the class, and waited by polling its request
alone (``progress.spin``). In eager JAX the cost between MPI and JAX's array creation
grows with whatever code runs in between (measured: one more ``MPI.buffer`` object
adds 2-3 µs to JAX's ``batched_device_put`` that follows), so less code there counts
twice. On 2 ranks, wall clock, see the README's table (``bench/overhead.py``).

What the fast path does instead, once per (group, dtype, backend, reduce op, and the
size when a tuning table decides), for host memory: the first call runs the full checks and
selection (same errors, raised before anything is sent) and asks the chosen backend
for an *issuer* (``Backend.fast_all_reduce``: a closure over the communicator, MPI
datatype and MPI op). Later calls with the same key pay one dict lookup, the issuer
(one ``Iallreduce``), and the wait below. Three entries share that memo: the Buffer
entry (``all_reduce``, any caller of ``mcrdl_core.all_reduce``, the only one that fills
it), the NumPy entry and the facts entry (``host_all_reduce``: frontends that have
checked contiguity and writability their own, cheaper way), which miss until the
general path has filled the key.

It is taken only when nothing can need the general path: no ``MCRDL_DEBUG`` (the
cross-rank checks run on the general path), no compression, a host buffer, nothing
in flight or pending in the progress engine (so there is no memory ordering to do and
no other library's work to drive), and an issuer exists (not float16/bfloat16, not
AVG: those need a finishing step).

The wait. With nothing else in flight, polling this one request *is* the progress
loop: the call spins on ``Request.Test`` for at most ``MCRDL_SPIN_US`` µs, holding the
engine's ``poll_lock`` if it is free (so that mcrdl_torch's progress thread does not
contend for MPI meanwhile); if it is not done by then, the request is wrapped in a Work
and handed to the engine's ordinary wait (the group's timeout or ``MCRDL_TIMEOUT``,
diagnostics naming op, group, backend and rank, broken-group marking), which lets go of
the engine's issuing ``lock`` while it waits. No MPI call that can block is ever made,
so no watchdog thread is needed: a wait that never completes ends in CommTimeoutError
like any other.

Threads. "Nothing in flight" is read without a lock: another thread may issue right
after. The request is this call's own, so nobody else polls it; at worst the other
thread's work is not driven by this call for the spin's length, after which the
engine's wait polls everything.
"""
from __future__ import annotations

import os
import time

from ctypes import addressof as _addressof
from ctypes import c_char as _c_char

from .dtypes import _BY_NP
from .ops import Op, ReduceOp
from .progress import spin as _spin

#: returned when the fast path does not apply: the caller takes the general path
MISS = object()

# Environment variables read on every call: a lookup in os.environ's own bytes-keyed
# dict costs 0.03 µs, ``os.environ.get(name)`` about 1 µs (it encodes the name every
# time); both see changes made through os.environ. Where that dict is missing (another
# platform), os.environ itself.
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


_TAG = "fast:all_reduce"  # first part of this module's keys in ``Runtime._choice``


def _plan(rt, g, buf, backend, op):
    """(backend instance, issuer or None, reduce op) for this key, running the general
    path's checks and selection (which raise its errors)."""
    from . import validate as _v

    red = ReduceOp.coerce(op)
    _v.reduce_op(red, buf.dtype)
    be = rt.select(Op.ALL_REDUCE, g, buf, backend, red)
    fast = getattr(be, "fast_all_reduce", None)
    issue = fast(g, buf.dtype, red) if fast is not None else None
    return be, issue, red


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
    dt = _BY_NP.get(arr.dtype)
    if dt is None or dt.is_half or not (f.c_contiguous and f.writeable and arr.size):
        return MISS
    return host_all_reduce(rt, arr, arr.size, dt, arr, op, group, async_op, backend)


def host_all_reduce(rt, mem, count: int, dtype, owner, op, group, async_op: bool,
                    backend, buf=None):
    """Issue and (blocking) complete an in-place all-reduce of ``count`` elements of
    ``dtype`` in host memory ``mem`` (an address, or an object MPI can read as a buffer:
    a NumPy array); return None (blocking) or the Work (async), or MISS if the general
    path must run.

    The facts entry, for frontends that have checked, as cheaply as their framework
    allows, that the memory is host memory, contiguous and writable (mcrdl_torch reads
    them off the tensor, mcrdl_core off a NumPy array's flags): no Buffer is made.
    ``owner`` is what keeps the memory alive while an async call is in flight. Without
    ``buf`` (the Buffer entry's), a key not memoized yet is a MISS: the caller's general
    path then checks the call and fills the memo."""
    if rt.debug or _ENV.get(_COMPRESSION):  # (compression_env(), inlined)
        return MISS
    g = rt.group(group)  # liveness and broken-group checks, every call
    if rt.table is not None and backend in (None, "auto") and g.backend is None:
        key = (_TAG, g, dtype, backend, op, count * dtype.itemsize)
    else:
        key = (_TAG, g, dtype, backend, op)
    choice = rt._choice
    try:
        plan = choice.get(key)
    except TypeError:  # an unhashable op argument: let the general path judge it
        return MISS
    if plan is None:
        if buf is None:
            return MISS
        plan = choice[key] = _plan(rt, g, buf, backend, op)
    be, issue, _ = plan
    eng = rt.engine
    if issue is None or eng.inflight or eng.pending:
        return MISS
    logging_on = rt.logger.enabled
    if logging_on:
        t0 = time.perf_counter()
    req = issue(mem, count)
    if async_op:
        nbytes = count * dtype.itemsize
        work = be.work_of(Op.ALL_REDUCE, g, req, _address(mem), nbytes, owner)
        if logging_on:
            work.add_finalizer(lambda: rt.logger.record("all_reduce", nbytes, be.name,
                                                        g.size, time.perf_counter() - t0))
        work.engine = eng
        eng.inflight.append(work)
        return work
    polling = eng.poll_lock.acquire(False)
    try:
        done = _spin(req.Test, eng.spin_s)
    finally:
        if polling:
            eng.poll_lock.release()
    if not done:  # then the engine's loop: timeout, diagnostics
        be.work_of(Op.ALL_REDUCE, g, req, _address(mem), count * dtype.itemsize,
                   owner).wait()
    if logging_on:  # CommLogger.record's tuple, appended without the method call
        rt.logger.records.append(("all_reduce", count * dtype.itemsize, be.name, g.size,
                                  time.perf_counter() - t0))
    return None


def _address(mem) -> int:
    """The address for a Work's span: ``mem`` itself, or a NumPy array's data."""
    return mem if mem.__class__ is int else _addressof(_c_char.from_buffer(mem))
