"""The call pipeline: every collective and point-to-point call of the core, described
once (a ``Call``) and run by one function (``run``).

The steps, in order, each raising before anything is sent:

1. the group (member, alive, not broken) and the reduce op (known, valid for the dtype);
2. the op's own checks that need the group (``Call.check``: a root in the group, element
   counts that fit the group size, split sizes); they return the call's *signature*
   (root, count, counts) for the observers;
3. selection (``Runtime.select``: the backend named, else the tuning table, else the
   policy) with the call's selection size;
4. a transform, where one applies: the compressed variants (``compression=`` or
   MCRDL_COMPRESSION, on the ops that have codecs: ``Call.compressed``) and the
   two-level algorithms (``backend="hier"``: ``Call.takeover``; or the tuning table's
   choice for an auto call: ``Call.algorithm``). Transforms are looked
   up by name in ``hooks``, so this module imports none of them;
5. the observers (``Runtime.before``: the debug checks, user observers), for
   collectives (not send and recv: only one side of the group calls them), with the
   algorithm that takes the call over, if any (``algorithm="hier"``);
6. ordering against work in flight on the memory it reads and writes;
7. the issue (``Call.issue``: the backend's own call) and the finish (register the
   async Work, or wait for it; the logger and the observers' ``after``).

The frontends' small host calls mostly skip all of this through ``fastpath``, a memo
of steps 1-3 per call key that the first call of each key fills by running here; a
call it cannot serve with the same guarantees comes here (see its docstring).

Why one function and closures rather than a method per op: every rule (order of the
checks, when compression applies, what an observer sees, how memory is ordered) is
written once, and a new op or transform only says what is its own. This is the shape
of torchcomms' pre/post hooks and DeepSpeed's ``timed_op``, with the backend choice
inside the pipeline as MCR-DL's one addition.
"""
from __future__ import annotations

import functools

from ..base.errors import MismatchError
from ..base.ops import Op, ReduceOp
from ..observe import recorder as _rec
from . import fastpath as _fast
from . import hooks as _hooks
from . import selection as _selection
from . import validate as _v
from .runtime import get_runtime


#: calls the observers do not see (they watch collectives: every rank of the group calls)
_POINT_TO_POINT = (Op.SEND, Op.RECV)


def _no_check(g, c) -> dict:
    return {}


class Call:
    """One call, described: what the pipeline needs to run it.

    ``op``, ``group``, ``backend`` (the request: None, a name, "auto"), ``buf`` (the
    Buffer selection judges: dtype, device, size), ``reduce_op`` (None for ops without
    one), ``compression`` (the ``compression=`` argument; None also consults
    MCRDL_COMPRESSION), ``async_op``; ``reads``/``writes``: the user's buffers it reads
    and writes (for ordering); ``nbytes``: the selection size (-1: ``buf.nbytes``;
    None: no size, an uneven call); ``log_bytes``: the size the logger and observers
    record. The op's own parts, as functions:

    - ``check(g, c) -> dict``: checks that need the group; the observers' signature
      (``root``, ``count``, ``counts``); may set the call's ``reads``, ``writes`` and
      ``log_bytes`` (a gather's list exists on its root only);

    No part refers to its own Call by closure: it gets the Call as ``c`` instead. A
    closure over its Call is a reference cycle (the Call holds the closure) that keeps
    the call's buffers, and so the caller's tensors, alive until Python's cyclic
    collector runs, which counts objects, not bytes: a training loop's heap then grows
    by every step's tensors and its compute runs on fresh pages.
    - ``issue(be, g, red, sig) -> Work``: the backend's call;
    - ``compressed(t, rt, g, red, sig, cz)``: the call through the ``compression``
      transform ``t`` with the resolved spec ``cz`` (None: the op has no codecs);
    - ``takeover(rt, g, red)``: another algorithm runs the whole call (after the
      checks, selection and observers; no ordering or issue here);
    - ``algorithm(name, rt, g, red)``: how the call runs an algorithm the tuning table
      names instead of a backend (``selection.algorithm``: ``hier``), where the op
      has one; taken as the takeover when the table says so;
    - ``value``: a blocking call returns its Work's value (recv: the source rank);
    - ``via``: the name of the algorithm ``takeover`` runs (``"hier"``), which the
      observers see as the signature's ``algorithm`` (a table's algorithm is named by
      ``run``): ranks that disagree on it run different collectives.
    """

    __slots__ = ("op", "group", "backend", "buf", "reduce_op", "compression", "async_op",
                 "reads", "writes", "nbytes", "log_bytes", "check", "issue", "compressed",
                 "takeover", "algorithm", "value", "via")

    def __init__(self, op, group, backend, buf, *, reduce_op=None, compression=None,
                 async_op=False, reads=(), writes=(), nbytes=-1, log_bytes=0,
                 check=_no_check, issue=None, compressed=None, takeover=None, algorithm=None,
                 value=False, via=None):
        self.op, self.group, self.backend, self.buf = op, group, backend, buf
        self.reduce_op, self.compression, self.async_op = reduce_op, compression, async_op
        self.reads, self.writes, self.nbytes, self.log_bytes = reads, writes, nbytes, log_bytes
        self.check, self.issue, self.compressed = check, issue, compressed
        self.takeover, self.algorithm, self.value, self.via = takeover, algorithm, value, via


def prepare(op, group, buf, backend, reduce_op=None, nbytes=-1):
    """Steps 1 and 3 of the pipeline alone: (runtime, group, backend instance, reduce
    op), raising the call's errors. ``buf`` may be metadata only (a traced value's
    shape and dtype): what a frontend that issues the call its own way needs (the JAX
    lowering under ``jit``)."""
    rt = get_runtime()
    g = rt.group(group)
    red = _reduce_op(reduce_op, buf)
    return rt, g, rt.select(op, g, buf, backend, red, nbytes), red


def _reduce_op(red, buf):
    if red is not None:
        red = ReduceOp.coerce(red)
        _v.reduce_op(red, buf.dtype)
    return red


def compression_for(compression, op, rt, g, backend, buf, reduce_op=None):
    """The compression allowed for this call (``compression=``, then MCRDL_COMPRESSION),
    checked against its dtype and reduce op; None (the usual case) costs one env lookup,
    and None too where an ``auto:`` spec keeps the backend's own collective."""
    if compression is None and not _fast.compression_env():
        return None
    return _selection.compression_for(compression, op, rt, g, backend, buf, reduce_op)


def run(c: Call):
    """Run a described call through the pipeline (the module docstring's steps); return
    what the torch.distributed-shaped call returns: the Work (async), else None (or the
    Work's value where ``c.value``)."""
    rt = get_runtime()
    g = rt.group(c.group)
    red = _reduce_op(c.reduce_op, c.buf)
    sig = c.check(g, c)
    takeover, via = c.takeover, c.via
    if c.algorithm is not None and c.nbytes is not None:
        name = _selection.algorithm(rt, c.op, g, c.buf, c.backend, c.nbytes, red)
        if name is not None:
            takeover = functools.partial(c.algorithm, name)
            via = name.partition(":")[0]  # ("hier:mpi": the algorithm is "hier")
    if _rec.ON:
        be, rule = rt.select(c.op, g, c.buf, c.backend, red, c.nbytes, why=True)
    else:
        be = rt.select(c.op, g, c.buf, c.backend, red, c.nbytes)
    if c.compressed is not None:
        cz = compression_for(c.compression, c.op, rt, g, c.backend, c.buf, red)
        if cz is not None:
            if not _rec.ON:
                return c.compressed(_hooks.transform("compression"), rt, g, red, sig, cz)
            by = "compression=" if c.compression is not None else "MCRDL_COMPRESSION"
            desc, extra = _describe(c, g, be, sig, str(cz), "compressed",
                                    f"{rule}; codec by {by}")
            e = _rec.call(desc, c.buf.numel, extra)
            try:
                return _finished(e, c.async_op, c.compressed, _hooks.transform("compression"),
                                 rt, g, red, sig, cz)
            except MismatchError:
                # refused by the debug check (compress/entry.py) on every rank before
                # anything was sent: no entry, as on the uncompressed path below, whose
                # check comes before its entry. Kept, a rank whose peers ran the call
                # uncompressed would number the group's later calls one higher than
                # theirs, and `mcrdl trace` would compare different calls.
                _rec.undo(e, desc)
                raise
    if rt.observed and c.op not in _POINT_TO_POINT:
        if red is not None:
            sig = dict(sig, reduce_op=red)
        if via is not None:  # (a takeover without a name still differs from the flat call)
            sig = dict(sig, algorithm=via)
        elif takeover is not None:
            sig = dict(sig, algorithm="takeover")
        rt.before(g, c.op, be, c.buf, **sig)
    if takeover is not None:
        if not _rec.ON:
            return takeover(rt, g, red)
        if via is not None and c.via is None:  # the table named the algorithm
            rule = _selection.table_why(rt, c.op, g, c.buf.device, c.buf.dtype,
                                        c.buf.nbytes if c.nbytes == -1 else c.nbytes)[1]
            rule += f": algorithm {via!r}"
        e = _record(c, g, be, sig, None, via or "takeover", rule)
        return _finished(e, c.async_op, takeover, rt, g, red)
    spans = rt.order(reads=c.reads, writes=c.writes, keep=c.async_op)
    if not _rec.ON:
        work = c.issue(be, g, red, sig)
        done = rt.finish(work, spans, c.async_op, c.log_bytes)
        return work.value if c.value and not c.async_op else done
    e = _record(c, g, be, sig, None, None, rule)
    try:
        work = c.issue(be, g, red, sig)
        if c.async_op:
            _rec.outcome(e, work)
        done = rt.finish(work, spans, c.async_op, c.log_bytes)
    except BaseException as exc:
        _rec.outcome(e, _rec.failure(exc))
        raise
    if not c.async_op:
        _rec.end(e)
    return work.value if c.value and not c.async_op else done


def _describe(c: Call, g, be, sig, codec, algorithm, rule) -> tuple:
    """(the flight recorder's static part of a call, its extra: root, peer, split
    counts) (``observe/recorder``)."""
    red = c.reduce_op if c.reduce_op is None else ReduceOp.coerce(c.reduce_op)
    desc = _rec.describe(g, c.op, c.buf.dtype, be.name, algorithm, codec, rule, c.async_op,
                         red, sig.get("root"))
    extra = {k: v for k, v in sig.items() if v is not None and k in _SIG_KEYS} or None
    if extra and "counts" in extra:
        extra["counts"] = [list(map(int, x)) for x in extra["counts"]]
    return desc, extra


def _record(c: Call, g, be, sig, codec, algorithm, rule) -> int:
    """The flight recorder's entry of a call about to be issued (``_describe``);
    returns its tick (``recorder.call``)."""
    desc, extra = _describe(c, g, be, sig, codec, algorithm, rule)
    return _rec.call(desc, c.buf.numel, extra)


def _finished(e, async_op, fn, *args):
    """``fn(*args)`` (a transform running the call), its outcome put in entry ``e``."""
    try:
        done = fn(*args)
    except BaseException as exc:
        _rec.outcome(e, _rec.failure(exc))
        raise
    if async_op:
        _rec.outcome(e, done)
    else:
        _rec.end(e)
    return done


#: the parts of a call's signature an entry keeps
_SIG_KEYS = ("peer", "counts")
