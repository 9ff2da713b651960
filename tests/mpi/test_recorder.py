"""The flight recorder's entries (issue 50), on every rank: the fast path (the NumPy
core's and mcrdl_torch's bound calls), the general path (Gloo), torch.distributed's "mcrdl" process group, async works (issued,
then completed with an end time), point to point, and the JAX lowering (a call lowered
to mpi4jax: one "lowered" entry when traced; a host-callback call: one entry per run).
Each call's entry holds op, dtype, count, backend and the rule that chose it, with a
sequence number per group that every member gives the same call (compared across the
ranks), and results stay NumPy's."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import mcrdl_core as core
import mcrdl_torch as dist
from mcrdl_core.observe import recorder as rec
from conftest import RANK, SIZE

pytestmark = pytest.mark.skipif(not rec.ON, reason="the recorder is off (MCRDL_TRACE_ENTRIES=0)")


@pytest.fixture
def ring():
    """The entries recorded by the test, as dump-shaped dicts."""
    rec.clear()

    def entries():
        return rec.snapshot("test")["entries"]
    return entries


def _same_everywhere(entries):
    """Every rank recorded the same collectives, with the same sequence numbers."""
    mine = [(e["group"], e["seq"], e["op"], e["count"], e["backend"]) for e in entries
            if not e["p2p"]]
    everyone = MPI.COMM_WORLD.allgather(mine)
    assert all(x == everyone[0] for x in everyone), everyone


def test_fast_path_entries(ring):
    x = np.ones(4, np.float32)
    t = torch.ones(4)
    for _ in range(3):  # the first call of a key fills the memo, the later ones are bound
        core.all_reduce(x, backend="mpi")
        dist.all_reduce(t, backend="mpi")
        dist.broadcast(t, 0, backend="mpi")
    np.testing.assert_array_equal(x, np.full(4, float(SIZE) ** 3))
    es = [e for e in ring() if e["group"] == "world"]
    assert [e["op"] for e in es] == ["all_reduce", "all_reduce", "broadcast"] * 3
    seqs = [e["seq"] for e in es]
    assert seqs == list(range(seqs[0], seqs[0] + 9))
    for e in es:
        assert (e["dtype"], e["count"], e["backend"], e["state"]) == ("float32", 4, "mpi",
                                                                      "completed"), e
        assert e["rule"] == "explicit: backend='mpi'", e
        assert e["t_end"] >= e["t_issue"]
    assert es[2]["root"] == 0
    _same_everywhere(es)


def test_general_path_and_async_entries(ring):
    x = np.full(6, RANK + 1.0, np.float32)
    w = core.all_reduce(x, backend="gloo", async_op=True)
    before = ring()[-1]
    assert before["async"] and before["state"] in ("issued", "completed")
    w.wait()
    np.testing.assert_allclose(x, np.full(6, SIZE * (SIZE + 1) / 2))
    out = [np.zeros(2, np.int64) for _ in range(SIZE)]
    core.all_gather(out, np.full(2, RANK, np.int64), backend="gloo")
    es = ring()
    assert [(e["op"], e["backend"], e["async"], e["state"]) for e in es] == [
        ("all_reduce", "gloo", True, "completed"), ("all_gather", "gloo", False, "completed")]
    assert es[0]["t_end"] is not None and es[0]["count"] == 6 and es[1]["dtype"] == "int64"
    assert es[1]["seq"] == es[0]["seq"] + 1
    _same_everywhere(es)


def test_group_default_and_sub_group(ring):
    g = core.new_group(list(range(SIZE))[::-1], backend="gloo")
    core.all_reduce(np.ones(3), group=g)
    core.all_reduce(np.ones(3), group=g, backend="mpi")
    es = [e for e in ring() if e["group"] == g.key]
    assert [e["seq"] for e in es] == [1, 2]
    assert es[0]["rule"].startswith("group default: backend='gloo'") and es[0]["backend"] == "gloo"
    assert es[1]["rule"] == "explicit: backend='mpi'" and es[1]["backend"] == "mpi"
    _same_everywhere(es)


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_call_the_debug_check_refuses_is_numbered_alike(ring, backend, monkeypatch):
    """MCRDL_DEBUG=1 refuses a call compressed on rank 0 only (a MismatchError on every
    rank, before anything is sent): no rank keeps an entry of it, so the group's next
    call has one number everywhere (the compressed path once kept its entry, the plain
    one none, and ``mcrdl trace`` then compared different calls)."""
    from mcrdl_core.base.errors import MismatchError

    g = core.new_group(backend=backend)
    monkeypatch.setattr(core.get_runtime(), "debug", True)
    out = np.empty(SIZE * 8, np.float32)
    with pytest.raises(MismatchError, match="compression"):
        core.all_to_all_single(out, np.ones(SIZE * 8, np.float32), group=g,
                               compression="fp16" if RANK == 0 else None)
    x = np.full(4, RANK + 1.0, np.float32)
    core.all_reduce(x, group=g)
    np.testing.assert_array_equal(x, np.full(4, SIZE * (SIZE + 1) / 2))
    es = [e for e in ring() if e["group"] == g.key]
    assert [(e["seq"], e["op"]) for e in es] == [(1, "all_reduce")], es
    _same_everywhere(es)


@pytest.mark.skipif(SIZE < 2, reason="point to point needs 2 ranks")
def test_point_to_point_entries(ring):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    buf = np.zeros(3, np.float32)
    reqs = [core.isend(np.full(3, RANK, np.float32), right, tag=7, backend="mpi"),
            core.irecv(buf, left, tag=7, backend="mpi")]
    for r in reqs:
        r.wait()
    assert buf[0] == left
    es = [e for e in ring() if e["p2p"]]
    assert [(e["op"], e["async"], e["state"]) for e in es] == [("send", True, "completed"),
                                                             ("recv", True, "completed")]
    assert es[0]["peer"] == right and es[1]["peer"] == left and es[0]["tag"] == 7


@pytest.mark.usefixtures("torch_world")  # conftest: torch.distributed on the "mcrdl" backend
def test_process_group_entries(ring):
    import torch.distributed as tdist

    t = torch.full((5,), float(RANK + 1))
    tdist.all_reduce(t)
    tdist.all_reduce(t, async_op=True).wait()
    assert t[0].item() == (SIZE * (SIZE + 1) / 2) * SIZE
    es = [e for e in ring() if e["op"] == "all_reduce"]
    assert len(es) == 2 and [e["count"] for e in es] == [5, 5]
    assert es[1]["seq"] == es[0]["seq"] + 1 and es[1]["async"] and \
        all(e["state"] == "completed" for e in es)
    _same_everywhere(es)


def test_jax_lowering(ring):
    jax = pytest.importorskip("jax")
    import mcrdl_jax as mj

    f = jax.jit(lambda a: mj.all_reduce(a, backend="mpi") + mj.all_reduce(a, backend="gloo"))
    a = jax.numpy.ones(5, jax.numpy.float32)
    for _ in range(2):
        y = f(a)
    np.testing.assert_allclose(np.asarray(y), np.full(5, 2.0 * SIZE))
    es = ring()
    lowered = [e for e in es if e["state"] == "lowered"]
    runs = [e for e in es if e["backend"] == "gloo"]
    from mcrdl_core.base import config
    from mcrdl_jax.callback import MPI4JAX
    expect = 1 if MPI4JAX is not None and config.get("MCRDL_JAX_MPI4JAX") else 0
    assert len(lowered) == expect and all(e["seq"] is None for e in lowered)
    if lowered:
        assert lowered[0]["algorithm"] == "mpi4jax" and lowered[0]["count"] == 5
    assert len(runs) == 2 and all(e["state"] == "completed" for e in runs)
    _same_everywhere(es)


@pytest.mark.skipif(SIZE < 2, reason="point to point needs 2 ranks")
def test_bound_point_to_point_entries(ring):
    """mcrdl_torch's bound sends and receives (a pipeline's step, the later calls of a
    key bound): each entry names its peer and tag, the isend's async and completed, the
    blocking receive's ended; the receives' results are the sender's."""
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.empty(3)
    for i in range(6):
        w = dist.isend(torch.full((3,), float(RANK * 10 + i)), right, tag=5, backend="mpi")
        assert dist.recv(got, left, tag=5, backend="mpi") == left
        w.wait()
        np.testing.assert_array_equal(got.numpy(), np.full(3, left * 10.0 + i))
    es = [e for e in ring() if e["p2p"]]
    assert [e["op"] for e in es] == ["send", "recv"] * 6
    for e in es:
        assert e["tag"] == 5 and e["count"] == 3 and e["state"] == "completed", e
        assert e["peer"] == (right if e["op"] == "send" else left), e
        assert e["async"] == (e["op"] == "send"), e
        if e["op"] == "recv":  # (a send's compiled Work keeps no end time)
            assert e["t_end"] >= e["t_issue"], e
    assert [e["seq"] for e in es] == list(range(es[0]["seq"], es[0]["seq"] + 12))
