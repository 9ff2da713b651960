"""Running an algorithm written as a generator as one Work of the progress engine.

An algorithm (``algorithms.py``) is a generator: it encodes, posts nonblocking sends
and receives through a :class:`Channel` (the chosen backend's own ``send``/``recv``/
``all_to_all``/``all_gather``, each returning that backend's Work), and *yields* the
Works it needs finished before it can go on. :class:`ScheduleWork` runs the generator
up to its first yield when the call is issued (so data is on the wire at once), then
advances it whenever the engine polls it and the yielded Works are complete. No call
ever blocks: waiting is the engine's loop, which drives every backend's in-flight
work, so the deadlock-freedom rule holds for compressed collectives as for any other,
and a stalled peer ends in the engine's timeout naming the op, the step and the peer.

A multi-stage call keeps its place. A stage that is a library call matched by its order
among the group's calls (a backend collective; any point-to-point on a backend without
tags, NCCL's) must be issued at the same place on every rank relative to the other
calls of the group. Issued from whichever poll finds the stage before it done, it would
not be: one rank issues it before the caller's next call, another after. So an
algorithm yields :class:`Ordered` where the stage after the yield is such a call, and
:class:`ScheduleWork` waits for those works (through the progress loop) while the call
is being issued, before it returns: every such stage is issued inside its own call, in
program order. Tagged point-to-point on host backends (the slot's tags, which no other
call in flight uses) may still go out from any poll.
"""
from __future__ import annotations

import numpy as np

from ..memory import alloc
from ..base import dtypes as _dt
from ..base import tags as _tags
from ..memory.buffer import Buffer
from ..base.ops import Op
from ..base.errors import McrdlError
from ..engine import faults as _faults
from ..engine.work import Work
from .codecs import bf16_bits
from .codecs import bf16_values

class Ordered(tuple):
    """Works an algorithm yields where what it issues next is a library call matched by
    order (see the module docstring): ``ScheduleWork`` waits for them inside the call."""


class ScheduleWork(Work):
    """A generator-driven Work; ``result`` is the generator's return value. ``wait``:
    the engine's ``wait(works)``, for the yields marked :class:`Ordered`, which are
    waited for here, while the call is issued (an algorithm never yields one after a
    plain yield: what follows a plain yield is polled, not issued in program order)."""

    poll_group = "compress"

    def __init__(self, backend: str, op, group, gen, desc: str = "", wait=None):
        super().__init__(backend, op, group, desc=desc)
        self._gen = gen
        self._waiting: list = []
        self._ordered = False
        self._desc0 = desc  # desc grows "waiting on ..." for timeout diagnostics
        self._issuing = True
        try:
            done = self._advance()
            while not done and self._ordered:
                if wait is None:
                    raise RuntimeError(f"{desc}: an Ordered wait needs the engine's wait")
                wait(self._waiting)
                done = self._advance()
        except McrdlError:
            raise
        except Exception as exc:  # the library failed a stage while the call was issued
            # (a stage's receive of more than its buffer holds, where the ranks chose
            # different codecs): what a wait on this work would raise, CommFailedError
            # naming op, group and backend, and the group broken, not the library's own
            self._issuing = False
            self.complete(exc)
            raise _faults.work_failed(self) from exc
        self._issuing = False
        if done:
            self.complete()

    def _advance(self) -> bool:
        while True:
            for w in self._waiting:
                if not w.test():
                    self.desc = f"{self._desc0} waiting on {w.op} {w.desc}"
                    return False
                if w.error is not None:
                    raise w.error
            try:
                nxt = next(self._gen)
            except StopIteration as stop:
                self.value = stop.value
                return True
            self._ordered = isinstance(nxt, Ordered)
            if self._ordered and not self._issuing:
                raise RuntimeError(f"{self._desc0}: the schedule yielded an Ordered wait after "
                                   "the call was issued (a defect of the algorithm: its next "
                                   "stage would go out from a poll, out of program order)")
            self._waiting = list(nxt) if isinstance(nxt, (list, tuple)) else [nxt]
            self.host_progress = any(w.host_progress for w in self._waiting)

    def poll(self) -> bool:
        return self._advance()


#: ops whose messages a channel sends on the backend chosen for another: a receive
#: runs where its send does (both ends of a message select from the same facts)
_SAME_CHOICE = {Op.RECV: Op.SEND}


class Channel:
    """The group, backend and device one compressed call communicates on."""

    def __init__(self, rt, group, backend: str | None, device):
        self.rt, self.group, self.device = rt, group, device
        self.size, self.rank = group.size, group.rank
        self.prev, self.next = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self._backend = backend
        self._chosen: dict = {}
        self._prepost = None
        self.slot = 0

    def claim_slot(self) -> None:
        """Take the group's next sequence number and its tag slot (``mcrdl_core.base.tags``),
        waiting through the progress loop for an earlier call still in flight on that
        slot, or, on a backend without tags (NCCL's ordered streams), for every earlier
        compressed call on the group. Every rank waits for the same calls."""
        g = self.group
        self.slot = g.next_seq() % _tags.SLOTS
        held = g.tag_slots.values() if not self.prepost else [g.tag_slots.get(self.slot)]
        busy = [w for w in held if w is not None and not w.is_completed()]
        if busy:
            self.rt.engine.wait(busy)

    def hold(self, work) -> None:
        """Record ``work`` as the holder of this call's slot until it completes."""
        slots, slot = self.group.tag_slots, self.slot
        slots[slot] = work
        work.add_finalizer(lambda: slots.pop(slot, None) if slots.get(slot) is work else None)

    def staging(self, nbytes: int) -> Buffer:
        """Fresh bytes on the call's device (encoded data lives here)."""
        return alloc.empty((nbytes,), _dt.uint8, self.device)

    def backend(self, op: Op, buf: Buffer, nbytes: int | None = -1):
        """The backend for ``op``, chosen once per call (``nbytes``: the selection size,
        as ``Runtime.select`` takes it; -1: ``buf``'s). The call's first choice of each
        op is made while it is issued, on every rank alike (``entry._issue`` makes them,
        with sizes every rank shares): so receives take the choice of the sends they
        match (``RECV`` is ``SEND`` here), never one of their own from another size,
        and the chosen backend's communicator is made at once, by every rank, also by a
        rank that then sends and receives nothing (a Gloo communicator is made by a
        rendezvous of every member; one that never came would hang the others)."""
        op = _SAME_CHOICE.get(op, op)
        be = self._chosen.get(op)
        if be is None:
            be = self._chosen[op] = self.rt.select(op, self.group, buf, self._backend,
                                                   nbytes=nbytes)
            be.comm(self.group)
        return be

    def send(self, buf: Buffer, peer: int, tag: int, op: Op = Op.SEND) -> Work:
        """A tagged send on the backend chosen for ``op`` (a ring's sends: SEND)."""
        return self.backend(op, buf).send(self.group, buf, peer,
                                          _tags.compress_tag(self.slot, tag))

    def recv(self, buf: Buffer, peer: int, tag: int, op: Op = Op.RECV) -> Work:
        """A tagged receive on the backend chosen for ``op`` (a ring's: RECV)."""
        return self.backend(op, buf).recv(self.group, buf, peer,
                                          _tags.compress_tag(self.slot, tag))

    @property
    def prepost(self) -> bool:
        """True: receives may be posted ahead of sends (host backends). False for a
        backend that runs point-to-point in order on a stream (``batch_p2p``: NCCL)."""
        if self._prepost is None:
            be = self.backend(Op.SEND, self.staging(1))
            self._prepost = not (self.force_paired or be.grouped_p2p)
        return self._prepost

    #: tests set this to run the paired (NCCL-style) schedule on a host backend
    force_paired = False

    def sendrecv(self, sbuf: Buffer, speer: int, rbuf: Buffer, rpeer: int, tag: int) -> Work:
        """One send and one receive issued together (one NCCL group where the backend
        has ``batch_p2p``); one Work for both."""
        be = self.backend(Op.SEND, sbuf)
        if be.grouped_p2p:
            return be.batch_p2p(self.group, [(sbuf, speer)], [(rbuf, rpeer)])
        return _Both(self.send(sbuf, speer, tag), self.recv(rbuf, rpeer, tag))

    def a2a_p2p(self, send: bool, arr, peer: int, tag: int) -> Work:
        """Send ``arr`` (a contiguous NumPy array) to ``peer``, or receive into it, on
        the backend this call chose for its all-to-all (chosen alike on every rank), so
        that both ends of each message use one backend whatever its size."""
        buf = Buffer.from_numpy(arr.view(np.uint8))
        return (self.send if send else self.recv)(buf, peer, tag, Op.ALL_TO_ALL)

    def direct_p2p(self) -> bool:
        """Whether this call's all-to-all backend takes tagged point-to-point messages
        posted in any order (a host backend: MPI, Gloo; not NCCL's ordered streams)."""
        be = self._chosen.get(Op.ALL_TO_ALL)
        return be is not None and not be.grouped_p2p and not self.force_paired

    def all_to_all(self, out: Buffer, inp: Buffer, out_counts=None, in_counts=None) -> Work:
        """One backend all-to-all of byte buffers: ``in_counts[k]`` bytes of ``inp``
        (packed in rank order) go to rank k, ``out_counts[k]`` bytes from rank k land in
        ``out`` (Alltoallv where they differ); None: even blocks of the whole buffers."""
        if in_counts is None:
            in_counts = [inp.numel // self.size] * self.size
        if out_counts is None:
            out_counts = [out.numel // self.size] * self.size
        return self.backend(Op.ALL_TO_ALL, inp).all_to_all(self.group, out, inp,
                                                           list(out_counts), list(in_counts))

    def all_gather(self, out: Buffer, inp: Buffer) -> Work:
        return self.backend(Op.ALL_GATHER, inp).all_gather(self.group, out, inp)


class _Both(Work):
    """A send and a receive as one Work (the paired schedule on a host backend)."""

    def __init__(self, a: Work, b: Work):
        super().__init__(a.backend, Op.RECV, a.group, desc=f"{a.desc} + {b.desc}")
        self.parts = (a, b)
        self.host_progress = a.host_progress or b.host_progress

    def poll(self) -> bool:
        for w in self.parts:
            if not w.test():
                return False
            if w.error is not None:
                raise w.error
        return True


class AnyOf(Work):
    """Complete as soon as one of ``works`` is (a wait for whichever receive is in
    first); it does not finish the others, which are still polled on their own."""

    def __init__(self, works, peers):
        super().__init__(works[0].backend, works[0].op, works[0].group,
                         desc="the first of the receives from ranks "
                              + ", ".join(map(str, peers)))
        self.parts = works
        self.host_progress = any(w.host_progress for w in works)

    def poll(self) -> bool:
        return any(w.test() for w in self.parts)


# --- dtype conversions between a call's buffers and the arrays the codecs work on ------
def xp_of(buf: Buffer):
    if buf.device.kind == "cpu":
        return np
    import cupy  # lazy: CUDA buffers only

    return cupy


def to_work(buf: Buffer, wd: np.dtype):
    """``buf`` as a flat array of the work dtype (a view when it already is one)."""
    arr = buf.array().reshape(-1)
    if buf.dtype is _dt.bfloat16 and buf.device.kind != "cpu":  # CuPy sees uint16 bits
        return bf16_values(arr, xp_of(buf), wd)
    return arr if arr.dtype == wd else arr.astype(wd)


def store(buf: Buffer, values) -> None:
    """Write work-dtype ``values`` into ``buf`` (rounding to its dtype)."""
    arr = buf.array().reshape(-1)
    if buf.dtype is _dt.bfloat16 and buf.device.kind != "cpu":
        arr[...] = bf16_bits(values, xp_of(buf))
    else:
        arr[...] = values
