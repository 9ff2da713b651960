"""The progress engine: the rule that makes mixing libraries deadlock-free.

No wait ever blocks inside one library while work of another is in flight. Every
wait is a loop that polls *all* in-flight work of *all* backends — MPI requests in one
``Testsome`` call (which is also what drives MPI's progress), Gloo works'
``is_completed()``, CUDA events' ``query()`` — until the awaited work is done or the
timeout passes, which raises :class:`CommTimeoutError` naming op, group, backend and
rank instead of hanging.

Polling cost. While work that needs the host to drive it is in flight
(``Work.host_progress``: MPI moves pipelined messages only while some rank calls into
it) and this host has a core per rank, the loop polls without pause, as MPI's own
blocking calls do: yielding between polls halved MPI's bandwidth (1 MiB all-reduce on 2
ranks: 393 µs with yields after 100 µs, 289 µs spinning, 233 µs raw MPI). When the
host has more ranks than cores (3 ranks on 2 cores), it spins ``MCRDL_SPIN_US`` µs
(default 100) and then gives up the CPU between polls with ``time.sleep(0)``, so that
the rank doing the work gets the core; so does a process that another took its core
from (a pass of the loop that took over ``PREEMPTED_S``: a busy host), for
``CONTENDED_S``. On Linux ``sleep(0)`` is a nap of the timer slack (50 µs; about 60 µs
a call), not a bare ``sched_yield``: ``sched_yield`` instead, or naps growing to 0.5 ms,
made no app faster where 4 ranks share 2 cores (docs/benchmarks.md, "Emulated hosts
at 1 Gbit/s"). With no host-driven work in flight, it gives up the CPU the same
way after the spin and, after 2 ms, naps with a backoff capped at 1 ms; Gloo and CUDA
progress on their own threads and engines. A wait whose works can all be slept on
(``Work.block``: Gloo's works, a helper thread joined or torch's timed wait) with
nothing host-driven in flight sleeps on them instead (a spinning waiter would keep the
GIL and the core that Gloo's threads need, and its naps would see completion late).

Threads. The engine is shared by every thread of the process (a training loop, a
checkpoint or metrics thread, mcrdl_torch's progress thread), and no thread keeps it
for the length of a wait: two threads running collectives on two groups, interleaved
differently on different ranks, would deadlock otherwise. Two locks:

- ``poll_lock`` is held for one poll at a time (``progress``, ``Work.test``, the
  spin of a lone work), so no two threads ever poll one library request at once. It
  is only ever *tried*: a thread that finds it taken skips its poll, since the holder
  is polling everybody's work, and looks at its own works' state instead. (A blocking
  acquire here starves: a thread that polls without pause takes the lock back before a
  woken waiter gets to it.)
- ``lock`` is held while a call is issued (mcrdl_torch's process group holds it around
  each call). A wait made while its own thread holds it from an outer frame (a blocking
  call, or a call that first waits for a memory conflict) lets go of every level of it
  until the wait returns, so that other threads can issue meanwhile.

Polls read a snapshot of the in-flight list, so works that other threads add or drop
meanwhile are seen at the next poll. Whichever thread polls drives everybody's work.

Timeouts. A wait without an explicit timeout uses the runtime's own: the shortest
``timeout`` of the works' groups where one is set (a torch process group's
``timeout=``), else ``MCRDL_TIMEOUT``. A wait past the runtime's own timeout breaks the
groups of its unfinished works (``on_timeout``); a shorter deadline a caller passes
leaves them in flight, to be waited again. Time the process was stopped does not
count: where one of the loop's pauses (a nap or a block of at most 1 ms) overran by
more than :data:`FROZEN_S` seconds, the whole machine or process was stopped meanwhile
(a virtual machine whose CPUs the host did not run, a suspend, SIGSTOP), its peers most
likely with it, and the deadline moves by that much. On the 2-core test VM such stops
of 10-57 s were seen (2026-11-27), with the guest kernel reporting a "workqueue
lockup"; counted, a stop longer than the time a wait has left would break a group whose
peers did nothing wrong.

Sooner than the timeout. Every :data:`CHECK_S` seconds of a wait the engine asks its
``peer_check`` hook (the runtime's ``peers_gone``) whether the unfinished works can
still complete: not if a group of theirs was broken meanwhile by another work (a Gloo
connection a dead peer closed, another thread's timeout), nor if a member's process on
this machine has ended. Then the wait raises that error at once, and the groups are
marked broken as for a timeout.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from ..base import config as _config
from ..base.errors import CommTimeoutError

log = logging.getLogger("mcrdl.progress")

#: seconds between two ``peer_check`` calls of a wait (the first after as long)
CHECK_S = 0.25
#: a pass of the wait loop that took longer than this (a pass takes a few µs) means the
#: process lost its core to another; the waits of the next CONTENDED_S seconds then yield
#: the CPU between polls after the spin, as they do where ranks outnumber cores
PREEMPTED_S = 200e-6
CONTENDED_S = 1.0
#: a pause of the wait loop (at most 1 ms asked) that overran by more than this means the
#: process was not run at all meanwhile: that time is left out of the timeout (see above).
#: Far beyond any scheduling delay; the time spent in polls and their callbacks is not
#: in a pause, so a callback that blocks still counts.
FROZEN_S = 5.0


class ProgressEngine:
    def __init__(self):
        self.inflight: list = []
        # held while a call is issued; a wait lets go of it (see "Threads" above)
        self.lock = threading.RLock()
        # held for one poll; only ever tried, never waited for (see "Threads" above)
        self.poll_lock = threading.RLock()
        # (work, what it kept) for works given up without completing (abandon()): the
        # library may still read or write their memory, so it stays referenced
        self.abandoned: list = []
        # works complete for their caller whose device side may still use their memory
        # (an NCCL op the caller's stream was made to wait on): see defer()
        self.pending: list = []
        self.rank = 0
        self.timeout = _config.get("MCRDL_TIMEOUT")
        self.spin_s = _config.get("MCRDL_SPIN_US") * 1e-6
        self.oversubscribed = False  # more ranks than cores on this host: yield when idle
        # until when this process counts as competing for its core (see _loop)
        self.contended_until = 0.0
        # called with (unfinished works, error) when a wait runs past the runtime's own
        # timeout, before it raises: the runtime marks their groups broken (faults.py)
        self.on_timeout = None
        # called with the unfinished works every CHECK_S s of a wait: an error that says
        # they cannot complete (a dead peer, a group broken meanwhile), or None
        self.peer_check = None

    def configure(self, local_ranks: int) -> None:
        """Tell the engine how many ranks share this host (the runtime does, at init)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        self.oversubscribed = local_ranks > cores

    # --- registry -----------------------------------------------------------------------
    def add(self, work) -> None:
        if not work.done:
            work.engine = self
            self.inflight.append(work)

    def discard(self, work) -> None:
        _drop(self.inflight, work)

    def abandon(self, works, error: BaseException) -> list:
        """Give up on ``works`` without waiting (a process group aborted or destroyed
        with them pending): each still pending completes at once with ``error`` (its
        finalizers do not run; a wait on it raises), leaves the in-flight list, and keeps
        its buffers referenced here for the rest of the process, since its library may
        still write into them (a late peer's message). Returns the works given up."""
        polling = self.poll_lock.acquire(timeout=0.1)  # a poll completes works too
        try:
            left = [w for w in works if not w.done]
            for w in left:
                self.abandoned.append((w, w.keep))
                w.complete(error)
        finally:
            if polling:
                self.poll_lock.release()
        return left

    def defer(self, work) -> None:
        """Hold ``work`` -- waited by its caller, but the GPU may still read or write its
        buffers -- until ``work.release()`` says the device is done (it then lets the
        buffers go). Polled here and from every progress loop."""
        self.pending.append(work)
        self.reap()

    def reap(self) -> None:
        """Release pending works oldest first, stopping at the first still running (one
        stream completes in order: this stays O(1) per call). A ``release()`` that finds
        an asynchronous error raises it here, once, naming its op. Safe to run from two
        threads at once (a wait that returned at once holds no engine lock): each step is
        one list operation, and a work another thread dropped is simply gone."""
        pending = self.pending
        while pending:
            try:
                w = pending[0]
            except IndexError:  # emptied by another thread meanwhile
                return
            try:
                done = w.release()
            except BaseException:
                _drop(pending, w)  # its error is reported once
                raise
            if not done:
                return
            _drop(pending, w)

    def backends_in_flight(self) -> set:
        return {w.backend for w in self.inflight}

    # --- polling ------------------------------------------------------------------------
    def progress(self) -> None:
        """Poll every in-flight work once, batched per work class. The caller holds
        ``poll_lock``; the in-flight list is read from a snapshot (other threads add
        works meanwhile)."""
        if self.pending:
            self.reap()
        if not self.inflight:
            return
        inflight = self.inflight[:]
        if len(inflight) == 1:
            inflight[0].test()
            return
        batches: dict = {}
        for w in inflight:
            batches.setdefault(type(w), []).append(w)
        for cls, works in batches.items():
            try:
                cls.poll_many(works)
            except BaseException as exc:  # a library error: attach it to the batch
                for w in works:
                    w.complete(exc)

    def timeout_of(self, works) -> float:
        """The runtime's own timeout for a wait on ``works``: the shortest ``timeout`` of
        their groups where one is set, else ``MCRDL_TIMEOUT``."""
        best = None
        for w in works:
            t = getattr(w.group, "timeout", None)
            if t is not None and (best is None or t < best):
                best = t
        return self.timeout if best is None else best

    def wait(self, works, timeout: float | None = None) -> None:
        """Drive all backends until every work in ``works`` is complete, within
        ``timeout`` seconds (None: the runtime's own, see ``timeout_of``)."""
        if len(works) == 1 and works[0].test():  # fast path: done at the first look
            return
        pending = [w for w in works if not w.done]
        if not pending:
            return
        for w in pending:
            if w.engine is None:
                self.add(w)
        # a caller up the stack that holds ``lock`` (issuing a call) lets go of it while
        # this waits, and gets it back, at the same depth, before this returns
        lock = self.lock
        saved = lock._release_save() if lock._is_owned() else None
        try:
            if (len(pending) == 1 and not self.pending and self.inflight[:2] == pending
                    and self.spin_alone(pending[0])):
                return
            self._loop(pending, timeout)
        finally:
            if saved is not None:
                lock._acquire_restore(saved)

    def _loop(self, pending, timeout: float | None) -> None:
        """The progress loop of ``wait``: a poll when nobody else is polling, then the
        checks and the pause (see the module docstring)."""
        own_timeout = timeout is None  # the runtime's: a timeout breaks the group
        timeout = self.timeout_of(pending) if own_timeout else timeout
        poll_lock = self.poll_lock
        start = time.perf_counter()
        spin_until = start + self.spin_s
        yield_until = start + 0.002
        nap = 1e-5
        check_at = start + CHECK_S
        # works finished by other threads (Gloo's: ``block``) need the GIL: with no
        # host-driven work in flight, the loop sleeps on them (GIL released) instead
        threaded = all(w.block is not None for w in pending)
        last = paused = start
        while True:
            resumed = time.perf_counter()
            if resumed - paused > FROZEN_S:  # stopped meanwhile: not the peers' time
                start += resumed - paused
            if poll_lock.acquire(False):
                try:
                    self.progress()
                finally:
                    poll_lock.release()
            if all(w.done for w in pending):
                return
            now = time.perf_counter()
            if now - start > timeout:
                err = CommTimeoutError(self.diagnose(pending, timeout))
                if own_timeout and self.on_timeout is not None:
                    self.on_timeout([w for w in pending if not w.done], err)
                raise err
            if now > check_at and self.peer_check is not None:
                check_at = now + CHECK_S
                unfinished = [w for w in pending if not w.done]
                err = self.peer_check(unfinished)
                if err is not None:
                    if self.on_timeout is not None:
                        self.on_timeout(unfinished, err)
                    raise err
            paused = now  # (the checks below take microseconds: what follows is the pause)
            if threaded and not any(w.host_progress for w in self.inflight):
                w = next((w for w in pending if not w.done), None)
                if w is not None:  # (another thread may have completed them meanwhile)
                    w.block(1e-3)
                continue
            if now - last > PREEMPTED_S:  # one pass took far longer than a pass takes:
                self.contended_until = now + CONTENDED_S  # the CPU was taken from us
            last = now
            if now < spin_until:
                continue
            if any(w.host_progress for w in self.inflight):
                if self.oversubscribed or now < self.contended_until:
                    time.sleep(0)  # let the peer (or whoever needs the core) run
            elif now < yield_until:
                time.sleep(0)
            else:
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)

    def spin_alone(self, w) -> bool:
        """The one work in flight on this rank: poll it alone, without the loop's
        bookkeeping (about 0.3 µs a poll instead of 1.5, so completion is seen sooner),
        for at most the spin time; True if it completed. Polling it alone is the whole
        progress loop here, since no other library has work in flight; afterwards the
        loop below takes over, with its timeout. Skipped (False) while another thread
        polls."""
        if w.block is not None or not self.poll_lock.acquire(False):
            return False  # (a helper thread's work: the loop blocks on it, see _loop)
        try:
            if not w.done:
                try:
                    if not spin(w.poll, self.spin_s):
                        return False
                except BaseException as exc:  # a library error: the work fails with it
                    w.complete(exc)
                    return True
                w.complete()
            return True
        finally:
            self.poll_lock.release()

    def diagnose(self, pending, timeout: float) -> str:
        w = next(x for x in pending if not x.done)
        group = getattr(w.group, "describe", lambda: str(w.group))()
        others = [repr(x) for x in self.inflight if x is not w][:8]
        return (
            f"mcrdl: rank {self.rank}: {w.op} on {group} via backend '{w.backend}' "
            f"{w.desc + ' ' if w.desc else ''}did not complete within {timeout:g} s: Timed out "
            "waiting for peers. "
            f"Other work in flight on this rank: {others or 'none'}. "
            "Most likely a rank of the group did not make the matching call, or made it "
            "with another size, root or backend: run with MCRDL_DEBUG=1 to check the "
            "arguments across ranks, or raise MCRDL_TIMEOUT if the op is just slow.")


def spin(poll, seconds: float) -> bool:
    """Call ``poll()`` (a non-blocking test) until it returns True, for at most
    ``seconds``; True if it did. The loop of every wait that polls one request alone."""
    if poll():
        return True
    deadline = time.perf_counter() + seconds
    while not poll():
        if time.perf_counter() > deadline:
            return False
    return True


def _drop(works: list, work) -> None:
    """Remove ``work`` from ``works`` if still there (another thread may have)."""
    try:
        works.remove(work)
    except ValueError:
        pass


_ENGINE = ProgressEngine()


def engine() -> ProgressEngine:
    return _ENGINE
