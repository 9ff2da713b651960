"""The torch ``Work`` of the registered "mcrdl" process group, and the thread that
completes its futures.

Why a thread. torch code does not always wait: DDP's reducer issues a bucket's
all-reduce, chains a callback on ``work.get_future()`` and later blocks, in C++, on
the chained future -- nobody calls ``wait()`` on the Work and no Python code of ours
runs on the main thread in between. MPI, though, moves a message only while some
thread calls into it. So once a future has been asked for, a daemon thread
("mcrdl-progress") drives the progress engine until that future's work is done and
then completes the future (its callbacks run on that thread, as torch's Gloo runs
them on its worker threads).

Thread safety. The core's progress engine is single-threaded by design: polls of
the same MPI request from two threads, or a work list changing under an iteration,
would corrupt it. Every entry that touches the engine holds ``engine.lock`` (a
re-entrant lock): the process group holds it while it issues a call, the engine
holds it for the whole of each ``wait()``, and the thread holds it for one poll of
every in-flight work. The thread never waits inside the lock. While the main thread
waits, it polls everything itself and the thread stays out (it sees the lock taken
and naps).

Cost. A call that nobody asks a future of never touches the thread: issuing adds one
uncontended lock acquire (~0.1 µs). torch's blocking ``dist.all_reduce`` (``asyncOp``
False) takes the core's blocking call and gets a completed Work: 12.7 µs per 4-byte
call through ``pg.allreduce(...).wait()`` against 16.7 µs on the asynchronous path
(one process, MPI singleton, medians of 7 x 5000 calls). When futures are pending the thread polls with a
nap that starts at 20 µs and doubles to 1 ms while nothing completes (it gives the GIL
back between polls), and sleeps on a condition when nothing is pending.

A future that does not complete within the timeout (the group's, else
``MCRDL_TIMEOUT``) is failed with the engine's diagnostic (op, group, backend, rank),
so a chained waiter gets an error instead of hanging.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from mcrdl_core.errors import CommTimeoutError
from mcrdl_core.progress import engine as _engine

log = logging.getLogger("mcrdl.torch.progress")

_NAP_MIN_S = 20e-6
_NAP_MAX_S = 1e-3
_FIRE = threading.Lock()  # a future is completed once, by whichever thread gets there


def seconds(timeout) -> float | None:
    """torch passes timedeltas; zero or None mean "the default" (None)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return float(timeout) if timeout and timeout > 0 else None


class PGWork(dist.Work):
    """One call of the process group: one or more core works (a coalesced call issues
    several). ``outputs`` is the future's value (torch's convention: the list of output
    tensors); ``source`` gives the sender of an any-source receive (group rank)."""

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
        return all(w._done for w in self._works)

    def _error(self):
        for w in self._works:
            if w._error is not None:
                return w._error
        return None

    def is_completed(self) -> bool:
        if self._all_done():
            return True
        lock = _engine().lock
        if lock.acquire(blocking=False):  # poll once if nobody else is polling
            try:
                for w in self._works:
                    w.test()
            finally:
                lock.release()
        return self._all_done()

    def is_success(self) -> bool:
        return self._all_done() and self._error() is None

    def exception(self):
        return self._error()

    def wait(self, timeout=None) -> bool:
        """Drive every backend until this call is done (``timeout``: timedelta or s;
        zero/None: the group's timeout, else MCRDL_TIMEOUT); re-raise its error."""
        secs = seconds(timeout) or self._timeout
        try:
            with _engine().lock:
                for w in self._works:
                    w.wait(secs)
        finally:
            if self._future is not None and self._all_done():
                self._fire()
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
        """A future completed with the output tensors once the call is done -- by the
        progress thread if nobody waits (see the module docstring)."""
        if self._future is None:
            self._future = torch.futures.Future()
            if self._all_done():
                self._fire()
            else:
                _DRIVER.watch(self)
        return self._future

    def _fire(self, error=None) -> None:
        with _FIRE:
            if self._fired:
                return
            self._fired = True
        error = error or self._error()
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(self._outputs)


class _Driver:
    """The progress thread: started on the first future asked for, then asleep on a
    condition whenever no future is pending."""

    def __init__(self):
        self._cond = threading.Condition()
        self._watched: list = []
        self._thread = None

    def watch(self, work: PGWork) -> None:
        eng = _engine()
        work._deadline = time.monotonic() + (work._timeout or eng.timeout)
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
            if eng.lock.acquire(blocking=False):
                try:
                    eng.progress()
                except BaseException:  # a library error is attached to its work; log others
                    log.exception("mcrdl: the progress thread's poll failed")
                finally:
                    eng.lock.release()
            finished = [w for w in works if w._all_done()]
            now = time.monotonic()
            expired = [w for w in works if w not in finished and now > w._deadline]
            for w in finished:
                w._fire()
            for w in expired:
                late = next(x for x in w._works if not x._done)
                w._fire(CommTimeoutError(eng.diagnose([late], w._timeout or eng.timeout)))
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
