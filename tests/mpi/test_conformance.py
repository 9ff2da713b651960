"""Backend conformance suite (issue 23, point 5): one test per op, run against every
registered backend (``mcrdl_core.world.backend.REGISTRY``), so that adding a backend means
passing this file. Runs under mpiexec at 1, 2 and 3 ranks (tests/test_multirank.py).

Each op test is parametrized by backend x dtype (every dtype the backend claims for the
op in ``unsupported_reason``) x group (the world; and a subgroup listing its ranks in
reverse, [last, 0], so that group ranks differ from global ones, for SUB_DTYPES), and
checks on every rank, against a NumPy reference built from every rank's input:

- the op through the core's public API (``mcrdl_core.*`` on NumPy arrays,
  ``backend=name``): 0, 1 and N elements, blocking; several calls in flight at once,
  waited in an order that differs from rank to rank; the in-place forms torch allows;
  every reduce op the dtype admits;
- the op through the ``Backend`` interface itself (the cases of
  ``tests/test_conformance_local.py``, which also run against the NCCL backend on CPU
  fakes): Buffers, group ranks, one Work per op. Dtypes a backend claims but the core
  never communicates (int16) run there only.

``test_refusals`` checks that every combination a backend (or the core) refuses raises
UnsupportedError (DtypeError for dtypes the core never communicates) on every rank
alike, before anything is sent. A backend that handles no host buffers (nccl) is
covered by the fakes and by tests/mpi/test_nccl.py on GPUs; here it is skipped.
"""
import importlib.util
import random
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import mcrdl_core as core
from conftest import RANK, SIZE
from mcrdl_core import dtypes as dt
from mcrdl_core.world.backend import REGISTRY, Backend
from mcrdl_core.memory.buffer import CPU
from mcrdl_core.base.ops import Op, ReduceOp
from mcrdl_core.dispatch.p2p import P2POp, batch_isend_irecv

_TESTS = Path(__file__).resolve().parents[1]
sys.path.append(str(_TESTS))  # the cases module imports the fakes of test_cuda_nccl_comm.py
_spec = importlib.util.spec_from_file_location("conformance_cases",
                                               _TESTS / "test_conformance_local.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)
vals, gathered, reduce_ref, check, N, COUNTS = (cases.vals, cases.gathered, cases.reduce_ref,
                                                cases.check, cases.N, cases.COUNTS)

RT = core.get_runtime()
AVAILABLE = core.available_backends()
SUM = ReduceOp.SUM


def _backend_dtypes():
    """(backend, dtype) for every registered backend and every dtype it claims for some
    op on host buffers; one skipped entry for a backend that cannot run here."""
    out = []
    for name in REGISTRY:
        why = AVAILABLE[name]
        if why is None and "cpu" not in RT.backend(name).devices:
            why = "handles no host buffers (covered by test_conformance_local.py's fakes)"
        if why is not None:
            out.append(pytest.param(name, None, id=name,
                                    marks=pytest.mark.skip(reason=f"{name}: {why}")))
            continue
        be = RT.backend(name)
        out += [pytest.param(name, d, id=f"{name}-{d.name}") for d in dt.ALL
                if any(be.unsupported_reason(op, CPU, d) is None for op in Op)]
    return out


BACKEND_DTYPES = _backend_dtypes()
HOST_BACKENDS = sorted({p.values[0] for p in BACKEND_DTYPES if p.values[1] is not None})

# Defects this suite found (reported, not fixed here). Strict: a fix makes the run fail
# until the mark goes.
GLOO_INT16 = pytest.mark.xfail(strict=True, raises=cases.BackendFailed, reason=(
    "backends/gloo.py: GlooBackend.unsupported_reason claims int16 (_TORCH maps it to "
    "torch.int16), but ProcessGroupGloo has no int16 kernels: broadcast, reduce, "
    "all_reduce, all_gather, reduce_scatter, all_to_all, gather and scatter all fail in "
    "the library with 'RuntimeError: Invalid scalar type'"))
GLOO_ANY_SOURCE_EMPTY = pytest.mark.xfail(strict=True, raises=cases.BackendFailed, reason=(
    "backends/gloo.py: GlooBackend.recv(src=None) of an empty buffer: "
    "ProcessGroupGloo.recv_anysource raises gloo's 'enforce fail at unbound_buffer.cc: "
    "offset < this->size. 0 vs 0' (a raw RuntimeError, when the receive is issued); a "
    "named receive of 0 elements works"))
DEFECTS = {("gloo", "int16", op): GLOO_INT16
           for op in ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
                      "all_to_all", "gather", "scatter")}
DEFECTS[("gloo", "int16", "send_recv")] = GLOO_ANY_SOURCE_EMPTY  # its 0-element case


def by_dtype(op):
    """Parametrize an op test by backend x dtype (the ``grp`` fixture of conftest.py
    adds world x subgroup); ``op`` names its Backend cases, and its known defects."""
    params = []
    for p in BACKEND_DTYPES:
        backend, dtype = p.values
        mark = DEFECTS.get((backend, getattr(dtype, "name", None), op))
        params.append(pytest.param(*p.values, id=p.id, marks=list(p.marks) + ([mark] if mark
                                                                               else [])))
    return pytest.mark.parametrize(("backend", "dtype"), params)


@pytest.fixture
def tag(request):
    """A tag unique to the test, so a message never matches another test's receive."""
    return zlib.crc32(request.node.nodeid.encode()) % 20000


def ctx_of(backend, group):
    return cases.Ctx(RT.backend(backend), RT.group(group))


#: the dtypes run in the subgroup too (rank mapping does not depend on the dtype; the
#: world runs them all): the fast path, a 16-bit float reduced upcast, a wide integer
SUB_DTYPES = (dt.float32, dt.bfloat16, dt.int64)


def claims(backend, op, dtype, group=None):
    """Skip unless ``backend`` claims ``op`` on ``dtype`` (and, in the subgroup, the dtype
    is one of SUB_DTYPES); True if the core's public API communicates the dtype too (else
    only the Backend interface is tested)."""
    why = RT.backend(backend).unsupported_reason(op, CPU, dtype)
    if why is not None:
        pytest.skip(why)
    if group is not None and dtype not in SUB_DTYPES:
        pytest.skip(f"the subgroup runs {[d.name for d in SUB_DTYPES]} (the world every dtype)")
    return dtype in dt.SUPPORTED


def rops(backend, op, dtype):
    return cases.reduce_ops(RT.backend(backend), op, CPU, dtype)


def wait_any_order(works):
    """Wait for every async call's Work in an order of this rank's own."""
    assert all(isinstance(w, core.Work) for w in works), works
    order = list(range(len(works)))
    random.Random(RANK * 31 + len(works)).shuffle(order)
    for i in order:
        works[i].wait()
    assert all(w.is_completed() for w in works)


class PrivateCtx(cases.Ctx):
    """A case on a one-rank group of this rank's own, its Works polled (``test()``) and
    not waited: a library failure fails the test with the library's error, without
    breaking a shared group (as a failed wait does) or leaving a peer waiting."""

    def wait(self, works):
        deadline = time.monotonic() + 30
        while not all(w.test() for w in works):
            assert time.monotonic() < deadline, "a call on a one-rank group did not complete"
            time.sleep(1e-4)
        failed = [w.exception() for w in works if w.exception() is not None]
        if failed:
            raise cases.BackendFailed(f"{self.be.name} on a one-rank group: {failed[0]!r}")


def backend_cases(op, backend, group, dtype, tag):
    """The Backend-interface cases of ``op`` at N elements (reductions: SUM and MAX; the
    core's calls ran the rest); for a dtype the core does not communicate (its only
    coverage) at 0, 1 and N with every reduce op, after a first try on a one-rank group
    (a backend claiming a dtype its library cannot do fails there, alone)."""
    be = RT.backend(backend)
    counts = (N,)
    if dtype not in dt.SUPPORTED:
        counts = COUNTS
        private = PrivateCtx(be, core.new_group([RANK]))
        for case in cases.CASES[op]:
            try:
                case(private, dtype, N, tag)
            except pytest.skip.Exception:
                pass
    ctx = ctx_of(backend, group)
    if dtype in dt.SUPPORTED:  # the core's calls above ran every reduce op on this backend
        ctx.reduce_ops = (ReduceOp.SUM, ReduceOp.MAX)
    for count in counts:
        for case in cases.CASES[op]:
            case(ctx, dtype, count, tag + count)


# --- point to point -------------------------------------------------------------------------
def ring(grp):
    """(group, its ranks, next rank, previous rank) of a ring round the group; skips a
    group of one (point-to-point needs a peer)."""
    group, ranks, me = grp
    if len(ranks) < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    return group, ranks, ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]


@by_dtype("send_recv")
def test_send_recv(grp, backend, dtype, tag):
    """A ring inside the group, blocking (even group ranks send first)."""
    group, ranks, nxt, prv = ring(grp)
    if claims(backend, Op.SEND, dtype, group):
        for count in COUNTS:
            out = np.zeros(count, dtype.np_dtype)
            src = vals(RANK, count, dtype)
            if ranks.index(RANK) % 2 == 0:
                assert core.send(src, nxt, group, tag, backend=backend) is None
                assert core.recv(out, prv, group, tag, backend=backend) == prv
            else:
                assert core.recv(out, prv, group, tag, backend=backend) == prv
                assert core.send(src, nxt, group, tag, backend=backend) is None
            check(out, vals(prv, count, dtype))
    backend_cases("send_recv", backend, group, dtype, tag)


@by_dtype("send_recv")
def test_isend_irecv(grp, backend, dtype, tag):
    """Every count in flight at once both ways round the ring, receives posted in the
    reverse order (matched by tag), one from any source; waited in any order."""
    group, ranks, nxt, prv = ring(grp)
    if not claims(backend, Op.SEND, dtype, group):
        pytest.skip(f"the core does not communicate {dtype.name} (Backend cases: send_recv)")
    outs = [np.zeros(c, dtype.np_dtype) for c in COUNTS]
    sends = [core.isend(vals(RANK, c, dtype), nxt, group, tag + i, backend=backend)
             for i, c in enumerate(COUNTS)]
    recvs = [core.irecv(outs[i], None if c == N else prv, group, tag + i, backend=backend)
             for i, c in reversed(list(enumerate(COUNTS)))][::-1]
    wait_any_order(sends + recvs)
    for c, out, w in zip(COUNTS, outs, recvs):
        assert w.result() == prv  # the sender's global rank, from any source too
        check(out, vals(prv, c, dtype), f"{c} elements")


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=[GLOO_ANY_SOURCE_EMPTY] if b == "gloo" else []) for b in HOST_BACKENDS])
def test_recv_any_source_empty(grp, backend, tag):
    """A receive from any source of 0 elements (the Backend case at count 0)."""
    cases.case_recv_any_source(ctx_of(backend, grp[0]), dt.float32, 0, tag)


@by_dtype("batch_p2p")
def test_batch_isend_irecv(grp, backend, dtype, tag):
    """Sends to both neighbours and receives from both in one batch (receives first)."""
    group, ranks, nxt, prv = ring(grp)
    if claims(backend, Op.SEND, dtype, group):
        for count in COUNTS:
            from_prv, from_nxt = np.zeros(count, dtype.np_dtype), np.zeros(count, dtype.np_dtype)
            ops = [P2POp(core.irecv, from_prv, prv, group, tag),
                   P2POp("irecv", from_nxt, nxt, group, tag + 1),
                   P2POp(core.isend, vals(RANK, count, dtype, salt=1), nxt, group, tag),
                   P2POp("isend", vals(RANK, count, dtype, salt=2), prv, group, tag + 1)]
            works = batch_isend_irecv(ops, backend=backend)
            assert len(works) == len(ops)
            wait_any_order(list({id(w): w for w in works}.values()))
            check(from_prv, vals(prv, count, dtype, salt=1), "from the previous rank")
            check(from_nxt, vals(nxt, count, dtype, salt=2), "from the next rank")
    backend_cases("batch_p2p", backend, group, dtype, tag)


# --- rooted collectives ---------------------------------------------------------------------
@by_dtype("broadcast")
def test_broadcast(grp, backend, dtype, tag):
    group, ranks, me = grp
    if claims(backend, Op.BROADCAST, dtype, group):
        for count in COUNTS:
            x = vals(RANK, count, dtype)
            assert core.broadcast(x, ranks[-1], group, backend=backend) is None
            check(x, vals(ranks[-1], count, dtype))
        xs = [vals(RANK, N, dtype, salt=i) for i in range(len(ranks))]  # every rank a root
        wait_any_order([core.broadcast(x, r, group, True, backend) for x, r in zip(xs, ranks)])
        for i, (x, r) in enumerate(zip(xs, ranks)):
            check(x, vals(r, N, dtype, salt=i), f"root {r}")
    backend_cases("broadcast", backend, group, dtype, tag)


def _reductions(backend, op, dtype, ranks, here, call):
    """SUM at 0, 1 and N elements, blocking, then every reduce op the dtype admits in
    flight at once; ``call(x, reduce_op, async_op)`` makes one call; results are checked
    where ``here``."""
    for count in COUNTS:
        x = vals(RANK, count, dtype)
        assert call(x, SUM, False) is None
        if here:
            check(x, reduce_ref(SUM, [vals(r, count, dtype) for r in ranks]))
    ops = rops(backend, op, dtype)
    xs = [vals(RANK, N, dtype) for _ in ops]
    wait_any_order([call(x, o, True) for x, o in zip(xs, ops)])
    if here:
        for x, o in zip(xs, ops):
            check(x, reduce_ref(o, [vals(r, N, dtype) for r in ranks]), o.name)


@by_dtype("reduce")
def test_reduce(grp, backend, dtype, tag):
    group, ranks, me = grp
    root = ranks[-1]
    if claims(backend, Op.REDUCE, dtype, group):
        _reductions(backend, Op.REDUCE, dtype, ranks, RANK == root,
                    lambda x, o, a: core.reduce(x, root, o, group, a, backend))
    backend_cases("reduce", backend, group, dtype, tag)


@by_dtype("gather")
def test_gather(grp, backend, dtype, tag):
    group, ranks, me = grp
    root = ranks[-1]
    if claims(backend, Op.GATHER, dtype, group):
        for count in COUNTS:
            outs = [np.zeros(count, dtype.np_dtype) for _ in ranks] if RANK == root else None
            assert core.gather(vals(RANK, count, dtype), outs, root, group, backend=backend) is None
            if outs is not None:
                check(np.concatenate(outs), gathered(ranks, count, dtype))
        # one gather to each rank in flight; the root's own input is one of its outputs
        lists = [[np.zeros(N, dtype.np_dtype) for _ in ranks] if RANK == r else None
                 for r in ranks]
        ins = [lst[me] if lst is not None else vals(RANK, N, dtype, salt=i)
               for i, lst in enumerate(lists)]
        for i, lst in enumerate(lists):
            if lst is not None:
                lst[me][...] = vals(RANK, N, dtype, salt=i)
        wait_any_order([core.gather(x, lst, r, group, True, backend)
                        for x, lst, r in zip(ins, lists, ranks)])
        for i, lst in enumerate(lists):
            if lst is not None:
                check(np.concatenate(lst), gathered(ranks, N, dtype, salt=i), f"root {ranks[i]}")
    backend_cases("gather", backend, group, dtype, tag)


@by_dtype("scatter")
def test_scatter(grp, backend, dtype, tag):
    group, ranks, me = grp
    root = ranks[-1]
    if claims(backend, Op.SCATTER, dtype, group):
        for count in COUNTS:
            ins = ([vals(RANK, count, dtype, salt=j) for j in range(len(ranks))]
                   if RANK == root else None)
            out = np.zeros(count, dtype.np_dtype)
            assert core.scatter(out, ins, root, group, backend=backend) is None
            check(out, vals(root, count, dtype, salt=me))
        # one scatter from each rank in flight; the root's output is one of its inputs
        lists = [[vals(RANK, N, dtype, salt=j) for j in range(len(ranks))] if RANK == r else None
                 for r in ranks]
        outs = [lst[me] if lst is not None else np.zeros(N, dtype.np_dtype) for lst in lists]
        wait_any_order([core.scatter(o, lst, r, group, True, backend)
                        for o, lst, r in zip(outs, lists, ranks)])
        for o, r in zip(outs, ranks):
            check(o, vals(r, N, dtype, salt=me), f"root {r}")
    backend_cases("scatter", backend, group, dtype, tag)


# --- symmetric collectives ------------------------------------------------------------------
@by_dtype("all_reduce")
def test_all_reduce(grp, backend, dtype, tag):
    group, ranks, me = grp
    if claims(backend, Op.ALL_REDUCE, dtype, group):
        _reductions(backend, Op.ALL_REDUCE, dtype, ranks, True,
                    lambda x, o, a: core.all_reduce(x, o, group, a, backend))
    backend_cases("all_reduce", backend, group, dtype, tag)


@by_dtype("all_gather")
def test_all_gather(grp, backend, dtype, tag):
    """Into a tensor and into a list; in flight, in place (the input is this rank's slot
    of the output, or its own tensor of the list)."""
    group, ranks, me = grp
    n = len(ranks)
    if claims(backend, Op.ALL_GATHER, dtype, group):
        for count in COUNTS:
            out = np.zeros(n * count, dtype.np_dtype)
            outs = [np.zeros(count, dtype.np_dtype) for _ in ranks]
            assert core.all_gather_into_tensor(out, vals(RANK, count, dtype), group,
                                               backend=backend) is None
            assert core.all_gather(outs, vals(RANK, count, dtype), group, backend=backend) is None
            check(out, gathered(ranks, count, dtype), "into a tensor")
            check(np.concatenate(outs), gathered(ranks, count, dtype), "into a list")
        plain, inplace = np.zeros(n * N, dtype.np_dtype), np.zeros(n * N, dtype.np_dtype)
        slot = inplace[me * N:(me + 1) * N]
        slot[...] = vals(RANK, N, dtype, salt=1)
        listed = [np.zeros(N, dtype.np_dtype) for _ in ranks]
        listed[me][...] = vals(RANK, N, dtype, salt=2)
        wait_any_order([core.all_gather_into_tensor(plain, vals(RANK, N, dtype), group, True,
                                                    backend),
                        core.all_gather_into_tensor(inplace, slot, group, True, backend),
                        core.all_gather(listed, listed[me], group, True, backend)])
        check(plain, gathered(ranks, N, dtype))
        check(inplace, gathered(ranks, N, dtype, salt=1), "in place")
        check(np.concatenate(listed), gathered(ranks, N, dtype, salt=2), "own tensor as input")
    backend_cases("all_gather", backend, group, dtype, tag)


def _rs_expected(ranks, me, count, dtype, op):
    full = reduce_ref(op, [vals(r, len(ranks) * count, dtype) for r in ranks])
    return full[me * count:(me + 1) * count]


@by_dtype("reduce_scatter")
def test_reduce_scatter(grp, backend, dtype, tag):
    """From a tensor and from a list; every reduce op in flight, in place (the output is
    this rank's slot of the input, or its own tensor of the list)."""
    group, ranks, me = grp
    n = len(ranks)
    if claims(backend, Op.REDUCE_SCATTER, dtype, group):
        for count in COUNTS:
            out, out_l = np.zeros(count, dtype.np_dtype), np.zeros(count, dtype.np_dtype)
            assert core.reduce_scatter_tensor(out, vals(RANK, n * count, dtype), SUM, group,
                                              backend=backend) is None
            assert core.reduce_scatter(out_l, np.split(vals(RANK, n * count, dtype), n), SUM,
                                       group, backend=backend) is None
            check(out, _rs_expected(ranks, me, count, dtype, SUM), "from a tensor")
            check(out_l, _rs_expected(ranks, me, count, dtype, SUM), "from a list")
        ops = rops(backend, Op.REDUCE_SCATTER, dtype)
        outs = [np.zeros(N, dtype.np_dtype) for _ in ops]
        works = [core.reduce_scatter_tensor(o, vals(RANK, n * N, dtype), op, group, True, backend)
                 for o, op in zip(outs, ops)]
        x = vals(RANK, n * N, dtype)
        own = np.split(vals(RANK, n * N, dtype), n)
        works += [core.reduce_scatter_tensor(x[me * N:(me + 1) * N], x, SUM, group, True, backend),
                  core.reduce_scatter(own[me], own, ops[-1], group, True, backend)]
        wait_any_order(works)
        for o, op in zip(outs, ops):
            check(o, _rs_expected(ranks, me, N, dtype, op), op.name)
        check(x[me * N:(me + 1) * N], _rs_expected(ranks, me, N, dtype, SUM), "in place")
        check(own[me], _rs_expected(ranks, me, N, dtype, ops[-1]), "own tensor as output")
    backend_cases("reduce_scatter", backend, group, dtype, tag)


@by_dtype("all_to_all")
def test_all_to_all(grp, backend, dtype, tag):
    """``all_to_all_single`` with even splits (flat, in rows, in place) and uneven ones
    (split sizes along dim 0, empty blocks included), and the list form (tensors of
    uneven sizes); blocking and in flight."""
    group, ranks, me = grp
    n = len(ranks)
    if claims(backend, Op.ALL_TO_ALL, dtype, group):
        for count in COUNTS:
            out = np.zeros(n * count, dtype.np_dtype)
            assert core.all_to_all_single(out, vals(RANK, n * count, dtype), group=group,
                                          backend=backend) is None
            check(out, cases.a2a_expected(ranks, me, count, dtype, True), "even")
        lists = [(count, 0) + _a2a_list(ranks, me, count, dtype) for count in COUNTS]
        for _, _, outs, ins in lists:
            assert core.all_to_all(outs, ins, group, backend=backend) is None
        plain, x = np.zeros(n * N, dtype.np_dtype), vals(RANK, n * N, dtype)
        rows = np.zeros((n, N), dtype.np_dtype)
        works = [
            core.all_to_all_single(plain, vals(RANK, n * N, dtype), group=group, async_op=True,
                                   backend=backend),
            core.all_to_all_single(rows, vals(RANK, n * N, dtype).reshape(n, N), group=group,
                                   async_op=True, backend=backend),
            core.all_to_all_single(x, x, group=group, async_op=True, backend=backend)]
        uneven = []
        for count in COUNTS:  # rows of 2
            in_splits = [cases.a2a_counts(me, j, count) for j in range(n)]
            out_splits = [cases.a2a_counts(j, me, count) for j in range(n)]
            out = np.zeros((sum(out_splits), 2), dtype.np_dtype)
            inp = vals(RANK, 2 * sum(in_splits), dtype).reshape(-1, 2)
            works.append(core.all_to_all_single(out, inp, out_splits, in_splits, group, True,
                                                backend))
            uneven.append((out, cases.a2a_expected(ranks, me, 2 * count, dtype, False)))
        lists.append((N, 1) + _a2a_list(ranks, me, N, dtype, salt=1))
        works.append(core.all_to_all(*lists[-1][2:], group, True, backend))
        wait_any_order(works)
        want = cases.a2a_expected(ranks, me, N, dtype, True)
        check(plain, want, "even")
        check(rows, want, "rows")
        check(x, want, "in place")
        for out, want in uneven:
            check(out, want, "uneven")
        for count, salt, outs, _ in lists:
            for j, r in enumerate(ranks):
                check(outs[j], vals(r, cases.a2a_counts(j, me, count), dtype, salt=me + salt),
                      f"list, from {r}")
    backend_cases("all_to_all", backend, group, dtype, tag)


def _a2a_list(ranks, me, count, dtype, salt=0):
    """(outputs, inputs) of a list-form all-to-all of uneven sizes (empty ones included):
    group rank i's j-th input is ``vals(rank i, a2a_counts(i, j, count), salt=j+salt)``."""
    n = len(ranks)
    ins = [vals(RANK, cases.a2a_counts(me, j, count), dtype, salt=j + salt) for j in range(n)]
    outs = [np.zeros(cases.a2a_counts(j, me, count), dtype.np_dtype) for j in range(n)]
    return (outs, ins)


# --- the rest -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_barrier(grp, backend, tag):
    group, ranks, me = grp
    assert core.barrier(group, backend=backend) is None
    wait_any_order([core.barrier(group, True, backend) for _ in range(3)])
    backend_cases("barrier", backend, group, dt.float32, tag)


@pytest.mark.parametrize(("backend", "dtype"), [pytest.param(b, d, id=f"{b}-{d.name}")
                                                for b in HOST_BACKENDS
                                                for d in (dt.float32, dt.bfloat16, dt.int64)])
def test_in_flight(grp, backend, dtype, tag):
    """One of every op in flight through the core at once, waited in any order, and the
    Backend cases of ops in flight together (a send across collectives included)."""
    group, ranks, me = grp
    n = len(ranks)
    root = ranks[-1]
    mine = vals(RANK, N, dtype)
    ar, bc = mine.copy(), mine.copy()
    ag = np.zeros(n * N, dtype.np_dtype)
    agl = [np.zeros(N, dtype.np_dtype) for _ in ranks]
    rs = np.zeros(N, dtype.np_dtype)
    a2a = np.zeros(n * N, dtype.np_dtype)
    gat = [np.zeros(N, dtype.np_dtype) for _ in ranks] if RANK == root else None
    sca = np.zeros(N, dtype.np_dtype)
    rcv = np.zeros(N, dtype.np_dtype)
    works = []
    if n > 1:
        works.append(core.isend(mine, ranks[(me + 1) % n], group, tag, backend=backend))
    works += [core.all_reduce(ar, ReduceOp.MAX, group, True, backend),
              core.broadcast(bc, root, group, True, backend),
              core.all_gather_into_tensor(ag, mine, group, True, backend),
              core.all_gather(agl, mine, group, True, backend),
              core.reduce_scatter_tensor(rs, vals(RANK, n * N, dtype), SUM, group, True, backend),
              core.all_to_all_single(a2a, vals(RANK, n * N, dtype), group=group, async_op=True,
                                     backend=backend),
              core.gather(mine, gat, root, group, True, backend),
              core.scatter(sca, [vals(RANK, N, dtype, salt=j) for j in range(n)]
                           if RANK == root else None, root, group, True, backend)]
    if n > 1:
        works.append(core.irecv(rcv, ranks[(me - 1) % n], group, tag, backend=backend))
    works.append(core.barrier(group, True, backend))
    wait_any_order(works)
    check(ar, reduce_ref(ReduceOp.MAX, [vals(r, N, dtype) for r in ranks]), "all_reduce")
    check(bc, vals(root, N, dtype), "broadcast")
    check(ag, gathered(ranks, N, dtype), "all_gather_into_tensor")
    check(np.concatenate(agl), gathered(ranks, N, dtype), "all_gather")
    check(rs, _rs_expected(ranks, me, N, dtype, SUM), "reduce_scatter_tensor")
    check(a2a, cases.a2a_expected(ranks, me, N, dtype, True), "all_to_all_single")
    if gat is not None:
        check(np.concatenate(gat), gathered(ranks, N, dtype), "gather")
    check(sca, vals(root, N, dtype, salt=me), "scatter")
    if n > 1:
        check(rcv, vals(ranks[(me - 1) % n], N, dtype), "irecv")
    backend_cases("in_flight", backend, group, dtype, tag + 100)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_refusals(grp, backend):
    """Every combination of every op (each call of the public API) that the backend or
    the core refuses raises, UnsupportedError or DtypeError for a dtype the core never
    communicates, with the same message on every rank, before anything is sent: the
    next messages to the group's first rank (where the refused sends and roots point)
    and the next collective are the right ones."""
    group, ranks, me = grp
    ctx = ctx_of(backend, group)
    verdicts = []
    for call, (op, fn) in cases.CORE_CALLS.items():
        for d, rop, want in cases.refusals(ctx.be, op, CPU):
            with pytest.raises(want) as err:
                fn(ctx, d, rop, backend)
            verdicts.append((call, d.name, str(rop), type(err.value).__name__, str(err.value)))
        assert any(v[0] == call for v in verdicts), f"{call}: nothing refused"
    assert RT.bootstrap.group_allgather(verdicts, ranks) == [verdicts] * len(ranks)
    first = ranks[0]
    if RANK == first:  # a refused send would arrive first (same tag, its own size)
        for r in ranks[1:]:
            out = np.zeros(2, np.float32)
            assert core.recv(out, r, group, 0, backend=backend) == r
            check(out, np.full(2, r))
    else:
        core.send(np.full(2, RANK, np.float32), first, group, 0, backend=backend)
    x = np.ones(3, np.float32)
    core.all_reduce(x, SUM, group, backend=backend)
    check(x, np.full(3, len(ranks)))


def test_registry_and_contract():
    """Every registered backend is reported by available_backends() with the same
    verdict on every rank; each that runs here is a Backend of its registered name that
    implements every op of the interface."""
    assert list(AVAILABLE) == list(REGISTRY)
    assert RT.bootstrap.allgather(AVAILABLE) == [AVAILABLE] * SIZE
    ops = ["send", "recv", "broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
           "all_to_all", "gather", "scatter", "barrier", "create_comm"]
    for name, why in AVAILABLE.items():
        if why is not None:
            assert isinstance(why, str) and why
            continue
        be = RT.backend(name)
        assert isinstance(be, Backend) and be.name == name
        missing = [m for m in ops if getattr(type(be), m) is getattr(Backend, m)]
        assert not missing, f"{name} does not implement {missing}"

