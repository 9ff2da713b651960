"""Backend conformance (issue 23, point 5): the ``Backend`` contract, op by op.

Part 1, the cases. ``CASES`` maps each op to functions ``case(ctx, dtype, count, tag)``
that run it through the Backend interface of ``mcrdl_core/world/backend.py`` on Buffers
(group ranks for roots and peers, one Work per op, returned without blocking), every
member of the group at once, each checking its own result against a NumPy reference
built from every member's input. Several Works are in flight together and are waited
in an order that differs from rank to rank. The same cases run

- here, against the NCCL backend on the CPU fakes of ``tests/test_cuda_nccl_comm.py``,
  made to move data (ranks are threads; world sizes 1 and 3, and a subgroup listing its
  ranks as [2, 0]);
- in ``tests/mpi/test_conformance.py``, against every registered backend in an mpiexec
  job at 1, 2 and 3 ranks, next to the same ops through the core's public API.

A backend is conformant when it passes them for every dtype its ``unsupported_reason``
claims. Part 2 is the fake NCCL world and its tests.
"""
import ctypes
import queue
import random
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import mcrdl_backends.nccl as nccl_be
import mcrdl_core as core
from mcrdl_core.memory import cuda as mc_cuda
from mcrdl_core import dtypes as dt
from mcrdl_core.dispatch import validate
from mcrdl_core.world.bootstrap import Bootstrap
from mcrdl_core.memory.buffer import CPU, Buffer, Device
from mcrdl_core.base.errors import DtypeError, UnsupportedError
from mcrdl_core.world.group import Group
from mcrdl_core.base.ops import BITWISE, REDUCING, Op, ReduceOp
from mcrdl_core.dispatch.p2p import P2POp, batch_isend_irecv
from mcrdl_core.engine.work import Work
from test_cuda_nccl_comm import FakeCupy, FakeNccl, FakeRuntime

N = 5  # elements per rank ("count" N); the cases also run with 0 and 1
COUNTS = (0, 1, N)


# --- Part 1: values, references, the cases ---------------------------------------------------
def vals(rank, count, dtype, salt=0):
    """Small exact values (1..5; 0/1 for bool; complex with an imaginary part) that every
    rank can compute for every other rank: sums and products of 3 ranks stay exact in
    every dtype."""
    v = ((np.arange(count) * 3 + rank * 7 + salt * 11) % 5 + 1).astype(np.float64)
    if dtype is dt.bool_:
        return (v % 2).astype(np.bool_)
    if dtype.kind == "complex":
        return (v + 1j * v[::-1]).astype(dtype.np_dtype)
    return v.astype(dtype.np_dtype)


def gathered(ranks, count, dtype, salt=0):
    """What gathering ``vals`` of ``ranks`` in group order gives."""
    return np.concatenate([vals(r, count, dtype, salt) for r in ranks])


_REF = {ReduceOp.SUM: np.sum, ReduceOp.PRODUCT: np.prod, ReduceOp.MIN: np.min,
        ReduceOp.MAX: np.max, ReduceOp.AVG: np.mean, ReduceOp.BAND: np.bitwise_and.reduce,
        ReduceOp.BOR: np.bitwise_or.reduce, ReduceOp.BXOR: np.bitwise_xor.reduce}


def reduce_ref(rop, arrays):
    """The reduction of ``arrays`` (one per rank), exact in float64 or int64."""
    a = np.stack(arrays).astype(np.int64 if rop in BITWISE else np.float64)
    return _REF[rop](a, axis=0)


#: tolerances of floating results (an average is rounded once to the dtype)
TOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-6, "complex64": 1e-6}


def check(got, want, what=""):
    """``got`` (an array of any MCR-DL dtype) equals the reference ``want``."""
    want = np.asarray(want).reshape(got.shape)
    kind = dt.lookup(got.dtype).kind
    if kind in ("float", "complex"):
        wide = np.complex128 if kind == "complex" else np.float64
        tol = TOL.get(dt.lookup(got.dtype).name, 1e-12)
        np.testing.assert_allclose(got.astype(wide), want.astype(wide), rtol=tol, atol=tol,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=what)


def _refuses(rop, dtype):
    """Whether the core refuses ``rop`` on ``dtype`` (AVG needs a floating dtype, the
    bitwise ops an integral one), whatever the backend."""
    try:
        validate.reduce_op(rop, dtype)
    except UnsupportedError:
        return True
    return False


def core_refusal(dtype, rop=None):
    """The error the core raises for ``dtype``/``rop`` whatever the backend (None if it
    lets the call through to selection): its own dtype and reduce-op rules."""
    if dtype not in dt.SUPPORTED:
        return DtypeError
    return UnsupportedError if rop is not None and _refuses(rop, dtype) else None


def refusals(be, op, device):
    """(dtype, reduce op, error) for every combination of ``op`` on ``device`` that the
    core or ``be`` (its ``unsupported_reason``) refuses: DtypeError for dtypes the core
    never communicates, else UnsupportedError."""
    for dtype in dt.ALL:
        for rop in (list(ReduceOp) if op in REDUCING else [None]):
            want = core_refusal(dtype, rop) or (
                UnsupportedError if be.unsupported_reason(op, device, dtype, rop) else None)
            if want is not None:
                yield dtype, rop, want


def reduce_ops(be, op, device, dtype):
    """The reduce ops a case runs: those the core allows for ``dtype`` and ``be`` claims."""
    return [r for r in ReduceOp
            if not _refuses(r, dtype) and be.unsupported_reason(op, device, dtype, r) is None]


def claimed(be, op, device, dtypes=dt.ALL):
    """The dtypes ``be`` says it can do ``op`` on (``unsupported_reason`` is None)."""
    return [d for d in dtypes if be.unsupported_reason(op, device, d) is None]


class BackendFailed(AssertionError):
    """A backend's library failed at a call the backend claims it can make (what the
    strict xfail of a known defect expects, rather than any failure)."""


class Ctx:
    """One rank's side of a case: the backend instance, a group this rank is a member
    of, and the device kind its buffers get (host memory backs them all: the fakes'
    CUDA-kind buffers point into host memory too)."""

    #: the reduce ops the reducing cases run (None: every one the backend claims)
    reduce_ops = None

    def __init__(self, be, group, device=CPU):
        self.be, self.g, self.device = be, group, device
        self.me, self.n, self.ranks = group.rank, group.size, group.ranks
        self.rank = group.ranks[group.rank]  # global

    def buf(self, arr):
        b = Buffer.from_numpy(arr)
        return b if self.device == CPU else Buffer(b.ptr, b.shape, b.dtype, self.device,
                                                   owner=arr)

    def wait(self, works):
        """Every Work complete, waited in an order of this rank's own (any order must
        do); each is a Work, returned without blocking, whose wait() returns True."""
        assert all(isinstance(w, Work) for w in works), works
        order = list(range(len(works)))
        random.Random(self.rank * 7919 + len(works)).shuffle(order)
        for i in order:
            assert works[i].wait() is True
        assert all(w.is_completed() for w in works)


def case_send_recv(ctx, dtype, count, tag):
    """A ring: send to the next group rank and receive from the previous one, both in
    flight. A receive's result is the sender's *group* rank."""
    be, g, me, n = ctx.be, ctx.g, ctx.me, ctx.n
    if n < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    prv = (me - 1) % n
    out = np.zeros(count, dtype.np_dtype)
    ws = [be.send(g, ctx.buf(vals(ctx.rank, count, dtype)), (me + 1) % n, tag),
          be.recv(g, ctx.buf(out), prv, tag)]
    ctx.wait(ws)
    assert ws[1].result() == prv, f"the receive reported {ws[1].result()}"
    check(out, vals(ctx.ranks[prv], count, dtype))


def case_recv_any_source(ctx, dtype, count, tag):
    """The ring again, received from any source (``src=None``). A backend may refuse it
    with UnsupportedError (NCCL needs the peer) as long as nothing was posted; any other
    failure fails the case, after a named receive has taken the message, so that the
    group stays usable."""
    be, g, me, n = ctx.be, ctx.g, ctx.me, ctx.n
    if n < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    prv = (me - 1) % n
    out = np.zeros(count, dtype.np_dtype)
    ws = [be.send(g, ctx.buf(vals(ctx.rank, count, dtype, salt=1)), (me + 1) % n, tag)]
    try:
        ws.append(be.recv(g, ctx.buf(out), None, tag))
        failed = None
    except Exception as exc:  # noqa: BLE001 - reported below, once the message is taken
        failed = exc
        ws.append(be.recv(g, ctx.buf(out), prv, tag))
    ctx.wait(ws)
    if failed is not None and not isinstance(failed, UnsupportedError):
        raise BackendFailed(f"{be.name}: recv(src=None) of {count} elements: {failed!r}")
    assert ws[1].result() == prv, f"the receive reported {ws[1].result()}"
    check(out, vals(ctx.ranks[prv], count, dtype, salt=1))


def case_broadcast(ctx, dtype, count, tag):
    root = ctx.n - 1
    x = vals(ctx.rank, count, dtype)
    ctx.wait([ctx.be.broadcast(ctx.g, ctx.buf(x), root)])
    check(x, vals(ctx.ranks[root], count, dtype))


def _reducing(ctx, op, dtype, count, issue, result):
    """Every reduce op the backend claims for ``dtype``, all in flight at once."""
    rops = [r for r in reduce_ops(ctx.be, op, ctx.device, dtype)
            if ctx.reduce_ops is None or r in ctx.reduce_ops]
    issued = [issue(ctx, rop, count, dtype) for rop in rops]
    ctx.wait([w for w, _ in issued])
    for rop, (_, got) in zip(rops, issued):
        if got is not None:
            check(got, result(ctx, rop, count, dtype), rop.name)


def _reduce(ctx, rop, count, dtype):
    x = vals(ctx.rank, count, dtype)
    return ctx.be.reduce(ctx.g, ctx.buf(x), ctx.n - 1, rop), x if ctx.me == ctx.n - 1 else None


def _all_reduce(ctx, rop, count, dtype):
    x = vals(ctx.rank, count, dtype)
    return ctx.be.all_reduce(ctx.g, ctx.buf(x), rop), x


def _reduce_scatter(ctx, rop, count, dtype):
    out = np.zeros(count, dtype.np_dtype)
    inp = vals(ctx.rank, ctx.n * count, dtype)
    return ctx.be.reduce_scatter(ctx.g, ctx.buf(out), ctx.buf(inp), rop), out


def _reduce_scatter_inplace(ctx, rop, count, dtype):
    """The output is this rank's own slot of the input (torch's in-place form)."""
    x = vals(ctx.rank, ctx.n * count, dtype)
    xb, me = ctx.buf(x), ctx.me
    return (ctx.be.reduce_scatter(ctx.g, xb.flat(me * count, count), xb, rop),
            x[me * count:(me + 1) * count])


def _full(ctx, rop, count, dtype):
    return reduce_ref(rop, [vals(r, count, dtype) for r in ctx.ranks])


def _slot(ctx, rop, count, dtype):
    full = reduce_ref(rop, [vals(r, ctx.n * count, dtype) for r in ctx.ranks])
    return full[ctx.me * count:(ctx.me + 1) * count]


def case_reduce(ctx, dtype, count, tag):
    _reducing(ctx, Op.REDUCE, dtype, count, _reduce, _full)


def case_all_reduce(ctx, dtype, count, tag):
    _reducing(ctx, Op.ALL_REDUCE, dtype, count, _all_reduce, _full)


def case_reduce_scatter(ctx, dtype, count, tag):
    _reducing(ctx, Op.REDUCE_SCATTER, dtype, count, _reduce_scatter, _slot)


def case_reduce_scatter_inplace(ctx, dtype, count, tag):
    _reducing(ctx, Op.REDUCE_SCATTER, dtype, count, _reduce_scatter_inplace, _slot)


def case_all_gather(ctx, dtype, count, tag, inplace=False):
    out = np.zeros(ctx.n * count, dtype.np_dtype)
    ob = ctx.buf(out)
    if inplace:  # the input is this rank's own slot of the output
        out[ctx.me * count:(ctx.me + 1) * count] = vals(ctx.rank, count, dtype)
        ib = ob.flat(ctx.me * count, count)
    else:
        ib = ctx.buf(vals(ctx.rank, count, dtype))
    ctx.wait([ctx.be.all_gather(ctx.g, ob, ib)])
    check(out, gathered(ctx.ranks, count, dtype))


def case_all_gather_inplace(ctx, dtype, count, tag):
    case_all_gather(ctx, dtype, count, tag, inplace=True)


def a2a_counts(i, j, count):
    """Elements group rank i sends group rank j in the uneven case: 0 to 2x ``count``
    (empty blocks included; i to itself sends as many as it receives, as NCCL needs)."""
    return (i + 2 * j) % 3 * count


def a2a_expected(ranks, me, count, dtype, even):
    """What group rank ``me`` receives in an all-to-all of ``vals`` (blocks by rank)."""
    n = len(ranks)
    c = (lambda i, j: count) if even else (lambda i, j: a2a_counts(i, j, count))
    pieces = []
    for j, r in enumerate(ranks):
        start = sum(c(j, k) for k in range(me))
        pieces.append(vals(r, sum(c(j, k) for k in range(n)), dtype)[start:start + c(j, me)])
    return np.concatenate(pieces)


def case_all_to_all(ctx, dtype, count, tag, even=True, inplace=False):
    n, me = ctx.n, ctx.me
    c = (lambda i, j: count) if even else (lambda i, j: a2a_counts(i, j, count))
    in_counts = [c(me, j) for j in range(n)]
    out_counts = [c(j, me) for j in range(n)]
    inp = vals(ctx.rank, sum(in_counts), dtype)
    out = inp if inplace else np.zeros(sum(out_counts), dtype.np_dtype)
    ib = ctx.buf(inp)
    ob = ib if inplace else ctx.buf(out)
    ctx.wait([ctx.be.all_to_all(ctx.g, ob, ib, out_counts, in_counts)])
    check(out, a2a_expected(ctx.ranks, me, count, dtype, even))


def case_all_to_all_uneven(ctx, dtype, count, tag):
    case_all_to_all(ctx, dtype, count, tag, even=False)


def case_all_to_all_inplace(ctx, dtype, count, tag):
    case_all_to_all(ctx, dtype, count, tag, inplace=True)


def case_gather(ctx, dtype, count, tag):
    """The root's output holds every member's block; elsewhere the output is None (the
    core hands the backend no buffer there)."""
    root = ctx.n - 1
    out = np.zeros(ctx.n * count, dtype.np_dtype) if ctx.me == root else None
    w = ctx.be.gather(ctx.g, None if out is None else ctx.buf(out),
                      ctx.buf(vals(ctx.rank, count, dtype)), root)
    ctx.wait([w])
    if out is not None:
        check(out, gathered(ctx.ranks, count, dtype))


def case_scatter(ctx, dtype, count, tag):
    root = ctx.n - 1
    out = np.zeros(count, dtype.np_dtype)
    inp = (np.concatenate([vals(ctx.rank, count, dtype, salt=j) for j in range(ctx.n)])
           if ctx.me == root else None)
    w = ctx.be.scatter(ctx.g, ctx.buf(out), None if inp is None else ctx.buf(inp), root)
    ctx.wait([w])
    check(out, vals(ctx.ranks[root], count, dtype, salt=ctx.me))


def case_barrier(ctx, dtype, count, tag):
    ctx.wait([ctx.be.barrier(ctx.g) for _ in range(2)])


def case_batch_p2p(ctx, dtype, count, tag):
    """``batch_p2p`` (optional: backends with a grouped form): to both neighbours and
    from both, receives listed before sends would deadlock if issued one by one."""
    be, n, me = ctx.be, ctx.n, ctx.me
    if not be.grouped_p2p:
        pytest.skip(f"{be.name} has no batch_p2p (the core issues a batch op by op)")
    if n < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    peers = [(me + 1) % n, (me - 1) % n]
    outs = [np.zeros(count, dtype.np_dtype) for _ in peers]
    sends = [(ctx.buf(vals(ctx.rank, count, dtype, salt=p)), p) for p in peers]
    ctx.wait([be.batch_p2p(ctx.g, sends, [(ctx.buf(o), p) for o, p in zip(outs, peers)])])
    for o, p in zip(outs, peers):
        check(o, vals(ctx.ranks[p], count, dtype, salt=me), f"from group rank {p}")


def case_in_flight(ctx, dtype, count, tag):
    """One of every op in flight at once, waited in a rank-dependent order (the ring's
    send and receive posted after the collectives)."""
    be, g, n, me = ctx.be, ctx.g, ctx.n, ctx.me
    rank, ranks, root = ctx.rank, ctx.ranks, n - 1
    mine = vals(rank, count, dtype)
    ar, bc = mine.copy(), mine.copy()
    ag = np.zeros(n * count, dtype.np_dtype)
    rs = np.zeros(count, dtype.np_dtype)
    a2a = np.zeros(n * count, dtype.np_dtype)
    rcv = np.zeros(count, dtype.np_dtype)
    ws = [be.all_reduce(g, ctx.buf(ar), ReduceOp.SUM),
          be.all_gather(g, ctx.buf(ag), ctx.buf(mine)),
          be.broadcast(g, ctx.buf(bc), root),
          be.reduce_scatter(g, ctx.buf(rs), ctx.buf(vals(rank, n * count, dtype)), ReduceOp.MAX),
          be.all_to_all(g, ctx.buf(a2a), ctx.buf(vals(rank, n * count, dtype)), [count] * n,
                        [count] * n)]
    if n > 1:
        ws += [be.send(g, ctx.buf(mine), (me + 1) % n, tag),
               be.recv(g, ctx.buf(rcv), (me - 1) % n, tag)]
    ctx.wait(ws)
    check(ar, reduce_ref(ReduceOp.SUM, [vals(r, count, dtype) for r in ranks]), "all_reduce")
    check(ag, gathered(ranks, count, dtype), "all_gather")
    check(bc, vals(ranks[root], count, dtype), "broadcast")
    full = reduce_ref(ReduceOp.MAX, [vals(r, n * count, dtype) for r in ranks])
    check(rs, full[me * count:(me + 1) * count], "reduce_scatter")
    check(a2a, a2a_expected(ranks, me, count, dtype, True), "all_to_all")
    if n > 1:
        check(rcv, vals(ranks[(me - 1) % n], count, dtype), "recv")


def case_send_across_collectives(ctx, dtype, count, tag):
    """A send posted before an all-to-all and a gather, its receive after them (as torch
    allows): the collectives must not take the message, nor it theirs."""
    be, g, n, me = ctx.be, ctx.g, ctx.n, ctx.me
    if n < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    mine = vals(ctx.rank, count, dtype, salt=3)
    a2a = np.zeros(n * count, dtype.np_dtype)
    gat = np.zeros(n * count, dtype.np_dtype) if me == 0 else None
    rcv = np.zeros(count, dtype.np_dtype)
    ws = [be.send(g, ctx.buf(mine), (me + 1) % n, tag),
          be.all_to_all(g, ctx.buf(a2a), ctx.buf(vals(ctx.rank, n * count, dtype)), [count] * n,
                        [count] * n),
          be.gather(g, None if gat is None else ctx.buf(gat), ctx.buf(vals(ctx.rank, count, dtype)),
                    0),
          be.recv(g, ctx.buf(rcv), (me - 1) % n, tag)]
    ctx.wait(ws)
    check(a2a, a2a_expected(ctx.ranks, me, count, dtype, True), "all_to_all")
    if gat is not None:
        check(gat, gathered(ctx.ranks, count, dtype), "gather")
    check(rcv, vals(ctx.ranks[(me - 1) % n], count, dtype, salt=3), "recv")


#: op -> its cases (the Backend method each exercises, and the forms torch allows)
CASES = {
    "send_recv": [case_send_recv, case_recv_any_source],
    "broadcast": [case_broadcast],
    "reduce": [case_reduce],
    "all_reduce": [case_all_reduce],
    "all_gather": [case_all_gather, case_all_gather_inplace],
    "reduce_scatter": [case_reduce_scatter, case_reduce_scatter_inplace],
    "all_to_all": [case_all_to_all, case_all_to_all_uneven, case_all_to_all_inplace],
    "gather": [case_gather],
    "scatter": [case_scatter],
    "barrier": [case_barrier],
    "batch_p2p": [case_batch_p2p],
    "in_flight": [case_in_flight, case_send_across_collectives],
}
#: the Op whose claims (``unsupported_reason``) decide a case's dtypes
CLAIM_OP = {"send_recv": Op.SEND, "broadcast": Op.BROADCAST, "reduce": Op.REDUCE,
            "all_reduce": Op.ALL_REDUCE, "all_gather": Op.ALL_GATHER,
            "reduce_scatter": Op.REDUCE_SCATTER, "all_to_all": Op.ALL_TO_ALL,
            "gather": Op.GATHER, "scatter": Op.SCATTER, "barrier": Op.BARRIER,
            "batch_p2p": Op.SEND, "in_flight": Op.REDUCE_SCATTER}


def _x(ctx, dtype, n=2):
    return ctx.buf(np.zeros(n, dtype.np_dtype))


def _xs(ctx, dtype):
    return [_x(ctx, dtype) for _ in range(ctx.n)]


#: name -> (op, a call of the core's public API on Buffers of ``ctx``'s device and group,
#: rooted at / sent to the group's first rank), for the refusal checks
CORE_CALLS = {
    "send": (Op.SEND, lambda c, d, rop, be: core.send(_x(c, d), c.ranks[0], c.g, backend=be)),
    "recv": (Op.RECV, lambda c, d, rop, be: core.recv(_x(c, d), c.ranks[0], c.g, backend=be)),
    "batch_isend_irecv": (Op.SEND, lambda c, d, rop, be: batch_isend_irecv(
        [P2POp("isend", _x(c, d), c.ranks[0], c.g)], backend=be)),
    "broadcast": (Op.BROADCAST, lambda c, d, rop, be: core.broadcast(_x(c, d), c.ranks[0], c.g,
                                                                     backend=be)),
    "reduce": (Op.REDUCE, lambda c, d, rop, be: core.reduce(_x(c, d), c.ranks[0], rop, c.g,
                                                            backend=be)),
    "all_reduce": (Op.ALL_REDUCE, lambda c, d, rop, be: core.all_reduce(_x(c, d), rop, c.g,
                                                                        backend=be)),
    "all_gather_into_tensor": (Op.ALL_GATHER, lambda c, d, rop, be: core.all_gather_into_tensor(
        _x(c, d, 2 * c.n), _x(c, d), c.g, backend=be)),
    "all_gather": (Op.ALL_GATHER, lambda c, d, rop, be: core.all_gather(_xs(c, d), _x(c, d), c.g,
                                                                        backend=be)),
    "reduce_scatter_tensor": (Op.REDUCE_SCATTER, lambda c, d, rop, be: core.reduce_scatter_tensor(
        _x(c, d), _x(c, d, 2 * c.n), rop, c.g, backend=be)),
    "reduce_scatter": (Op.REDUCE_SCATTER, lambda c, d, rop, be: core.reduce_scatter(
        _x(c, d), _xs(c, d), rop, c.g, backend=be)),
    "all_to_all_single": (Op.ALL_TO_ALL, lambda c, d, rop, be: core.all_to_all_single(
        _x(c, d, c.n), _x(c, d, c.n), group=c.g, backend=be)),
    "all_to_all": (Op.ALL_TO_ALL, lambda c, d, rop, be: core.all_to_all(_xs(c, d), _xs(c, d), c.g,
                                                                        backend=be)),
    "gather": (Op.GATHER, lambda c, d, rop, be: core.gather(_x(c, d), _xs(c, d), c.ranks[0], c.g,
                                                            backend=be)),
    "scatter": (Op.SCATTER, lambda c, d, rop, be: core.scatter(_x(c, d), _xs(c, d), c.ranks[0],
                                                               c.g, backend=be)),
}


# --- Part 2: NCCL on fakes that move data; ranks are threads --------------------------------
class Hub:
    """The bootstrap's exchanges between rank threads: every member of ``ranks`` hands
    in an object and gets all of them, in the order of ``ranks``."""

    def __init__(self, timeout=20.0):
        self.cv = threading.Condition()
        self.rounds: dict = {}
        self.seq: dict = {}
        self.timeout = timeout

    def exchange(self, rank, ranks, obj):
        ranks = tuple(ranks)
        with self.cv:
            n = self.seq.get((rank, ranks), 0)
            self.seq[(rank, ranks)] = n + 1
            got = self.rounds.setdefault((ranks, n), {})
            got[rank] = obj
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: len(got) == len(ranks), self.timeout):
                raise TimeoutError(f"rank {rank}: bootstrap exchange {ranks} #{n} incomplete")
            return [got[r] for r in ranks]


class HubBootstrap(Bootstrap):
    kind = "fake"

    def __init__(self, hub, rank, size):
        self.hub, self.rank, self.size = hub, rank, size

    def group_allgather(self, obj, ranks):
        return self.hub.exchange(self.rank, ranks, obj)

    def group_bcast(self, obj, ranks, root=0):
        return self.hub.exchange(self.rank, ranks, obj)[root]

    def hostname(self):
        return f"host{self.rank}"  # a GPU each: (host, PCI bus id) differ


def _read(ptr, count, np_dtype):
    if not count:
        return np.zeros(0, np_dtype)
    return np.frombuffer(ctypes.string_at(ptr, count * np_dtype.itemsize), np_dtype).copy()


def _write(ptr, arr):
    if arr.nbytes:
        ctypes.memmove(ptr, arr.tobytes(), arr.nbytes)


class Wire:
    """What the members of one fake communicator share: a rendezvous for collectives
    (every member calls them in the same order) and a FIFO per (sender, receiver)."""

    def __init__(self, size):
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots = [None] * size
        self.mail = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.dead = threading.Event()

    def abort(self):
        """A member failed: wake the others at once, wherever they wait."""
        self.dead.set()
        self.barrier.abort()

    def get(self, src, dst):
        deadline = time.monotonic() + 20
        while not self.dead.is_set() and time.monotonic() < deadline:
            try:
                return self.mail[(src, dst)].get(timeout=0.01)
            except queue.Empty:
                pass
        raise TimeoutError(f"rank {dst}: no message from {src} (a peer failed or never sent)")

    def collective(self, rank, payload):
        self.slots[rank] = payload
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


class DataNccl(FakeNccl):
    """``FakeNccl`` (test_cuda_nccl_comm.py) whose communicators move data between rank
    threads through host memory: collectives meet at the wire, sends are queued at
    once, receives inside groupStart/groupEnd are taken at groupEnd (in the order
    posted), as NCCL's grouped calls complete together."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 1, 0, 2, 3
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
    TYPES = {0: dt.uint8, 1: dt.int8, 2: dt.int32, 3: dt.int64, 6: dt.float16, 7: dt.float32,
             8: dt.float64, 9: dt.bfloat16}
    REDUCE = {0: ReduceOp.SUM, 1: ReduceOp.PRODUCT, 2: ReduceOp.MAX, 3: ReduceOp.MIN,
              4: ReduceOp.AVG}

    def __init__(self):
        super().__init__()
        self.local = threading.local()
        self.wires: dict = {}
        self.lock = threading.Lock()
        self.ids = 0
        outer = self

        class NcclCommunicator:
            def __init__(self, size, uid, rank):
                with outer.lock:
                    self.wire = outer.wires.setdefault(uid, Wire(size))
                    outer.log.append(("init", size, rank))
                self.size, self.rank = size, rank

            def _dtype(self, code):
                return outer.TYPES[code].np_dtype

            def _reduce(self, op, arrays, np_dtype):
                return reduce_ref(outer.REDUCE[op], arrays).astype(np_dtype)

            def allReduce(self, s, r, count, dtype, op, stream):
                t = self._dtype(dtype)
                _write(r, self._reduce(op, self.wire.collective(self.rank, _read(s, count, t)), t))

            def reduce(self, s, r, count, dtype, op, root, stream):
                t = self._dtype(dtype)
                res = self._reduce(op, self.wire.collective(self.rank, _read(s, count, t)), t)
                if self.rank == root:
                    _write(r, res)

            def broadcast(self, s, r, count, dtype, root, stream):
                t = self._dtype(dtype)
                got = self.wire.collective(self.rank, _read(s, count, t) if self.rank == root
                                           else None)
                _write(r, got[root])

            def allGather(self, s, r, count, dtype, stream):
                t = self._dtype(dtype)
                _write(r, np.concatenate(self.wire.collective(self.rank, _read(s, count, t))))

            def reduceScatter(self, s, r, count, dtype, op, stream):
                t = self._dtype(dtype)
                got = self.wire.collective(self.rank, _read(s, count * self.size, t))
                _write(r, self._reduce(op, got, t)[self.rank * count:(self.rank + 1) * count])

            def send(self, ptr, count, dtype, peer, stream):
                self.wire.mail[(self.rank, peer)].put(_read(ptr, count, self._dtype(dtype)))

            def recv(self, ptr, count, dtype, peer, stream):
                if getattr(outer.local, "depth", 0):
                    outer.local.recvs.append((self, ptr, count, dtype, peer))
                else:
                    self.take(ptr, count, dtype, peer)

            def take(self, ptr, count, dtype, peer):
                msg = self.wire.get(peer, self.rank)
                if msg.size != count:
                    raise outer.NcclError(f"rank {self.rank}: a receive of {count} elements "
                                          f"matched a send of {msg.size} from {peer}")
                _write(ptr, msg.astype(self._dtype(dtype), copy=False))

            def check_async_error(self):
                pass

            def destroy(self):
                outer.log.append(("destroy",))

            def abort(self):
                outer.log.append(("abort",))

        self.NcclCommunicator = NcclCommunicator

    def groupStart(self):
        loc = self.local
        if not getattr(loc, "depth", 0):
            loc.recvs = []
        loc.depth = getattr(loc, "depth", 0) + 1

    def groupEnd(self):
        loc = self.local
        loc.depth -= 1
        if not loc.depth:
            recvs, loc.recvs = loc.recvs, []
            for comm, *args in recvs:
                comm.take(*args)

    def get_unique_id(self):
        with self.lock:
            self.ids += 1
            return self.ids.to_bytes(128, "little")

    def get_version(self):
        return 22000


class DataCupy(FakeCupy):
    """``FakeCupy`` whose device memory is host memory: ``zeros`` (the barrier's and
    pre-connection's scratch) is real, ``memcpyAsync`` copies at once."""

    float32 = np.float32

    def __init__(self):
        super().__init__()
        self.kept = []
        self.cuda.runtime.memcpyAsync = staticmethod(
            lambda dst, src, nbytes, kind, stream: ctypes.memmove(dst, src, nbytes))

    def zeros(self, n, dtype=None):
        arr = np.zeros(n, dtype=dtype)
        self.kept.append(arr)
        return SimpleNamespace(data=SimpleNamespace(ptr=arr.ctypes.data), host=arr)


CUDA = Device("cuda", 0)


class FakeWorld:
    """``size`` ranks as threads, each with its own NCCLBackend, runtime and groups: the
    world and ``sub`` (a subgroup whose group ranks differ from the global ones)."""

    def __init__(self, size, sub):
        hub = Hub()
        self.size, self.members = size, {"world": list(range(size)), "sub": sub}
        self.backends, self.groups = [], []
        for r in range(size):
            groups = {"world": Group(0, range(size), r, "world"), "sub": Group(1, sub, r, "sub")}
            rt = FakeRuntime(HubBootstrap(hub, r, size), list(groups.values()))
            rt.engine.timeout = 20.0
            self.backends.append(nccl_be.NCCLBackend(rt))
            self.groups.append(groups)

    def run(self, which, fn):
        """``fn(ctx)`` on every member of group ``which``, each on its own thread; the
        first failure (or skip) is raised here."""
        errors = []

        def body(r):
            try:
                fn(Ctx(self.backends[r], self.groups[r][which], CUDA))
            except BaseException as exc:  # noqa: BLE001 - pytest's skip too
                errors.append(exc)
                for g in self.groups[r].values():  # wake peers waiting for this rank
                    comm = g.comms.get("nccl")
                    if comm is not None:
                        comm.nccl.wire.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}")
                   for r in self.members[which]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a fake rank hung"
        if errors:
            raise errors[0]

    def close(self):
        for be in self.backends:
            be.destroy()


@pytest.fixture
def data_fakes(monkeypatch):
    """DataCupy and DataNccl behind the real NCCL backend (as ``fakes`` in
    test_cuda_nccl_comm.py, with data)."""
    cp, nccl = DataCupy(), DataNccl()
    monkeypatch.setattr(mc_cuda, "cupy", lambda: cp)
    monkeypatch.setattr(mc_cuda, "_WRAPPERS", {})
    monkeypatch.setattr(mc_cuda, "_LASTING", {})
    monkeypatch.setattr(nccl_be, "_LIB", [(nccl, None)])
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")  # restored afterwards
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # rank threads hand over at every rendezvous: not every 5 ms
    yield cp, nccl
    sys.setswitchinterval(interval)


#: (world size, group): one rank alone; three ranks; the subgroup [2, 0] of three
LAYOUTS = [(1, "world"), (3, "world"), (3, "sub")]
_PROBE = nccl_be.NCCLBackend(None)
#: NCCL's defect (reported, not fixed here): p2p and the collectives made of p2p share
#: one communicator, so NCCL's in-order matching per peer pairs them across ops
SHARED_P2P = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "mcrdl_backends/nccl.py: send/recv and the grouped send/recv of all_to_all, gather and "
    "scatter run on the group's one NCCL communicator; NCCL matches point-to-point calls "
    "per peer in posting order, so a send posted before an all_to_all whose receive is "
    "posted after it is taken by the all_to_all (torch's ProcessGroupNCCL gives p2p its "
    "own communicators)"))


def _params():
    """(case, dtype, layout) for every dtype the NCCL backend claims for the case's op."""
    out = []
    for op, fns in CASES.items():
        dtypes = [dt.float32] if op == "barrier" else claimed(_PROBE, CLAIM_OP[op], CUDA)
        for case in fns:
            for d in dtypes:
                for size, which in LAYOUTS:
                    marks = [SHARED_P2P] if (case is case_send_across_collectives
                                             and size > 1) else []
                    out.append(pytest.param(case, d, (size, which), marks=marks,
                                            id=f"{case.__name__[5:]}-{d.name}-{size}ranks-{which}"))
    return out


@pytest.mark.parametrize(("case", "dtype", "layout"), _params())
def test_nccl_on_fakes(data_fakes, case, dtype, layout):
    """Every conformance case on the NCCL backend, at 0, 1 and N elements."""
    size, which = layout
    world = FakeWorld(size, [size - 1, 0] if size > 1 else [0])
    try:
        world.run(which, lambda ctx: [case(ctx, dtype, count, count) for count in COUNTS])
    finally:
        world.close()
    _, nccl = data_fakes
    assert nccl.log.count(("destroy",)) == len([e for e in nccl.log if e[0] == "init"])


def test_nccl_claims_what_the_cases_cover():
    """The dtypes the cases above run: every NCCL type for reductions, any dtype as bytes
    for data movement; bitwise reductions refused with a reason."""
    reducing = claimed(_PROBE, Op.ALL_REDUCE, CUDA)
    assert {d.name for d in reducing} == set(nccl_be.NCCL_TYPES)
    assert claimed(_PROBE, Op.ALL_GATHER, CUDA) == list(dt.ALL)
    for rop in BITWISE:
        assert "no bitwise" in _PROBE.unsupported_reason(Op.ALL_REDUCE, CUDA, dt.int32, rop)
    assert "CUDA buffers only" in _PROBE.unsupported_reason(Op.BROADCAST, CPU, dt.float32)


@pytest.mark.parametrize("call", list(CORE_CALLS))
def test_nccl_refusals_raise_before_anything_is_sent(data_fakes, monkeypatch, call):
    """Through the core's public API at world size 1 with the fake NCCL made available:
    every combination the NCCL backend refuses (host buffers; dtypes and reduce ops it
    cannot reduce) raises UnsupportedError (DtypeError for dtypes the core never sends)
    before the backend is called: no communicator, nothing on the fake wire."""
    rt = core.get_runtime()
    if rt.world_size != 1:
        pytest.skip("a single-process runtime is needed")
    monkeypatch.setitem(rt._unavailable, "nccl", None)
    monkeypatch.setattr(rt, "_backends", dict(rt._backends))
    monkeypatch.setattr(rt, "choices", {})
    be = rt.backend("nccl")
    _, nccl = data_fakes
    op, fn = CORE_CALLS[call]
    refused = 0
    for device in (CPU, CUDA):
        ctx = Ctx(be, rt.world, device)
        for dtype, rop, want in refusals(be, op, device):
            with pytest.raises(want):
                fn(ctx, dtype, rop, "nccl")
            refused += 1
    assert refused and nccl.log == [], nccl.log
    assert "nccl" not in rt.world.comms
