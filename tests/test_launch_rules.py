"""An async fast-path call's launch (``Backend.fast_launch``): the Python default and the
MPI backend's compiled one (``mpi_fast.launch``) apply one rule, ``conflicts``: a call
whose memory overlaps that of a work in flight, where one of the two writes, is not
issued (None: the general path orders it); otherwise it is issued, and its Work gets
its fields and joins the engine's in-flight list. A refused issue (False) registers
nothing. One process, no peers: the issuers here are stand-ins that record their calls."""
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcrdl_core.base.ops import Op
from mcrdl_core.engine.work import conflicts
from mcrdl_core.world.backend import Backend

pytest.importorskip("mpi4py")
from mcrdl_backends import mpi as mpi_backend  # noqa: E402

span = st.tuples(st.integers(0, 12), st.integers(0, 12), st.booleans()).map(
    lambda s: (min(s[0], s[1]), max(s[0], s[1]), s[2]))
spans = st.lists(span, min_size=0, max_size=3).map(tuple)


def _compiled():
    c = mpi_backend.compiled()[0]
    if c is None:
        pytest.skip("the compiled module is not built")
    return c


class _Plain:
    """A work of another kind in flight: only ``spans``."""

    def __init__(self, spans):
        self.spans = spans


class _Engine:
    def __init__(self, inflight):
        self.inflight = inflight


class _Backend(Backend):
    name = "stand-in"

    def fast_work(self, op, group, req, spans, keep):
        return types.SimpleNamespace(op=op, group=group, req=req, spans=spans, keep=keep)


def _fast_work(spans):
    """A compiled-module Work in flight (its spans in the object, not in a dict)."""
    w = mpi_backend._FastWork.__new__(mpi_backend._FastWork)
    w.spans = spans
    return w


@settings(max_examples=300, deadline=None)
@given(st.lists(spans, max_size=3), spans, st.booleans())
def test_both_launches_issue_exactly_when_nothing_in_flight_conflicts(flight, mine, compiled_kind):
    c = _compiled()
    want = conflicts([_Plain(s) for s in flight], mine)
    # the rule itself, spelled out: some pair overlaps and one of the two writes
    assert want == any((wa or wb) and a < d and c_ < b for s in flight for a, b, wa in s
                       for c_, d, wb in mine)
    make = _fast_work if compiled_kind else _Plain
    for launch in (c.launch, _Backend(None).fast_launch):
        calls = []
        eng = _Engine([make(s) for s in flight])
        got = launch(Op.ALL_REDUCE, None, lambda *a: calls.append(a) or False, (1, 2), mine,
                     (), eng)
        assert got is None  # a conflict, or the issuer refused: nothing registered
        assert calls == ([] if want else [(1, 2)])
        assert len(eng.inflight) == len(flight)


def test_the_compiled_launch_fills_in_and_registers_its_work():
    c = _compiled()
    w = mpi_backend._FastWork.__new__(mpi_backend._FastWork)
    assert (w.done, w.keep, w.spans, w.finalizers, w.engine, w.error) == \
        (False, (), (), (), None, None)
    eng = _Engine([_Plain(((0, 8, False),))])  # a read of the same memory: no conflict
    owner, sp, grp = object(), ((0, 8, False),), object()
    got = c.launch(Op.BROADCAST, grp, lambda a, b: w if (a, b) == (3, 4) else None, (3, 4),
                   sp, (owner,), eng)
    assert got is w and eng.inflight[-1] is w and len(eng.inflight) == 2
    assert (w.op, w.group, w.spans, w.keep, w.engine) == (Op.BROADCAST, grp, sp, (owner,), eng)
    with pytest.raises(TypeError, match="launch"):
        c.launch(Op.BROADCAST, grp, lambda: w, [3, 4], sp, (), eng)  # args not a tuple
    with pytest.raises(TypeError, match="span"):
        c.launch(Op.BROADCAST, grp, lambda: w, (), ([0, 8, True],), (), eng)
    with pytest.raises(ZeroDivisionError):  # the issuer's error, nothing registered
        c.launch(Op.BROADCAST, grp, lambda: 1 / 0, (), ((20, 28, True),), (), eng)
    assert len(eng.inflight) == 2


def test_the_compiled_launch_hands_other_requests_to_the_python_one(monkeypatch):
    c = _compiled()
    seen = []
    monkeypatch.setattr(mpi_backend, "_launch", lambda *a: seen.append(a) or "work")
    c.set_work_classes(mpi_backend._FastWork, mpi_backend._FastRecvWork,
                       mpi_backend._MPI_WORKS, mpi_backend.MPIWork.wait, mpi_backend._launch)
    try:
        eng = _Engine([])
        req = object()
        assert c.launch(Op.SEND, "g", lambda: req, (), ((0, 4, False),), ("k",), eng) == "work"
        assert seen == [(Op.SEND, "g", req, ((0, 4, False),), ("k",), eng)]
    finally:
        monkeypatch.undo()
        c.set_work_classes(mpi_backend._FastWork, mpi_backend._FastRecvWork,
                           mpi_backend._MPI_WORKS, mpi_backend.MPIWork.wait,
                           mpi_backend._launch)
    with pytest.raises(TypeError, match="derive from mpi_fast.Work"):
        c.set_work_classes(mpi_backend.MPIWork, mpi_backend._FastRecvWork,
                           mpi_backend._MPI_WORKS, mpi_backend.MPIWork.wait, mpi_backend._launch)


def test_without_the_compiled_module_the_python_fields_and_launch_serve(tmp_path):
    """Where mpi_fast cannot be imported, the fast path's Works take their fields from
    ``_PyWorkFields`` and register through the Python ``Backend.fast_launch``: async
    and blocking calls on one rank still give NumPy's results and leave nothing in
    flight (a separate interpreter, with the module's import made to fail)."""
    import subprocess
    import sys
    code = r'''
import sys
sys.modules["mcrdl_backends.mpi_fast"] = None  # the import fails: not built
import numpy as np, torch
import mcrdl_core, mcrdl_torch as dist
from mcrdl_backends import mpi
assert mpi.mpi_fast is None and mpi._WorkFields is mpi._PyWorkFields
dist.init_process_group(backend="mpi")
be = mcrdl_core.get_runtime().backend("mpi")
assert be.fast_launch.__func__ is mpi.Backend.fast_launch
for _ in range(3):
    t = torch.arange(4, dtype=torch.float32)
    dist.all_reduce(t, backend="mpi", async_op=True).wait()
    assert t.tolist() == [0, 1, 2, 3]
    out = torch.zeros(4)
    w = dist.all_to_all_single(out, torch.arange(4.0), [4], [4], backend="mpi", async_op=True)
    w.wait()
    assert out.tolist() == [0, 1, 2, 3]
    r = torch.zeros(3)
    wr = dist.irecv(r, 0, tag=5, backend="mpi")
    ws = dist.isend(torch.ones(3), 0, tag=5, backend="mpi")
    ws.wait(); assert wr.result() == 0 and r.tolist() == [1, 1, 1]
    dist.barrier(backend="mpi", async_op=True).wait()
assert not mcrdl_core.get_runtime().engine.inflight
print("ok")
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
