"""The call forms the fast path took over in issue 49: list ``all_gather``, list
``reduce_scatter``, list ``all_to_all``, ``gather``, ``scatter``, ``batch_isend_irecv``
and blocking point-to-point calls with other work in flight. Each is checked against
NumPy on every rank, explicit (``backend="mpi"``) and through a tuning table (one range,
and two ranges: the bound call by table range), blocking and async, with the list in
one run (chunks of one tensor), in separate tensors (staged) and sharing memory with the
other side; the fast path is shown to be taken (the general path's backend call never
runs, and the frontend's bound key is in the memo); a fast call on one rank meets a
general-path call on the others; bad input is refused on every rank before anything is
sent; an async list call whose memory is in flight is ordered after it.
"""
import numpy as np
import pytest
import torch

import mcrdl_core as core
import mcrdl_torch as dist
from mcrdl_core.base.errors import InvalidArgumentError
from mcrdl_core.dispatch import fastpath
from mcrdl_core.dispatch.selection import SCHEMA, TuningTable
from mcrdl_backends import mpi as _mpi_backend
from conftest import RANK, SIZE

F = torch.float64
needs_peers = pytest.mark.skipif(SIZE < 2, reason="needs a peer")
pytestmark = needs_peers
OPS = ["all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "send", "recv"]
MODES = ["mpi", "table", "two ranges"]
LAYOUTS = ["run", "apart", "shared"]


def _table(ranges, group=None):
    rt = core.get_runtime()
    g = rt.world if group is None else group
    return TuningTable({"schema": SCHEMA, "entries": [
        {"op": op, "world_size": g.size, "hosts": rt.bootstrap.hosts_in(g.ranks),
         "device": "cpu", "dtype_class": "float", "ranges": ranges} for op in OPS]}, "<test>")


@pytest.fixture
def rt():
    rt = core.get_runtime()
    old = rt.table
    yield rt
    rt.set_table(old)


def _mode(rt, mode):
    """The backend request of ``mode``, its table set."""
    if mode == "mpi":
        return "mpi"
    rt.set_table(_table([[None, "mpi"]] if mode == "table" else [[16, "mpi"], [None, "mpi"]]))
    return "auto"


#: the list forms, gather, scatter and batches are fast only with the compiled issuers
#: (``mpi_fast.c``); without them (not built, MCRDL_MPI_FAST=0) they take the general
#: path, and only the results are checked
COMPILED = _mpi_backend.fast_module() is not None


def _general_calls(monkeypatch, rt, *ops):
    """A list that gets an op's name each time the mpi backend's general-path method of
    it runs (the fast path never calls them); without the compiled issuers a list that
    compares equal to anything."""
    be, ran = rt.backend("mpi"), ([] if COMPILED else _Any())
    for op in ops:
        def counted(*a, _f=getattr(be, op), _op=op, **kw):
            ran.append(_op)
            return _f(*a, **kw)
        monkeypatch.setattr(be, op, counted)
    return ran


class _Any(list):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False


def _vals(rank, i, count, salt=0):
    """Rank ``rank``'s block ``i`` of ``count`` float64 (small exact integers)."""
    return torch.tensor((np.arange(count) * 3 + rank * 5 + i * 7 + salt) % 11 + 1, dtype=F)


def _outputs(layout, n, count, inp=None):
    """n output tensors of ``count``: chunks of one tensor ("run"), separate tensors
    ("apart"), or chunks of one tensor whose block ``RANK`` is ``inp``'s memory
    ("shared": ``inp`` is then a view of it)."""
    if layout == "apart":
        return [torch.zeros(count, dtype=F) for _ in range(n)]
    whole = torch.zeros(n * count, dtype=F)
    return list(whole.split(count)) if count else [whole[:0] for _ in range(n)]


def _wait(w):
    if w is not None:
        w.wait()


def _bound(rt, name):
    return [k for k in rt.choices if isinstance(k, tuple) and k[0] == f"bound:torch.{name}"
            and rt.choices[k] is not None]


def _run_all_gather(layout, count, backend, async_op, salt):
    n = SIZE
    outs = _outputs(layout, n, count)
    if layout == "shared":
        inp = outs[RANK]
        inp.copy_(_vals(RANK, 0, count, salt))
    else:
        inp = _vals(RANK, 0, count, salt)
    _wait(dist.all_gather(outs, inp, backend=backend, async_op=async_op))
    for r in range(n):
        np.testing.assert_array_equal(outs[r].numpy(), _vals(r, 0, count, salt).numpy())


def _run_reduce_scatter(layout, count, backend, async_op, salt):
    n = SIZE
    ins = _outputs(layout, n, count)
    for i, t in enumerate(ins):
        t.copy_(_vals(RANK, i, count, salt))
    out = ins[RANK] if layout == "shared" else torch.zeros(count, dtype=F)
    _wait(dist.reduce_scatter(out, ins, backend=backend, async_op=async_op))
    want = sum(_vals(r, RANK, count, salt).numpy() for r in range(n))
    np.testing.assert_array_equal(out.numpy(), want)


def _a2a_count(src, dst, count):
    """Elements rank ``src`` sends rank ``dst`` (uneven, the same on every rank)."""
    return (src + 2 * dst) % 3 + count


def _run_all_to_all(layout, count, backend, async_op, salt):
    n = SIZE
    in_counts = [_a2a_count(RANK, j, count) for j in range(n)]
    out_counts = [_a2a_count(j, RANK, count) for j in range(n)]
    if layout == "apart":
        ins = [_vals(RANK, j, c, salt) for j, c in enumerate(in_counts)]
        outs = [torch.zeros(c, dtype=F) for c in out_counts]
    else:
        ins = list(torch.cat([_vals(RANK, j, c, salt) for j, c in enumerate(in_counts)])
                   .split(in_counts))
        if layout == "shared":  # the outputs interleaved with the inputs in one tensor
            whole = torch.zeros(sum(in_counts) + sum(out_counts), dtype=F)
            parts = whole.split([c for pair in zip(out_counts, in_counts) for c in pair])
            outs = list(parts[0::2])
            for t, src in zip(parts[1::2], ins):
                t.copy_(src)
            ins = list(parts[1::2])
        else:
            outs = list(torch.zeros(sum(out_counts), dtype=F).split(out_counts))
    _wait(dist.all_to_all(outs, ins, backend=backend, async_op=async_op))
    for j in range(n):
        np.testing.assert_array_equal(outs[j].numpy(), _vals(j, RANK, out_counts[j], salt).numpy())


def _run_gather(layout, count, backend, async_op, salt, dst=None):
    n = SIZE
    dst = n - 1 if dst is None else dst
    outs = _outputs(layout, n, count) if RANK == dst else None
    if layout == "shared" and RANK == dst:
        inp = outs[RANK]
        inp.copy_(_vals(RANK, 0, count, salt))
    else:
        inp = _vals(RANK, 0, count, salt)
    _wait(dist.gather(inp, outs, dst, backend=backend, async_op=async_op))
    if RANK == dst:
        for r in range(n):
            np.testing.assert_array_equal(outs[r].numpy(), _vals(r, 0, count, salt).numpy())


def _run_scatter(layout, count, backend, async_op, salt, src=None):
    n = SIZE
    src = n - 1 if src is None else src
    ins = None
    if RANK == src:
        ins = _outputs(layout, n, count)
        for i, t in enumerate(ins):
            t.copy_(_vals(RANK, i, count, salt))
    out = ins[RANK] if layout == "shared" and RANK == src else torch.zeros(count, dtype=F)
    _wait(dist.scatter(out, ins, src, backend=backend, async_op=async_op))
    np.testing.assert_array_equal(out.numpy(), _vals(src, RANK, count, salt).numpy())


FORMS = {"all_gather": (_run_all_gather, "all_gather"),
         "reduce_scatter": (_run_reduce_scatter, "reduce_scatter"),
         "all_to_all": (_run_all_to_all, "all_to_all"),
         "gather": (_run_gather, "gather"), "scatter": (_run_scatter, "scatter")}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("mode", MODES)
def test_list_forms_on_the_fast_path(rt, monkeypatch, form, mode):
    """Every layout, blocking and async, sizes on both sides of the two-range table's
    bound (16 B): NumPy's result, and no call of the mpi backend's general-path method;
    the frontend's key is bound (a closure, or a call by table range)."""
    backend = _mode(rt, mode)
    run, general = FORMS[form]
    ran = _general_calls(monkeypatch, rt, general)
    for salt, (layout, count, async_op) in enumerate(
            (lay, c, a) for lay in LAYOUTS for c in (1, 4) for a in (False, True, False)):
        run(layout, count, backend, async_op, salt)
    run("apart", 0, backend, False, 0)  # empty blocks
    assert ran == [], ran
    assert _bound(rt, form) or not COMPILED, list(rt.choices)


@pytest.mark.parametrize("form", list(FORMS))
def test_fast_rank_meets_general_rank(rt, monkeypatch, form):
    """Rank 0 takes the general path (its fast entries step aside), the others the
    fast path: the same library call underneath, so the results hold on every rank."""
    g = core.new_group(list(range(SIZE)))  # (no bound keys yet)
    if RANK == 0:
        for name in ("all_gather_list", "reduce_scatter_list", "all_to_all_list", "gather",
                     "scatter"):
            monkeypatch.setattr(fastpath, name, lambda *a, **k: fastpath.MISS)
    run, general = FORMS[form]
    ran = _general_calls(monkeypatch, rt, general)
    for salt, layout in enumerate(LAYOUTS * 2):
        for async_op in (False, True):
            _call_on(g, run, layout, 2, async_op, salt)
    if COMPILED:
        assert (ran != []) == (RANK == 0), ran


def _call_on(g, run, layout, count, async_op, salt):
    """``run`` on group ``g`` (the world's ranks): passes ``group=`` through."""
    real = {name: getattr(dist, name) for name in FORMS}

    def with_group(fn):
        return lambda *a, **k: fn(*a, group=g, **k)
    try:
        for name, fn in real.items():
            setattr(dist, name, with_group(fn))
        run(layout, count, "mpi", async_op, salt)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _bad_calls(kind):
    """Calls refused on every rank alike: a list of the wrong length, or sizes that
    disagree (an element of the list, or all_to_all's own block)."""
    n = SIZE
    long = [torch.zeros(2, dtype=F) for _ in range(n + 1)]
    odd = [torch.zeros(2, dtype=F) for _ in range(n - 1)] + [torch.zeros(3, dtype=F)]
    x = torch.ones(2, dtype=F)
    lists = long if kind == "length" else odd
    own = [torch.zeros(2, dtype=F) for _ in range(n)]
    own_in = [torch.zeros(2 if j != RANK else 1, dtype=F) for j in range(n)]
    return {
        "all_gather": lambda b: dist.all_gather(lists, x, backend=b),
        "reduce_scatter": lambda b: dist.reduce_scatter(x.clone(), lists, backend=b),
        "all_to_all": (lambda b: dist.all_to_all(long, long, backend=b)) if kind == "length"
        else (lambda b: dist.all_to_all(own, own_in, backend=b)),
        "gather": lambda b: dist.gather(x, lists if RANK == 0 else None, 0, backend=b),
        "scatter": lambda b: dist.scatter(x.clone(), lists if RANK == 0 else None, 0,
                                          backend=b),
    }


@pytest.mark.parametrize("kind", ["length", "sizes"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("mode", ["mpi", "two ranges"])
def test_bad_input_is_refused_before_anything_is_sent(rt, monkeypatch, kind, form, mode):
    """On a bound key too (the good calls first): InvalidArgumentError, and the group
    then runs the good call (nothing of the refused one was sent). gather and scatter:
    the root's list is the bad one, so the root refuses and the others, whose list is
    ignored, would wait for it: they are given the same bad call only where it is
    refused everywhere (a wrong length at every rank is refused at the root only), so
    here only the root's call is bad and the others' is skipped."""
    backend = _mode(rt, mode)
    run, _ = FORMS[form]
    for salt in range(2):
        run("run", 2, backend, False, salt)
    bad = _bad_calls(kind)[form]
    if form in ("gather", "scatter"):
        if RANK == 0:
            with pytest.raises(InvalidArgumentError):
                bad(backend)
    else:
        with pytest.raises(InvalidArgumentError):
            bad(backend)
    run("run", 2, backend, False, 9)  # the group is usable: nothing was left half-sent


def test_async_list_call_is_ordered_after_memory_in_flight(rt, monkeypatch):
    """An irecv into the first output block is in flight when an async all_gather of
    that list is called: the gather waits for the receive (the general path orders
    it), so the block holds the gather's result, not the message's; a blocking list call
    beside an unrelated isend in flight stays on the fast path."""
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    outs = _outputs("run", SIZE, 2)
    w = dist.irecv(outs[0], prv, tag=3, backend="mpi")
    dist.send(torch.full((2,), -1.0, dtype=F), nxt, tag=3, backend="mpi")
    ag = dist.all_gather(outs, _vals(RANK, 0, 2), backend="mpi", async_op=True)
    ag.wait()
    w.wait()
    for r in range(SIZE):
        np.testing.assert_array_equal(outs[r].numpy(), _vals(r, 0, 2).numpy())
    for salt in range(2):  # bound
        _run_all_gather("apart", 2, "mpi", False, salt)
    ran = _general_calls(monkeypatch, rt, "all_gather")
    got = torch.zeros(3, dtype=F)
    w = dist.irecv(got, prv, tag=4, backend="mpi")
    s = dist.isend(_vals(RANK, 1, 3), nxt, tag=4, backend="mpi")
    _run_all_gather("apart", 2, "mpi", False, 5)
    _run_all_gather("run", 2, "mpi", True, 6)
    s.wait()
    w.wait()
    np.testing.assert_array_equal(got.numpy(), _vals(prv, 1, 3).numpy())
    assert ran == [], ran


@pytest.mark.parametrize("mode", MODES)
def test_point_to_point_in_any_mix(rt, monkeypatch, mode):
    """isend then a blocking recv then wait; irecv then a blocking send; both async; a
    blocking recv from any source with an isend in flight: NumPy's values and the
    sender's rank, and never the general path's send or recv once the keys are bound."""
    backend = _mode(rt, mode)
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE

    def rounds(salt):
        for size in (1, 4):
            got = torch.zeros(size, dtype=F)
            s = dist.isend(_vals(RANK, 0, size, salt), nxt, tag=5, backend=backend)
            assert dist.recv(got, prv, tag=5, backend=backend) == prv
            s.wait()
            np.testing.assert_array_equal(got.numpy(), _vals(prv, 0, size, salt).numpy())
            w = dist.irecv(got, prv, tag=6, backend=backend)
            dist.send(_vals(RANK, 1, size, salt), nxt, tag=6, backend=backend)
            w.wait()
            assert w.result() == prv
            np.testing.assert_array_equal(got.numpy(), _vals(prv, 1, size, salt).numpy())
            s = dist.isend(_vals(RANK, 2, size, salt), nxt, tag=7, backend=backend)
            assert dist.recv(got, None, tag=7, backend=backend) == prv
            s.wait()
            np.testing.assert_array_equal(got.numpy(), _vals(prv, 2, size, salt).numpy())
    rounds(0)
    ran = _general_calls(monkeypatch, rt, "send", "recv")
    for salt in range(1, 3):
        rounds(salt)
    assert ran == [], ran


@pytest.mark.parametrize("frontend", ["torch", "numpy"])
@pytest.mark.parametrize("mode", MODES)
def test_batch_isend_irecv(rt, monkeypatch, frontend, mode):
    """A ring in both directions as one batch, waited at once and after another call;
    NumPy's values, the receives' sources; the general path's send and recv never run
    once planned."""
    backend = _mode(rt, mode)
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    conv = (lambda t: t) if frontend == "torch" else (lambda t: t.numpy())
    batch = dist.batch_isend_irecv if frontend == "torch" else core.batch_isend_irecv

    def ring(salt, size=3):
        a, b = torch.zeros(size, dtype=F), torch.zeros(size, dtype=F)
        ops = [core.P2POp(dist.irecv, conv(a), prv, None, 8),
               core.P2POp("irecv", conv(b), nxt, None, 9),
               core.P2POp(dist.isend, conv(_vals(RANK, 0, size, salt)), nxt, None, 8),
               core.P2POp("isend", conv(_vals(RANK, 1, size, salt)), prv, None, 9)]
        works = batch(ops, backend=backend)
        assert len(works) == 4
        for w in works:
            w.wait()
        assert works[0].result() == prv and works[1].result() == nxt
        np.testing.assert_array_equal(a.numpy(), _vals(prv, 0, size, salt).numpy())
        np.testing.assert_array_equal(b.numpy(), _vals(nxt, 1, size, salt).numpy())
    ring(0)
    ran = _general_calls(monkeypatch, rt, "send", "recv")
    for salt in range(1, 3):
        ring(salt, 1 + salt)
    assert ran == [], ran
