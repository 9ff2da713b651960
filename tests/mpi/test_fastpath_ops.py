"""The fast path of every op other than all_reduce (mcrdl_core/dispatch/fastpath.py, issue 23
point 2): repeated calls of a memoized key give NumPy's result on every rank, blocking
and async, on the world and on a subgroup whose ranks are reversed; work in flight
(a ring of isend/irecv, async collectives overlapping) is ordered and driven; aliasing,
bad input, debug mode and a late peer take the general path or the engine's wait with
the same results and errors; 0 and 1 elements."""
import time

import numpy as np
import pytest
import torch

import mcrdl_core
import mcrdl_torch as dist
from mcrdl_core.base import config as _config
from mcrdl_core.base.errors import InvalidArgumentError
from mcrdl_core.observe.logger import logger
from conftest import RANK, SIZE, values

F = torch.float64


def fast_tags():
    return {k[0] for k in mcrdl_core.get_runtime().choices
            if isinstance(k[0], str) and k[0].startswith("fast:")}


def finish(res, async_op):
    if async_op:
        assert isinstance(res, dist.Work), res
        res.wait()
        assert res.is_completed()
    else:
        assert res is None, res


def stack(ranks, count, salt=0, dtype=F):
    return np.stack([values(r, count, dtype, salt).double().numpy() for r in ranks])


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("count", [0, 1, 5])
def test_rooted_and_gathering_ops_match_numpy(grp, async_op, count):
    group, ranks, me = grp
    n = len(ranks)
    for salt in range(3):  # the first call fills the memo, the later ones use it
        root = ranks[salt % n]
        t = values(RANK, count, F, salt)
        finish(dist.broadcast(t, root, group=group, backend="mpi", async_op=async_op), async_op)
        np.testing.assert_array_equal(t.numpy(), values(root, count, F, salt).numpy())

        t = values(RANK, count, F, salt)
        finish(dist.reduce(t, root, op=dist.ReduceOp.MAX, group=group, backend="mpi",
                           async_op=async_op), async_op)
        if RANK == root:
            np.testing.assert_array_equal(t.numpy(), stack(ranks, count, salt).max(0)
                                          if count else np.zeros(0))

        out = torch.full((n * count,), -1.0, dtype=F)
        finish(dist.all_gather_into_tensor(out, values(RANK, count, F, salt), group=group,
                                           backend="mpi", async_op=async_op), async_op)
        np.testing.assert_array_equal(out.numpy(), stack(ranks, count, salt).reshape(-1))

        inp = values(RANK, n * count, F, salt)
        out = torch.full((count,), -1.0, dtype=F)
        finish(dist.reduce_scatter_tensor(out, inp, group=group, backend="mpi",
                                          async_op=async_op), async_op)
        np.testing.assert_array_equal(
            out.numpy(), stack(ranks, n * count, salt).sum(0)[me * count:(me + 1) * count])
    assert {"fast:broadcast", "fast:reduce", "fast:all_gather",
            "fast:reduce_scatter"} <= fast_tags()


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.uint8])
def test_all_to_all_single_even_and_by_splits(grp, async_op, dtype):
    group, ranks, me = grp
    n = len(ranks)
    for salt in range(3):
        # even: 2 rows of 3 per peer
        inp = values(RANK, n * 6, dtype, salt).reshape(n * 2, 3)
        out = torch.zeros(n * 2, 3, dtype=dtype)
        finish(dist.all_to_all_single(out, inp, group=group, backend="mpi", async_op=async_op),
               async_op)
        exp = np.concatenate([values(r, n * 6, dtype, salt).double().numpy()[me * 6:(me + 1) * 6]
                              for r in ranks])
        np.testing.assert_array_equal(out.double().numpy().reshape(-1), exp)
        # by splits: group rank i sends i + 1 + salt rows to every peer, 0 rows to the next
        def rows(src, dst):
            return 0 if dst == (src + 1) % n and n > 1 else src + 1 + salt
        ins = [rows(me, j) for j in range(n)]
        outs = [rows(j, me) for j in range(n)]
        inp = values(RANK, sum(ins) * 2, dtype, salt).reshape(-1, 2)
        out = torch.zeros(sum(outs), 2, dtype=dtype)
        finish(dist.all_to_all_single(out, inp, outs, ins, group=group, backend="mpi",
                                      async_op=async_op), async_op)
        parts = []
        for j, r in enumerate(ranks):
            theirs = values(r, sum(rows(j, k) for k in range(n)) * 2, dtype, salt).double().numpy()
            off = sum(rows(j, k) for k in range(me)) * 2
            parts.append(theirs[off:off + rows(j, me) * 2])
        np.testing.assert_array_equal(out.double().numpy().reshape(-1), np.concatenate(parts))
    assert {"fast:all_to_all", "fast:all_to_all_v"} <= fast_tags()


@pytest.mark.parametrize("blocking", [False, True])
def test_ring_of_sends_and_receives_in_flight_together(grp, blocking):
    """isend/irecv both in flight (the second call finds the first in flight: no memory
    conflict, so it stays on the fast path), and blocking send/recv in rank order."""
    group, ranks, me = grp
    n = len(ranks)
    if n == 1:
        pytest.skip("a ring needs two ranks")
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for salt in range(3):
        s, r = values(RANK, 7, F, salt), torch.zeros(7, dtype=F)
        if blocking:  # even positions send first, odd ones receive first
            if me % 2 == 0:
                dist.send(s, nxt, group=group, tag=salt, backend="mpi")
                src = dist.recv(r, prv, group=group, tag=salt, backend="mpi")
            else:
                src = dist.recv(r, prv, group=group, tag=salt, backend="mpi")
                dist.send(s, nxt, group=group, tag=salt, backend="mpi")
            assert src == prv
        else:
            wr = dist.irecv(r, prv, group=group, tag=salt, backend="mpi")
            ws = dist.isend(s, nxt, group=group, tag=salt, backend="mpi")
            ws.wait()
            wr.wait()
            assert wr.result() == prv
        np.testing.assert_array_equal(r.numpy(), values(prv, 7, F, salt).numpy())
    assert {"fast:send", "fast:recv"} <= fast_tags()


def test_receive_from_any_source_names_the_sender():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    for salt in range(3):
        t = torch.zeros(3, dtype=F)
        if RANK == 0:
            got = {dist.recv(t, None, tag=salt, backend="mpi") for _ in range(SIZE - 1)}
            assert got == set(range(1, SIZE))
        else:  # a tag per round: any-source must not take a later round's message
            dist.send(values(RANK, 3, F, salt), 0, tag=salt, backend="mpi")
    dist.barrier(backend="mpi")


def test_async_collectives_in_flight_are_ordered_by_memory():
    """An async all-gather in flight, then a broadcast into its input (a write after a
    read: must wait), then one into unrelated memory (no conflict): both right."""
    for salt in range(3):
        x = values(RANK, 4, F, salt)
        out = torch.zeros(4 * SIZE, dtype=F)
        w = dist.all_gather_into_tensor(out, x, backend="mpi", async_op=True)
        other = values(RANK, 4, F, salt + 1)
        w2 = dist.broadcast(other, 0, backend="mpi", async_op=True)
        dist.broadcast(x, SIZE - 1, backend="mpi")  # overwrites what w reads
        w.wait()
        w2.wait()
        np.testing.assert_array_equal(out.numpy(), stack(range(SIZE), 4, salt).reshape(-1))
        np.testing.assert_array_equal(other.numpy(), values(0, 4, F, salt + 1).numpy())
        np.testing.assert_array_equal(x.numpy(), values(SIZE - 1, 4, F, salt).numpy())
    assert not mcrdl_core.get_runtime().engine.inflight


def test_aliased_output_and_input_take_the_general_path():
    """Also after the keys were bound (two calls apart; tests/mpi/test_bound_calls.py)."""
    n = SIZE
    for _ in range(2):
        dist.all_gather_into_tensor(torch.zeros(3 * n, dtype=F), torch.ones(3, dtype=F),
                                    backend="mpi")
        dist.reduce_scatter_tensor(torch.zeros(2, dtype=F), torch.ones(2 * n, dtype=F),
                                   backend="mpi")
    for _ in range(2):
        x = torch.zeros(3 * n, dtype=F)
        x[RANK * 3:(RANK + 1) * 3] = values(RANK, 3, F)
        dist.all_gather_into_tensor(x, x[RANK * 3:(RANK + 1) * 3], backend="mpi")
        np.testing.assert_array_equal(x.numpy(), stack(range(n), 3).reshape(-1))
        y = values(RANK, 2 * n, F)
        dist.reduce_scatter_tensor(y[RANK * 2:(RANK + 1) * 2], y, backend="mpi")
        np.testing.assert_array_equal(y[RANK * 2:(RANK + 1) * 2].numpy(),
                                      stack(range(n), 2 * n).sum(0)[RANK * 2:(RANK + 1) * 2])


def test_bad_input_raises_on_every_call_of_a_memoized_key():
    t = torch.ones(4, dtype=F)
    dist.broadcast(t, 0, backend="mpi")
    dist.all_gather_into_tensor(torch.zeros(4 * SIZE, dtype=F), t, backend="mpi")
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="not in group"):
            dist.broadcast(t, SIZE + 3, backend="mpi")
        with pytest.raises(InvalidArgumentError, match="elements"):
            dist.all_gather_into_tensor(torch.zeros(4 * SIZE + 1, dtype=F), t, backend="mpi")
        with pytest.raises(InvalidArgumentError, match="dtypes differ"):
            dist.all_gather_into_tensor(torch.zeros(4 * SIZE), t, backend="mpi")
        with pytest.raises(InvalidArgumentError, match="split sizes"):
            dist.all_to_all_single(torch.zeros(SIZE, dtype=F), torch.zeros(SIZE, dtype=F),
                                   [1] * SIZE, [2] * SIZE, backend="mpi")
        with pytest.raises(InvalidArgumentError, match="not in group"):
            dist.send(t, SIZE + 1, backend="mpi")
    np.testing.assert_array_equal(t.numpy(), np.ones(4))


def test_debug_mode_checks_every_call(monkeypatch):
    """MCRDL_DEBUG on: the fast path steps aside, and the cross-rank check runs."""
    rt = mcrdl_core.get_runtime()
    t = values(RANK, 3, F)
    dist.broadcast(t, 0, backend="mpi")  # memoized
    monkeypatch.setattr(rt, "debug", True)
    calls = []
    import mcrdl_core.observe.debug as dbg
    real = dbg.check
    monkeypatch.setattr(dbg, "check", lambda *a, **k: (calls.append(a[2]), real(*a, **k)))
    t = values(RANK, 3, F, 1)
    dist.broadcast(t, 0, backend="mpi")
    np.testing.assert_array_equal(t.numpy(), values(0, 3, F, 1).numpy())
    assert calls and calls[0].value == "broadcast"


def test_logger_records_fast_calls_of_every_op():
    lg = logger()
    lg.clear()
    lg.enable()
    try:
        t = torch.ones(2, dtype=F)
        dist.broadcast(t, 0, backend="mpi")
        dist.all_gather_into_tensor(torch.zeros(2 * SIZE, dtype=F), t, backend="mpi",
                                    async_op=True).wait()
        dist.barrier(backend="mpi")
    finally:
        lg.disable()
    ops = [r[0] for r in lg.records]
    lg.clear()
    assert ops == ["broadcast", "all_gather", "barrier"], ops


@pytest.mark.parametrize("async_op", [False, True])
def test_a_late_peer_hands_the_wait_to_the_engine(monkeypatch, async_op):
    monkeypatch.setattr(mcrdl_core.get_runtime().engine, "spin_s", 0.0)
    for salt in range(3):
        out = torch.zeros(2 * SIZE, dtype=F)
        if RANK == SIZE - 1:
            time.sleep(0.02)
        finish(dist.all_gather_into_tensor(out, values(RANK, 2, F, salt), backend="mpi",
                                           async_op=async_op), async_op)
        np.testing.assert_array_equal(out.numpy(), stack(range(SIZE), 2, salt).reshape(-1))
    assert not mcrdl_core.get_runtime().engine.inflight


def test_numpy_arrays_through_the_core_take_it_too():
    a = values(RANK, 4, F).numpy().copy()
    out = np.zeros(4 * SIZE)
    for _ in range(2):
        mcrdl_core.all_gather_into_tensor(out, a, backend="mpi")
        np.testing.assert_array_equal(out, stack(range(SIZE), 4).reshape(-1))
        b = a.copy()
        mcrdl_core.broadcast(b, SIZE - 1, backend="mpi")
        np.testing.assert_array_equal(b, values(SIZE - 1, 4, F).numpy())


def _late_peer_call(op, salt):
    """One blocking call of ``op`` on the world, its result checked against NumPy."""
    n = SIZE
    if op == "broadcast":
        t = values(RANK, 3, F, salt)
        assert dist.broadcast(t, n - 1, backend="mpi") is None
        np.testing.assert_array_equal(t.numpy(), values(n - 1, 3, F, salt).numpy())
    elif op == "reduce":
        t = values(RANK, 3, F, salt)
        dist.reduce(t, 0, op=dist.ReduceOp.SUM, backend="mpi")
        if RANK == 0:
            np.testing.assert_array_equal(t.numpy(), stack(range(n), 3, salt).sum(0))
    elif op == "all_reduce":
        t = values(RANK, 3, F, salt)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, backend="mpi")
        np.testing.assert_array_equal(t.numpy(), stack(range(n), 3, salt).max(0))
    elif op == "all_gather":
        out = torch.zeros(2 * n, dtype=F)
        dist.all_gather_into_tensor(out, values(RANK, 2, F, salt), backend="mpi")
        np.testing.assert_array_equal(out.numpy(), stack(range(n), 2, salt).reshape(-1))
    elif op == "reduce_scatter":
        out = torch.zeros(2, dtype=F)
        dist.reduce_scatter_tensor(out, values(RANK, 2 * n, F, salt), backend="mpi")
        np.testing.assert_array_equal(
            out.numpy(), stack(range(n), 2 * n, salt).sum(0)[2 * RANK:2 * RANK + 2])
    elif op == "all_to_all":
        out = torch.zeros(2 * n, dtype=F)
        dist.all_to_all_single(out, values(RANK, 2 * n, F, salt), backend="mpi")
        theirs = stack(range(n), 2 * n, salt)
        np.testing.assert_array_equal(out.numpy(),
                                      theirs[:, 2 * RANK:2 * RANK + 2].reshape(-1))
    elif op == "all_to_all_v":  # by split sizes: (i + 2j) % 3 rows of 2 from i to j
        rows = [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]
        ins = [values(i, 2 * sum(rows[i]), F, salt).reshape(-1, 2) for i in range(n)]
        out = torch.zeros(sum(rows[i][RANK] for i in range(n)), 2, dtype=F)
        dist.all_to_all_single(out, ins[RANK], [rows[i][RANK] for i in range(n)], rows[RANK],
                               backend="mpi")
        want = [ins[i][sum(rows[i][:RANK]):sum(rows[i][:RANK + 1])].numpy() for i in range(n)]
        np.testing.assert_array_equal(out.numpy(), np.concatenate(want))
    elif op == "send_recv":  # to the next rank, from any source; even ranks send first
        r = torch.zeros(4, dtype=F)
        nxt, prv = (RANK + 1) % n, (RANK - 1) % n
        if RANK % 2 == 0:
            dist.send(values(RANK, 4, F, salt), nxt, tag=salt, backend="mpi")
            src = dist.recv(r, None, tag=salt, backend="mpi")
        else:
            src = dist.recv(r, None, tag=salt, backend="mpi")
            dist.send(values(RANK, 4, F, salt), nxt, tag=salt, backend="mpi")
        assert src == prv
        np.testing.assert_array_equal(r.numpy(), values(prv, 4, F, salt).numpy())
    else:
        assert dist.barrier(backend="mpi") is None


@pytest.mark.parametrize("op", ["broadcast", "reduce", "all_reduce", "all_gather",
                                "reduce_scatter", "all_to_all", "all_to_all_v", "send_recv",
                                "barrier"])
def test_a_late_peer_of_every_blocking_op_hands_the_wait_over(monkeypatch, op):
    """No spin: a call its peer has not joined is unfinished when the issuer returns,
    and the engine's wait completes it (with the compiled issuer: from the handle it
    returned, a receive's with its status). Results and the sender are still right."""
    if op == "send_recv" and SIZE % 2:
        pytest.skip("a blocking ring in rank order needs an even number of ranks")
    monkeypatch.setattr(mcrdl_core.get_runtime().engine, "spin_s", 0.0)
    for salt in range(3):
        if RANK == SIZE - 1:
            time.sleep(0.02)
        _late_peer_call(op, salt)
    assert not mcrdl_core.get_runtime().engine.inflight


def test_the_compiled_issuer_is_used_where_built():
    """With the module built (``make install`` builds it) and MCRDL_MPI_FAST on, every
    memoized MPI plan has the compiled issuer (the uneven all-to-all's too); off, none."""
    from mcrdl_backends import mpi as mpi_backend
    mod, why = mpi_backend.compiled()
    on = mpi_backend.fast_module() is not None
    if _config.get("MCRDL_MPI_FAST"):  # the project's one parser of the variable
        assert mod is not None, why
        assert on
    for op in ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
               "all_to_all", "all_to_all_v", "barrier"):
        _late_peer_call(op, 0)
        _late_peer_call(op, 0)
    plans = {k[0]: v for k, v in mcrdl_core.get_runtime().choices.items()
             if isinstance(k[0], str) and k[0].startswith("fast:") and v[1] is not None}
    assert {"fast:broadcast", "fast:all_reduce", "fast:barrier", "fast:all_to_all_v"} <= set(plans)
    for tag, plan in plans.items():
        assert (plan[3] is not None) == on, (tag, plan)


def test_the_compiled_module_raises_what_mpi_reports():
    """An MPI error in the compiled module gives the call's Work already failed with an
    MPIError of MPI's message, which its wait raises as the engine raises a library's
    error (tests/mpi/test_seams_fastpath.py; the fast path never passes such arguments:
    a bad root is refused before a plan)."""
    from mpi4py import MPI
    from mcrdl_backends import mpi as mpi_backend
    mod = mpi_backend.compiled()[0]
    if mod is None:
        pytest.skip("the compiled module is not built")
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        buf = np.zeros(2)
        failed = mod.bcast(comm.handle, MPI.DOUBLE.handle, SIZE + 5, 0.0, buf, 2)
        assert isinstance(failed, mod.Work) and failed.done
        with pytest.raises(mod.MPIError, match="MPI error"):
            raise failed.error
        # and a good call right after, on a NumPy array by the buffer protocol
        buf[:] = RANK + 1
        left = mod.bcast(comm.handle, MPI.DOUBLE.handle, SIZE - 1, 1.0, buf, 2)
        if left is not None:  # not done within the second: finish it here
            MPI.Request.fromhandle(left).Wait()
        np.testing.assert_array_equal(buf, [SIZE, SIZE])
    finally:
        comm.Barrier()
        comm.Free()
