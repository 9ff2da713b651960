"""Where the fast path (memo, bound closures, the compiled MPI issuers) meets the rest:
issue 48, defects 1, 2, 3, 4, 5, 10 and 13. Every call's result is checked against NumPy
on every rank, and every refusal is expected on every rank, before anything is sent,
with the group usable afterwards.

- 1: a tuning table decides an auto call's backend on a group with a default backend
  (``backend="auto"`` on a group made with ``backend="mpi"``; a group made with
  ``backend="auto"``) on every path, so a rank on the general path and a rank on a bound
  closure pick the same library;
- 2: a bound async Work whose finalizer failed raises from ``wait()``, as from
  ``wait(timeout=...)``;
- 3: a library error on the compiled (and the Python) issuers' path is CommFailedError
  and breaks the group, as on the general path; a negative tag is InvalidArgumentError;
- 4, 5: ``all_to_all_single`` without split sizes whose output and input sizes differ,
  or with split sizes whose own block disagrees, is refused on mpi and gloo;
- 10: MCRDL_DEBUG reports ranks that disagree on ``hier`` versus the flat collective;
- 13: a table naming ``hier:NAME`` that the call cannot run falls back to the policy.
"""
import time

import numpy as np
import pytest
import torch

import mcrdl_core as core
import mcrdl_torch as dist
from mcrdl_core.base.errors import (BrokenGroupError, CommFailedError, InvalidArgumentError,
                                    McrdlError, MismatchError)
from mcrdl_core.dispatch.selection import SCHEMA, TuningTable
from conftest import RANK, SIZE, values

F = torch.float64
BACKENDS = ["mpi", "gloo"]
FRONTENDS = ["torch", "numpy"]
needs_peers = pytest.mark.skipif(SIZE < 2, reason="needs a peer")


def _table(ranges, ops, group=None):
    """A tuning table of ``ranges`` for ``ops`` on float host buffers of ``group``'s size
    (default: the world)."""
    rt = core.get_runtime()
    g = rt.world if group is None else group
    return TuningTable({"schema": SCHEMA, "entries": [
        {"op": op, "world_size": g.size, "hosts": rt.bootstrap.hosts_in(g.ranks),
         "device": "cpu", "dtype_class": "float", "ranges": ranges} for op in ops]}, "<test>")


@pytest.fixture
def rt():
    rt = core.get_runtime()
    old = rt.table
    yield rt
    rt.set_table(old)
    rt.set_override(None)
    rt.debug = False


def _all_reduce(frontend, n, salt, group, backend, async_op=False):
    """A SUM all-reduce of ``n`` float64 on ``group`` (all ranks) through ``frontend``,
    its result checked against NumPy."""
    ranks = list(range(SIZE))
    t = values(RANK, n, F, salt)
    x = t if frontend == "torch" else t.numpy()
    call = dist.all_reduce if frontend == "torch" else core.all_reduce
    w = call(x, group=group, async_op=async_op, backend=backend)
    if async_op:
        w.wait()
    want = np.stack([values(r, n, F, salt).numpy() for r in ranks]).sum(0)
    np.testing.assert_array_equal(np.asarray(x), want)


def _count_calls(monkeypatch, rt, name, op):
    """A list that gets ``op``'s name each time backend ``name`` issues one."""
    be, ran = rt.backend(name), []

    def counted(*a, _f=getattr(be, op), **kw):
        ran.append(op)
        return _f(*a, **kw)
    monkeypatch.setattr(be, op, counted)
    return ran


# --- defect 1 --------------------------------------------------------------------------
DEFAULTS = [("mpi", "auto"), ("auto", None)]  # (the group's default, the call's backend=)


@needs_peers
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("default,request_", DEFAULTS)
def test_auto_on_a_group_with_a_default_follows_the_table(rt, monkeypatch, frontend, default,
                                                          request_):
    """A table: mpi up to 1 KiB, gloo above. On a group whose default leaves the choice to
    MCR-DL for the call (default "mpi", call "auto"; default "auto", call None), 64 B
    calls run on mpi (memoized and bound) and the 16 KiB calls after them on gloo, as
    ``Runtime.select`` says, every one of them."""
    g = core.new_group(range(SIZE), backend=default)
    rt.set_table(_table([[1024, "mpi"], [None, "gloo"]], ["all_reduce"], g))
    ran = _count_calls(monkeypatch, rt, "gloo", "all_reduce")
    for salt in range(3):
        _all_reduce(frontend, 8, salt, g, request_)
    assert ran == []
    for salt in range(3):
        _all_reduce(frontend, 2048, salt, g, request_)
        _all_reduce(frontend, 8, salt, g, request_)
    assert ran == ["all_reduce"] * 3, ran


@needs_peers
@pytest.mark.parametrize("default,request_", DEFAULTS)
def test_auto_with_one_rank_on_the_general_path_and_the_other_bound(rt, default, request_):
    """The issue's hang: rank 0 has a receive in flight (its all-reduce takes the general
    path), the others run the key's bound closure; both must pick the table's gloo for
    16 KiB (before: the closure ran mpi, and both waited out the timeout)."""
    g = core.new_group(range(SIZE), backend=default)
    g.timeout = 10.0
    rt.set_table(_table([[1024, "mpi"], [None, "gloo"]], ["all_reduce"], g))
    for salt in range(3):  # binds the key (64 B: mpi) on every rank
        _all_reduce("torch", 8, salt, g, request_)
    _all_reduce("torch", 2048, 0, g, request_)  # every rank on the same path: fills the memo
    got = torch.zeros(4, dtype=F)
    w = dist.irecv(got, 1, group=g) if RANK == 0 else None
    _all_reduce("torch", 2048, 1, g, request_)
    if RANK == 1:
        dist.send(values(1, 4, F), 0, group=g)
    if w is not None:
        w.wait()
        np.testing.assert_array_equal(got.numpy(), values(1, 4, F).numpy())


# --- defect 2 --------------------------------------------------------------------------
class _FinalizerFailed(McrdlError):
    pass


def _boom():
    raise _FinalizerFailed("the test's finalizer failed")


@needs_peers
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_failed_finalizer_fails_every_wait(rt, monkeypatch, frontend, timeout):
    """An async fast-path all-reduce (bound, for torch) with a finalizer that raises:
    ``wait()`` raises its error, as ``wait(timeout=30)`` does, whoever sees the request
    end (here the compiled wait's spin, made long enough to see it on every rank)."""
    for salt in range(3):
        _all_reduce(frontend, 4, salt, None, "mpi", async_op=True)  # binds the key
    monkeypatch.setattr(rt.engine, "spin_s", 5.0)
    t = values(RANK, 4, F)
    x = t if frontend == "torch" else t.numpy()
    w = (dist.all_reduce if frontend == "torch" else core.all_reduce)(
        x, async_op=True, backend="mpi")
    assert not w.done
    w.add_finalizer(_boom)
    with pytest.raises(_FinalizerFailed):
        w.wait(timeout)
    assert w.error is not None
    with pytest.raises(_FinalizerFailed):  # and again
        w.wait()
    monkeypatch.undo()
    _all_reduce(frontend, 4, 1, None, "mpi")  # the world is fine


# --- defect 3 --------------------------------------------------------------------------
@needs_peers
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_library_error_on_the_fast_path_breaks_the_group(rt, monkeypatch, frontend,
                                                           async_op, compiled):
    """A receive of 8 floats into 4 fails in MPI (truncation): on the fast path, compiled
    issuers or Python ones (``MCRDL_MPI_FAST=0``), as on the general path: CommFailedError
    naming the op, group and backend, and the group is broken; the sender's call
    completes."""
    if compiled:
        from mcrdl_backends import mpi as mpi_backend
        if mpi_backend.compiled()[0] is None:
            pytest.skip("the compiled MPI issuers are not built")
    else:
        monkeypatch.setenv("MCRDL_MPI_FAST", "0")
    g = core.new_group(range(SIZE))  # (its own plans: new keys)
    if RANK == 0:
        data = torch.ones(8, dtype=torch.float32)
        (dist.send if frontend == "torch" else core.send)(
            data if frontend == "torch" else data.numpy(), 1, group=g, backend="mpi")
    elif RANK == 1:
        buf = torch.zeros(4, dtype=torch.float32)
        x = buf if frontend == "torch" else buf.numpy()
        with pytest.raises(CommFailedError, match="recv on group .* via backend 'mpi'"):
            if async_op:
                (dist.irecv if frontend == "torch" else core.irecv)(x, 0, group=g,
                                                                    backend="mpi").wait()
            else:
                (dist.recv if frontend == "torch" else core.recv)(x, 0, group=g,
                                                                  backend="mpi")
        assert g.broken is not None
        with pytest.raises(BrokenGroupError):
            (dist.recv if frontend == "torch" else core.recv)(x, 0, group=g, backend="mpi")
    dist.barrier()  # (the world is fine)


@needs_peers
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_negative_tag_is_refused_before_sending(rt, frontend, async_op, backend):
    """A negative tag is InvalidArgumentError on the sender and on the receiver (on MPI a
    receive's -1 would be MPI_ANY_TAG), on a key the fast path has bound too; nothing is
    sent: the pair's next messages match."""
    dist.barrier(backend=backend)  # (every rank: the world's communicator on backend)
    peer = RANK ^ 1
    if peer >= SIZE:
        pytest.skip("no partner rank")
    mod = dist if frontend == "torch" else core
    send, recv = (mod.isend, mod.irecv) if async_op else (mod.send, mod.recv)

    def wait(w):
        if async_op:
            w.wait()

    def pair(tag, salt):
        got = torch.zeros(3, dtype=F)
        mine = values(RANK, 3, F, salt)
        conv = (lambda t: t) if frontend == "torch" else (lambda t: t.numpy())
        first, second = ((send, conv(mine)), (recv, conv(got))) if RANK % 2 == 0 \
            else ((recv, conv(got)), (send, conv(mine)))
        for f, x in (first, second):
            wait(f(x, peer, tag=tag, backend=backend))
        np.testing.assert_array_equal(got.numpy(), values(peer, 3, F, salt).numpy())

    for salt in range(3):  # memo and bound keys
        pair(0, salt)
    x = values(RANK, 3, F)
    for f in (send, recv):
        with pytest.raises(InvalidArgumentError, match="tag"):
            wait(f(x if frontend == "torch" else x.numpy(), peer, tag=-1, backend=backend))
    pair(0, 5)


# --- defects 4 and 5 -------------------------------------------------------------------
def _a2a(frontend, out, inp, out_splits=None, in_splits=None, backend=None):
    if frontend == "torch":
        return dist.all_to_all_single(out, inp, out_splits, in_splits, backend=backend)
    return core.all_to_all_single(out.numpy(), inp.numpy(), out_splits, in_splits,
                                  backend=backend)


def _good_even_a2a(frontend, backend, salt):
    n = SIZE
    inp = values(RANK, 2 * n, F, salt).reshape(n, 2)
    out = torch.zeros(n, 2, dtype=F)
    _a2a(frontend, out, inp, backend=backend)
    want = np.stack([values(r, 2 * n, F, salt).numpy().reshape(n, 2)[RANK] for r in range(n)])
    np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_even_all_to_all_of_unequal_sizes_is_refused(rt, frontend, backend):
    """Without split sizes, an output of 4 rows per rank and an input of 2 (24 vs 12
    elements at 3 ranks): refused on every rank before anything is sent, as torch does
    (before: MPI left half the output unwritten, Gloo failed in the library); then the
    same key runs right."""
    for salt in range(3):
        _good_even_a2a(frontend, backend, salt)
    n = SIZE
    inp = values(RANK, 2 * n, F).reshape(2 * n, 1)
    out = torch.full((4 * n, 1), -1.0, dtype=F)
    with pytest.raises(InvalidArgumentError, match="split sizes"):
        _a2a(frontend, out, inp, backend=backend)
    assert (out.numpy() == -1).all()
    _good_even_a2a(frontend, backend, 7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_own_block_that_disagrees_is_refused(rt, frontend, backend):
    """Split sizes by which every rank sends itself 1 row and expects 2 from itself:
    refused on every rank before anything is sent, on MPI as on Gloo and NCCL, on the
    fast path and bound keys too; a good uneven call after it runs right."""
    n = SIZE

    def good(salt):  # one row to every rank, by split sizes
        inp = values(RANK, 2 * n, F, salt).reshape(n, 2)
        out = torch.zeros(n, 2, dtype=F)
        _a2a(frontend, out, inp, [1] * n, [1] * n, backend=backend)
        want = np.stack([values(r, 2 * n, F, salt).numpy().reshape(n, 2)[RANK]
                         for r in range(n)])
        np.testing.assert_array_equal(out.numpy(), want)

    for salt in range(3):
        good(salt)
    out_splits = [1] * n
    out_splits[RANK] = 2
    inp = values(RANK, 2 * n, F).reshape(n, 2)
    out = torch.full((n + 1, 2), -1.0, dtype=F)
    with pytest.raises(InvalidArgumentError, match="itself"):
        _a2a(frontend, out, inp, out_splits, [1] * n, backend=backend)
    assert (out.numpy() == -1).all()
    good(9)


# --- defect 10 -------------------------------------------------------------------------
@needs_peers
@pytest.mark.parametrize("op", ["all_reduce", "all_to_all_single"])
def test_debug_reports_hier_against_flat(rt, op):
    """MCRDL_DEBUG: rank 0 asks for ``hier:mpi``, the others for ``mpi``: MismatchError
    on every rank naming the algorithm, before anything is sent (where hosts make the
    call two-level this would hang); agreeing ranks run on."""
    rt.debug = True
    n = SIZE
    backend = "hier:mpi" if RANK == 0 else "mpi"

    def call(backend, salt):
        if op == "all_reduce":
            _all_reduce("numpy", 6, salt, None, backend)
        else:
            inp = values(RANK, 2 * n, F, salt).numpy().reshape(n, 2)
            out = np.zeros((n, 2))
            core.all_to_all_single(out, inp, backend=backend)
            want = np.stack([values(r, 2 * n, F, salt).numpy().reshape(n, 2)[RANK]
                             for r in range(n)])
            np.testing.assert_array_equal(out, want)

    with pytest.raises(MismatchError, match="algorithm"):
        call(backend, 0)
    call("hier:mpi", 1)
    call("mpi", 2)


# --- defect 13 -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hier:nosuch", "hier:nccl"])
@pytest.mark.parametrize("op", ["all_reduce", "all_to_all"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_table_naming_an_unrunnable_hier_falls_back_to_the_policy(rt, frontend, op, name):
    """A table whose every range names ``hier`` on a backend the call cannot run (one not
    known, nccl for host buffers): auto calls run on the policy's choice, right, as for
    an unrunnable plain name (before: BackendUnavailableError on every call)."""
    rt.set_table(_table([[None, name]], [op]))
    for salt in range(3):
        if op == "all_reduce":
            _all_reduce(frontend, 5, salt, None, None)
        else:
            _good_even_a2a(frontend, None, salt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_list_form_refuses_an_own_block_that_disagrees(rt, backend):
    """The list form of defect 5: ``output_tensor_list[rank]`` of 2 elements where
    ``input_tensor_list[rank]`` has 1 is refused on every rank before anything is sent
    (before: MPI left an element unwritten, Gloo failed in the library); then a good
    call runs right."""
    n = SIZE
    ins = [values(RANK, 1, F, j) for j in range(n)]
    outs = [torch.full((2 if j == RANK else 1,), -1.0, dtype=F) for j in range(n)]
    with pytest.raises(InvalidArgumentError, match="itself"):
        dist.all_to_all(outs, ins, backend=backend)
    assert all((o.numpy() == -1).all() for o in outs)
    outs = [torch.zeros(1, dtype=F) for _ in range(n)]
    dist.all_to_all(outs, ins, backend=backend)
    for j in range(n):
        np.testing.assert_array_equal(outs[j].numpy(), values(j, 1, F, RANK).numpy())
