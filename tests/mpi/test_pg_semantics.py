"""The "mcrdl" torch process group against torch's own contract (issue 22, items 1-4, 15
and 17): ordering of ``barrier``, the rank order of ``new_group(sort_ranks=False)``, the
pairing of ``all_gather_coalesced``, the value of ``Work.result()`` and futures, the
dtypes and layouts torch's Gloo accepts, and ``new_group(backend="gloo")``.

Runs on every rank (1, 2 or 3) under mpiexec; torch makes the default group itself
(``init_process_group("mcrdl")``). Every result is checked against a reference each
rank computes from every rank's inputs; where torch defines the form of a result by
what its backends return (the value of a future), the same call is made on a real
Gloo group of the same job and the two are compared.
"""
import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mcrdl_torch
from conftest import RANK, SIZE, assert_equal, values

_vals = functools.partial(values, dtype=torch.float32)


pytestmark = pytest.mark.usefixtures("torch_world")  # conftest: an "mcrdl" default group


@pytest.fixture(scope="module")
def gloo(torch_world):
    """A real torch Gloo group of the whole job, made under the mcrdl default group."""
    g = dist.new_group(backend="gloo")
    yield g
    dist.destroy_process_group(g)


def _mcrdl(group=None):
    from mcrdl_torch.process_group import McrdlProcessGroup

    pg = group or dist.distributed_c10d._get_default_group()
    return isinstance(pg, McrdlProcessGroup)


# --- item 1: barrier orders after earlier work ---------------------------------------------
@pytest.mark.parametrize("keep", [True, False], ids=["work-kept", "work-dropped"])
@pytest.mark.parametrize("count", [1 << 10, 4 << 20], ids=["4KiB", "16MiB"])
def test_barrier_completes_after_earlier_async_collectives(count, keep):
    """Gloo's barrier waits for the group's earlier work; so must ours: after
    ``barrier()`` the async all-reduce's result is in the tensor, whether or not the
    Work was kept (the Work is never waited)."""
    t = torch.full((count,), float(RANK + 1))
    works = [dist.all_reduce(t, async_op=True)]
    if not keep:
        works.clear()
    dist.barrier()
    expected = SIZE * (SIZE + 1) / 2
    assert bool((t == expected).all()), f"rank {RANK}: {t[:4]} != {expected}"


def test_async_barrier_and_mcrdl_torch_barrier_complete_after_earlier_work():
    """The async barrier of the process group, and the torch-shaped API's barrier on the
    same world, both complete only after the earlier all-reduces."""
    a = torch.full((1 << 20,), float(RANK + 1))
    dist.all_reduce(a, async_op=True)
    dist.barrier(async_op=True).wait()
    b = torch.full((1 << 20,), float(RANK + 2))
    mcrdl_torch.all_reduce(b, async_op=True)
    mcrdl_torch.barrier()
    c = torch.full((1 << 20,), float(RANK + 3))
    mcrdl_torch.all_reduce(c, async_op=True)
    mcrdl_torch.barrier(async_op=True).wait()
    n = SIZE
    for t, base in ((a, 1), (b, 2), (c, 3)):
        expected = sum(r + base for r in range(n))
        assert bool((t == expected).all()), f"rank {RANK}: {t[:2]} != {expected} (base {base})"


def test_barrier_does_not_wait_for_point_to_point():
    """As with Gloo, a pending receive is not part of the barrier: rank 1 posts a
    receive that rank 0 only matches after the barrier; waiting for it there would
    deadlock."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    t = torch.zeros(1 << 16)
    if RANK == 1:
        work = dist.irecv(t, src=0)
        dist.barrier()
        work.wait()
        assert_equal(t, _vals(0, 1 << 16))
    else:
        dist.barrier()
        if RANK == 0:
            dist.send(_vals(0, 1 << 16), dst=1)


# --- item 2: new_group keeps the order it is given -----------------------------------------
def test_new_group_sort_ranks_false_keeps_the_order():
    """torch's mapping: group rank i is ranks[i]. A broadcast from group rank 0 of the
    reversed world sends the last global rank's data; all_gather lists by group rank."""
    n = SIZE
    ranks = list(reversed(range(n)))
    g = dist.new_group(ranks, sort_ranks=False)
    assert dist.get_rank(g) == ranks.index(RANK)
    assert dist.get_global_rank(g, 0) == ranks[0]
    assert g.rank() == ranks.index(RANK) and g.size() == n
    t = _vals(RANK, 5)
    dist.broadcast(t, group_src=0, group=g)
    assert_equal(t, _vals(ranks[0], 5))
    outs = [torch.empty(5) for _ in range(n)]
    dist.all_gather(outs, _vals(RANK, 5), group=g)
    for i, o in enumerate(outs):
        assert_equal(o, _vals(ranks[i], 5))
    s = dist.new_group(ranks)  # torch's default sorts
    t = _vals(RANK, 5)
    dist.broadcast(t, group_src=0, group=s)
    assert_equal(t, _vals(0, 5))
    # the torch-shaped API keeps the order given unless asked to sort (documented)
    assert mcrdl_torch.new_group(ranks).ranks == tuple(ranks)
    assert mcrdl_torch.new_group(ranks, sort_ranks=True).ranks == tuple(sorted(ranks))


# --- item 3: all_gather_coalesced ------------------------------------------------------------
_SHAPES = {"equal": [(3,), (3,)], "mixed": [(2,), (3, 2), (1,)], "with_empty": [(0,), (4,), (0, 3)],
           "complex": [(3,), (2, 2)]}


@pytest.mark.parametrize("case", list(_SHAPES))
def test_all_gather_coalesced_pairs_outputs_by_rank(case):
    """``output_lists[r][j]`` receives rank r's input j (torch's contract, as its own
    test_all_gather_coalesced_* check)."""
    n = SIZE
    dtype = torch.complex64 if case == "complex" else torch.float32

    def inp(r, j, shape):
        v = _vals(r, max(1, int(np.prod(shape))), salt=10 * j)[:int(np.prod(shape))]
        v = v.reshape(shape).to(dtype)
        return v * (1 + 2j) if case == "complex" else v

    shapes = _SHAPES[case]
    inputs = [inp(RANK, j, s) for j, s in enumerate(shapes)]
    outs = [[torch.full(s, -1.0).to(dtype) for s in shapes] for _ in range(n)]
    dist.all_gather_coalesced(outs, inputs)
    for r in range(n):
        for j, s in enumerate(shapes):
            assert torch.equal(outs[r][j], inp(r, j, s)), f"rank {RANK}: [{r}][{j}] {outs[r][j]}"


# --- item 4: result() and future values -------------------------------------------------------
def _form(value):
    """The structure of a future's value or a result: nested lists of tensor shapes."""
    if isinstance(value, (list, tuple)):
        return [_form(v) for v in value]
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _gather_calls(group, n):
    root = 0
    ins = _vals(RANK, 3)
    outs = [torch.empty(3) for _ in range(n)]
    gl = [torch.empty(3) for _ in range(n)] if RANK == root else None
    lists = [[torch.empty(2), torch.empty(3)] for _ in range(n)]
    yield "all_gather", dist.all_gather(outs, ins, group=group, async_op=True), outs
    yield "gather", dist.gather(ins, gl, dst=root, group=group, async_op=True), gl or []
    fut = dist.all_gather_coalesced(lists, [_vals(RANK, 2), _vals(RANK, 3)], group=group,
                                    async_op=True)
    yield "all_gather_coalesced", fut, lists


def test_result_and_future_value_match_gloo(gloo):
    """``work.result()`` and the future's value of all_gather and gather are the flat
    list of output tensors ``[t0, t1, ...]`` (``[]`` on a gather's non-root), as Gloo
    returns them; all_gather_coalesced's future holds what Gloo's holds."""
    n = SIZE
    ours = {name: (w, expected) for name, w, expected in _gather_calls(None, n)}
    theirs = {name: w for name, w, _ in _gather_calls(gloo, n)}
    for name, (work, expected) in ours.items():
        if isinstance(work, torch.futures.Future):  # all_gather_coalesced returns a future
            value, gloo_value = work.wait(), theirs[name].wait()
        else:
            work.wait()
            theirs[name].wait()
            assert _form(work.result()) == _form(theirs[name].result()), name
            assert _form(work.result()) == _form(expected), name
            assert all(a is b for a, b in zip(work.result(), expected)), name
            value = work.get_future().wait()
            gloo_value = theirs[name].get_future().wait()
        assert _form(value) == _form(gloo_value), (name, _form(value), _form(gloo_value))
        if name != "all_gather_coalesced":
            assert _form(value) == _form(expected), name


# --- item 15: dtypes ---------------------------------------------------------------------------
def _bools(rank, count, salt=0):
    return torch.tensor((np.arange(count) * 5 + rank * 3 + salt) % 4 < 2)


_BOOL_REF = {"SUM": np.logical_or.reduce, "MAX": np.logical_or.reduce,
             "MIN": np.logical_and.reduce, "PRODUCT": np.logical_and.reduce,
             "BAND": np.logical_and.reduce, "BOR": np.logical_or.reduce,
             "BXOR": np.logical_xor.reduce}


@pytest.mark.parametrize("op", list(_BOOL_REF))
def test_bool_all_reduce_and_reduce(op, gloo):
    """bool reductions as Gloo computes them (SUM/MAX are OR, PRODUCT/MIN are AND, XOR
    is parity), checked against NumPy and against the Gloo group."""
    n = SIZE
    allb = np.stack([_bools(r, 9).numpy() for r in range(n)])
    expected = _BOOL_REF[op](allb, axis=0)
    rop = getattr(dist.ReduceOp, op)
    t = _bools(RANK, 9)
    dist.all_reduce(t, op=rop)
    assert t.tolist() == expected.tolist(), (RANK, op, t)
    g = _bools(RANK, 9)
    dist.all_reduce(g, op=rop, group=gloo)
    assert t.tolist() == g.tolist()
    t = _bools(RANK, 9)
    dist.reduce(t, dst=n - 1, op=rop)
    if RANK == n - 1:
        assert t.tolist() == expected.tolist()


def test_bool_every_other_op():
    """bool on broadcast, all_gather(_into_tensor), reduce_scatter(_tensor), gather,
    scatter, all_to_all(_single) and send/recv (DDP broadcasts a bool buffer)."""
    n, root = SIZE, SIZE - 1
    mine = _bools(RANK, 4)
    t = mine.clone()
    dist.broadcast(t, src=root)
    assert torch.equal(t, _bools(root, 4))
    outs = [torch.zeros(4, dtype=torch.bool) for _ in range(n)]
    dist.all_gather(outs, mine)
    assert all(torch.equal(o, _bools(r, 4)) for r, o in enumerate(outs))
    flat = torch.zeros(4 * n, dtype=torch.bool)
    dist.all_gather_into_tensor(flat, mine)
    assert torch.equal(flat, torch.cat([_bools(r, 4) for r in range(n)]))
    big = [_bools(r, 4 * n, salt=1) for r in range(n)]
    any_of = torch.stack(big).any(0)
    out = torch.zeros(4, dtype=torch.bool)
    dist.reduce_scatter_tensor(out, big[RANK])
    assert torch.equal(out, any_of[4 * RANK:4 * RANK + 4])
    out = torch.zeros(4, dtype=torch.bool)
    dist.reduce_scatter(out, list(big[RANK].chunk(n)))
    assert torch.equal(out, any_of[4 * RANK:4 * RANK + 4])
    gl = [torch.zeros(4, dtype=torch.bool) for _ in range(n)] if RANK == root else None
    dist.gather(mine, gl, dst=root)
    if RANK == root:
        assert all(torch.equal(o, _bools(r, 4)) for r, o in enumerate(gl))
    out = torch.zeros(4, dtype=torch.bool)
    dist.scatter(out, list(big[root].chunk(n)) if RANK == root else None, src=root)
    assert torch.equal(out, big[root][4 * RANK:4 * RANK + 4])
    out = torch.zeros(4 * n, dtype=torch.bool)
    dist.all_to_all_single(out, big[RANK])
    assert torch.equal(out, torch.cat([big[s][4 * RANK:4 * RANK + 4] for s in range(n)]))
    outs = [torch.zeros(4, dtype=torch.bool) for _ in range(n)]
    dist.all_to_all(outs, list(big[RANK].chunk(n)))
    assert all(torch.equal(o, big[s][4 * RANK:4 * RANK + 4]) for s, o in enumerate(outs))
    if n > 1:
        nxt, prv = (RANK + 1) % n, (RANK - 1) % n
        got = torch.zeros(4, dtype=torch.bool)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, prv),
                                        dist.P2POp(dist.isend, mine, nxt)])
        for w in works:
            w.wait()
        assert torch.equal(got, _bools(prv, 4))


@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_complex_reduce_and_reduce_scatter_tensor(op):
    """Complex sums (torch's all_reduce views complex as real pairs itself; reduce and
    reduce_scatter_tensor hand the complex tensor to the backend)."""
    n, root = SIZE, SIZE - 1
    rop = getattr(dist.ReduceOp, op)

    def cx(r, count):
        return _vals(r, count) + 1j * _vals(r, count, salt=2)

    total = sum(cx(r, 6) for r in range(n)) / (n if op == "AVG" else 1)
    t = cx(RANK, 6)
    dist.reduce(t, dst=root, op=rop)
    if RANK == root:
        torch.testing.assert_close(t, total.to(t.dtype))
    big = sum(cx(r, 2 * n) for r in range(n)) / (n if op == "AVG" else 1)
    out = torch.zeros(2, dtype=torch.complex64)
    dist.reduce_scatter_tensor(out, cx(RANK, 2 * n), op=rop)
    torch.testing.assert_close(out, big[2 * RANK:2 * RANK + 2].to(out.dtype))


def test_complex_max_is_refused_clearly():
    """MAX/MIN/PRODUCT/bitwise have no meaning on complex numbers; torch refuses them
    for all_reduce before the backend is called, so reduce refuses them too, before
    anything is sent (the group stays in step)."""
    t = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="complex"):
        dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    dist.barrier()


_P2P_DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.bool, torch.complex128]


@pytest.mark.parametrize("dtype", _P2P_DTYPES, ids=str)
def test_send_recv_dtypes_gloo_accepts(dtype):
    """Point to point (and broadcast) moves bytes: any dtype torch's Gloo sends goes."""
    n = SIZE
    ref = [(torch.arange(6) + 7 * r + 1).to(dtype) for r in range(n)]
    if n > 1:
        nxt, prv = (RANK + 1) % n, (RANK - 1) % n
        got = torch.zeros(6, dtype=dtype)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, prv),
                                        dist.P2POp(dist.isend, ref[RANK], nxt)])
        for w in works:
            w.wait()
        assert torch.equal(got.view(torch.uint8), ref[prv].view(torch.uint8))
    t = ref[RANK].clone()
    dist.broadcast(t, src=0)
    assert torch.equal(t.view(torch.uint8), ref[0].view(torch.uint8))


# --- item 15: layouts --------------------------------------------------------------------------
def _layout(kind, rank):
    """(tensor to reduce in place, the memory that must show the result, a function from
    the reduced values to what that memory must hold)."""
    if kind == "transposed":
        base = _vals(rank, 12).reshape(3, 4)
        return base.t(), base, lambda s: s.reshape(4, 3).t()
    if kind == "strided-slice":
        base = torch.full((10,), -1.0)
        base[::2] = _vals(rank, 5)
        def put(s):
            b = torch.full((10,), -1.0)
            b[::2] = s.reshape(-1)
            return b
        return base[::2], base, put
    if kind == "expanded":
        base = _vals(rank, 3)
        return base.expand(4, 3), base, lambda s: s.reshape(4, 3)[0]
    if kind == "channels-last":
        t = _vals(rank, 24).reshape(1, 2, 3, 4).contiguous(memory_format=torch.channels_last)
        return t, t, lambda s: s.reshape(1, 2, 3, 4)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["transposed", "strided-slice", "expanded", "channels-last"])
def test_all_reduce_into_non_contiguous_tensor(kind):
    """The result lands in the tensor's own memory, element for element (Gloo writes
    a strided slice as if it were contiguous; the reference here is the arithmetic)."""
    n = SIZE
    t, memory, view = _layout(kind, RANK)
    total = sum(_layout(kind, r)[0].contiguous() for r in range(n))
    dist.all_reduce(t)
    assert_equal(t, total)
    assert_equal(memory, view(total))


def test_broadcast_and_recv_into_columns_and_all_gather_into_columns():
    n, root = SIZE, SIZE - 1
    base = torch.full((3, 4), -1.0)
    col = base[:, 1]
    col.copy_(_vals(RANK, 3))
    dist.broadcast(col, src=root)
    expected = torch.full((3, 4), -1.0)
    expected[:, 1] = _vals(root, 3)
    assert_equal(base, expected)
    out = torch.zeros(3, n + 1)
    dist.all_gather([out[:, i] for i in range(n)], _vals(RANK, 3))
    expected = torch.zeros(3, n + 1)
    for r in range(n):
        expected[:, r] = _vals(r, 3)
    assert_equal(out, expected)
    out = torch.zeros(2, 6)
    dist.reduce_scatter_tensor(out[:, 1], _vals(RANK, 2 * n, salt=4))
    expected = torch.zeros(2, 6)
    expected[:, 1] = sum(_vals(r, 2 * n, salt=4) for r in range(n))[2 * RANK:2 * RANK + 2]
    assert_equal(out, expected)
    if n > 1:
        base = torch.zeros(4, 3)
        if RANK == 0:
            dist.send(_vals(0, 4), dst=1)
        elif RANK == 1:
            dist.recv(base[:, 2], src=0)
            expected = torch.zeros(4, 3)
            expected[:, 2] = _vals(0, 4)
            assert_equal(base, expected)


# --- item 15: sparse ---------------------------------------------------------------------------
def _sparse(rank, hybrid=False):
    idx = torch.tensor([[rank % 3, 4, (2 * rank + 1) % 6]])
    vals = torch.tensor([1.0 + rank, 2.0, 3.0 * rank])
    if hybrid:
        return torch.sparse_coo_tensor(idx, vals[:, None] * torch.arange(1.0, 3.0), (6, 2))
    return torch.sparse_coo_tensor(idx, vals, (6,))


@pytest.mark.parametrize("hybrid", [False, True], ids=["sparse", "hybrid"])
def test_sparse_all_reduce(hybrid, gloo):
    """Sparse COO all-reduce (SUM), as Gloo does it: the tensor holds the coalesced sum."""
    n = SIZE
    t = _sparse(RANK, hybrid)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    expected = sum(_sparse(r, hybrid).to_dense() for r in range(n))
    assert t.is_sparse
    assert_equal(t.to_dense(), expected)
    assert_equal(work.get_future().wait()[0].to_dense(), expected)
    g = _sparse(RANK, hybrid)
    dist.all_reduce(g, group=gloo)
    assert_equal(g.to_dense(), t.to_dense())


def test_sparse_refusals_are_clear():
    """MAX of sparse tensors, and sparse tensors on calls other than all_reduce, are
    refused before anything is sent, naming the layout (Gloo refuses them too)."""
    t = _sparse(RANK)
    with pytest.raises(RuntimeError, match="sparse"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    with pytest.raises(RuntimeError, match="sparse"):
        dist.broadcast(t, src=0)
    dist.barrier()


class _Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
        self.out = nn.Linear(4, 2)
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, idx):
        return self.out(self.emb(idx)) * self.mask


def _sparse_batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 20, (5, 3), generator=g), torch.randn(5, 2, generator=g)


def test_ddp_with_sparse_embedding_and_bool_buffer():
    """DDP broadcasts the bool buffer at construction and all-reduces the embedding's
    sparse gradient; the trained weights equal one-process training on every batch."""
    n = SIZE
    ddp = nn.parallel.DistributedDataParallel(_Sparse())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ref = _Sparse()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        x, y = _sparse_batch(RANK, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = sum(nn.functional.mse_loss(ref(xr), yr)
                   for xr, yr in (_sparse_batch(r, step) for r in range(n))) / n
        loss.backward()
        ref_opt.step()
    for (k, v), (_, e) in zip(ddp.module.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(v, e, rtol=1e-5, atol=1e-5)


# --- item 17: new_group(backend="gloo") ---------------------------------------------------------
def test_new_group_gloo_is_a_real_gloo_group(gloo):
    """Under an mcrdl default group, ``new_group(backend="gloo")`` is torch's own Gloo
    group (``get_backend`` says so and it is so), in the order asked for."""
    assert _mcrdl()
    assert dist.get_backend(gloo) == "gloo"
    assert not _mcrdl(gloo) and gloo._get_backend_name() == "gloo"
    n = SIZE
    t = _vals(RANK, 4)
    dist.all_reduce(t, group=gloo)
    assert_equal(t, sum(_vals(r, 4) for r in range(n)))
    ranks = list(reversed(range(n)))
    rev = dist.new_group(ranks, backend="gloo", sort_ranks=False)
    assert not _mcrdl(rev) and dist.get_rank(rev) == ranks.index(RANK)
    t = _vals(RANK, 4)
    dist.broadcast(t, group_src=0, group=rev)
    assert_equal(t, _vals(ranks[0], 4))
    dist.destroy_process_group(rev)


def test_new_group_other_backend_is_refused_clearly():
    """A backend the mcrdl default group cannot make (torch 2.13 hands new_group to it
    without the backend's name) is refused on every rank, naming what to do instead."""
    with pytest.raises(RuntimeError, match="pg_options"):
        dist.new_group(backend="mpi")
    dist.barrier()
