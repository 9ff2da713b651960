"""Set-up traffic over MPI that waits through the progress loop, never inside MPI.

Creating a communicator and the bootstrap's small exchanges are collective: a blocking
MPI call there (``Comm.Dup``, ``Comm.Create_group``, mpi4py's pickled ``bcast``) waits
for every peer with no timeout, and while it waits nothing drives the other libraries'
work. Here each step is a nonblocking MPI call whose request is a :class:`RequestsWork`
polled by the progress engine, so a peer that never comes (a straggler, a dead rank)
ends in :class:`~mcrdl_core.errors.CommTimeoutError` after ``MCRDL_TIMEOUT`` naming
the step, and in-flight work of other backends keeps moving meanwhile.

- :func:`dup`: ``MPI_Comm_idup`` (MPI-3), fully nonblocking.
- :func:`members_ready`: MPI has no nonblocking ``Comm_create_group``/``Comm_split``.
  Before such a call the members run a readiness handshake of nonblocking point-to-point
  messages (each member tells the leader it is there; the leader answers once all are)
  on a private communicator. Only then is the blocking creation called, which returns at
  once because every member is already in it. Only a peer that dies between the
  handshake and the creation (a window of microseconds) could still block it.
- :func:`bcast`, :func:`allgather`: pickled objects moved by ``Ibcast``/``Iallgather(v)``
  (a length, then the bytes).

mpi4py is imported inside the functions: the core imports without it.
"""
from __future__ import annotations

import pickle

import numpy as np

from .work import Work


class RequestsWork(Work):
    """Complete when every MPI request in ``reqs`` is (one ``Testall`` per poll, which
    also drives MPI's progress). ``keep`` holds the buffers MPI uses meanwhile."""

    host_progress = True

    def __init__(self, op: str, reqs, group=None, keep=(), desc: str = ""):
        super().__init__("mpi", op, group, desc=desc)
        self.reqs = list(reqs)
        self.keep = keep

    def _poll(self) -> bool:
        from mpi4py import MPI

        return MPI.Request.Testall(self.reqs)


def _engine():
    from .progress import engine

    return engine()


def wait(op: str, reqs, group=None, keep=(), desc: str = "") -> None:
    """Drive ``reqs`` to completion through the progress loop (``MCRDL_TIMEOUT``)."""
    work = RequestsWork(op, reqs, "the set-up communicator" if group is None else group,
                        keep, desc)
    _engine().wait([work])


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


def members_ready(comm, ranks, key: int, group=None, what: str = "create communicator",
                  kind: int = 1) -> None:
    """Return once every rank of ``ranks`` (ranks of ``comm``) has called this with the
    same ``key``; only the members call it. Nonblocking point-to-point messages on
    ``comm`` (tag from ``kind`` and ``key``), waited through the progress loop."""
    ranks = list(ranks)
    me = comm.Get_rank()
    if len(ranks) < 2:
        return
    tag, leader = _tag(comm, kind, key), ranks[0]
    desc = (f"(readiness handshake before creating the communicator of ranks {ranks}: every "
            "member must make its first call on the group)")
    token = np.zeros(len(ranks), dtype=np.uint8)
    if me == leader:
        reqs = [comm.Irecv([token[i:i + 1], 1, _byte()], r, tag)
                for i, r in enumerate(ranks) if i]
        wait(what, reqs, group, (token,), desc)
        reqs = [comm.Isend([token[i:i + 1], 1, _byte()], r, tag)
                for i, r in enumerate(ranks) if i]
        wait(what, reqs, group, (token,), desc)
    else:
        reqs = [comm.Isend([token[:1], 1, _byte()], leader, tag),
                comm.Irecv([token[1:2], 1, _byte()], leader, tag)]
        wait(what, reqs, group, (token,), desc)


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
