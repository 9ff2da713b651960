"""Every op x {mpi, gloo} x dtype x {blocking, async} x {world, subgroup}, checked
against a NumPy reference on every rank (world sizes 1, 2, 3 come from the launcher)."""
import zlib

import numpy as np
import pytest
import torch

import mcrdl_torch as dist
from conftest import BACKENDS, DTYPES, RANK, assert_equal, finish, values

FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]
N = 6  # elements per rank

pytestmark = [pytest.mark.parametrize("backend", BACKENDS),
              pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1]),
              pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])]


def reference(op, arrays):
    a = np.stack([x.double().numpy() for x in arrays])
    if op in ("BAND", "BOR", "BXOR"):
        f = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
        return f.reduce(a.astype(np.int64), axis=0)
    return {"SUM": a.sum(0), "PRODUCT": a.prod(0), "MIN": a.min(0), "MAX": a.max(0),
            "AVG": a.mean(0)}[op]


def applicable(op, dtype):
    if op == "AVG" and dtype not in FLOATS:
        pytest.skip("AVG is defined for floating dtypes (tested to raise in test_errors)")
    if op in ("BAND", "BOR", "BXOR") and dtype in FLOATS:
        pytest.skip("bitwise ops are defined for integer dtypes (tested in test_errors)")


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_all_reduce(grp, backend, dtype, async_op, op):
    applicable(op, dtype)
    group, ranks, me = grp
    t = values(RANK, N, dtype)
    finish(dist.all_reduce(t, getattr(dist.ReduceOp, op), group, async_op, backend), async_op)
    assert_equal(t, reference(op, [values(r, N, dtype) for r in ranks]))


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce(grp, backend, dtype, async_op, op):
    applicable(op, dtype)
    group, ranks, me = grp
    root = ranks[-1]
    t = values(RANK, N, dtype)
    finish(dist.reduce(t, root, getattr(dist.ReduceOp, op), group, async_op, backend), async_op)
    if RANK == root:
        assert_equal(t, reference(op, [values(r, N, dtype) for r in ranks]))


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_scatter_tensor(grp, backend, dtype, async_op, op):
    applicable(op, dtype)
    group, ranks, me = grp
    n = len(ranks)
    out = torch.zeros(N, dtype=dtype)
    finish(dist.reduce_scatter_tensor(out, values(RANK, n * N, dtype),
                                      getattr(dist.ReduceOp, op), group, async_op, backend),
           async_op)
    full = reference(op, [values(r, n * N, dtype) for r in ranks])
    assert_equal(out, full[me * N:(me + 1) * N])


def test_reduce_scatter_list(grp, backend, dtype, async_op):
    group, ranks, me = grp
    n = len(ranks)
    out = torch.zeros(N, dtype=dtype)
    ins = list(values(RANK, n * N, dtype).reshape(n, N).unbind(0))
    finish(dist.reduce_scatter(out, ins, dist.ReduceOp.SUM, group, async_op, backend), async_op)
    full = reference("SUM", [values(r, n * N, dtype) for r in ranks])
    assert_equal(out, full[me * N:(me + 1) * N])


def test_broadcast(grp, backend, dtype, async_op):
    group, ranks, me = grp
    root = ranks[-1]
    t = values(RANK, N, dtype)
    finish(dist.broadcast(t, root, group, async_op, backend), async_op)
    assert_equal(t, values(root, N, dtype))


def test_all_gather_into_tensor(grp, backend, dtype, async_op):
    group, ranks, me = grp
    out = torch.zeros(len(ranks), N, dtype=dtype)
    finish(dist.all_gather_into_tensor(out, values(RANK, N, dtype), group, async_op, backend),
           async_op)
    assert_equal(out, torch.stack([values(r, N, dtype) for r in ranks]))


def test_all_gather_list(grp, backend, dtype, async_op):
    group, ranks, me = grp
    outs = [torch.zeros(N, dtype=dtype) for _ in ranks]
    finish(dist.all_gather(outs, values(RANK, N, dtype), group, async_op, backend), async_op)
    for r, o in zip(ranks, outs):
        assert_equal(o, values(r, N, dtype))


def _counts(i, j):
    """Elements group rank i sends to group rank j in the uneven tests (1..3 rows)."""
    return (i + 2 * j) % 3 + 1


def test_all_to_all_single_even(grp, backend, dtype, async_op):
    group, ranks, me = grp
    n = len(ranks)
    out = torch.zeros(n * N, dtype=dtype)
    finish(dist.all_to_all_single(out, values(RANK, n * N, dtype), group=group,
                                  async_op=async_op, backend=backend), async_op)
    expected = torch.cat([values(r, n * N, dtype)[me * N:(me + 1) * N] for r in ranks])
    assert_equal(out, expected)


def test_all_to_all_single_uneven(grp, backend, dtype, async_op):
    group, ranks, me = grp
    n, width = len(ranks), 2
    in_splits = [_counts(me, j) for j in range(n)]
    out_splits = [_counts(j, me) for j in range(n)]
    inp = values(RANK, sum(in_splits) * width, dtype).reshape(-1, width)
    out = torch.zeros(sum(out_splits), width, dtype=dtype)
    finish(dist.all_to_all_single(out, inp, out_splits, in_splits, group, async_op, backend),
           async_op)
    pieces = []
    for j, r in enumerate(ranks):
        their = values(r, sum(_counts(j, k) for k in range(n)) * width, dtype).reshape(-1, width)
        start = sum(_counts(j, k) for k in range(me))
        pieces.append(their[start:start + _counts(j, me)])
    assert_equal(out, torch.cat(pieces))


def test_all_to_all_list(grp, backend, dtype, async_op):
    group, ranks, me = grp
    n = len(ranks)
    ins = [values(RANK, _counts(me, j), dtype, salt=j) for j in range(n)]
    outs = [torch.zeros(_counts(j, me), dtype=dtype) for j in range(n)]
    finish(dist.all_to_all(outs, ins, group, async_op, backend), async_op)
    for j, r in enumerate(ranks):
        assert_equal(outs[j], values(r, _counts(j, me), dtype, salt=me))


def test_gather(grp, backend, dtype, async_op):
    group, ranks, me = grp
    root = ranks[-1]
    outs = [torch.zeros(N, dtype=dtype) for _ in ranks] if RANK == root else None
    finish(dist.gather(values(RANK, N, dtype), outs, root, group, async_op, backend), async_op)
    if RANK == root:
        for r, o in zip(ranks, outs):
            assert_equal(o, values(r, N, dtype))


def test_scatter(grp, backend, dtype, async_op):
    group, ranks, me = grp
    root = ranks[-1]
    ins = [values(root, N, dtype, salt=j) for j in range(len(ranks))] if RANK == root else None
    out = torch.zeros(N, dtype=dtype)
    finish(dist.scatter(out, ins, root, group, async_op, backend), async_op)
    assert_equal(out, values(root, N, dtype, salt=me))


@pytest.fixture
def tag(request):
    """A tag unique to the test, so a message can never match another test's receive."""
    return zlib.crc32(request.node.name.encode()) % 30000


def test_send_recv(grp, backend, dtype, async_op, tag):
    """A ring inside the group: send to the next rank, receive from the previous one."""
    group, ranks, me = grp
    n = len(ranks)
    if n < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    out = torch.zeros(N, dtype=dtype)
    src = values(RANK, N, dtype)
    if async_op:
        ws = dist.isend(src, nxt, group, tag=tag, backend=backend)
        wr = dist.irecv(out, prv, group, tag=tag, backend=backend)
        wr.wait()
        ws.wait()
        assert wr.result() == prv
    elif me % 2 == 0:
        dist.send(src, nxt, group, tag=tag, backend=backend)
        assert dist.recv(out, prv, group, tag=tag, backend=backend) == prv
    else:
        assert dist.recv(out, prv, group, tag=tag, backend=backend) == prv
        dist.send(src, nxt, group, tag=tag, backend=backend)
    assert_equal(out, values(prv, N, dtype))


def test_recv_any_source(grp, backend, dtype, async_op, tag):
    group, ranks, me = grp
    if len(ranks) < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    if me == 0:
        got = set()
        for _ in ranks[1:]:
            out = torch.zeros(N, dtype=dtype)
            if async_op:
                w = dist.irecv(out, None, group, tag, backend=backend)
                src = w.result()
            else:
                src = dist.recv(out, None, group, tag, backend=backend)
            assert_equal(out, values(src, N, dtype))
            got.add(src)
        assert got == set(ranks[1:])
    else:
        w = dist.isend(values(RANK, N, dtype), ranks[0], group, tag, backend=backend)
        w.wait()


def test_barrier(grp, backend, dtype, async_op):
    if dtype != torch.float32:
        pytest.skip("barrier has no dtype; run once")
    group, ranks, me = grp
    finish(dist.barrier(group, async_op, backend=backend), async_op)
