"""The all-reduce fast path (mcrdl_core/dispatch/fastpath.py): the same results and the same
errors as the general path, on every call of a memoized key, and the general path
whenever other work is in flight. Every rank checks its own result against NumPy."""
import numpy as np
import pytest
import torch

import mcrdl_core
import mcrdl_torch as dist
from mcrdl_core.dispatch import fastpath
from mcrdl_core.observe.logger import logger
from mcrdl_core.base.errors import InvalidArgumentError, UnsupportedError
from conftest import RANK, SIZE, values

OPS = {"sum": (dist.ReduceOp.SUM, np.sum), "max": (dist.ReduceOp.MAX, np.max),
       "product": (dist.ReduceOp.PRODUCT, np.prod)}


def expected(count, dtype, op, ranks, salt=0):
    stack = np.stack([values(r, count, dtype, salt).double().numpy() for r in ranks])
    return OPS[op][1](stack, axis=0)


def fast_keys():
    return [k for k in mcrdl_core.get_runtime().choices if k[0] == fastpath._TAG]


@pytest.mark.parametrize("backend", ["mpi", "auto", None])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("async_op", [False, True])
def test_repeated_calls_match_numpy(grp, backend, op, dtype, async_op):
    group, ranks, _ = grp
    for salt in range(3):  # the first call fills the memo, the later ones use it
        t = values(RANK, 5, dtype, salt)
        work = dist.all_reduce(t, op=OPS[op][0], group=group, async_op=async_op,
                               backend=backend)
        if async_op:
            work.wait()
        np.testing.assert_array_equal(t.double().numpy(), expected(5, dtype, op, ranks, salt))
    assert fast_keys(), "no call took the fast path"


@pytest.mark.parametrize("async_op", [False, True])
def test_numpy_arrays_and_sizes(async_op):
    """NumPy arrays enter the fast path as themselves (MPI reads their buffer); an async
    call still records the array's address range for the ordering of later calls."""
    for count in (0, 1, 2, 256, 16384):
        for dtype in (torch.float32, torch.int64, torch.float64):
            a = values(RANK, count, dtype).numpy().copy()
            work = mcrdl_core.all_reduce(a, backend="mpi", async_op=async_op)
            if async_op:
                if count:  # the span is the array's memory
                    lo, hi, _ = work.spans[0]
                    assert (lo, hi) == (a.ctypes.data, a.ctypes.data + a.nbytes)
                work.wait()
            np.testing.assert_array_equal(a, expected(count, dtype, "sum", range(SIZE)))


def test_half_and_avg_take_the_general_path_and_stay_right():
    t = values(RANK, 4, torch.bfloat16)
    dist.all_reduce(t, backend="mpi")
    np.testing.assert_allclose(t.double().numpy(), expected(4, torch.bfloat16, "sum", range(SIZE)))
    f = values(RANK, 4, torch.float32)
    for _ in range(2):
        f = values(RANK, 4, torch.float32)
        dist.all_reduce(f, op=dist.ReduceOp.AVG, backend="mpi")
    np.testing.assert_allclose(f.numpy(), expected(4, torch.float32, "sum", range(SIZE)) / SIZE,
                               rtol=1e-6)


def test_bad_input_raises_on_every_call_of_a_memoized_key():
    t = torch.ones(4, dtype=torch.int32)
    dist.all_reduce(t, backend="mpi")  # fills the memo for (world, int32, cpu, mpi, SUM)
    for _ in range(2):
        with pytest.raises(UnsupportedError, match="floating"):
            dist.all_reduce(t, op=dist.ReduceOp.AVG, backend="mpi")
        with pytest.raises(UnsupportedError, match="bitwise"):
            dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, backend="mpi")
        ro = np.ones(4, np.float32)
        ro.flags.writeable = False
        with pytest.raises(InvalidArgumentError, match="read-only"):
            mcrdl_core.all_reduce(ro, backend="mpi")
        with pytest.raises(InvalidArgumentError, match="not contiguous"):
            dist.all_reduce(torch.ones(4, 2).t(), backend="mpi")
    np.testing.assert_array_equal(t.numpy(), np.full(4, SIZE))  # nothing else was sent


def test_other_work_in_flight_takes_the_general_path():
    """An async all-reduce on gloo in flight: the next mpi all-reduce must not spin on
    MPI alone (deadlock freedom), and both results are right."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    a = values(RANK, 8, torch.float32)
    b = values(RANK, 8, torch.float32, salt=1)
    w = dist.all_reduce(a, backend="gloo", async_op=True)
    dist.all_reduce(b, backend="mpi")
    w.wait()
    np.testing.assert_array_equal(a.numpy(), expected(8, torch.float32, "sum", range(SIZE)))
    np.testing.assert_array_equal(b.numpy(), expected(8, torch.float32, "sum", range(SIZE), 1))
    assert not mcrdl_core.get_runtime().engine.inflight


def test_logger_records_fast_calls():
    lg = logger()
    lg.clear()
    lg.enable()
    try:
        t = torch.ones(2)
        dist.all_reduce(t, backend="mpi")
        dist.all_reduce(t, backend="mpi", async_op=True).wait()
    finally:
        lg.disable()
    recs = [r for r in lg.records if r[0] == "all_reduce"]
    lg.clear()
    assert len(recs) == 2 and all(r[1] == 8 and r[2] == "mpi" and r[3] == SIZE for r in recs)
    np.testing.assert_array_equal(t.numpy(), np.full(2, float(SIZE * SIZE)))



def test_facts_entries_need_a_memoized_key_and_stay_right():
    """The facts entry (mcrdl_torch / NumPy: no Buffer) never fills the memo itself: a
    new key is a MISS, the general path checks the call and fills it, later calls hit."""
    rt = mcrdl_core.get_runtime()
    a = values(RANK, 3, torch.float64).numpy().copy()
    g = mcrdl_core.new_group(list(range(SIZE)))  # a fresh group: no key of it is memoized
    assert fastpath.host_all_reduce(rt, a.ctypes.data, 3, mcrdl_core.base.dtypes.float64, a,
                                    dist.ReduceOp.MAX, g, False, "mpi") is fastpath.MISS
    for salt in range(3):
        p = torch.nn.Parameter(values(RANK, 3, torch.float64, salt), requires_grad=False)
        dist.all_reduce(p, op=dist.ReduceOp.MAX, group=g, backend="mpi")
        np.testing.assert_array_equal(p.detach().numpy(),
                                      expected(3, torch.float64, "max", range(SIZE), salt))
    b = values(RANK, 3, torch.float64, 7).numpy().copy()
    assert fastpath.host_all_reduce(rt, b.ctypes.data, 3, mcrdl_core.base.dtypes.float64, b,
                                    dist.ReduceOp.MAX, g, False, "mpi") is None
    np.testing.assert_array_equal(b, expected(3, torch.float64, "max", range(SIZE), 7))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_a_late_peer_hands_the_wait_to_the_engine(monkeypatch, async_op, kind):
    """A peer later than the spin: the fast path's request is handed to the engine's
    wait (a Work, its timeout), and the result is still right. Spin 0 and a peer 20 ms
    late make every rank but the late one take that branch."""
    import time

    monkeypatch.setattr(mcrdl_core.get_runtime().engine, "spin_s", 0.0)
    for salt in range(3):
        t = values(RANK, 6, torch.float64, salt)
        x = t if kind == "torch" else t.numpy()
        if RANK == SIZE - 1:
            time.sleep(0.02)
        call = dist.all_reduce if kind == "torch" else mcrdl_core.all_reduce
        work = call(x, backend="mpi", async_op=async_op)
        if async_op:
            work.wait()
        np.testing.assert_array_equal(t.numpy(), expected(6, torch.float64, "sum", range(SIZE), salt))
    assert not mcrdl_core.get_runtime().engine.inflight
