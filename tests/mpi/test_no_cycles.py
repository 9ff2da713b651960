"""No call leaves a reference cycle behind. A cycle that holds a call's buffers keeps
the caller's tensors (and their memory) alive until Python's cyclic collector happens to
run, which it does by counting Python objects, not bytes: a training loop then grows its
heap by every step's tensors, and its compute runs on fresh pages (a DLRM step under a
tuning table was 20% slower for this). Each op runs through the general path (an
observer forces it), the fast path and the torch process group, blocking and async, on
every rank; the results are checked against NumPy, and ``gc.collect()`` must find
nothing the call made."""
import gc

import numpy as np
import pytest
import torch

import mcrdl_core
from conftest import RANK, SIZE, dist, torch_world  # noqa: F401


class Quiet(mcrdl_core.Observer):
    """Watches nothing: its presence alone sends every collective down the general path."""


@pytest.fixture(params=["general", "fast"])
def path(request):
    rt = mcrdl_core.get_runtime()
    if request.param == "general":
        rt.watch(Quiet())
    yield request.param
    rt.unwatch("Quiet")


def rows(r, n, salt=0):
    return torch.tensor(((np.arange(n) * 7 + r * 3 + salt) % 5 + 1), dtype=torch.float32)


def garbage_of(fn) -> list:
    """Run ``fn`` with the collector off; the type names of the objects it left in
    reference cycles. Every object older than the call is frozen first (``gc.freeze``),
    so the collection here looks only at what the call made, and takes milliseconds
    instead of a walk over everything torch and JAX hold."""
    gc.disable()
    gc.freeze()
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()
        gc.enable()
    return found


def _uneven(backend, async_op):
    """all_to_all_single with split sizes: rank s sends s + 1 + r rows to rank r."""
    out_splits = [s + 1 + RANK for s in range(SIZE)]
    in_splits = [RANK + 1 + d for d in range(SIZE)]
    x = torch.cat([rows(RANK, k, d) for d, k in enumerate(in_splits)])
    out = torch.empty(sum(out_splits))
    w = dist.all_to_all_single(out, x, out_splits, in_splits, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    expect = torch.cat([rows(s, k, RANK) for s, k in enumerate(out_splits)])
    assert torch.equal(out, expect), f"rank {RANK}: {out} != {expect}"


def _even(backend, async_op):
    x = torch.cat([rows(RANK, 3, d) for d in range(SIZE)])
    out = torch.empty(3 * SIZE)
    w = dist.all_to_all_single(out, x, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    assert torch.equal(out, torch.cat([rows(s, 3, RANK) for s in range(SIZE)]))


def _all_reduce(backend, async_op):
    x = rows(RANK, 5)
    w = dist.all_reduce(x, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    assert torch.equal(x, sum(rows(r, 5) for r in range(SIZE)))


def _all_gather(backend, async_op):
    out = torch.empty(4 * SIZE)
    w = dist.all_gather_into_tensor(out, rows(RANK, 4), async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    assert torch.equal(out, torch.cat([rows(r, 4) for r in range(SIZE)]))


def _reduce_scatter(backend, async_op):
    out = torch.empty(2)
    x = torch.cat([rows(RANK, 2, d) for d in range(SIZE)])
    w = dist.reduce_scatter_tensor(out, x, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    assert torch.equal(out, sum(rows(r, 2, RANK) for r in range(SIZE)))


def _gather(backend, async_op):
    outs = [torch.empty(3) for _ in range(SIZE)] if RANK == 0 else None
    w = dist.gather(rows(RANK, 3), outs, dst=0, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    if RANK == 0:
        for r, o in enumerate(outs):
            assert torch.equal(o, rows(r, 3))


def _scatter(backend, async_op):
    out = torch.empty(3)
    ins = [rows(r, 3, 1) for r in range(SIZE)] if RANK == 0 else None
    w = dist.scatter(out, ins, src=0, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    assert torch.equal(out, rows(RANK, 3, 1))


def _broadcast(backend, async_op):
    x = rows(RANK, 4)
    w = dist.broadcast(x, src=SIZE - 1, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    assert torch.equal(x, rows(SIZE - 1, 4))


def _ring(backend, async_op):
    got = torch.empty(4)
    reqs = [dist.isend(rows(RANK, 4), (RANK + 1) % SIZE, backend=backend),
            dist.irecv(got, (RANK - 1) % SIZE, backend=backend)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, rows((RANK - 1) % SIZE, 4))


OPS = {"all_to_all_single uneven": _uneven, "all_to_all_single even": _even,
       "all_reduce": _all_reduce, "all_gather_into_tensor": _all_gather,
       "reduce_scatter_tensor": _reduce_scatter, "gather": _gather, "scatter": _scatter,
       "broadcast": _broadcast, "isend/irecv": _ring}


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("op", list(OPS))
def test_a_core_call_leaves_no_reference_cycle(path, op, async_op):
    fn = OPS[op]
    fn("mpi", async_op)  # first calls of the keys: the memo is filled (that may allocate)
    fn(None, async_op)
    assert garbage_of(lambda: (fn("mpi", async_op), fn(None, async_op))) == []


def _pg_uneven(tdist):
    out_splits = [s + 1 + RANK for s in range(SIZE)]
    in_splits = [RANK + 1 + d for d in range(SIZE)]
    x = torch.cat([rows(RANK, k, d) for d, k in enumerate(in_splits)])
    out = torch.empty(sum(out_splits))
    tdist.all_to_all_single(out, x, out_splits, in_splits)
    assert torch.equal(out, torch.cat([rows(s, k, RANK) for s, k in enumerate(out_splits)]))


def _pg_even(tdist):
    x = torch.cat([rows(RANK, 3, d) for d in range(SIZE)])
    out = torch.empty(3 * SIZE)
    tdist.all_to_all_single(out, x)
    assert torch.equal(out, torch.cat([rows(s, 3, RANK) for s in range(SIZE)]))


def _pg_list_a2a(tdist):
    outs = [torch.empty(2) for _ in range(SIZE)]
    tdist.all_to_all(outs, [rows(RANK, 2, d) for d in range(SIZE)])
    for s, o in enumerate(outs):
        assert torch.equal(o, rows(s, 2, RANK))


def _pg_all_reduce(tdist):
    x = rows(RANK, 5)
    tdist.all_reduce(x, async_op=True).wait()
    assert torch.equal(x, sum(rows(r, 5) for r in range(SIZE)))


def _pg_all_gather(tdist):
    outs = [torch.empty(4) for _ in range(SIZE)]
    tdist.all_gather(outs, rows(RANK, 4))
    for r, o in enumerate(outs):
        assert torch.equal(o, rows(r, 4))


def _pg_reduce_scatter(tdist):
    out = torch.empty(2)
    tdist.reduce_scatter_tensor(out, torch.cat([rows(RANK, 2, d) for d in range(SIZE)]))
    assert torch.equal(out, sum(rows(r, 2, RANK) for r in range(SIZE)))


def _pg_broadcast(tdist):
    x = rows(RANK, 4)
    tdist.broadcast(x, src=SIZE - 1)
    assert torch.equal(x, rows(SIZE - 1, 4))


def _pg_ring(tdist):
    got = torch.empty(4)
    reqs = [tdist.isend(rows(RANK, 4), (RANK + 1) % SIZE),
            tdist.irecv(got, (RANK - 1) % SIZE)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, rows((RANK - 1) % SIZE, 4))


PG_OPS = {"all_to_all_single uneven": _pg_uneven, "all_to_all_single even": _pg_even,
          "all_to_all list": _pg_list_a2a, "all_reduce async": _pg_all_reduce,
          "all_gather list": _pg_all_gather, "reduce_scatter_tensor": _pg_reduce_scatter,
          "broadcast": _pg_broadcast, "isend/irecv": _pg_ring}


@pytest.mark.parametrize("op", list(PG_OPS))
def test_a_process_group_call_leaves_no_reference_cycle(torch_world, path, op):  # noqa: F811
    import torch.distributed as tdist

    call = PG_OPS[op]
    call(tdist)
    assert garbage_of(lambda: call(tdist)) == []
