"""The flight recorder: what each rank did last, kept for when a job hangs or fails.

One bounded ring per process (``MCRDL_TRACE_ENTRIES`` calls, default 4096; ``0``
turns it off), one entry per call of every frontend: the general path
(``pipeline.run``), the fast path's entries and bound calls, the JAX lowering. An
entry is a small list, filled once when the call is issued and once more when a
blocking call returns::

    [desc, seq, t_issue, count, extra, outcome, t_end, frame]

``desc`` is the call's static part, one tuple per plan (the fast path builds it once per
memo key): ``(group, op, dtype, backend, algorithm, codec, rule, async, p2p, reduce
op, root)``, where
``rule`` says what chose the backend (``selection.decide_why``). ``seq`` is the
group's sequence number of the call: collectives count on ``Group.trace_seq``, the
same on every member (every member makes the group's collectives in one order), point
to point on ``Group.trace_p2p`` (one side's count only). ``count`` is the element
count per rank, ``extra`` the peer and tag, or the split counts (a dict, or the fast path's tuple). ``outcome`` is the
async Work, or (state, text) of the exception a blocking call raised; ``t_end`` is set when a blocking
call returns. Times are ``time.perf_counter()``; a dump converts them to wall-clock
seconds. Nothing is computed for a dump until one is written: the state of each entry
(issued, completed, failed, timed out) is read then from its Work, its exception or its
group's broken mark, so a call that completes in compiled code (``mpi_fast.c``) costs
the recorder nothing more.

A deque with ``maxlen`` is the ring: one C call appends and drops the oldest, cheaper
from Python than an index kept by hand. The cost per call is measured by
``bench/recorder_cost.py`` (docs/reliability.md).

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

import collections
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

SCHEMA = "mcrdl.trace/1"

#: how many calls the ring keeps (MCRDL_TRACE_ENTRIES, read once per process)
SIZE = _config.get("MCRDL_TRACE_ENTRIES")
ON = SIZE > 0
STACK = ON and _config.get("MCRDL_TRACE_STACK")
ring: collections.deque = collections.deque(maxlen=SIZE)
#: ``append(entry)``: the ring's own method, bound once (the fast path calls it)
append = ring.append
_now = time.perf_counter

# entry fields
DESC, SEQ, T_ISSUE, COUNT, EXTRA, OUTCOME, T_END, FRAME = range(8)
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


def call(desc: tuple, count: int, extra=None) -> list:
    """Record one call issued now; returns its entry (the caller sets ``T_END`` when a
    blocking call returns, ``OUTCOME`` to its Work or exception)."""
    g = desc[0]
    if desc[8]:
        seq = g.trace_p2p = g.trace_p2p + 1
    else:
        seq = g.trace_seq = g.trace_seq + 1
    e = [desc, seq, _now(), count, extra, None, None, frame() if STACK else None]
    append(e)
    return e


def failure(exc) -> tuple:
    """What an entry keeps of the exception its call raised: its state and text, not
    the exception (whose traceback holds the caller's frames and their tensors)."""
    return ("timed out" if isinstance(exc, CommTimeoutError) else "failed",
            f"{type(exc).__name__}: {str(exc)[:300]}")


def undo(e) -> None:
    """Take back the entry ``call`` just made, where the call was not issued after all
    (an issuer that refused its arguments: the general path then records the call)."""
    g = e[DESC][D_GROUP]
    if e[DESC][D_P2P]:
        g.trace_p2p -= 1
    else:
        g.trace_seq -= 1
    for i in range(1, min(len(ring), 64) + 1):  # the newest, unless a thread added more
        try:
            if ring[-i] is e:
                del ring[-i]
                return
        except IndexError:  # (another thread changed the ring meanwhile)
            return


#: what a tuple ``extra`` (the fast path's, cheaper than a dict) holds, by op
_EXTRA = {"send": ("peer", "tag"), "recv": ("peer", "tag"), "all_to_all": ("splits",)}


def lowered(desc: tuple, count: int, extra=None) -> None:
    """Record a call traced into a compiled program that MCR-DL does not run itself
    (a JAX call lowered to mpi4jax's primitive): once, when traced, with no sequence
    number, since its runs are the program's, not the core's."""
    if ON:
        append([desc, None, _now(), count, extra, "lowered", None,
                frame() if STACK else None])


def frame():
    """The first frame outside MCR-DL's packages: "file:line in function"."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if not mod.startswith(("mcrdl_", "jax", "torch")):
            return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return None


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


def _state_of(e) -> tuple:
    """(state, end time or None) of an entry, read now."""
    out, t_end = e[OUTCOME], e[T_END]
    if t_end is not None:
        return "completed", t_end
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
    broken = getattr(e[DESC][D_GROUP], "broken", None)
    if broken is not None:
        return ("timed out" if isinstance(broken, CommTimeoutError) else "failed"), None
    return "issued", None


def _entry_json(e, wall) -> dict:
    d = e[DESC]
    g, dtype = d[D_GROUP], d[D_DTYPE]
    state, t_end = _state_of(e)
    count = e[COUNT]
    item = getattr(dtype, "itemsize", None)
    out = {"group": getattr(g, "key", str(g)), "seq": e[SEQ], "p2p": d[D_P2P], "op": d[D_OP],
           "dtype": getattr(dtype, "name", dtype), "count": count,
           "bytes": None if item is None or count is None else count * item,
           "backend": d[D_BACKEND], "algorithm": d[D_ALGO], "codec": d[D_CODEC],
           "rule": d[D_RULE], "async": d[D_ASYNC] or hasattr(e[OUTCOME], "done"),
           "state": state,
           "t_issue": round(e[T_ISSUE] + wall, 6),
           "t_end": None if t_end is None else round(t_end + wall, 6)}
    if d[D_RED] is not None:
        out["reduce_op"] = d[D_RED]
    if d[D_ROOT] is not None:
        out["root"] = d[D_ROOT]
    extra = e[EXTRA]
    if extra:
        if isinstance(extra, tuple):
            extra = {k: _plain(v) for k, v in zip(_EXTRA.get(d[D_OP], ()), extra)
                     if v is not None}
        out.update(extra)
    if e[OUTCOME].__class__ is tuple:
        out["error"] = e[OUTCOME][1]
    if e[FRAME]:
        out["frame"] = e[FRAME]
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
    for _ in range(4):  # another thread may append meanwhile
        try:
            entries = list(ring)
            break
        except RuntimeError:
            continue
    else:
        entries = []
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
            "entries": [_entry_json(e, wall) for e in entries],
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
