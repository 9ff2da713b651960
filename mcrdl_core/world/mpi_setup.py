"""Set-up traffic over MPI that waits through the progress loop, never inside MPI.

Creating a communicator and the bootstrap's small exchanges are collective: a blocking
MPI call there (``Comm.Dup``, ``Comm.Create_group``, mpi4py's pickled ``bcast``) waits
for every peer with no timeout, and while it waits nothing drives the other libraries'
work. Here each step is a nonblocking MPI call whose request is a :class:`RequestsWork`
polled by the progress engine, so a peer that never comes (a straggler, a dead rank)
ends in :class:`~mcrdl_core.base.errors.CommTimeoutError` after ``MCRDL_TIMEOUT`` naming
the step, and in-flight work of other backends keeps moving meanwhile.

- :func:`dup`: ``MPI_Comm_idup`` (MPI-3), fully nonblocking.
- :func:`members_ready`: MPI has no nonblocking ``Comm_create_group``/``Comm_split``.
  Before such a call the members run a readiness handshake of nonblocking point-to-point
  messages (each member tells the leader it is there and which group it is creating;
  the leader answers once all are, with a verdict: a member creating another group
  makes every member raise MismatchError) on a private communicator. Only then is the blocking creation called, which returns at
  once because every member is already in it. Only a peer that dies between the
  handshake and the creation (a window of microseconds) could still block it.
- :func:`bcast`, :func:`allgather`: pickled objects moved by ``Ibcast``/``Iallgather(v)``
  (a length, then the bytes).

mpi4py is imported inside the functions: the core imports without it.
"""
from __future__ import annotations

import hashlib
import pickle

import numpy as np

from ..base.errors import MismatchError
from ..engine.work import Work
from ..engine.progress import engine


class RequestsWork(Work):
    """Complete when every MPI request in ``reqs`` is (one ``Testall`` per poll, which
    also drives MPI's progress). ``keep`` holds the buffers MPI uses meanwhile."""

    host_progress = True

    def __init__(self, op: str, reqs, group=None, keep=(), desc: str = ""):
        super().__init__("mpi", op, group, desc=desc)
        self.reqs = list(reqs)
        self.keep = keep

    def poll(self) -> bool:
        from mpi4py import MPI

        return MPI.Request.Testall(self.reqs)


def _engine():
    return engine()


def wait(op: str, reqs, group=None, keep=(), desc: str = "", cancel: bool = False) -> None:
    """Drive ``reqs`` to completion through the progress loop (``MCRDL_TIMEOUT``). If
    that fails (a peer that never came) and ``cancel``, the requests still pending are
    cancelled, so that none is left behind to meet a later exchange's message."""
    work = RequestsWork(op, reqs, "the set-up communicator" if group is None else group,
                        keep, desc)
    try:
        _engine().wait([work])
    except BaseException:
        from mpi4py import MPI

        pending = [r for r in (reqs if cancel else ()) if not r.Test()]
        for r in pending:
            r.Cancel()
        if pending:
            MPI.Request.Testall(pending)  # MPICH completes a cancelled request at once
        raise


def dup(comm, group=None, what: str = "create communicator"):
    """``comm.Idup()`` waited through the progress loop; the new communicator."""
    new, req = comm.Idup()
    wait(what, [req], group, desc="(MPI_Comm_idup: every rank of the group must make the "
                                  "call that creates it)")
    return new


def _tag(comm, kind: int, key: int) -> int:
    from mpi4py import MPI

    ub = comm.Get_attr(MPI.TAG_UB) or 32767
    return (kind * 1_000_003 + int(key)) % (ub + 1)


_DIGEST, _TEXT = 32, 95
_RECORD = _DIGEST + _TEXT + 1  # digest of the key, its text (for messages), a verdict


def _record(key: str) -> np.ndarray:
    raw = key.encode()
    text = raw[:_TEXT] if len(raw) <= _TEXT else raw[:_TEXT - 3] + b"..."
    rec = np.zeros(_RECORD, np.uint8)
    rec[:_DIGEST] = np.frombuffer(hashlib.sha256(raw).digest(), np.uint8)
    rec[_DIGEST:_DIGEST + len(text)] = np.frombuffer(text, np.uint8)
    rec[-1] = 1
    return rec


def _text(rec) -> str:
    return rec[_DIGEST:_DIGEST + _TEXT].tobytes().rstrip(b"\0").decode(errors="replace")


def members_ready(comm, ranks, key: str, group=None, what: str = "create communicator",
                  kind: int = 1) -> None:
    """Return once every rank of ``ranks`` (ranks of ``comm``) has called this with the
    same ``key``; only the members call it. Each member sends the leader (``ranks[0]``)
    a digest of its key; the leader answers every member with its own and a verdict, so
    members that are creating different groups at this point (a rank out of step after
    a caught error, member lists that differ) all raise MismatchError, naming both keys,
    instead of entering a blocking MPI creation that would never return. Nonblocking
    point-to-point messages on ``comm`` (one tag per ``kind``), waited through the
    progress loop."""
    ranks = list(ranks)
    me = comm.Get_rank()
    if len(ranks) < 2:
        return
    tag, leader = _tag(comm, kind, 0), ranks[0]
    desc = (f"(readiness handshake before creating the communicator of ranks {ranks}: every "
            "member must make its first call on the group)")
    mine = _record(key)
    if me == leader:
        got = np.zeros((len(ranks) - 1, _RECORD), np.uint8)
        reqs = [comm.Irecv([got[i], _RECORD, _byte()], r, tag) for i, r in enumerate(ranks[1:])]
        wait(what, reqs, group, (got,), desc, cancel=True)
        bad = [(r, _text(got[i])) for i, r in enumerate(ranks[1:])
               if not np.array_equal(got[i, :_DIGEST], mine[:_DIGEST])]
        if bad:
            mine[-1] = 0
        reqs = [comm.Isend([mine, _RECORD, _byte()], r, tag) for r in ranks[1:]]
        wait(what, reqs, group, (mine,), desc, cancel=True)
        if bad:
            _mismatch(key, bad, me)
    else:
        theirs = np.zeros(_RECORD, np.uint8)
        reqs = [comm.Isend([mine, _RECORD, _byte()], leader, tag),
                comm.Irecv([theirs, _RECORD, _byte()], leader, tag)]
        wait(what, reqs, group, (mine, theirs), desc, cancel=True)
        if not np.array_equal(theirs[:_DIGEST], mine[:_DIGEST]):
            _mismatch(key, [(leader, _text(theirs))], me)
        if theirs[-1] != 1:
            raise MismatchError(
                f"mcrdl: rank {me}: creating the communicator of group {key!r}: the leader "
                f"(rank {leader}) found members that are creating other groups at this point; "
                "see their errors. " + _ADVICE)


_ADVICE = ("Every member must create the same groups in the same order (new_group on every "
           "rank, or on the members only with use_local_synchronization); a call that "
           "failed on some ranks only (a caught error) can leave ranks out of step.")


def _mismatch(key: str, others, me: int):
    theirs = "; ".join(f"rank {r} is creating {k!r}" for r, k in others)
    raise MismatchError(f"mcrdl: rank {me}: creating the communicator of group {key!r} while "
                        f"{theirs} at the same point. " + _ADVICE)


def _byte():
    from mpi4py import MPI

    return MPI.BYTE


def bcast(comm, obj, root: int = 0, what: str = "bootstrap bcast"):
    """mpi4py's ``comm.bcast`` (a picklable object from ``root``), nonblocking inside."""
    from mpi4py import MPI

    me = comm.Get_rank()
    data = pickle.dumps(obj) if me == root else b""
    n = np.array([len(data)], dtype=np.int64)
    wait(what, [comm.Ibcast([n, MPI.INT64_T], root)], keep=(n,),
         desc=f"(root {root}: every rank must make the same set-up call)")
    buf = np.frombuffer(data, dtype=np.uint8).copy() if me == root else np.empty(int(n[0]),
                                                                                 np.uint8)
    wait(what, [comm.Ibcast([buf, MPI.BYTE], root)], keep=(buf,),
         desc=f"(root {root}: every rank must make the same set-up call)")
    return obj if me == root else pickle.loads(buf.tobytes())


def allgather(comm, obj, what: str = "bootstrap allgather") -> list:
    """mpi4py's ``comm.allgather`` (every rank's picklable object), nonblocking inside."""
    from mpi4py import MPI

    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    size = comm.Get_size()
    lens = np.empty(size, dtype=np.int64)
    mine = np.array([data.size], dtype=np.int64)
    desc = "(every rank must make the same set-up call)"
    wait(what, [comm.Iallgather([mine, MPI.INT64_T], [lens, MPI.INT64_T])], keep=(mine, lens),
         desc=desc)
    displs = np.concatenate(([0], np.cumsum(lens[:-1]))).astype(np.int64)
    out = np.empty(int(lens.sum()), dtype=np.uint8)
    req = comm.Iallgatherv([data, MPI.BYTE], [out, (lens.tolist(), displs.tolist()), MPI.BYTE])
    wait(what, [req], keep=(data, out), desc=desc)
    return [pickle.loads(out[d:d + n].tobytes()) for d, n in zip(displs.tolist(), lens.tolist())]
