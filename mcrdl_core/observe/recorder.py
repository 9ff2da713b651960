"""The flight recorder: what each rank did last, kept for when a job hangs or fails.

One bounded ring per process (``MCRDL_TRACE_ENTRIES`` calls, default 4096; ``0``
turns it off), one entry per call of every frontend: the general path
(``pipeline.run``), the fast path's entries and bound calls, the JAX lowering.

The ring is a set of preallocated columns, one slot per entry, filled in turn (slot
``tick % SIZE`` for the call's ``tick``, a process-wide counter): the call's static
part, sequence number, issue and end times, element count, extra, outcome, and which
call a slot holds now. It is compiled (``observe/ring.c``, built by ``make install``;
``RING`` is then ``NATIVE``), or ``PyRing``, the same columns in Python, where it is
not built or ``MCRDL_TRACE_STACK`` asks for each call's frame. The fast path's bound
calls record through ``recorded``: their blocking issuer wrapped so that each call is
noted, issued and ended in one C call. Why: on a 2-core VM a dozen Python stores and
two clock reads per call cost about 1 µs a call on the fast path (``bench/overhead.py``
with the recorder on against off); in C the entry costs a clock read on each side of
the issue and a few stores.

``desc`` is one tuple per plan (the fast path builds it once per memo key): ``(group,
op, dtype, backend, algorithm, codec, rule, async, p2p, reduce op, root)``, where
``rule`` says what chose the backend (``selection.decide_why``). ``seq`` is the
group's sequence number of the call: collectives count on ``Group.trace_seq``, the
same on every member (every member makes the group's collectives in one order), point
to point on ``Group.trace_p2p`` (one side's count only); -1 for a lowered call.
``count`` is the element count per rank, ``extra`` the peer and tag, or the split
counts (a dict, or the fast path's tuple). ``outcome`` is the async Work (let go 4
calls later, and again 64 later, once it is done without an error: then ``"async"``,
with its ``t_done`` as the end, unknown for a compiled Work, which keeps none), or
(state, text) of the exception a blocking call raised; ``t_end`` is set when a
blocking call returns (a slot's entry has ended when its ``t_end`` is not older than
its ``t_issue``: the clock only goes forward, so the end left by the slot's previous
entry never counts). ``call`` returns the entry's tick; ``end`` and ``outcome`` take
it and write only while the slot still holds that call (another thread may have gone
round the ring meanwhile); ``undo(tick, desc)`` takes back the group's number in any
case. Times are ``time.perf_counter()``; a dump converts
them to wall-clock seconds. Nothing is computed for a dump until one is written: the
state of each entry (issued, completed, failed, timed out) is read then from its Work,
its exception or its group's broken mark, so a call that completes in compiled code
(``mpi_fast.c``) costs the recorder nothing more. The cost per call is in
``bench/overhead.py``'s table (docs/benchmarks.md).

Dumps (``dump``): one JSON file per rank, ``rank-N.json`` in ``MCRDL_TRACE_DIR``
(default ``$TMPDIR/mcrdl-trace-JOB``, ``JOB`` being rank 0's host and process id, which
every rank learnt at the bootstrap), written to a temporary name and renamed, without
any communication. Written on every fault (``faults.fault_hooks``: a CommTimeoutError,
a library's CommFailedError, a dead peer, each of which breaks a group), on SIGUSR1,
on ``mcrdl_core.dump_trace()``, on an uncaught exception before the job is ended, and
at exit after a fault, or at exit where a peer of the job has dumped (a rank that
skipped a call and ended normally shows where it was). ``mcrdl trace DIR`` reads them
(``observe/analyze.py``).
"""
from __future__ import annotations

import array
import itertools
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time

from ..base import config as _config
from ..base.errors import CommTimeoutError
from ..engine import faults as _faults
from . import analyze, torch_fr

try:  # the compiled ring: built by mcrdl_core.tools.build_ring (make install), not by pip
    from . import ring
except ImportError:
    ring = None

SCHEMA = "mcrdl.trace/1"

#: how many calls the ring keeps (MCRDL_TRACE_ENTRIES, read once per process)
SIZE = _config.get("MCRDL_TRACE_ENTRIES")
ON = SIZE > 0
STACK = ON and _config.get("MCRDL_TRACE_STACK")
_now = time.perf_counter

# desc fields
D_GROUP, D_OP, D_DTYPE, D_BACKEND, D_ALGO, D_CODEC, D_RULE, D_ASYNC, D_P2P, D_RED, D_ROOT = \
    range(11)

_P2P = ("send", "recv")
_state = {"rt": None, "signal": False, "dumped": None, "verdict": None}


def describe(group, op, dtype, backend, algorithm=None, codec=None, rule=None,
             async_op=False, reduce_op=None, root=None) -> tuple:
    """The static part of a call's entries (``op`` an Op or its name, ``dtype`` a core
    DType or None, ``backend`` a name, ``reduce_op`` a ReduceOp, ``root`` a group
    rank): what every call of one fast-path plan shares."""
    name = getattr(op, "value", op)
    return (group, name, dtype, backend, algorithm, codec, rule, bool(async_op),
            name in _P2P, getattr(reduce_op, "value", reduce_op), root)


def failure(exc) -> tuple:
    """What an entry keeps of the exception its call raised: its state and text, not
    the exception (whose traceback holds the caller's frames and their tensors)."""
    return ("timed out" if isinstance(exc, CommTimeoutError) else "failed",
            f"{type(exc).__name__}: {str(exc)[:300]}")


#: what a tuple ``extra`` (the fast path's, cheaper than a dict) holds, by op
_EXTRA = {"send": ("peer", "tag"), "recv": ("peer", "tag"), "all_to_all": ("splits",)}


def frame(depth: int = 2):
    """The first frame outside MCR-DL's packages: "file:line in function"."""
    f = sys._getframe(depth)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if not mod.startswith(("mcrdl_", "jax", "torch")):
            return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return None


class PyRing:
    """The ring in Python columns (where ring.c is not built, or MCRDL_TRACE_STACK asks
    for each call's frame): the same functions as the compiled ring, slot for slot."""

    def __init__(self, size: int, stack: bool = False):
        self.size, self.stack = size, stack
        self.descs: list = [None] * size
        self.seqs = array.array("q", bytes(8 * size))
        self.t_issue = array.array("d", bytes(8 * size))
        self.t_end = array.array("d", bytes(8 * size))
        self.counts = array.array("q", bytes(8 * size))
        self.extras: list = [None] * size
        self.outcomes: list = [None] * size
        self.frames: list = [None] * size
        self.ticks = array.array("q", [-1]) * size
        self._next = itertools.count().__next__

    def note(self, desc: tuple, count: int, extra=None, out=None) -> int:
        """Record one call issued now (``out``: its async Work, where it is known
        already); returns its tick, for ``end`` when a blocking call returns,
        ``outcome`` for its Work or exception, ``forget``."""
        g = desc[0]
        if desc[8]:
            seq = g.trace_p2p = g.trace_p2p + 1
        else:
            seq = g.trace_seq = g.trace_seq + 1
        t = self._fill(desc, seq, count, extra, out)
        if t >= 4:
            self._release(t - 4)  # (a p2p step's send, waited by now)
        if t >= 64:
            self._release(t - 64)  # (an overlapped collective, a second look)
        return t

    def _release(self, t: int) -> None:
        """Call ``t``'s async Work, done without an error, let go: its end becomes the
        Work's ``t_done`` (unknown where it keeps none), its outcome ``"async"``. Why: a
        ring of thousands of Works kept their memory from being reused hot, which cost
        async calls most of a µs each (ring.c does the same)."""
        i = self._slot(t)
        if i < 0:
            return
        o = self.outcomes[i]
        if o is None or o.__class__ in (tuple, str) or not getattr(o, "done", False) \
                or getattr(o, "error", None) is not None:
            return
        end_ = getattr(o, "t_done", None)
        if isinstance(end_, float) and end_ >= self.t_issue[i]:
            self.t_end[i] = end_  # (else its end is unknown: a compiled Work keeps none)
        self.outcomes[i] = "async"

    def lowered(self, desc: tuple, count: int, extra, out) -> int:
        """An entry with no sequence number (seq -1): a call lowered into a program."""
        return self._fill(desc, -1, count, extra, out)

    def _fill(self, desc, seq, count, extra, out) -> int:
        t = self._next()
        i = t % self.size
        self.ticks[i] = t
        self.descs[i] = desc
        self.seqs[i] = seq
        self.counts[i] = count
        self.extras[i] = extra
        self.outcomes[i] = out
        self.frames[i] = frame(3) if self.stack else None
        self.t_issue[i] = _now()
        return t

    def _slot(self, t: int) -> int:
        """Call ``t``'s slot, or -1 where the slot holds a later call now."""
        i = t % self.size
        return i if t >= 0 and self.ticks[i] == t else -1

    def end(self, t: int) -> None:
        """The blocking call of tick ``t`` returned now."""
        i = self._slot(t)
        if i >= 0:
            self.t_end[i] = _now()

    def outcome(self, t: int, value) -> None:
        """Call ``t``'s Work (async), or ``failure(exc)`` of the exception it raised."""
        i = self._slot(t)
        if i >= 0:
            self.outcomes[i] = value

    def forget(self, t: int, desc: tuple) -> None:
        """Take back call ``t`` of ``desc``: its group's number whatever happened to its
        slot (another thread may have gone round the ring: the number must still go, or
        this rank numbers the group's later calls one higher than its peers), the slot
        emptied while it still holds that call."""
        i = self._slot(t)
        if i >= 0:
            self.ticks[i] = -1
            self.descs[i] = self.extras[i] = self.outcomes[i] = None
        g = desc[D_GROUP]
        if desc[D_P2P]:
            g.trace_p2p -= 1
        else:
            g.trace_seq -= 1

    def clear(self) -> None:
        """Forget every entry (tests; the groups' sequence numbers go on)."""
        for i in range(self.size):
            self.ticks[i] = -1
            self.descs[i] = self.extras[i] = self.outcomes[i] = self.frames[i] = None

    def recorded(self, fn, desc: tuple, count_at: int, mul: int, extra_at: tuple):
        """``fn``, a blocking issuer (``spin, ...`` -> None when done, a receive's
        source rank, False when it refused its arguments, else the Work of a call not
        done within the spin), with every call recorded: noted before ``fn`` runs
        (count: its argument ``count_at`` times ``mul``, 1 where ``count_at`` < 0;
        extra: its arguments at ``extra_at``, the one itself where it names one), ended
        when it returns done, taken back when it refused. A call not done within the
        spin stays issued until the caller's wait returns and it calls ``end_of(desc)``.
        """
        note, end, forget = self.note, self.end, self.forget

        one = extra_at[0] if len(extra_at) == 1 else None

        def recorded_call(*args):
            if one is not None:  # (one argument: itself)
                extra = args[one] if one < len(args) else None
            else:
                extra = tuple(args[k] if k < len(args) else None for k in extra_at) or None
            t = note(desc, args[count_at] * mul if count_at >= 0 else 1, extra)
            res = fn(*args)
            if res is False:
                forget(t, desc)
            elif res is None or res.__class__ is int:
                end(t)
            return res
        return recorded_call

    def end_of(self, desc: tuple) -> None:
        """End the newest call of ``desc`` not ended yet (see ``recorded``)."""
        best = -1
        for i, t in enumerate(self.ticks):
            if (t > best and self.descs[i] is desc and self.outcomes[i] is None
                    and self.t_end[i] < self.t_issue[i]):
                best = t
        if best >= 0:
            self.end(best)

    def slots(self) -> list:
        """The filled slots, oldest call first: (tick, desc, seq, t_issue, t_end,
        count, extra, outcome, frame) each. Each column is copied at once (another
        thread may fill or empty slots meanwhile), and a slot whose call changed while
        they were copied is left out."""
        ticks = self.ticks.tolist()
        cols = (self.descs[:], self.seqs.tolist(), self.t_issue.tolist(),
                self.t_end.tolist(), self.counts.tolist(), self.extras[:],
                self.outcomes[:], self.frames[:])
        now = self.ticks.tolist()
        keep = sorted((t, i) for i, t in enumerate(ticks)
                      if t >= 0 and now[i] == t and cols[0][i] is not None)
        return [(t, *(c[i] for c in cols)) for t, i in keep]


def native(size: int):
    """The compiled ring (``observe/ring.c``, built by ``make install``), made anew
    with ``size`` slots, or None: not built, built from another version of ring.c, or
    a clock other than perf_counter's (Work.t_done is perf_counter's)."""
    if ring is None:
        return None
    if getattr(ring, "VERSION", None) != 4 or abs(ring.now() - time.perf_counter()) > 0.05:
        return None
    ring.init(size)
    return ring


#: the ring in use: the compiled one (``NATIVE``), else Python's; its functions, bound
#: once (the fast path calls them)
NATIVE = native(SIZE) if ON and not STACK else None
RING = NATIVE if NATIVE is not None else PyRing(max(SIZE, 1), STACK)
call, end, outcome, undo, clear = RING.note, RING.end, RING.outcome, RING.forget, RING.clear
recorded, end_of = RING.recorded, RING.end_of
if NATIVE is not None:
    def _slots() -> list:
        return [(*x, None) for x in NATIVE.slots()]
else:
    _slots = RING.slots


def lowered(desc: tuple, count: int, extra=None) -> None:
    """Record a call traced into a compiled program that MCR-DL does not run itself
    (a JAX call lowered to mpi4jax's primitive): once, when traced, with no sequence
    number, since its runs are the program's, not the core's."""
    if ON:
        RING.lowered(desc, count, extra, "lowered")


# --- the process's runtime ---------------------------------------------------------------
def attach(rt) -> None:
    """Called by each new Runtime: who this process is (rank, job, groups) for dumps; the
    fault hook; SIGUSR1 where the runtime is made on the main thread."""
    _state["rt"] = rt
    _state["dumped"] = None
    if _on_fault not in _faults.fault_hooks:
        _faults.fault_hooks.append(_on_fault)
        _faults.exit_hooks.append(_on_exit)
    if not _state["signal"] and threading.current_thread() is threading.main_thread() \
            and hasattr(signal, "SIGUSR1"):
        previous = signal.getsignal(signal.SIGUSR1)

        def on_signal(signum, frame):
            dump("SIGUSR1")
            if callable(previous):  # a handler of the program's own runs too
                previous(signum, frame)

        try:
            signal.signal(signal.SIGUSR1, on_signal)
            _state["signal"] = True
        except (ValueError, OSError):  # not the main interpreter's main thread
            pass


def job_id(rt) -> str:
    """The job's name, the same on every rank without any exchange: rank 0's host and
    process id, which the bootstrap gave every rank (a torchrun job: its run id too)."""
    bs = rt.bootstrap
    host = (bs.host_of[0] if bs.host_of else socket.gethostname()).split("#")[0]
    ident = bs.proc_of[0] if bs.proc_of else None
    pid = ident[2] if ident else os.getpid()
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"{host}-{pid}" + (f"-{run}" if run and run != "none" else "")


def directory(rt=None) -> str:
    """Where this job's dumps go: MCRDL_TRACE_DIR, else ``$TMPDIR/mcrdl-trace-JOB``."""
    rt = rt or _state["rt"]
    given = _config.get("MCRDL_TRACE_DIR")
    if given:
        return given
    return os.path.join(tempfile.gettempdir(), f"mcrdl-trace-{job_id(rt)}")


def _state_of(slot) -> tuple:
    """(state, end time or None) of a slot's entry (``_slots``), read now."""
    _, desc, _, issued, ended, _, _, out, _ = slot
    if out is None and ended >= issued:
        return "completed", ended
    if out == "async":  # (its Work let go once done; a compiled Work keeps no end time)
        return "completed", ended if ended >= issued else None
    if out == "lowered":
        return "lowered", None
    if out.__class__ is tuple:  # (state, text): the exception a blocking call raised
        return out[0], None
    if out is not None:  # an async Work
        if getattr(out, "done", False):
            err = getattr(out, "error", None)
            t = getattr(out, "t_done", None)
            if err is None:
                return "completed", t
            return ("timed out" if isinstance(err, CommTimeoutError) else "failed"), t
    broken = getattr(desc[D_GROUP], "broken", None)
    if broken is not None:
        return ("timed out" if isinstance(broken, CommTimeoutError) else "failed"), None
    return "issued", None


def _entry_json(slot, wall) -> dict:
    _, d, seq, issued, _, count, extra, outcome_, frame_ = slot
    g, dtype = d[D_GROUP], d[D_DTYPE]
    state, end_ = _state_of(slot)
    item = getattr(dtype, "itemsize", None)
    out = {"group": getattr(g, "key", str(g)), "seq": None if seq < 0 else seq,
           "p2p": d[D_P2P], "op": d[D_OP],
           "dtype": getattr(dtype, "name", dtype), "count": count,
           "bytes": None if item is None else count * item,
           "backend": d[D_BACKEND], "algorithm": d[D_ALGO], "codec": d[D_CODEC],
           "rule": d[D_RULE],
           "async": d[D_ASYNC] or outcome_ == "async" or hasattr(outcome_, "done"),
           "state": state,
           "t_issue": round(issued + wall, 6),
           "t_end": None if end_ is None else round(end_ + wall, 6)}
    if d[D_RED] is not None:
        out["reduce_op"] = d[D_RED]
    if d[D_ROOT] is not None:  # (a bound send's or receive's: its peer, in the desc)
        out["peer" if d[D_P2P] else "root"] = d[D_ROOT]
    if extra.__class__ is int and d[D_P2P]:  # (its tag alone: the peer is the desc's)
        extra = {"tag": extra}
    if extra:
        if isinstance(extra, tuple):
            extra = {k: _plain(v) for k, v in zip(_EXTRA.get(d[D_OP], ()), extra)
                     if v is not None}
        out.update(extra)
    if outcome_.__class__ is tuple:
        out["error"] = outcome_[1]
    if frame_:
        out["frame"] = frame_
    return out


def _plain(v):
    """A value of a fast-path entry as JSON has it (a ReduceOp, split sizes)."""
    if hasattr(v, "value"):
        return v.value
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def snapshot(reason: str = "requested") -> dict:
    """This rank's dump as a dict (what ``dump`` writes)."""
    rt = _state["rt"]
    wall = time.time() - _now()  # perf_counter -> wall-clock seconds
    slots = _slots() if ON else []  # (oldest first; under the GIL for the C ring)
    groups = {}
    for g in (rt.groups if rt is not None else ()):
        if not getattr(g, "is_member", False):
            continue
        groups[g.key] = {"name": g.name, "ranks": list(g.ranks), "calls": g.trace_seq,
                         "p2p_calls": g.trace_p2p, "default": g.backend,
                         "broken": None if g.broken is None else
                         f"{type(g.broken).__name__}: {str(g.broken)[:300]}"}
    return {"job": job_id(rt) if rt is not None else f"{socket.gethostname()}-{os.getpid()}",
            "schema": SCHEMA, "rank": rt.rank if rt is not None else 0,
            "world_size": rt.world_size if rt is not None else 1,
            "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
            "time": round(time.time(), 6), "capacity": SIZE,
            "faults": [f"{type(f).__name__}: {str(f)[:300]}" for f in _faults.recorded()],
            "groups": groups,
            "entries": [_entry_json(x, wall) for x in slots],
            "complete": True}


def dump(reason: str = "requested", path: str | None = None) -> str | None:
    """Write this rank's dump (``rank-N.json`` in ``directory()``, or ``path``); return
    its path, or None where the recorder is off or there is no runtime yet. Never
    raises: a dump must not hide the fault it records."""
    rt = _state["rt"]
    if rt is None or not ON:
        return None
    try:
        data = snapshot(reason)
        if path is None:
            folder = directory(rt)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank-{rt.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
        _state["dumped"] = path
        torch_fr.write(data, path)  # (the same calls for torch's own analyzer)
        return path
    except Exception as exc:  # a full disk, a read-only directory: say so, go on
        print(f"mcrdl: rank {getattr(rt, 'rank', '?')}: could not write the flight "
              f"recorder's dump ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def peer_dumps(rt=None) -> list:
    """The dumps of this job's other ranks already in ``directory()``."""
    rt = rt or _state["rt"]
    folder = directory(rt)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    job, out = job_id(rt), []
    for n in names:
        if not (n.startswith("rank-") and n.endswith(".json")) or n == f"rank-{rt.rank}.json":
            continue
        try:
            with open(os.path.join(folder, n), encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if d.get("job") == job:
            out.append(d)
    return out


def _on_fault(error) -> None:
    """A fault (``faults._record``): dump, and name the dump in the error's message,
    with the verdict where every rank's dump is already there."""
    rt = _state["rt"]
    if rt is None or not ON:
        return
    path = dump(f"{type(error).__name__}")
    if path is None or not isinstance(getattr(error, "args", None), tuple) or not error.args:
        return
    note = f" Flight recorder: this rank's calls are in {path}"
    try:
        dumps = peer_dumps(rt)
        if len(dumps) + 1 >= rt.world_size:
            with open(path, encoding="utf-8") as f:
                dumps.append(json.load(f))
            note += f"; the ranks' dumps say: {analyze.verdict(dumps)['line']}"
        else:
            note += (f"; run 'mcrdl trace {os.path.dirname(path)}' once every rank has "
                     "written its own")
    except Exception:  # the verdict is a courtesy: the fault is what matters
        note += f"; run 'mcrdl trace {os.path.dirname(path)}'"
    if str(error.args[0]).find("Flight recorder:") < 0:
        error.args = (f"{error.args[0]}{note}", *error.args[1:])


def _on_exit(fault: bool, reason: str) -> None:
    """At exit (``faults``): dump after a fault of this rank, or where a peer of the
    job has dumped (this rank may be the one that went elsewhere)."""
    rt = _state["rt"]
    if rt is None or not ON:
        return
    if fault or peer_dumps(rt):
        dump(reason)
