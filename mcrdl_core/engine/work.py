"""Work: the handle of one communication call.

Every backend returns a subclass. A Work is *polled*, never blocked on: ``test()``
asks the library whether it is done without waiting, and ``wait()`` hands the work to
the progress engine, whose loop polls all in-flight work of all backends (see
``progress.py``). Finalizers (copy out of a staging buffer, cast back from an upcast,
divide for AVG) run once, on the thread whose poll sees the library report completion.
Polls happen under the progress engine's ``poll_lock`` (``test()`` tries it), so no two
threads ever poll one library request at once.
"""
from __future__ import annotations

from time import perf_counter as _now
from typing import Callable

from .progress import engine as _engine
from .faults import work_failed


def conflicts(inflight, spans) -> bool:
    """Whether memory ``spans`` (``((lo, hi, writes), ...)``) conflicts with that of a
    work in ``inflight``: they overlap and one of the two writes (read after write,
    write after read, write after write). Two reads of the same memory do not."""
    for w in inflight:
        for a, b, wa in w.spans:
            for c, d, wb in spans:
                if (wa or wb) and a < d and c < b:
                    return True
    return False


def _failure(work):
    """The error to raise for a failed work (a library's is wrapped, and its group
    marked broken: see ``faults.work_failed``)."""
    return work_failed(work)


class Work:
    """Base class. Subclasses implement ``poll()`` (non-blocking) and, for batching,
    may set ``poll_group`` and implement ``poll_many``."""

    #: works with the same poll_group are polled together by ``poll_many``
    poll_group: str = "generic"
    #: True if the library only progresses while the host calls into it (MPI)
    host_progress: bool = False
    #: ``block(seconds)``: wait up to ``seconds`` for completion without holding the
    #: GIL, returning early when done; None where only polling can tell (see ThreadWork)
    block = None
    #: what the library may read or write until completion (buffers, temporaries);
    #: dropped by ``complete``
    keep: tuple = ()

    def __init__(self, backend: str, op, group=None, *, finalize: Callable | None = None,
                 spans=(), result=None, desc: str = ""):
        self.backend = backend
        self.op = op
        self.group = group
        self.desc = desc
        self.finalizers = [finalize] if finalize else []
        self.spans = spans  # ((lo, hi, writes), ...) for memory-overlap ordering
        self.done = False
        self.error: BaseException | None = None
        self.value = result
        self.engine = None  # set when registered in flight

    # --- backend hooks ------------------------------------------------------------------
    def poll(self) -> bool:
        """True once the library has finished. Must not block."""
        raise NotImplementedError

    @classmethod
    def poll_many(cls, works: list["Work"]) -> None:
        """Poll a batch of works of this class; default polls one by one."""
        for w in works:
            if not w.done and w.poll():
                w.complete()

    # --- state --------------------------------------------------------------------------
    _completing = False

    def add_finalizer(self, fn: Callable) -> None:
        if self.done or self._completing:
            fn()
        else:
            self.finalizers = [*self.finalizers, fn]  # (a subclass may start with a tuple)

    def complete(self, error: BaseException | None = None) -> None:
        """Run the finalizers (copies back, casts, AVG's division), then mark the work
        done: another thread that sees ``done`` (a waiter, the progress thread firing a
        torch future) must find the results in the caller's buffers already."""
        if self.done or self._completing:
            return
        self._completing = True
        fins, self.finalizers = self.finalizers, []
        if fins and error is None:
            try:
                for fn in fins:
                    fn()
            except BaseException as exc:  # surfaced at wait()
                error = exc
        self.error = error
        self.keep = ()  # the library is done with the buffers: let them go
        self.t_done = _now()  # (the flight recorder's end of an async call)
        self.done = True
        if self.engine is not None:
            self.engine.discard(self)

    def test(self) -> bool:
        """Non-blocking: True when complete. Drives this work's library once, under the
        engine's ``poll_lock``; while another thread holds it (it is polling every
        in-flight work, this one included) only reports the state."""
        if not self.done:
            lock = (self.engine or _engine()).poll_lock
            if lock.acquire(False):
                try:
                    if not self.done and self.poll():
                        self.complete()
                except BaseException as exc:
                    self.complete(exc)
                finally:
                    lock.release()
        return self.done

    def is_completed(self) -> bool:
        return self.test()

    def is_success(self) -> bool:
        return self.done and self.error is None

    def exception(self):
        return self.error

    def wait(self, timeout: float | None = None) -> bool:
        """Block (polling every backend's in-flight work) until done; re-raise its error.

        ``timeout`` in seconds; None means the runtime's own (the group's timeout if it
        has one, else ``MCRDL_TIMEOUT``), past which the group is broken; an explicit
        timeout leaves the work in flight.
        """
        if not self.done:
            eng = self.engine
            # alone in flight (the usual async call): poll it alone (the engine's loop
            # would do the same first). A slice, since other threads may change the list.
            if (timeout is None and eng is not None and not eng.pending
                    and eng.inflight[:2] == [self]):
                eng.spin_alone(self)
            if not self.done:
                if hasattr(timeout, "total_seconds"):  # torch passes a timedelta
                    timeout = timeout.total_seconds()
                (eng or _engine()).wait([self], timeout)
        if self.error is not None:
            raise _failure(self)
        return True

    def result(self):
        """The op's result once complete (e.g. the source rank of a recv)."""
        self.wait()
        return self.value

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        return f"<Work {self.op} via {self.backend} {self.desc} ({state})>"


class CompletedWork(Work):
    """Work that finished when it was issued (world size 1, local ops)."""

    def __init__(self, backend: str, op, group=None, result=None):
        super().__init__(backend, op, group, result=result)
        self.done = True

    def poll(self) -> bool:
        return True


class ThreadWork(Work):
    """Work done by a helper thread (a library call that can only block, such as a
    rendezvous). The progress loop keeps driving other libraries meanwhile."""

    poll_group = "thread"

    def __init__(self, backend: str, op, fn: Callable, group=None, desc: str = ""):
        import threading

        super().__init__(backend, op, group, desc=desc)
        self._value = None
        self._exc = None

        def run():
            try:
                self._value = fn()
            except BaseException as exc:
                self._exc = exc

        self._thread = threading.Thread(target=run, name=f"mcrdl-{desc or op}", daemon=True)
        self._thread.start()

    def poll(self) -> bool:
        if self._thread.is_alive():
            return False
        if self._exc is not None:
            raise self._exc
        self.value = self._value
        return True

    def block(self, seconds: float) -> None:
        """Join the helper thread for up to ``seconds``. The helper needs the GIL to
        finish, so a waiter must not spin for it: a spinning thread keeps the GIL until
        Python's switch interval (5 ms) or the wait loop's first nap (2 ms). A join
        releases the GIL and returns the moment the thread ends."""
        self._thread.join(seconds)


class EventWork(Work):
    """A CUDA event (any object with a non-blocking ``done`` property, such as
    ``cupy.cuda.Event``): complete once the GPU has passed the point where the event was
    recorded. The progress loop *queries* it (``cudaEventQuery``) and never synchronizes,
    so MPI and Gloo work in flight keeps being driven while the GPU catches up.

    ``check`` (optional) is called on each poll that finds the event not yet done; it
    raises the library's asynchronous error (NCCL's ``check_async_error``) so that a
    failed peer surfaces as an error naming the op instead of a wait that never ends.
    ``keep`` holds memory the GPU may still read or write (staging buffers)."""

    poll_group = "cuda"

    def __init__(self, backend: str, op, event, group=None, *, keep=(), check=None,
                 desc: str = ""):
        super().__init__(backend, op, group, desc=desc)
        self.event = event
        self.keep = keep
        self._check = check

    def poll(self) -> bool:
        if self.event.done:
            return True
        if self._check is not None:
            self._check()
        return False


class ChainWork(Work):
    """Work done in stages: ``first``, then whatever ``then()`` returns once ``first`` is
    complete (a Work, or None when nothing is left). Used for CUDA buffers on host
    libraries: the MPI/Gloo request, then the copy of the result back to the GPU (an
    EventWork). The chain is polled like any other work; ``result`` is ``first``'s."""

    def __init__(self, first: Work, then: Callable):
        super().__init__(first.backend, first.op, first.group, desc=first.desc)
        self.first = self.stage = first
        self._then = then
        self.host_progress = first.host_progress

    def poll(self) -> bool:
        while True:
            if not self.stage.test():
                return False
            if self.stage.error is not None:
                raise self.stage.error
            nxt, self._then = (self._then() if self._then else None), None
            if nxt is None:
                self.value = self.first.value
                return True
            self.stage = nxt
            self.host_progress = nxt.host_progress
