"""The two-level all-reduce (``backend="hier"``, mcrdl_core/algorithms/hier.py) against NumPy on
every rank. Hierarchical where the launch emulates hosts (``MCRDL_RANKS_PER_HOST=2`` at
4 ranks and ``=3`` at 6, from tests/test_multirank.py); elsewhere the same calls run flat, which is part
of the contract (``hier`` is always a valid request)."""
import numpy as np
import pytest
import torch

import mcrdl_core as core
import mcrdl_torch as dist
from mcrdl_core.base import config as _config
from mcrdl_core.algorithms import hier
from mcrdl_core.base.errors import InvalidArgumentError
from mcrdl_core.observe.logger import logger
from mcrdl_core.dispatch.selection import SCHEMA, TuningTable

RANK, SIZE = dist.get_rank(), dist.get_world_size()
K = _config.get("MCRDL_RANKS_PER_HOST") or 0  # ranks per emulated host
EMULATED = K >= 2 and SIZE % K == 0 and SIZE // K >= 2


def _vals(rank, n, dtype, salt=0):
    return ((np.arange(n) * 5 + rank * 3 + salt) % 7 + 1).astype(dtype)


def _expect(n, dtype, op):
    xs = np.stack([_vals(r, n, dtype) for r in range(SIZE)])
    return {"sum": xs.sum(0), "max": xs.max(0), "min": xs.min(0), "prod": xs.prod(0),
            "avg": xs.mean(0)}[op].astype(dtype)


def test_the_world_is_hierarchical_where_hosts_are_emulated():
    rt = core.get_runtime()
    lv = hier.levels(rt, rt.world)
    if not EMULATED:
        assert lv is None or rt.bootstrap.hosts_in(rt.world.ranks) > 1
        pytest.skip("no emulated hosts in this launch: the calls below run flat")
    intra, inter, _ = lv
    assert intra.size == K and inter.size == SIZE // K
    assert sorted(intra.ranks) == list(range(RANK - RANK % K, RANK - RANK % K + K))
    assert all(r % K == RANK % K for r in inter.ranks)


@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.float64, "avg"),
                                      (np.int32, "max"), (np.int64, "min"),
                                      (np.float64, "prod")])
@pytest.mark.parametrize("backend", ["hier", "hier:mpi", "hier:gloo"])
def test_all_reduce(n, dtype, op, backend):
    x = _vals(RANK, n, dtype)
    core.all_reduce(x, op=op, backend=backend)
    np.testing.assert_allclose(x, _expect(n, dtype, op), rtol=1e-6)


def test_zero_elements_and_the_logged_algorithm():
    x = np.empty(0, np.float32)
    core.all_reduce(x, backend="hier")
    logger().enable()
    logger().clear()
    try:
        y = _vals(RANK, 10, np.float32)
        core.all_reduce(y, backend="hier:mpi")
        names = [rec[2] for rec in logger().records if rec[0] == "all_reduce"]
    finally:
        logger().disable()
    np.testing.assert_allclose(y, _expect(10, np.float32, "sum"))
    assert names == (["hier(mpi/mpi/mpi)"] if EMULATED else ["mpi"]), names


def test_several_in_flight_with_other_work():
    """Two hierarchical all-reduces and a plain all-gather in flight at once, waited in
    reverse order: each result is its own."""
    a, b = _vals(RANK, 64, np.float32), _vals(RANK, 33, np.float64, salt=1)
    src, out = np.full(3, RANK, np.int32), np.empty(3 * SIZE, np.int32)
    works = [core.all_reduce(a, backend="hier", async_op=True),
             core.all_gather_into_tensor(out, src, backend="gloo", async_op=True),
             core.all_reduce(b, op="max", backend="hier:gloo", async_op=True)]
    for w in reversed(works):
        w.wait()
    np.testing.assert_allclose(a, _expect(64, np.float32, "sum"))
    xs = np.stack([_vals(r, 33, np.float64, salt=1) for r in range(SIZE)])
    np.testing.assert_allclose(b, xs.max(0))
    np.testing.assert_array_equal(out, np.repeat(np.arange(SIZE), 3))


def test_many_in_flight_of_different_sizes():
    """A large call then small ones, all async: a small call's steps could complete
    first on one rank and not on another; the steps must still meet in order."""
    sizes = [200000, 10, 5000, 1, 70000, 3]
    xs = [_vals(RANK, n, np.float32, salt=i) for i, n in enumerate(sizes)]
    works = [core.all_reduce(x, backend="hier", async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
    for i, (n, x) in enumerate(zip(sizes, xs)):
        want = np.stack([_vals(r, n, np.float32, salt=i) for r in range(SIZE)]).sum(0)
        np.testing.assert_allclose(x, want, rtol=1e-6)


def test_a_reversed_subgroup_and_a_one_host_subgroup():
    g = core.new_group(list(reversed(range(SIZE))))
    x = _vals(RANK, 9, np.float32)
    core.all_reduce(x, group=g, backend="hier")
    np.testing.assert_allclose(x, _expect(9, np.float32, "sum"))
    if SIZE >= 2:
        pair = core.new_group([0, 1])  # one emulated host (or 2 x 1 rank): flat
        y = np.full(4, float(RANK + 1), np.float32)
        if RANK in (0, 1):
            core.all_reduce(y, group=pair, backend="hier")
            np.testing.assert_allclose(y, np.full(4, 3.0))


def test_torch_frontend():
    t = torch.full((6,), float(RANK + 1))
    dist.all_reduce(t, backend="hier")
    assert torch.equal(t, torch.full((6,), SIZE * (SIZE + 1) / 2))
    w = dist.all_reduce(t, op=dist.ReduceOp.MAX, backend="hier:mpi", async_op=True)
    w.wait()
    assert torch.equal(t, torch.full((6,), SIZE * (SIZE + 1) / 2))


@pytest.mark.parametrize("backend", ["hier:", "hierx", "hier:hier"])
def test_bad_requests_fail_before_anything_is_sent(backend):
    with pytest.raises(InvalidArgumentError, match="hier:NAME"):
        core.all_reduce(np.ones(2, np.float32), backend=backend)


def test_compression_is_refused():
    with pytest.raises(InvalidArgumentError, match="lossless"):
        core.all_reduce(np.ones(2, np.float32), backend="hier", compression="fp16")


# --- the two-level all-to-all (Tutel's 2DH shape) -------------------------------------
def _a2a_expect(per_peer, dtype, salt=0):
    """What this rank receives: block RANK of every rank's input, in rank order."""
    return np.concatenate([_vals(k, SIZE * per_peer, dtype, salt)[RANK * per_peer:
                                                                 (RANK + 1) * per_peer]
                           for k in range(SIZE)])


@pytest.mark.parametrize("per_peer", [1, 7, 3000])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
@pytest.mark.parametrize("backend", ["hier", "hier:mpi", "hier:gloo"])
def test_all_to_all(per_peer, dtype, backend):
    x = _vals(RANK, SIZE * per_peer, dtype)
    out = np.empty_like(x)
    core.all_to_all_single(out, x, backend=backend)
    np.testing.assert_array_equal(out, _a2a_expect(per_peer, dtype))


def test_all_to_all_in_place_rows_and_logged_algorithm():
    x = _vals(RANK, SIZE * 6, np.float64).reshape(SIZE * 2, 3)  # rows: 2 per peer
    logger().enable()
    logger().clear()
    try:
        core.all_to_all_single(x, x, backend="hier:mpi")  # output is the input
        names = [rec[2] for rec in logger().records if rec[0] == "all_to_all"]
    finally:
        logger().disable()
    np.testing.assert_array_equal(x.reshape(-1), _a2a_expect(6, np.float64))
    assert names == (["hier(mpi/mpi)"] if EMULATED else ["mpi"]), names


def test_all_to_all_and_all_reduce_in_flight_together():
    """Both ops share the sub-groups: their steps must meet in order across calls."""
    xs = [_vals(RANK, SIZE * n, np.float32, salt=i) for i, n in enumerate([5000, 3, 40])]
    outs = [np.empty_like(x) for x in xs]
    y = _vals(RANK, 999, np.float32, salt=9)
    works = [core.all_to_all_single(outs[0], xs[0], backend="hier", async_op=True),
             core.all_reduce(y, backend="hier", async_op=True),
             core.all_to_all_single(outs[1], xs[1], backend="hier:gloo", async_op=True),
             core.all_to_all_single(outs[2], xs[2], backend="hier", async_op=True)]
    for w in reversed(works):
        w.wait()
    for i, (n, out) in enumerate(zip([5000, 3, 40], outs)):
        np.testing.assert_array_equal(out, _a2a_expect(n, np.float32, salt=i))
    want = np.stack([_vals(r, 999, np.float32, salt=9) for r in range(SIZE)]).sum(0)
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_uneven_all_to_all_runs_flat():
    splits = [1 + k for k in range(SIZE)]  # rank k gets 1 + k elements from each
    x = _vals(RANK, sum(splits), np.int32)
    out = np.empty((1 + RANK) * SIZE, np.int32)
    core.all_to_all_single(out, x, [1 + RANK] * SIZE, splits, backend="hier")
    offs = np.cumsum([0] + splits)
    want = np.concatenate([_vals(k, sum(splits), np.int32)[offs[RANK]:offs[RANK + 1]]
                           for k in range(SIZE)])
    np.testing.assert_array_equal(out, want)


def test_torch_all_to_all_single():
    x = torch.arange(SIZE * 4, dtype=torch.float32) + 100 * RANK
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, backend="hier")
    want = torch.cat([torch.arange(RANK * 4, RANK * 4 + 4, dtype=torch.float32) + 100 * k
                      for k in range(SIZE)])
    assert torch.equal(out, want), out


def test_all_to_all_bad_input_fails_before_anything_is_sent():
    with pytest.raises(InvalidArgumentError, match="hier:NAME"):
        core.all_to_all_single(np.empty(SIZE), np.ones(SIZE), backend="hier:")
    with pytest.raises(InvalidArgumentError, match="lossless"):
        core.all_to_all_single(np.empty(SIZE, np.float32), np.ones(SIZE, np.float32),
                               backend="hier", compression="fp16")
    if SIZE > 1:
        with pytest.raises(InvalidArgumentError, match="divisible"):
            core.all_to_all_single(np.empty(SIZE + 1), np.ones(SIZE + 1), backend="hier")


@pytest.fixture
def hier_table():
    """A tuning table that says: mpi up to 64 B, the two-level algorithm above, for
    all_reduce and all_to_all (what ``mcrdl tune`` writes where ``hier`` wins)."""
    rt = core.get_runtime()
    hosts = rt.bootstrap.hosts_in(rt.world.ranks)
    rt.set_table(TuningTable({"schema": SCHEMA, "entries": [
        {"op": op, "world_size": SIZE, "hosts": hosts, "device": "cpu", "dtype_class": "float",
         "ranges": [[64, "mpi"], [None, "hier"]]} for op in ("all_reduce", "all_to_all")]}))
    yield rt
    rt.set_table(None)


def test_a_table_that_names_hier_runs_it_for_auto_calls_only(hier_table):
    logger().enable()
    logger().clear()
    try:
        small = [_vals(RANK, 4, np.float32) for _ in range(2)]  # 16 B: mpi (fast path)
        big = [_vals(RANK, 100, np.float32) for _ in range(3)]  # 400 B: hier
        for x in small + big[:2]:  # twice each: the fast path's memo must not take hier's
            core.all_reduce(x)
        t = torch.from_numpy(_vals(RANK, 100, np.float32))
        dist.all_reduce(t)
        x = _vals(RANK, SIZE * 50, np.float32)
        out = np.empty_like(x)
        core.all_to_all_single(out, x)
        core.all_reduce(big[2], backend="mpi")  # a named backend beats the table
        uneven = np.empty(SIZE * 50, np.float32)  # split sizes: always flat
        core.all_to_all_single(uneven, x, [50] * SIZE, [50] * SIZE)
        names = [(rec[0], rec[2]) for rec in logger().records]
    finally:
        logger().disable()
    for y in small:
        np.testing.assert_allclose(y, _expect(4, np.float32, "sum"))
    for y in big + [t.numpy()]:
        np.testing.assert_allclose(y, _expect(100, np.float32, "sum"))
    np.testing.assert_array_equal(out, _a2a_expect(50, np.float32))
    np.testing.assert_array_equal(uneven, _a2a_expect(50, np.float32))
    h_ar = "hier(mpi/mpi/mpi)" if EMULATED else "mpi"
    h_a2a = "hier(mpi/mpi)" if EMULATED else "mpi"
    assert names == [("all_reduce", "mpi")] * 2 + [("all_reduce", h_ar)] * 3 + \
        [("all_to_all", h_a2a), ("all_reduce", "mpi"), ("all_to_all", "mpi")], names
