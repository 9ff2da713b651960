"""After a fault: broken groups, helper threads still inside a library, and exit.

A fault is a wait that ran past the runtime's timeout (``MCRDL_TIMEOUT``), or a call
that a backend library reported as failed (a peer that died closes Gloo's connections
at once; Gloo's own timeout; an MPI error), which :func:`work_failed` re-raises as
CommFailedError naming op, group, backend and rank and quoting the library. Either way
the groups of the unfinished or failed works are marked broken (``Group.mark_broken``:
later calls on them raise BrokenGroupError at once). A timed-out wait with no group (a
bootstrap exchange while the runtime is being created) marks the process's runtime
broken instead (:data:`runtime_fault`, checked by ``runtime.init``).

For a timeout the progress engine calls :func:`timed_out` before it raises. The
timed-out works leave the engine (no later wait polls them or lists them as in flight)
but stay referenced here, with their buffers, since a late peer may still write. Helper
threads of the timed-out works (a Gloo rendezvous, a Gloo send/recv wait: calls that
can only block, run on a thread while the caller drives the progress loop) get up to
:data:`GRACE_S` seconds to return. Their libraries time out on their own 1 s after
``MCRDL_TIMEOUT`` (Gloo's is set so, that MCR-DL's diagnosis comes first), so they
normally return about 1 s after the error. A thread still
inside torch's C++ code when the interpreter finalizes is, on returning, ended by
CPython with a forced unwind that C++ turns into ``terminate called without an active
exception`` (SIGABRT), replacing the Python exception's exit status (a Gloo
rendezvous that timed out: 2 exits in 9 aborted so before this module, 0 in 22 since;
docs/reliability.md).

At exit (:func:`_at_exit`, registered when the runtime is created), every rank of an
MPI launch of 2+ processes first meets the others in a bounded nonblocking barrier on
``MPI.COMM_WORLD`` (:func:`_exit_barrier`; MCR-DL issues no collective of its own on
that communicator, its groups use duplicates). That costs nothing where all ranks end
together (MPICH's ``MPI_Finalize`` waits for every rank anyway) and tells a rank whether
all its peers are alive and at their exit. If a fault was recorded: helper threads
still alive get the rest of the grace; if every peer reached the barrier within
:data:`GRACE_S` and no helper thread is stuck, the exit is the normal one (MPICH's
``MPI_Finalize`` returns with unmatched requests left over when the peers are alive).
Otherwise, as a last resort and only after the error was reported (raised, and printed
if uncaught), the process leaves with ``os._exit(status)`` if a helper thread is still
inside a library or MPI is initialized. Why the barrier: hydra (MPICH's ``mpiexec``)
kills every rank still running when one exits without ``MPI_Finalize``, and reports the
job as failed (exit 9); a rank that had an expected, handled fault and left first so
failed whole jobs whose every rank succeeded (seen once in CI). MPICH's ``MPI_Finalize`` never returns once a peer has died (measured: a
rank that ends with ``os._exit(1)`` under ``mpiexec -disable-auto-cleanup`` leaves the
others in ``MPI_Finalize`` until the job is killed), and a fault cannot tell a dead
peer from a slow one. ``status`` is 1 when an exception reached the top level
(Python's own status for it), else 0. ``MPI_Finalize``, torch's destructors and atexit
hooks registered before the runtime was created are skipped then; stdout and stderr are
flushed first. Without a fault, exit is untouched. ``MCRDL_EXIT_GUARD=0`` turns the
last resort off (to measure what the libraries do without it).

An exception that reaches the top level of a rank of an MPI job ends the whole job at
once (:func:`_abort_job`: ``MPI_Abort``, after the traceback is printed), so the job's
status is non-zero and the peers do not wait for the dead rank until their timeout.
Before, the failed rank waited for its peers in ``MPI_Finalize``, they for it in their
collective, and the survivors' status (0 where they handled their error) became the
job's. (``sys.exit(N)`` is not an exception Python hands the hook: it takes the normal
exit.)
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import time

from ..base import config as _config
from ..base.errors import CommFailedError, CommTimeoutError, McrdlError
from . import progress as _progress

log = logging.getLogger("mcrdl.faults")

#: seconds a helper thread of a timed-out work gets to return (at the fault, then at exit)
GRACE_S = _config.get("MCRDL_FAULT_GRACE_S")

#: the fault that broke the process's runtime (a bootstrap exchange timed out), or None
runtime_fault: BaseException | None = None

_faults: list = []  # errors that broke a group or the runtime (the first few)
_stuck_threads: list = []  # helper threads of timed-out works
_abandoned: list = []  # timed-out works: their buffers stay alive (a late peer may write)
_state = {"guard": False, "uncaught": False, "mpi_world": False}


#: called with each fault's error as it is recorded, before it is raised (the flight
#: recorder dumps, and names its dump in the error's message: ``observe/recorder.py``)
fault_hooks: list = []
#: called at exit with (whether this rank had a fault, the reason), before the exit
#: guard acts, and before an uncaught exception ends the MPI job
exit_hooks: list = []


def _record(error: BaseException) -> None:
    if len(_faults) < 16:
        _faults.append(error)
    for hook in fault_hooks:
        try:
            hook(error)
        except Exception:  # an observer of faults must not replace the fault
            log.debug("fault hook %r failed", hook, exc_info=True)


def recorded() -> list:
    """The faults recorded in this process (the first 16)."""
    return list(_faults)


def _exit_hooks(fault: bool, reason: str) -> None:
    for hook in exit_hooks:
        try:
            hook(fault, reason)
        except Exception:  # the exit goes on
            log.debug("exit hook %r failed", hook, exc_info=True)


def timed_out(works, error: BaseException) -> None:
    """Called by the progress engine for the unfinished ``works`` of a wait that ran
    past the runtime's timeout, or that can no longer complete (a peer gone: ``error``
    is then not a CommTimeoutError, and the helper threads are not waited for here, as
    their library may only give up at its own timeout; the exit waits for them),
    just before it raises ``error``."""
    global runtime_fault
    for w in works:
        g = getattr(w, "group", None)
        if hasattr(g, "mark_broken"):
            g.mark_broken(error)
        elif runtime_fault is None:
            runtime_fault = error
        thread = _thread_of(w)
        if thread is not None:
            _stuck_threads.append(thread)
        if w.engine is not None:  # not polled again; its diagnostics would mislead
            w.engine.discard(w)
        _abandoned.append(w)
    _record(error)
    if isinstance(error, CommTimeoutError):  # their library times out 1 s later
        _join(_stuck_threads, GRACE_S)


def work_failed(work) -> BaseException:
    """The error to raise for ``work``, which completed with ``work.error``. A library's
    own exception on a group's work becomes CommFailedError (its cause kept) and breaks
    the group; MCR-DL's own errors are returned as they are."""
    err = work.error
    group = work.group
    if isinstance(err, McrdlError) or not hasattr(group, "mark_broken"):
        return err
    # (a work found failed at a wait's first look was never registered: the engine's rank)
    rank = getattr(work.engine or _progress.engine(), "rank", "?")
    wrapped = CommFailedError(
        f"mcrdl: rank {rank}: {work.op} on {group.describe()} via backend '{work.backend}' "
        f"failed in the library: {type(err).__name__}: {err}. A peer most likely died, "
        "closed its connection or did not make the matching call; the group is unusable "
        "now. Check the other ranks' logs for the first error.")
    wrapped.__cause__ = err
    work.error = wrapped
    group.mark_broken(wrapped)
    _record(wrapped)
    return wrapped


def _thread_of(work):
    """The helper thread behind a work (a ThreadWork, or the stage of a chain)."""
    for w in (work, getattr(work, "stage", None)):
        t = getattr(w, "_thread", None)
        if isinstance(t, threading.Thread):
            return t
    return None


def _join(threads, budget: float) -> list:
    """Join ``threads`` within ``budget`` seconds in all; the ones still alive."""
    deadline = time.monotonic() + budget
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def install_exit_guard(mpi_world: bool = False) -> None:
    """Register the exit hook and note uncaught exceptions (once per process).
    ``mpi_world``: the runtime was bootstrapped over ``MPI.COMM_WORLD``, so every rank
    of the job has this hook and meets the others at exit. Sticky: a runtime started
    among some ranks only (a members-only torch subgroup, on Gloo) leaves it unset, and
    its exit does not wait for ranks that never start one."""
    _state["mpi_world"] = _state["mpi_world"] or bool(mpi_world)
    if _state["guard"]:
        return
    _state["guard"] = True
    previous = sys.excepthook

    def hook(*exc_info):
        _state["uncaught"] = True
        previous(*exc_info)
        # a dump where the job is ended for it, or a fault of MCR-DL's own (a plain
        # script's KeyError leaves no files behind)
        kind = exc_info[0]
        _exit_hooks(bool(_faults) or _state["mpi_world"] or
                    (isinstance(kind, type) and issubclass(kind, McrdlError)),
                    f"uncaught {getattr(kind, '__name__', kind)}")
        _abort_job(exc_info[0])

    sys.excepthook = hook
    atexit.register(_at_exit)


def _abort_job(kind) -> None:
    """An exception reached the top level of this rank of an MPI job of 2+ processes
    (the hook above, after Python printed its traceback): end the whole job now with
    ``MPI_Abort(MPI.COMM_WORLD, 1)``, as ``python -m mpi4py`` does. The launcher
    (hydra, Open MPI's mpirun, srun) then ends every rank and returns a non-zero status.
    Leaving normally instead, this rank would wait for its peers in the exit barrier and
    in ``MPI_Finalize`` while they wait for it in a collective until ``MCRDL_TIMEOUT``;
    once they gave up and left, the job's status was theirs (0 where they handled the
    error). The job has failed whichever way it ends, so ending it at once loses
    nothing: the peers see the end of the job within a second, not at their timeout.
    Not under ``MCRDL_EXIT_GUARD=0`` (the libraries' own exit), nor in a process of its
    own (a 1-process world: Python's status 1 is the job's), nor at an interactive
    prompt (``python -i``, ``code.interact``), which hands every error typed there to
    this hook and goes on."""
    if not _config.get("MCRDL_EXIT_GUARD") or not _mpi_initialized():
        return
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return
    try:
        world = sys.modules["mpi4py.MPI"].COMM_WORLD
        if world.Get_size() < 2:
            return
        rank = world.Get_rank()
    except Exception:  # a broken MPI: the normal exit
        return
    print(f"mcrdl: rank {rank}: uncaught {getattr(kind, '__name__', kind)}: ending the MPI "
          "job with MPI_Abort(MPI_COMM_WORLD, 1), so that every rank stops now and the "
          "job's status is non-zero (its peers would wait for this rank until "
          "MCRDL_TIMEOUT); the traceback above is the cause", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the abort
            pass
    # a moment for the launcher to forward what this rank wrote: hydra's proxy drops
    # output it has not read yet when the abort kills the job (a fresh-clone run lost
    # the traceback and this line so)
    time.sleep(0.5)
    world.Abort(1)


def _mpi_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return bool(mpi and mpi.Is_initialized() and not mpi.Is_finalized())
    except Exception:  # a broken MPI must not stop the exit
        return False


def _exit_barrier(budget: float) -> bool:
    """Every rank of ``MPI.COMM_WORLD`` (2+ processes) at its exit within ``budget``
    seconds; False also where MPI cannot tell (a broken MPI must not stop the exit)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        world = mpi.COMM_WORLD
        if world.Get_size() < 2:
            return True
        req, deadline = world.Ibarrier(), time.monotonic() + budget
        while not req.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True
    except Exception:
        return False


def _finish_unwaited(limit_s: float) -> None:
    """Async work that was issued and never waited is still in the engine at exit:
    drive it to completion (bounded by ``limit_s``; errors are logged, nobody waits for
    them) before the interpreter frees its buffers. A library that finished it later
    (MPICH inside ``MPI_Finalize``, which runs after Python's teardown) would write
    into freed memory. Work that still has not completed is kept alive for good (one
    reference that is never dropped), so its memory stays valid to the end."""
    eng = _progress.engine()
    pending = [w for w in list(eng.inflight) if not w.done]
    if not pending:
        return
    try:
        eng.wait(pending, timeout=limit_s)
    except Exception as exc:  # a peer that never issued its part, a failed library
        log.info("mcrdl: %d unwaited work(s) did not complete at exit: %s", len(pending), exc)
    for w in pending:
        if not w.done:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(w))


def _at_exit() -> None:
    if not _config.get("MCRDL_EXIT_GUARD"):
        if _faults and not _state["uncaught"]:
            _exit_hooks(True, "exit after a fault")
        return
    _finish_unwaited(GRACE_S)
    mpi = _mpi_initialized() and _state["mpi_world"]
    if not _faults:
        if mpi:  # the peers with a fault wait for this rank here (see the module doc)
            _exit_barrier(2 * GRACE_S + 1.0)
        _exit_hooks(False, "exit")  # (a peer that dumped meanwhile: dump too)
        return
    if not _state["uncaught"]:  # (an uncaught one dumped in the hook above)
        _exit_hooks(True, "exit after a fault")
    alive = _join([t for t in _stuck_threads if t.is_alive()], GRACE_S)
    if not alive and not mpi:
        return
    if mpi and _exit_barrier(GRACE_S) and not alive:
        log.info("mcrdl: every rank reached its exit after %s; finalizing normally", _faults[0])
        return
    status = 1 if _state["uncaught"] else 0
    why = []
    if alive:
        why.append(f"{len(alive)} helper thread(s) still inside a library "
                   f"({', '.join(t.name for t in alive)})")
    if mpi:
        why.append("MPI_Finalize would wait for peers that may be dead")
    log.warning("mcrdl: exiting with status %d without finalizing the libraries (%s) after: "
                "%s", status, "; ".join(why), _faults[0])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the exit
            pass
    os._exit(status)
