"""Bound calls (mcrdl_core/dispatch/fastpath.py, "Bound calls"): where the compiled MPI
issuer is in use, the first blocking call of a frontend key that the fast path serves
(the second: the first fills the memo) binds a closure, and later
calls of the key run through it with NumPy's result on every rank (a late peer too, on
the world and on a subgroup whose ranks are reversed). A closure steps aside, before
anything is sent, for everything it does not handle (a logger, async; an observer,
MCRDL_COMPRESSION, work in flight, counts that do not fit, a broken group), and the
frontend's next path then gives the same results and errors as before; whatever drops
the plans drops the closures; a key that a tuning table decides by size is bound per
table range."""
import time
import types

import numpy as np
import pytest
import torch

import mcrdl_core
import mcrdl_torch as dist
from mcrdl_core.base.errors import BrokenGroupError, InvalidArgumentError
from mcrdl_core.dispatch.fastpath import MISS, _never
from mcrdl_core.observe.logger import logger
from conftest import RANK, SIZE, SUB_RANKS, values

F = torch.float64
OPS = ["broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
       "all_to_all_v", "send_recv"]
TAGS = {"broadcast": "bound:torch.broadcast", "reduce": "bound:torch.reduce",
        "all_reduce": "bound:torch.all_reduce",
        "all_gather": "bound:torch.all_gather_into_tensor",
        "reduce_scatter": "bound:torch.reduce_scatter_tensor",
        "all_to_all": "bound:torch.all_to_all_single",
        "all_to_all_v": "bound:torch.all_to_all_single_v"}


@pytest.fixture(autouse=True)
def compiled():
    from mcrdl_backends import mpi as mpi_backend
    if mpi_backend.fast_module() is None:
        pytest.skip("calls are bound only where the compiled MPI issuer is in use")


def bound(async_op=False, group=None):
    """{tag: closure} of the runtime's bound calls of float64 tensors with backend "mpi"
    on ``group`` (None: the world), blocking or async (keys end in group, backend,
    async)."""
    return {k[0]: v for k, v in mcrdl_core.get_runtime().choices.items()
            if isinstance(k[0], str) and k[0].startswith("bound:") and k[1] is F
            and k[-3] is group and k[-2] == "mpi" and k[-1] is async_op and v is not None}


def stack(ranks, count, salt=0):
    return np.stack([values(r, count, F, salt).numpy() for r in ranks])


def done(res, async_op):
    """The result of a blocking call, or of an async one's Work once waited for."""
    if not async_op:
        return res
    assert isinstance(res, dist.Work), res
    res.wait()
    return res.result()


def call(op, salt, group=None, ranks=None, async_op=False, backend="mpi", k=1):
    """One call of ``op`` on ``group`` (``ranks``: its global ranks, in group order),
    blocking or async and waited for, its result checked against NumPy on this rank;
    ``k`` times the usual element counts (a size a table may put in another range)."""
    ranks = list(range(SIZE)) if ranks is None else ranks
    n, me = len(ranks), ranks.index(RANK)
    kw = {"group": group, "async_op": async_op, "backend": backend}
    if op == "broadcast":
        t = values(RANK, 3 * k, F, salt)
        assert done(dist.broadcast(t, ranks[-1], **kw), async_op) is None
        np.testing.assert_array_equal(t.numpy(), values(ranks[-1], 3 * k, F, salt).numpy())
    elif op == "reduce":
        t = values(RANK, 3 * k, F, salt)
        done(dist.reduce(t, ranks[-1], dist.ReduceOp.SUM, **kw), async_op)
        if me == n - 1:
            np.testing.assert_array_equal(t.numpy(), stack(ranks, 3 * k, salt).sum(0))
    elif op == "all_reduce":
        t = values(RANK, 3 * k, F, salt)
        done(dist.all_reduce(t, dist.ReduceOp.MAX, **kw), async_op)
        np.testing.assert_array_equal(t.numpy(), stack(ranks, 3 * k, salt).max(0))
    elif op == "all_gather":
        out = torch.zeros(2 * k * n, dtype=F)
        done(dist.all_gather_into_tensor(out, values(RANK, 2 * k, F, salt), **kw), async_op)
        np.testing.assert_array_equal(out.numpy(), stack(ranks, 2 * k, salt).reshape(-1))
    elif op == "reduce_scatter":
        m = 2 * k
        out = torch.zeros(m, dtype=F)
        done(dist.reduce_scatter_tensor(out, values(RANK, m * n, F, salt), **kw), async_op)
        np.testing.assert_array_equal(out.numpy(),
                                      stack(ranks, m * n, salt).sum(0)[m * me:m * me + m])
    elif op == "all_to_all":  # 2-D: dim 0 is what must divide by the group's size
        m = 2 * k
        out = torch.zeros(n, m, dtype=F)
        done(dist.all_to_all_single(out, values(RANK, m * n, F, salt).reshape(n, m), **kw),
             async_op)
        np.testing.assert_array_equal(out.numpy().reshape(-1),
                                      stack(ranks, m * n, salt)[:, m * me:m * me + m].reshape(-1))
    elif op == "all_to_all_v":  # by split sizes: (i + 2j + salt) % 3 rows of 2 from i to j
        rows = [[(i + 2 * j + salt) % 3 for j in range(n)] for i in range(n)]
        ins = [values(ranks[i], 2 * sum(rows[i]), F, salt).reshape(-1, 2) for i in range(n)]
        out = torch.zeros(sum(rows[i][me] for i in range(n)), 2, dtype=F)
        done(dist.all_to_all_single(out, ins[me], [rows[i][me] for i in range(n)], rows[me],
                                    **kw), async_op)
        want = [ins[i][sum(rows[i][:me]):sum(rows[i][:me + 1])].numpy() for i in range(n)]
        np.testing.assert_array_equal(out.numpy(), np.concatenate(want))
    else:  # send/recv in pairs of group ranks (0, 1), (2, 3), ...; an odd last one idles
        peer = me ^ 1
        if peer < n:
            r = torch.zeros(4 * k, dtype=F)
            mine = values(RANK, 4 * k, F, salt)
            kw = {"group": group, "tag": salt, "backend": backend}
            if async_op:  # the receive first, from any source; both in flight
                wr = dist.irecv(r, None, **kw)
                ws = dist.isend(mine, ranks[peer], **kw)
                assert done(ws, True) is None
                assert done(wr, True) == ranks[peer]
            else:
                first, second = ((dist.send, (mine, ranks[peer])), (dist.recv, (r, None))) \
                    if me % 2 == 0 else ((dist.recv, (r, ranks[peer])),
                                         (dist.send, (mine, ranks[peer])))
                got = [f(*args, **kw) for f, args in (first, second)]
                assert ranks[peer] in got
            np.testing.assert_array_equal(r.numpy(), values(ranks[peer], 4 * k, F, salt).numpy())


def refuse_entries(monkeypatch):
    """From here on, a call that reaches a fast-path entry fails the test: the calls
    must run through their bound closures."""
    from mcrdl_core.dispatch import fastpath

    def refuse(*a, **k):
        raise AssertionError("a bound key took the regular entry")
    for name in ("broadcast", "reduce", "host_all_reduce", "all_gather", "reduce_scatter",
                 "all_to_all", "send", "recv"):
        monkeypatch.setattr(fastpath, name, refuse)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("where", ["world", "sub"])
@pytest.mark.parametrize("op", OPS)
def test_repeated_calls_run_bound_and_stay_right(monkeypatch, op, where, late, async_op):
    """Later calls of a key run through its closure (the regular entry is not called),
    blocking and async, with NumPy's results; a late peer (no spin) leaves the request to
    the engine's wait."""
    group, ranks = (None, None) if where == "world" else (dist.new_group(SUB_RANKS), SUB_RANKS)
    if ranks is not None and RANK not in ranks:
        pytest.skip("not a member of the subgroup")
    if late:
        monkeypatch.setattr(mcrdl_core.get_runtime().engine, "spin_s", 0.0)
    call(op, 0, group, ranks, async_op)  # the general path: fills the memo
    call(op, 0, group, ranks, async_op)  # the regular entry: binds
    if op != "send_recv":
        assert TAGS[op] in bound(async_op, group)
    refuse_entries(monkeypatch)
    for salt in range(1, 4):
        if late and RANK == (ranks or list(range(SIZE)))[-1]:
            time.sleep(0.01)
        call(op, salt, group, ranks, async_op)
    assert not mcrdl_core.get_runtime().engine.inflight


def _bind_all():
    """Bind every collective's key, blocking and async."""
    for async_op in (False, True):
        for op in OPS[:-1] * 2:
            call(op, 0, async_op=async_op)
        assert set(TAGS.values()) <= set(bound(async_op))


def _tensors(n):
    """Arguments of each closure for valid calls of 2 elements per rank."""
    t, big, small = torch.ones(2, dtype=F), torch.ones(2 * n, dtype=F), torch.ones(2, dtype=F)
    a2a_in, a2a_out = torch.ones(2 * n, dtype=F), torch.ones(2 * n, dtype=F)
    return {
        "bound:torch.broadcast": (t.data_ptr(), 2, t),
        "bound:torch.reduce": (t.data_ptr(), 2, t),
        "bound:torch.all_reduce": (t.data_ptr(), 2, t),
        "bound:torch.all_gather_into_tensor": (big.data_ptr(), 2 * n, small.data_ptr(), 2,
                                               (big, small)),
        "bound:torch.reduce_scatter_tensor": (small.data_ptr(), 2, big.data_ptr(), 2 * n,
                                              (small, big)),
        "bound:torch.all_to_all_single": (a2a_out.data_ptr(), 2 * n, 2 * n,
                                          a2a_in.data_ptr(), 2 * n, 2 * n, (a2a_out, a2a_in)),
        "bound:torch.all_to_all_single_v": (a2a_out.data_ptr(), 2 * n, 2 * n,
                                            a2a_in.data_ptr(), 2 * n, 2 * n, [2] * n, [2] * n,
                                            (a2a_out, a2a_in)),
    }


@pytest.mark.parametrize("async_op", [False, True])
def test_a_closure_steps_aside_before_sending(monkeypatch, async_op):
    """Each closure returns MISS (sending nothing: no rank would match it) while the
    logger is on (async), an observer watches, work is deferred, work is in flight (blocking;
    async: work whose memory overlaps the call's), and (ops with codecs)
    MCRDL_COMPRESSION is set."""
    _bind_all()
    rt = mcrdl_core.get_runtime()
    eng = rt.engine
    closures, args = bound(async_op), _tensors(SIZE)
    lg = logger()
    codecs = {"bound:torch.all_reduce", "bound:torch.all_gather_into_tensor",
              "bound:torch.reduce_scatter_tensor", "bound:torch.all_to_all_single",
              "bound:torch.all_to_all_single_v"}
    everything = types.SimpleNamespace(spans=((0, 1 << 62, True),))  # writes all memory

    class Quiet(mcrdl_core.Observer):
        def before(self, *a, **k):
            pass

        def after(self, *a, **k):
            pass
    states = {
        "logger": lambda on: lg.enable() if on else lg.disable(),
        "observer": lambda on: rt.watch(Quiet(), "quiet") if on else rt.unwatch("quiet"),
        "inflight": lambda on: (eng.inflight.append if on else eng.inflight.remove)(everything),
        "pending": lambda on: (eng.pending.append if on else eng.pending.remove)(everything),
        "compression": lambda on: (monkeypatch.setenv("MCRDL_COMPRESSION", "int8") if on
                                   else monkeypatch.delenv("MCRDL_COMPRESSION")),
    }
    for state, switch in states.items():
        if state == "logger" and not async_op:
            continue  # a blocking bound call records itself (the test above)
        switch(True)
        try:
            for tag, closure in closures.items():
                if tag not in args or (state == "compression" and tag not in codecs):
                    continue
                assert closure(*args[tag]) is MISS, (state, tag)
        finally:
            switch(False)
    lg.clear()
    assert not eng.inflight


def test_counts_that_do_not_fit_after_binding():
    """A bound key's call with counts or splits that do not fit the group raises the
    general path's error on every rank (aliased memory after binding:
    test_fastpath_ops.py's aliasing test)."""
    _bind_all()
    n = SIZE
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="elements"):
            dist.all_gather_into_tensor(torch.zeros(2 * n + 1, dtype=F), torch.ones(2, dtype=F),
                                        backend="mpi")
        with pytest.raises(InvalidArgumentError):
            dist.reduce_scatter_tensor(torch.zeros(2, dtype=F), torch.ones(2 * n + 1, dtype=F),
                                       backend="mpi")
        if n > 1:
            with pytest.raises(InvalidArgumentError):  # dim 0 does not divide by the size
                dist.all_to_all_single(torch.zeros(n + 1, 2, dtype=F),
                                       torch.ones(n + 1, 2, dtype=F), backend="mpi")
        with pytest.raises(InvalidArgumentError, match="split"):  # n + 1 rows of n
            dist.all_to_all_single(torch.zeros(n, dtype=F), torch.ones(n, dtype=F),
                                   [1] * (n - 1) + [2], [1] * (n - 1) + [2], backend="mpi")
        with pytest.raises(InvalidArgumentError, match="split"):  # a negative one
            dist.all_to_all_single(torch.zeros(n, dtype=F), torch.ones(n, dtype=F),
                                   [2, -1] + [1] * (n - 2), [1] * n, backend="mpi")


def test_a_bound_call_in_flight_order_and_logger_hold(monkeypatch):
    """With async work in flight a bound key's call takes the regular entry, which
    orders it against that work; with the logger on a blocking bound call runs through
    its closure and records itself as the entry would: op, bytes (the entries' figure:
    the whole tensor, the big block of all_gather/reduce_scatter, the input of an
    all-to-all), backend, ranks, seconds."""
    _bind_all()
    t = values(RANK, 3, F, 1)
    w = dist.all_reduce(t, dist.ReduceOp.MAX, async_op=True, backend="mpi")
    b = values(RANK, 3, F, 2)
    dist.broadcast(b, SIZE - 1, backend="mpi")
    w.wait()
    np.testing.assert_array_equal(t.numpy(), stack(range(SIZE), 3, 1).max(0))
    np.testing.assert_array_equal(b.numpy(), values(SIZE - 1, 3, F, 2).numpy())
    lg = logger()
    lg.clear()
    refuse_entries(monkeypatch)
    lg.enable()
    try:
        for op in OPS:
            call(op, 3)
    finally:
        lg.disable()
    got = list(lg.records)
    lg.clear()
    n = SIZE
    rows = sum((RANK + 2 * j + 3) % 3 for j in range(n))  # call()'s uneven rows from RANK
    want = [("broadcast", 24), ("reduce", 24), ("all_reduce", 24), ("all_gather", 16 * n),
            ("reduce_scatter", 16 * n), ("all_to_all", 16 * n), ("all_to_all", 16 * rows)]
    if RANK ^ 1 < n:  # send and receive 4 float64 with the neighbour, in call()'s order
        want += [("send", 32), ("recv", 32)] if RANK % 2 == 0 else [("recv", 32), ("send", 32)]
    assert [r[:2] for r in got] == want, got
    assert all(r[2] == "mpi" and r[3] == n and r[4] > 0 for r in got), got


def test_async_bound_calls_in_flight_together_are_ordered_by_memory():
    """Async bound calls overlap; one whose memory conflicts with work in flight steps
    aside and the regular path orders it: an all-gather from ``inp``, a broadcast of
    memory apart from it (in flight with it), then a broadcast into ``inp`` (write after
    read: it must wait until the all-gather has read ``inp``), all issued before the
    first wait."""
    n = SIZE
    for salt in range(4):  # the first calls fill the memo and bind the keys
        out = torch.zeros(2 * n, dtype=F)
        inp, other = values(RANK, 2, F, salt), values(RANK, 2, F, salt + 1)
        w1 = dist.all_gather_into_tensor(out, inp, async_op=True, backend="mpi")
        w2 = dist.broadcast(other, 0, async_op=True, backend="mpi")
        w3 = dist.broadcast(inp, n - 1, async_op=True, backend="mpi")
        for w in (w3, w2, w1):
            w.wait()
        np.testing.assert_array_equal(out.numpy(), stack(range(n), 2, salt).reshape(-1))
        np.testing.assert_array_equal(other.numpy(), values(0, 2, F, salt + 1).numpy())
        np.testing.assert_array_equal(inp.numpy(), values(n - 1, 2, F, salt).numpy())
    keys = {k[0] for k in mcrdl_core.get_runtime().choices if k[-1] is True}
    assert {"bound:torch.all_gather_into_tensor", "bound:torch.broadcast"} <= keys
    assert not mcrdl_core.get_runtime().engine.inflight


def test_async_waits_spin_in_the_compiled_module_while_all_in_flight_is_mpi():
    """The wait of a fast-path Work spins on its request in the compiled module while
    everything in flight is MPI's (one async collective; a send and a receive in flight
    together, the receive's source read from the status the module filled), and leaves
    the wait to the engine's loop while another library's work is in flight. NumPy's
    results either way, and nothing left in flight."""
    from mcrdl_backends import mpi as mpi_backend
    _bind_all()
    for _ in range(2):
        call("send_recv", 0, async_op=True)
    spins = mpi_backend.fast_module().spins  # how many waits spun in the module
    before = spins()
    for op in OPS:
        call(op, 5, async_op=True)
    pairs = 2 * (SIZE // 2)  # ranks with a send/recv partner: two waits each
    assert spins() - before >= len(OPS) - 1 + (2 if RANK < pairs else 0)
    before = spins()
    g, t = values(RANK, 3, F, 7), values(RANK, 3, F, 8)
    wg = dist.all_reduce(g, dist.ReduceOp.MAX, async_op=True, backend="gloo")
    wm = dist.broadcast(t, SIZE - 1, async_op=True, backend="mpi")
    wm.wait()
    wg.wait()
    assert spins() == before
    np.testing.assert_array_equal(g.numpy(), stack(range(SIZE), 3, 7).max(0))
    np.testing.assert_array_equal(t.numpy(), values(SIZE - 1, 3, F, 8).numpy())
    assert not mcrdl_core.get_runtime().engine.inflight


def test_the_compiled_wait_with_a_timeout_and_when_it_fails():
    """A fast-path Work's compiled wait: with a timeout (seconds, positional or keyword,
    or a timedelta, as torch passes it) it leaves the wait to the engine, which
    completes it; an error raised inside it (here: by the engine's state it reads) fails
    the work, and the wait raises it as a library failure that breaks the work's group,
    on every rank, while the call itself still completes underneath."""
    import datetime

    from mcrdl_backends import mpi as mpi_backend
    from mcrdl_core.base.errors import CommFailedError
    g = dist.new_group(list(range(SIZE)))
    t = values(RANK, 3, F, 4)
    want = stack(range(SIZE), 3, 4).sum(0)
    for _ in range(2):  # fill the memo, bind
        dist.all_reduce(values(RANK, 3, F, 4), group=g, backend="mpi", async_op=True).wait()
    for how in ({"timeout": 30.0}, {"timeout": datetime.timedelta(seconds=30)}, 30):
        t = values(RANK, 3, F, 4)
        w = dist.all_reduce(t, group=g, backend="mpi", async_op=True)
        assert type(w) is mpi_backend._FastWork
        assert (w.wait(**how) if isinstance(how, dict) else w.wait(how)) is True
        np.testing.assert_allclose(t.numpy(), want)
    t = values(RANK, 3, F, 4)
    w = dist.all_reduce(t, group=g, backend="mpi", async_op=True)
    engine = w.engine

    class Failing:  # an engine whose state cannot be read
        @property
        def pending(self):
            raise RuntimeError("state unreadable (the test's)")

        def discard(self, work):
            engine.discard(work)

    w.engine = Failing()
    with pytest.raises(CommFailedError, match="state unreadable") as err:
        w.wait()
    assert w.done and w.error is err.value and g.broken is not None
    w.req.Wait()  # the collective itself, still running underneath
    np.testing.assert_allclose(t.numpy(), want)
    assert w not in engine.inflight


def test_a_broken_group_refuses_a_bound_key_on_every_rank():
    g = dist.new_group(list(range(SIZE)))
    t = values(RANK, 3, F)
    for _ in range(2):
        dist.broadcast(t, 0, g, backend="mpi")
    assert "bound:torch.broadcast" in bound()
    g.mark_broken(RuntimeError("marked by the test"))
    with pytest.raises(BrokenGroupError, match="marked by the test"):
        dist.broadcast(t, 0, g, backend="mpi")


def test_dropping_the_plans_drops_the_closures_and_odd_keys_are_not_bound():
    """``set_override`` (like ``set_table`` and ``destroy``) clears the memo, closures
    included; a root given as a 0-d tensor (hashed by identity: a new key on every call)
    is never bound."""
    _bind_all()
    rt = mcrdl_core.get_runtime()
    rt.set_override(rt.override)
    assert not bound() and not bound(True)
    t = values(RANK, 3, F)
    for _ in range(2):
        dist.broadcast(t, torch.tensor(SIZE - 1), backend="mpi")
        np.testing.assert_array_equal(t.numpy(), values(SIZE - 1, 3, F).numpy())
    assert not bound()
    call("broadcast", 1)
    call("broadcast", 1)
    assert "bound:torch.broadcast" in bound()


def _table(ranges, ops):
    from mcrdl_core.dispatch.selection import SCHEMA, TuningTable
    rt = mcrdl_core.get_runtime()
    return TuningTable({"schema": SCHEMA, "entries": [
        {"op": op, "world_size": SIZE, "hosts": len(rt.bootstrap.hosts), "device": "cpu",
         "dtype_class": "float", "ranges": ranges} for op in ops]}, "<test>")


def auto_keys(async_op=False):
    """{tag: what the key holds} of the frontend keys of float64 calls with no backend
    named (auto), on the world, blocking or async."""
    return {k[0]: v for k, v in mcrdl_core.get_runtime().choices.items()
            if isinstance(k[0], str) and k[0].startswith("bound:") and k[1] is F
            and k[-3] is None and k[-2] is None and k[-1] is async_op}


TABLE_OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
             "send", "recv")


@pytest.mark.parametrize("async_op", [False, True])
def test_keys_a_table_decides_by_size_are_bound_per_range(monkeypatch, async_op):
    """auto under a tuning table of two ranges (mpi up to 64 B, mpi above): each sized
    key holds a call by table range, one closure per range, each made by the first call
    in its range that the regular entry serves; later calls of both sizes, alternated,
    run through them (the entries are not called) with NumPy's results on every rank.
    The uneven all-to-all has no size every rank shares (the table's largest range
    decides, once): a plain closure. ``k=1`` puts every op's selection size at 16-48 B,
    ``k=8`` at 128 B or more."""
    rt = mcrdl_core.get_runtime()
    old = rt.table
    rt.set_table(_table([[64, "mpi"], [None, "mpi"]], TABLE_OPS))
    try:
        for op in OPS:
            for k in (1, 8):
                call(op, 0, async_op=async_op, backend=None, k=k)  # general path: memo
                call(op, 0, async_op=async_op, backend=None, k=k)  # entry: binds the range
        keys = auto_keys(async_op)
        for tag in TAGS.values():
            v = keys.get(tag)
            assert v is not None, (tag, keys)
            if tag.endswith("_v"):
                assert not hasattr(v, "calls"), tag  # one plan: a plain closure
            else:
                assert len(v.calls) == 3, tag
                assert all(c not in (None, _never) for c in v.calls[:2]), tag
        if SIZE > 1 and RANK ^ 1 < SIZE:  # a rank with a send/recv peer
            p2p = [v for t, v in keys.items() if t in ("bound:torch.send", "bound:torch.recv")]
            assert p2p and all(v.calls[1] not in (None, _never) for v in p2p), keys
        refuse_entries(monkeypatch)
        for salt in range(1, 4):
            for op in OPS:
                for k in (8, 1):
                    call(op, salt, async_op=async_op, backend=None, k=k)
        assert not rt.engine.inflight
    finally:
        rt.set_table(old)


def test_a_range_that_chose_gloo_stays_on_the_entries_and_the_other_is_bound(monkeypatch):
    """A table with gloo up to 64 B (no compiled issuer) and mpi above: the small calls
    keep taking the entry and the general path to Gloo, every one of them, the large
    ones run bound on MPI; results right either way, alternated."""
    rt = mcrdl_core.get_runtime()
    old = rt.table
    rt.set_table(_table([[64, "gloo"], [None, "mpi"]], ("all_reduce", "all_to_all")))
    gloo, ran = rt.backend("gloo"), []
    for name in ("all_reduce", "all_to_all"):
        def counted(*a, _f=getattr(gloo, name), _n=name, **kw):
            ran.append(_n)
            return _f(*a, **kw)
        monkeypatch.setattr(gloo, name, counted)
    try:
        for salt in range(4):
            for k in (1, 8):
                ran.clear()
                call("all_reduce", salt, backend=None, k=k)
                call("all_to_all", salt, backend=None, k=k)
                assert ran == (["all_reduce", "all_to_all"] if k == 1 else []), (k, ran)
        keys = auto_keys()
        for tag in ("bound:torch.all_reduce", "bound:torch.all_to_all_single"):
            assert keys[tag].calls[0] in (None, _never), tag  # never a closure
            assert keys[tag].calls[1] not in (None, _never), tag
    finally:
        rt.set_table(old)


def test_a_table_of_one_open_range_binds_plain_closures():
    """An entry of one open-ended range (what ``mcrdl tune`` writes where one backend
    wins at every size) chooses alike for every size: auto's keys hold plain closures,
    as a named backend's do, and calls of two sizes run through them."""
    rt = mcrdl_core.get_runtime()
    old = rt.table
    rt.set_table(_table([[None, "mpi"]], ("all_reduce", "all_to_all")))
    try:
        for salt in range(3):
            for k in (1, 8):
                call("all_reduce", salt, backend=None, k=k)
                call("all_to_all", salt, backend=None, k=k)
        keys = auto_keys()
        for tag in ("bound:torch.all_reduce", "bound:torch.all_to_all_single"):
            assert keys.get(tag) is not None and not hasattr(keys[tag], "calls"), keys
    finally:
        rt.set_table(old)


def test_a_table_then_mcrdl_backend_for_one_op():
    """Under a table, auto's memo keys carry their size; MCRDL_BACKEND naming the op's
    backend decides instead of the table, and that key is bound plainly (no size in its
    memo keys) while the other ops stay by range; an explicit backend under the table is
    bound plainly too."""
    rt = mcrdl_core.get_runtime()
    old = rt.table
    rt.set_table(_table([[64, "mpi"], [None, "mpi"]], ("all_reduce", "broadcast",
                                                       "all_gather", "all_to_all")))

    def max_and_broadcast(salt):  # auto: no backend named
        call("all_reduce", salt, backend=None)
        call("broadcast", salt, backend=None)

    try:
        for salt in range(3):
            max_and_broadcast(salt)
            call("all_to_all_v", salt, backend=None)
        # an uneven all-to-all has no size every rank shares: the table's largest range
        # decides, once, and the fast path serves it (its key carries no size)
        uneven = [v for k, v in rt.choices.items() if k[0] == "fast:all_to_all_v"]
        assert len(uneven) == 1 and uneven[0][1] is not None, uneven
        keys = auto_keys()
        assert hasattr(keys["bound:torch.all_reduce"], "calls")
        assert hasattr(keys["bound:torch.broadcast"], "calls")
        for salt in range(3):
            call("broadcast", salt)
        assert not hasattr(bound()["bound:torch.broadcast"], "calls")  # explicit: plain
        rt.set_override("all_reduce=mpi")
        for salt in range(3):
            max_and_broadcast(salt)
        keys = auto_keys()
        assert keys["bound:torch.all_reduce"] is not None
        assert not hasattr(keys["bound:torch.all_reduce"], "calls")
        assert hasattr(keys["bound:torch.broadcast"], "calls")
        sized = [k for k in rt.choices if k[0] == "fast:all_reduce"]
        assert sized and all(len(k) == 5 for k in sized), sized  # no size in the key
    finally:
        rt.set_override(None)
        rt.set_table(old)


@pytest.mark.parametrize("splits", [None, []])
def test_even_all_to_all_whether_splits_are_none_or_empty(splits):
    """Empty split lists mean even, as None does: they share the even key's closure."""
    n = SIZE
    for salt in range(3):
        out = torch.zeros(2 * n, dtype=F)
        dist.all_to_all_single(out, values(RANK, 2 * n, F, salt), splits, splits, backend="mpi")
        np.testing.assert_array_equal(out.numpy(),
                                      stack(range(n), 2 * n, salt)[:, 2 * RANK:2 * RANK + 2]
                                      .reshape(-1))


def test_unhashable_arguments_get_the_general_paths_error():
    """A list where a group, peer or reduce op belongs cannot be part of a key: the
    frontend skips the lookup and the general path raises its error, on every rank."""
    t = values(RANK, 3, F)
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="group"):
            dist.broadcast(t, 0, group=[0], backend="mpi")
        with pytest.raises(InvalidArgumentError):
            dist.send(t, [0], backend="mpi")
        with pytest.raises(InvalidArgumentError):
            dist.all_reduce(t, op=["sum"], backend="mpi")
    np.testing.assert_array_equal(t.numpy(), values(RANK, 3, F).numpy())


@pytest.mark.parametrize("async_op", [False, True])
def test_a_bound_barrier_waits_for_every_rank_and_steps_aside_for_work_in_flight(
        monkeypatch, async_op):
    """A barrier's key is bound like the collectives' (its later calls skip the regular
    entry); it returns on no rank before the last one has entered it; with an async
    all-reduce in flight it steps aside, and the general path's barrier completes only
    once that all-reduce has, so its result is in place when the barrier returns."""
    from mcrdl_core.dispatch import fastpath
    key = ("bound:torch.barrier", None, "mpi", async_op)

    def barrier():
        w = dist.barrier(backend="mpi", async_op=async_op)
        if async_op:
            assert isinstance(w, dist.Work) and w.wait() and w.is_completed()
        else:
            assert w is None

    for _ in range(3):  # the general path, the regular entry (binds), the closure
        barrier()
    assert mcrdl_core.get_runtime().choices.get(key) is not None

    def refuse(*a, **k):
        raise AssertionError("a bound barrier took the regular entry")
    monkeypatch.setattr(fastpath, "barrier", refuse)
    for _ in range(2):
        if RANK == SIZE - 1:
            time.sleep(0.3)
        start = time.monotonic()
        barrier()
        if RANK != SIZE - 1:  # it cannot return before the last rank entered it
            assert time.monotonic() - start > 0.2
    monkeypatch.undo()
    t = values(RANK, 3, F, 9)
    w = dist.all_reduce(t, dist.ReduceOp.MAX, async_op=True, backend="mpi")
    barrier()
    np.testing.assert_array_equal(t.numpy(), stack(range(SIZE), 3, 9).max(0))
    w.wait()
    assert not mcrdl_core.get_runtime().engine.inflight
