"""No call leaves a reference cycle behind. A cycle that holds a call's buffers keeps
the caller's tensors (and their memory) alive until Python's cyclic collector happens to
run, which it does by counting Python objects, not bytes: a training loop then grows its
heap by every step's tensors, and its compute runs on fresh pages (a DLRM step under a
tuning table was 20% slower for this). Each op runs through the general path (an
observer forces it), the fast path and the torch process group, blocking and async, on
every rank; the results are checked against NumPy, and ``gc.collect()`` must find
nothing the call made."""
import gc

import pytest
import torch

import mcrdl_core
from conftest import RANK, SIZE, dist, torch_world, values  # noqa: F401


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
    """Rank ``r``'s ``n`` float32 inputs (conftest's ``values``: exact in sums)."""
    return values(r, n, torch.float32, salt)


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


def _done(w, async_op):
    if async_op:
        w.wait()


# Each op as ``fn(api, async_op, **kw)``: ``api`` is mcrdl_torch (with ``backend=`` in
# ``kw``) or torch.distributed on the "mcrdl" process group (no ``kw``).
def _uneven(api, async_op, **kw):
    """all_to_all_single with split sizes: rank s sends s + 1 + r rows to rank r."""
    out_splits = [s + 1 + RANK for s in range(SIZE)]
    in_splits = [RANK + 1 + d for d in range(SIZE)]
    x = torch.cat([rows(RANK, k, d) for d, k in enumerate(in_splits)])
    out = torch.empty(sum(out_splits))
    _done(api.all_to_all_single(out, x, out_splits, in_splits, async_op=async_op, **kw),
          async_op)
    expect = torch.cat([rows(s, k, RANK) for s, k in enumerate(out_splits)])
    assert torch.equal(out, expect), f"rank {RANK}: {out} != {expect}"


def _even(api, async_op, **kw):
    x = torch.cat([rows(RANK, 3, d) for d in range(SIZE)])
    out = torch.empty(3 * SIZE)
    _done(api.all_to_all_single(out, x, async_op=async_op, **kw), async_op)
    assert torch.equal(out, torch.cat([rows(s, 3, RANK) for s in range(SIZE)]))


def _list_a2a(api, async_op, **kw):
    outs = [torch.empty(2) for _ in range(SIZE)]
    _done(api.all_to_all(outs, [rows(RANK, 2, d) for d in range(SIZE)], async_op=async_op,
                         **kw), async_op)
    for s, o in enumerate(outs):
        assert torch.equal(o, rows(s, 2, RANK))


def _all_reduce(api, async_op, **kw):
    x = rows(RANK, 5)
    _done(api.all_reduce(x, async_op=async_op, **kw), async_op)
    assert torch.equal(x, sum(rows(r, 5) for r in range(SIZE)))


def _all_gather(api, async_op, **kw):
    out = torch.empty(4 * SIZE)
    _done(api.all_gather_into_tensor(out, rows(RANK, 4), async_op=async_op, **kw), async_op)
    assert torch.equal(out, torch.cat([rows(r, 4) for r in range(SIZE)]))


def _list_all_gather(api, async_op, **kw):
    outs = [torch.empty(4) for _ in range(SIZE)]
    _done(api.all_gather(outs, rows(RANK, 4), async_op=async_op, **kw), async_op)
    for r, o in enumerate(outs):
        assert torch.equal(o, rows(r, 4))


def _reduce_scatter(api, async_op, **kw):
    out = torch.empty(2)
    x = torch.cat([rows(RANK, 2, d) for d in range(SIZE)])
    _done(api.reduce_scatter_tensor(out, x, async_op=async_op, **kw), async_op)
    assert torch.equal(out, sum(rows(r, 2, RANK) for r in range(SIZE)))


def _gather(api, async_op, **kw):
    outs = [torch.empty(3) for _ in range(SIZE)] if RANK == 0 else None
    _done(api.gather(rows(RANK, 3), outs, dst=0, async_op=async_op, **kw), async_op)
    if RANK == 0:
        for r, o in enumerate(outs):
            assert torch.equal(o, rows(r, 3))


def _scatter(api, async_op, **kw):
    out = torch.empty(3)
    ins = [rows(r, 3, 1) for r in range(SIZE)] if RANK == 0 else None
    _done(api.scatter(out, ins, src=0, async_op=async_op, **kw), async_op)
    assert torch.equal(out, rows(RANK, 3, 1))


def _broadcast(api, async_op, **kw):
    x = rows(RANK, 4)
    _done(api.broadcast(x, src=SIZE - 1, async_op=async_op, **kw), async_op)
    assert torch.equal(x, rows(SIZE - 1, 4))


def _ring(api, async_op, **kw):
    """isend/irecv around the ring (always async; ``async_op`` does not apply)."""
    got = torch.empty(4)
    reqs = [api.isend(rows(RANK, 4), (RANK + 1) % SIZE, **kw),
            api.irecv(got, (RANK - 1) % SIZE, **kw)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, rows((RANK - 1) % SIZE, 4))


OPS = {"all_to_all_single uneven": _uneven, "all_to_all_single even": _even,
       "all_reduce": _all_reduce, "all_gather_into_tensor": _all_gather,
       "reduce_scatter_tensor": _reduce_scatter, "gather": _gather, "scatter": _scatter,
       "broadcast": _broadcast, "isend/irecv": _ring}
PG_OPS = {**OPS, "all_to_all list": _list_a2a, "all_gather list": _list_all_gather}


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("op", list(OPS))
def test_a_core_call_leaves_no_reference_cycle(path, op, async_op):
    fn = OPS[op]
    fn(dist, async_op, backend="mpi")  # first calls of the keys fill the memo (allocating)
    fn(dist, async_op, backend=None)
    assert garbage_of(lambda: (fn(dist, async_op, backend="mpi"),
                               fn(dist, async_op, backend=None))) == []


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("op", list(PG_OPS))
def test_a_process_group_call_leaves_no_reference_cycle(torch_world, path, op,  # noqa: F811
                                                        async_op):
    import torch.distributed as tdist

    fn = PG_OPS[op]
    fn(tdist, async_op)
    assert garbage_of(lambda: fn(tdist, async_op)) == []
