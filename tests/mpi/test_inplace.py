"""In-place collectives (issue 21, item 3): an output that shares memory with the input,
as torch.distributed accepts it and FSDP, Megatron and NCCL users write it:

- ``all_gather_into_tensor(out, out[r*n:(r+1)*n])``: the input is the rank's own slot;
- ``reduce_scatter_tensor(x[r*n:(r+1)*n], x)``: the output is the rank's own slot;
- ``all_to_all_single(x, x, ...)``, even and uneven splits;
- the same buffers overlapping somewhere else than the rank's slot (half a block off);
- the list forms with the rank's own tensor in the list (gather, scatter, all_gather,
  reduce_scatter), which the core already routes through temporaries.

MPI forbids overlapping send and receive buffers (MPICH refuses identical pointers with
"Invalid buffer pointer" and leaves the peers waiting; other overlaps are undefined);
Gloo computed the in-place all_to_all wrongly. Every rank checks its result against a
NumPy reference built from every rank's inputs, through the torch frontend and through
the core on NumPy arrays, on mpi and gloo, in the world and in a subgroup whose group
ranks differ from the global ones.
"""
import numpy as np
import pytest
import torch

import mcrdl_core as mc
import mcrdl_torch as dist
from conftest import BACKENDS, RANK, assert_equal, finish, values

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int8]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
N = 6  # elements per rank

pytestmark = [pytest.mark.parametrize("backend", BACKENDS),
              pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])]


def _off_slot(me, n):
    """Start of an N-element window of an n*N buffer that overlaps the buffer but is not
    rank ``me``'s slot (half a block past it, wrapped; the slot itself at 1 rank)."""
    return (me * N + N // 2) % ((n - 1) * N + 1)


def _reference(op, arrays):
    a = np.stack([x.double().numpy() for x in arrays])
    return {"SUM": a.sum(0), "MAX": a.max(0), "AVG": a.mean(0)}[op]


def _gathered(ranks, dtype):
    return torch.cat([values(r, N, dtype) for r in ranks])


@pytest.mark.parametrize("where", ["slot", "off_slot"])
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_all_gather_into_tensor_input_in_output(grp, backend, dtype, where, async_op):
    group, ranks, me = grp
    n = len(ranks)
    out = torch.zeros(n * N, dtype=dtype)
    start = me * N if where == "slot" else _off_slot(me, n)
    inp = out[start:start + N]
    inp.copy_(values(RANK, N, dtype))
    finish(dist.all_gather_into_tensor(out, inp, group, async_op, backend), async_op)
    assert_equal(out, _gathered(ranks, dtype))
    # the group still works afterwards (a refused call used to leave the peers waiting)
    t = values(RANK, N, dtype)
    dist.all_reduce(t, dist.ReduceOp.MAX, group, backend=backend)
    assert_equal(t, _reference("MAX", [values(r, N, dtype) for r in ranks]))


@pytest.mark.parametrize("where", ["slot", "off_slot"])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_reduce_scatter_tensor_output_in_input(grp, backend, dtype, where, op):
    if op == "AVG" and dtype not in FLOATS:
        pytest.skip("AVG is defined for floating dtypes")
    group, ranks, me = grp
    n = len(ranks)
    x = values(RANK, n * N, dtype)
    start = me * N if where == "slot" else _off_slot(me, n)
    out = x[start:start + N]
    finish(dist.reduce_scatter_tensor(out, x, getattr(dist.ReduceOp, op), group,
                                      backend=backend), False)
    full = _reference(op, [values(r, n * N, dtype) for r in ranks])
    assert_equal(out, full[me * N:(me + 1) * N])


def _rotated(i, j, n):
    """Elements group rank i sends to group rank j in the uneven in-place test: 1..n by
    the distance from i to j, so every rank sends and receives the same total (what an
    in-place call needs) while its input and output splits differ."""
    return (j - i) % n + 1


@pytest.mark.parametrize("splits", ["even", "uneven"])
def test_all_to_all_single_output_is_input(grp, backend, dtype, splits):
    group, ranks, me = grp
    n = len(ranks)
    if splits == "even":
        count = [[N] * n for _ in range(n)]
        in_splits = out_splits = None
    else:
        count = [[_rotated(i, j, n) for j in range(n)] for i in range(n)]
        in_splits = count[me]
        out_splits = [count[j][me] for j in range(n)]
    x = values(RANK, sum(count[me]), dtype)
    dist.all_to_all_single(x, x, out_splits, in_splits, group, backend=backend)
    pieces = []
    for j, r in enumerate(ranks):
        start = sum(count[j][:me])
        pieces.append(values(r, sum(count[j]), dtype)[start:start + count[j][me]])
    assert_equal(x, torch.cat(pieces))


def test_list_forms_with_own_tensor(grp, backend, dtype):
    """gather / scatter / all_gather / reduce_scatter with the rank's own tensor inside
    the list, as torch allows: the core stages the lists through one temporary."""
    group, ranks, me = grp
    n, root = len(ranks), ranks[-1]
    # gather: the root's input is its own entry of gather_list
    t = values(RANK, N, dtype)
    outs = ([torch.zeros(N, dtype=dtype) for _ in ranks] if RANK == root else None)
    if outs is not None:
        outs[me] = t
    dist.gather(t, outs, root, group, backend=backend)
    if outs is not None:
        for r, o in zip(ranks, outs):
            assert_equal(o, values(r, N, dtype))
    # scatter: the root's output is its own entry of scatter_list
    t = torch.zeros(N, dtype=dtype)
    ins = None
    if RANK == root:
        ins = [values(root, N, dtype, salt=j) for j in range(n)]
        t.copy_(ins[me])
        ins[me] = t
    dist.scatter(t, ins, root, group, backend=backend)
    assert_equal(t, values(root, N, dtype, salt=me))
    # all_gather: the input is the rank's own entry of tensor_list
    outs = [torch.zeros(N, dtype=dtype) for _ in ranks]
    outs[me].copy_(values(RANK, N, dtype))
    dist.all_gather(outs, outs[me], group, backend=backend)
    for r, o in zip(ranks, outs):
        assert_equal(o, values(r, N, dtype))
    # reduce_scatter: the output is the rank's own entry of input_list
    ins = list(values(RANK, n * N, dtype).reshape(n, N).clone().unbind(0))
    dist.reduce_scatter(ins[me], ins, dist.ReduceOp.SUM, group, backend=backend)
    full = _reference("SUM", [values(r, n * N, dtype) for r in ranks])
    assert_equal(ins[me], full[me * N:(me + 1) * N])


def test_core_on_numpy(grp, backend, dtype):
    """The core's own API on NumPy views (what mcrdl_jax's eager path and NumPy users
    reach): in-place all-gather, reduce-scatter and all-to-all."""
    if dtype is torch.bfloat16:
        pytest.skip("NumPy has no bfloat16 of its own (ml_dtypes is tested via torch)")
    group, ranks, me = grp
    n = len(ranks)
    npdt = torch.empty(0, dtype=dtype).numpy().dtype

    def arr(r, count):
        return values(r, count, dtype).numpy().astype(npdt)

    out = np.zeros(n * N, dtype=npdt)
    out[me * N:(me + 1) * N] = arr(RANK, N)
    mc.all_gather_into_tensor(out, out[me * N:(me + 1) * N], group, backend=backend)
    np.testing.assert_array_equal(out, np.concatenate([arr(r, N) for r in ranks]))

    x = arr(RANK, n * N)
    mc.reduce_scatter_tensor(x[me * N:(me + 1) * N], x, mc.ReduceOp.MAX, group,
                             backend=backend)
    full = np.max([arr(r, n * N) for r in ranks], axis=0)
    np.testing.assert_array_equal(x[me * N:(me + 1) * N], full[me * N:(me + 1) * N])

    x = arr(RANK, n * N)
    mc.all_to_all_single(x, x, group=group, backend=backend)
    np.testing.assert_array_equal(
        x, np.concatenate([arr(r, n * N)[me * N:(me + 1) * N] for r in ranks]))
