"""Observers (mcrdl_core/observe/observer.py): an Observer added with ``Runtime.watch``
sees each collective before it runs, on every rank, with its signature, and each issued
work with its size; results stay NumPy's; a ``before`` that raises refuses the call on
every rank before anything is sent; ``unwatch`` gives the fast path back; the debug
checks are the observer named "debug" (``rt.debug`` adds and removes it)."""
import numpy as np
import pytest

import mcrdl_core
from mcrdl_core.base.errors import InvalidArgumentError, MismatchError
from mcrdl_core.base.ops import Op
from conftest import RANK, SIZE


class Recorder(mcrdl_core.Observer):
    def __init__(self):
        self.seen, self.issued = [], []

    def before(self, rt, group, op, backend, buf, **signature):
        self.seen.append((op, backend.name, group.size, signature))

    def after(self, rt, work, nbytes):
        self.issued.append((work.op, nbytes))


class Refuser(mcrdl_core.Observer):
    def before(self, rt, group, op, backend, buf, **signature):
        raise MismatchError(f"refused {op.value}")


@pytest.fixture
def rt():
    rt = mcrdl_core.get_runtime()
    yield rt
    for name in ("Recorder", "Refuser", "rec"):
        rt.unwatch(name)
    assert not rt.observed


def rank_values(r, n, salt=0):
    return ((np.arange(n) * 7 + r * 3 + salt) % 5 + 1).astype(np.float64)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("n", [0, 1, 8])
def test_an_observer_sees_every_collective_and_results_stay_right(rt, backend, n):
    rec = Recorder()
    rt.watch(rec)
    assert rt.observed and rec in rt.observers
    x = rank_values(RANK, n)
    mcrdl_core.all_reduce(x, backend=backend)
    np.testing.assert_array_equal(x, sum(rank_values(r, n) for r in range(SIZE)))
    b = rank_values(RANK, n, 1)
    mcrdl_core.broadcast(b, src=SIZE - 1, backend=backend)
    np.testing.assert_array_equal(b, rank_values(SIZE - 1, n, 1))
    out = np.empty(SIZE * n)
    mcrdl_core.all_gather_into_tensor(out, rank_values(RANK, n, 2), backend=backend)
    np.testing.assert_array_equal(out, np.concatenate([rank_values(r, n, 2) for r in range(SIZE)]))
    a2a = np.empty(SIZE * n)
    mcrdl_core.all_to_all_single(a2a, rank_values(RANK, SIZE * n, 3), backend=backend)
    expect = np.concatenate([rank_values(r, SIZE * n, 3)[RANK * n:(RANK + 1) * n]
                             for r in range(SIZE)])
    np.testing.assert_array_equal(a2a, expect)
    y = rank_values(RANK, n, 4)
    work = mcrdl_core.all_reduce(y, backend=backend, async_op=True)
    mcrdl_core.barrier(backend=backend)
    work.wait()
    np.testing.assert_array_equal(y, sum(rank_values(r, n, 4) for r in range(SIZE)))
    ops = [Op.ALL_REDUCE, Op.BROADCAST, Op.ALL_GATHER, Op.ALL_TO_ALL, Op.ALL_REDUCE, Op.BARRIER]
    assert [s[0] for s in rec.seen] == ops
    assert {s[1] for s in rec.seen} == {backend} and {s[2] for s in rec.seen} == {SIZE}
    assert rec.seen[0][3]["count"] == n and rec.seen[1][3]["root"] == SIZE - 1
    assert rec.seen[3][3]["counts"] == ([n] * SIZE, [n] * SIZE)
    assert [w[0] for w in rec.issued] == ops
    assert [w[1] for w in rec.issued] == [8 * n, 8 * n, 8 * n * SIZE, 8 * n * SIZE, 8 * n, 0]


def test_a_refusing_observer_stops_the_call_before_anything_is_sent(rt):
    rt.watch(Refuser())
    x = rank_values(RANK, 4)
    for call in (lambda: mcrdl_core.all_reduce(x), lambda: mcrdl_core.broadcast(x, src=0),
                 lambda: mcrdl_core.barrier()):
        with pytest.raises(MismatchError, match="refused"):
            call()
    np.testing.assert_array_equal(x, rank_values(RANK, 4))  # untouched
    rt.unwatch("Refuser")
    assert not rt.observed
    mcrdl_core.all_reduce(x)  # nothing was left half sent: the next call lines up
    np.testing.assert_array_equal(x, sum(rank_values(r, 4) for r in range(SIZE)))


def test_debug_is_the_observer_named_debug(rt):
    rec = Recorder()
    rt.watch(rec, "rec")
    rt.debug = True
    assert rt.debug and len(rt.observers) == 2
    x = rank_values(RANK, 3)
    mcrdl_core.all_reduce(x)
    np.testing.assert_array_equal(x, sum(rank_values(r, 3) for r in range(SIZE)))
    rt.debug = False
    assert not rt.debug and rt.observers == (rec,) and rt.observed
    assert [s[0] for s in rec.seen] == [Op.ALL_REDUCE]


def test_an_unknown_observer_or_a_non_observer_is_refused(rt):
    with pytest.raises(InvalidArgumentError, match="no observer is registered as 'tracer'"):
        rt.watch("tracer")
    with pytest.raises(InvalidArgumentError, match="is not an observer: it needs before"):
        rt.watch(object())
    assert not rt.observed
