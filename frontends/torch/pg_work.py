"""The torch ``Work`` of the registered "mcrdl" process group, the thread that drives
its futures, and the threads that complete them.

Why a progress thread. torch code does not always wait: DDP's reducer issues a
bucket's all-reduce, chains a callback on ``work.get_future()`` and later blocks, in
C++, on the chained future -- nobody calls ``wait()`` on the Work and no Python code
of ours runs on the main thread in between. MPI, though, moves a message only while
some thread calls into it. So once a future has been asked for, a daemon thread
("mcrdl-progress") drives the progress engine until that future's work is done or
its deadline passes.

Why callback threads. Completing a torch future runs its callbacks (``then``) on the
completing thread, and a callback may block: PowerSGD's issues another all-reduce and
waits on its future. Were that the progress thread, nothing would drive the second
all-reduce and no deadline would fire. So the progress thread runs no user code: it
only sees works finish (or expire) and hands each completion to a callback thread
("mcrdl-callback"), as torch's Gloo completes futures on its worker threads. A
completion never waits behind a callback that blocks: it goes to an idle callback
thread, or to a new one if all are busy (:class:`_Callbacks`); idle ones end after
a minute. A thread that calls ``wait()`` completes the future itself once its work is
done (as Gloo's do, before ``wait`` returns), so its callbacks run there.

Thread safety. Polls of the core's engine are serialized by its ``poll_lock``, held
for one poll, never for a whole wait, and only tried (``mcrdl_core.engine.progress``): the
progress thread polls when nobody else does, and a thread that waits
(``PGWork.wait``) polls everything itself meanwhile. A callback that waits on another
Work drives the engine the same way; one that waits on a future leaves it to the
progress thread. Issuing holds the engine's ``lock``, which no wait keeps.

Cost. A call that nobody asks a future of never touches these threads: issuing adds
one uncontended lock acquire (~0.1 µs). torch's blocking ``dist.all_reduce`` (``asyncOp``
False) takes the core's blocking call and gets a completed Work: 12.7 µs per 4-byte
call through ``pg.allreduce(...).wait()`` against 16.7 µs on the asynchronous path
(one process, MPI singleton, medians of 7 x 5000 calls). When futures are pending the
progress thread polls with a nap that starts at 20 µs and doubles to 1 ms while
nothing completes (it gives the GIL back between polls), and sleeps on a condition
when nothing is pending.

Timeouts (docs/torch_backend.md, "Timeouts"). A wait with no timeout of its own, and
a future, get the runtime's own timeout for the group: the group's ``timeout=`` if the
user gave one, else ``MCRDL_TIMEOUT``, else torch's default (:func:`seconds`); past it
the work fails with the engine's diagnostic (op, group, backend, rank), the group is
broken, and a chained waiter gets the error instead of hanging. ``wait(timeout)`` with
a timeout of its own raises past it and leaves the work in flight. Errors are raised
as a ``torch.distributed.DistBackendError`` (a RuntimeError) that is also the core's
error type (:func:`dist_error`): torch code catches the first, MCR-DL code the second.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from mcrdl_core.base import config as _config
from mcrdl_core.base.errors import BrokenGroupError, CommTimeoutError, McrdlError
from mcrdl_core.engine.progress import engine as _engine

log = logging.getLogger("mcrdl.torch.progress")

_NAP_MIN_S = 20e-6
_NAP_MAX_S = 1e-3
_IDLE_S = 60.0  # an idle callback thread ends after this long
_FIRE = threading.Lock()  # a future is completed once, by whichever thread gets there


def _span(timeout) -> float | None:
    """A timeout as torch passes it (timedelta or seconds) in seconds; zero or None:
    none given (None)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return float(timeout) if timeout and timeout > 0 else None


def seconds(timeout) -> float | None:
    """A process group's timeout as torch hands it to the creator, in seconds, or None
    for "MCRDL_TIMEOUT". torch passes its default (30 minutes) when the user gave none,
    so that value counts as not given: it yields to ``MCRDL_TIMEOUT`` when that is set
    and is kept otherwise. (An explicit ``timeout=timedelta(minutes=30)`` is the same
    value and cannot be told apart.)"""
    secs = _span(timeout)
    if secs == default_pg_timeout.total_seconds() and _config.is_set("MCRDL_TIMEOUT"):
        return None
    return secs


_DIST_ERRORS: dict = {}


def dist_error(exc: BaseException) -> BaseException:
    """``exc`` as torch code expects a backend's error: a copy that is also a
    ``torch.distributed.DistBackendError`` (a RuntimeError), keeping its own type (a
    CommTimeoutError stays a TimeoutError) and message; ``exc`` is its cause. Errors
    that are not MCR-DL's are returned as they are."""
    if not isinstance(exc, McrdlError) or isinstance(exc, dist.DistBackendError):
        return exc
    cls = _DIST_ERRORS.get(type(exc))
    if cls is None:
        cls = _DIST_ERRORS[type(exc)] = type(type(exc).__name__, (type(exc), dist.DistBackendError),
                                             {"__module__": type(exc).__module__})
    err = cls(*exc.args)
    err.__cause__ = exc
    return err


class PGWork(dist.Work):
    """One call of the process group: one or more core works (a coalesced call issues
    several). ``outputs`` is the future's value (torch's convention: the list of output
    tensors); ``source`` gives the sender of an any-source receive (group rank);
    ``timeout`` is the process group's (None: ``MCRDL_TIMEOUT``)."""

    def __init__(self, works, outputs, timeout: float | None = None, source=None):
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._outputs = outputs
        self._timeout = timeout
        self._source = source
        self._future = None
        self._fired = False
        self._deadline = None

    # --- state --------------------------------------------------------------------------
    def _all_done(self) -> bool:
        return all(w.done for w in self._works)

    def _error(self):
        for w in self._works:
            if w.error is not None:
                return w.error
        return None

    def is_completed(self) -> bool:
        for w in self._works:  # each polls once if nobody else is polling
            if not w.test():
                return False
        return True

    def is_success(self) -> bool:
        return self._all_done() and self._error() is None

    def exception(self):
        return self._error()

    def _own_timeout(self, w) -> float | None:
        """The timeout to hand ``w.wait`` when the caller gave none: None (the engine
        takes the group's timeout or MCRDL_TIMEOUT, and a wait past it breaks the group)
        unless this group's timeout is not recorded on the core group, which is then
        passed as a deadline of the caller's."""
        if self._timeout is None or getattr(w.group, "timeout", None) == self._timeout:
            return None
        return self._timeout

    def _default_timeout(self) -> tuple:
        """(seconds, whether running past them breaks the group) for a wait -- or the
        future -- with no timeout of its own (see ``_own_timeout``)."""
        secs = self._own_timeout(self._works[0])
        if secs is not None:
            return secs, False
        return _engine().timeout_of(self._works), True

    def wait(self, timeout=None) -> bool:
        """Drive every backend until this call is done; re-raise its error (as
        :func:`dist_error` makes it). ``timeout`` (timedelta or s) bounds the whole
        call and leaves it in flight when it passes; zero/None: the group's own."""
        explicit = _span(timeout)
        end = None if explicit is None else time.monotonic() + explicit
        try:
            for w in self._works:
                if end is None:
                    w.wait(self._own_timeout(w))
                elif not w.done:  # what is left of the call's timeout (to the ms)
                    w.wait(round(max(end - time.monotonic(), 0.0), 3))
        except McrdlError as exc:
            raise dist_error(exc) from exc
        finally:
            if self._future is not None and self._all_done():
                self._complete_here()
        return True

    def synchronize(self) -> None:
        self.wait()

    def result(self):
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        self.wait()
        return self._source()

    def source_rank(self) -> int:
        return self._source_rank()

    # --- future -------------------------------------------------------------------------
    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors once the call is done -- by a
        callback thread if nobody waits (see the module docstring)."""
        if self._future is None:
            self._future = torch.futures.Future()
            if self._all_done():
                self._fire()
            else:
                _DRIVER.watch(self)
        return self._future

    def _claim(self) -> bool:
        with _FIRE:
            if self._fired:
                return False
            self._fired = True
            return True

    def _fire(self, error=None) -> None:
        """Complete the future (once), which runs its callbacks on this thread."""
        if not self._claim():
            return
        error = error or self._error()
        if error is not None:
            self._future.set_exception(dist_error(error))
        else:
            self._future.set_result(self._outputs)

    def _complete_here(self) -> None:
        """After ``wait``: the future is done when ``wait`` returns. If a callback thread
        claimed it first, it marks it done at once (torch marks a future done before it
        runs the callbacks); this only waits for that mark, not for the callbacks."""
        if not self._fired:
            self._fire()
        end = time.monotonic() + 1.0  # (bounded, should the other thread have failed)
        while not self._future.done() and time.monotonic() < end:
            time.sleep(1e-5)

    def _expire(self, error, late, breaks: bool) -> None:
        """(On a callback thread.) The future's deadline passed: break the group if it
        was the runtime's own timeout (as a wait past it does), then fail the future."""
        on_timeout = _engine().on_timeout
        if breaks and on_timeout is not None:
            on_timeout([w for w in late if not w.done], error)
        self._fire(error)


class _Callbacks:
    """The threads that complete futures: each job (one future's completion, with its
    callbacks) goes to an idle thread, or to a new one when all are busy -- a callback
    that blocks (on another future, say) never holds up the next completion."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list = []  # threads waiting for a job: [event, job]
        self._started = 0

    def submit(self, job) -> None:
        with self._lock:
            slot = self._idle.pop() if self._idle else None
        if slot is None:
            slot = [threading.Event(), job]
            self._started += 1
            threading.Thread(target=self._run, args=(slot,), daemon=True,
                             name=f"mcrdl-callback-{self._started}").start()
        else:
            slot[1] = job
            slot[0].set()

    def _run(self, slot) -> None:
        ready = slot[0]
        while True:
            job, slot[1] = slot[1], None
            try:
                job()
            except BaseException:  # torch stores a callback's error in its future
                log.exception("mcrdl: completing a future failed")
            ready.clear()
            with self._lock:
                self._idle.append(slot)
            if not ready.wait(_IDLE_S):
                with self._lock:
                    if slot in self._idle:  # nobody handed it a job meanwhile: end
                        self._idle.remove(slot)
                        return
                ready.wait()  # a job was handed over just now


class _Driver:
    """The progress thread: started on the first future asked for, then asleep on a
    condition whenever no future is pending. It polls, and checks deadlines; it hands
    every completion to the callback threads."""

    def __init__(self):
        self._cond = threading.Condition()
        self._watched: list = []
        self._thread = None
        self.callbacks = _Callbacks()

    def watch(self, work: PGWork) -> None:
        secs, breaks = work._default_timeout()
        work._deadline = (time.monotonic() + secs, secs, breaks)
        with self._cond:
            self._watched.append(work)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mcrdl-progress",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        return len(self._watched)

    def _run(self) -> None:
        eng = _engine()
        nap = _NAP_MIN_S
        while True:
            with self._cond:
                while not self._watched:
                    self._cond.wait()
                    nap = _NAP_MIN_S
                works = list(self._watched)
            if eng.poll_lock.acquire(False):  # else another thread is polling
                try:
                    eng.progress()
                except BaseException:  # a library error is attached to its work; log others
                    log.exception("mcrdl: the progress thread's poll failed")
                finally:
                    eng.poll_lock.release()
            finished = [w for w in works if w._all_done()]
            now = time.monotonic()
            expired = [w for w in works if w not in finished and now > w._deadline[0]]
            for w in finished:
                self.callbacks.submit(w._fire)
            for w in expired:
                late = [x for x in w._works if not x.done]
                if not late:  # completed just now
                    self.callbacks.submit(w._fire)
                    continue
                _, secs, breaks = w._deadline
                err = CommTimeoutError(eng.diagnose(late, secs))
                self.callbacks.submit(lambda w=w, e=err, late=late, b=breaks: w._expire(e, late, b))
            if finished or expired:
                with self._cond:
                    gone = set(map(id, finished + expired))
                    self._watched = [w for w in self._watched if id(w) not in gone]
                nap = _NAP_MIN_S
            else:
                nap = min(nap * 2, _NAP_MAX_S)
            time.sleep(nap)


_DRIVER = _Driver()


def driver() -> _Driver:
    return _DRIVER


# --- teardown ------------------------------------------------------------------------------
#: how long ``destroy_process_group`` lets a group's in-flight work finish (work already
#: matched finishes in microseconds to milliseconds) before it gives the rest up
SHUTDOWN_GRACE_S = 1.0


def close_group(group, how: str, grace: float) -> list:
    """Teardown of a process group's core ``group`` (``shutdown``: ``how`` "destroyed",
    ``abort``: "aborted"). Its in-flight work gets ``grace`` seconds to finish (none if
    the group is already broken: what it holds will not complete); whatever is still
    pending then is given up at once (``ProgressEngine.abandon``: its waits raise, its
    buffers stay referenced), the group is marked broken, since its communicators hold
    operations that will never be matched, and a warning names the work. Never raises,
    never waits longer than ``grace``. Returns the works given up."""
    eng = _engine()
    mine = [w for w in eng.inflight[:] if w.group is group]
    if mine and grace > 0 and group.broken is None:
        try:
            eng.wait(mine, min(grace, eng.timeout_of(mine)))
        except CommTimeoutError:
            pass
    left = [w for w in mine if not w.done]
    if not left:
        return []
    names = ", ".join(sorted({f"{w.op}" for w in left}))
    err = BrokenGroupError(
        f"mcrdl: rank {eng.rank}: {len(left)} operation(s) ({names}) on {group.describe()} "
        f"were still pending when the process group was {how}; they were given up and "
        "never complete. Wait for a group's work before destroying it, or make sure "
        "every rank makes the matching calls")
    group.mark_broken(err)
    eng.abandon(left, err)
    log.warning("%s", err)
    return left
