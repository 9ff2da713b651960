"""Seams of the torch frontend with the core (issue 48, defects 6, 7, 14 and 19).

Runs on every rank (1, 2 or 3) under mpiexec; each test makes the same calls on every
rank and checks its own result against a NumPy reference (or the same error).
"""
import datetime
import time
import warnings

import numpy as np
import pytest
import torch

import mcrdl_core
import mcrdl_torch as dist
from mcrdl_core.base.errors import CommTimeoutError, InvalidArgumentError, McrdlError

from conftest import BACKENDS, RANK, SIZE

WORLD = list(range(SIZE))


def _rt():
    return mcrdl_core.get_runtime()


# --- defect 7: nested tensors --------------------------------------------------------------
def _nested():
    with warnings.catch_warnings():  # ("the nested tensor API is in prototype stage")
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])  # strided layout


def _calls(backend):
    """(name, call of a tensor-shaped argument x) for every fast-path op of mcrdl_torch;
    each plain call binds its key (the same dtype, group, backend and async flag)."""
    n = SIZE
    peer_to, peer_from = (RANK + 1) % n, (RANK - 1) % n

    def p2p(x):  # the send first: a refused one leaves no receive posted
        s = dist.isend(x, peer_to, backend=backend)
        r = dist.irecv(torch.empty_like(x), peer_from, backend=backend)
        s.wait(), r.wait()
    calls = [
        ("all_reduce", lambda x: dist.all_reduce(x, backend=backend)),
        ("all_reduce async", lambda x: dist.all_reduce(x, backend=backend, async_op=True).wait()),
        ("broadcast", lambda x: dist.broadcast(x, 0, backend=backend)),
        ("reduce", lambda x: dist.reduce(x, 0, backend=backend)),
        ("send/recv", p2p),
        ("all_gather_into_tensor in", lambda x: dist.all_gather_into_tensor(
            torch.empty(n * 4), x, backend=backend)),
        ("all_gather_into_tensor out", lambda x: dist.all_gather_into_tensor(
            x, torch.ones(4 if x.is_nested else x.numel() // n), backend=backend)),
        ("reduce_scatter_tensor", lambda x: dist.reduce_scatter_tensor(
            torch.empty(4), x, backend=backend)),
        ("all_to_all_single", lambda x: dist.all_to_all_single(
            torch.empty(x.numel() if not x.is_nested else 5), x, backend=backend)),
    ]
    return [c for c in calls if SIZE > 1 or c[0] != "send/recv"]  # (Gloo: none to oneself)


def _plain(name):
    """A plain tensor of the shape each call takes (the nested one has 5 elements)."""
    n = SIZE
    return {"all_gather_into_tensor out": torch.ones(4 * n), "reduce_scatter_tensor":
            torch.ones(4 * n), "all_to_all_single": torch.ones(2 * n)}.get(name, torch.ones(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_tensors_get_one_clear_error_on_every_path(backend):
    """Before: the first call raised torch's "NestedTensorImpl doesn't support sizes" (an
    internal error) and, once a plain tensor had bound the key, the same call went
    through the bound fast path and "succeeded". Now every call refuses it, before
    anything is sent, with InvalidArgumentError naming nested tensors."""
    for name, call in _calls(backend):
        for attempt in ("first", "after plain calls bound the key"):
            with pytest.raises(InvalidArgumentError, match="nested tensors") as info:
                call(_nested())
            assert "NestedTensorImpl" not in str(info.value), (name, attempt)
            if attempt == "first":
                call(_plain(name))
                call(_plain(name))  # (the second runs on the bound closure)
    x = torch.full((3,), float(RANK + 1))
    dist.all_reduce(x, backend=backend)  # the world is still usable
    assert x.tolist() == [SIZE * (SIZE + 1) / 2] * 3


# --- defect 6: init_process_group(timeout=) after an implicit start ------------------------
@pytest.fixture
def runtime_state():
    """The runtime's timeout and the world's default backend, restored after the test."""
    rt = _rt()
    saved = rt.engine.timeout, rt.world.backend
    yield rt
    rt.engine.timeout, rt.world.backend = saved
    rt.choices.clear()


def _unmatched_recv(group, backend, tag):
    """An irecv from the next rank that no rank ever sends: its wait can only time out."""
    return dist.irecv(torch.empty(2), (RANK + 1) % SIZE, group=group, tag=tag, backend=backend)


@pytest.mark.skipif(SIZE == 1, reason="needs a peer that does not send")
@pytest.mark.parametrize("backend", BACKENDS)
def test_init_process_group_timeout_applies_to_a_running_runtime(backend, runtime_state):
    """The runtime already runs (conftest's init, as after a get_rank() first); a later
    init_process_group(backend=, timeout=1.5 s) used to apply only the backend, and a
    wait then ran to MCRDL_TIMEOUT (60 s here)."""
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=1.5))
    assert runtime_state.world.backend == backend
    assert runtime_state.engine.timeout == 1.5, runtime_state.engine.timeout
    g = dist.new_group(WORLD)  # (broken by the timeout below; the world stays usable)
    w = _unmatched_recv(g, backend, tag=61)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=f"rank {RANK}"):
        w.wait()
    assert time.monotonic() - start < 10


# --- defect 14: a group's own timeout on Gloo ----------------------------------------------
LATE_S = 2.0  # how late the last rank comes


def _late_all_reduce(call):
    """``call(t)`` on every rank, the last rank ``LATE_S`` late; checks the sum."""
    t = torch.full((3,), float(RANK + 1))
    if RANK == SIZE - 1:
        time.sleep(LATE_S)
    call(t)
    assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 3, t


@pytest.mark.skipif(SIZE == 1, reason="needs a late peer")
@pytest.mark.parametrize("form", ["torch new_group", "mcrdl_torch new_group"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_groups_own_timeout_outlasts_mcrdl_timeout(form, backend, runtime_state,
                                                     torch_world):
    """MCRDL_TIMEOUT 0.5 s, the group's own 30 s: a rank 2 s late is within the group's
    timeout on every backend. Before, the group's Gloo communicator was made with
    MCRDL_TIMEOUT + 1 s and Gloo gave up at 1.5 s (CommFailedError); mcrdl_torch's
    new_group ignored its timeout=. (The torch group's Gloo communicator is made with
    the group, mcrdl_torch's by this late first call.)"""
    import torch.distributed as tdist

    runtime_state.engine.timeout = 0.5  # as MCRDL_TIMEOUT=0.5
    own = datetime.timedelta(seconds=30)
    if form == "torch new_group":
        pg = tdist.new_group(WORLD, timeout=own, pg_options=backend)
        call = lambda t: tdist.all_reduce(t, group=pg)  # noqa: E731
    else:
        g = dist.new_group(WORLD, timeout=own)
        call = lambda t: dist.all_reduce(t, group=g, backend=backend)  # noqa: E731
    _late_all_reduce(call)


@pytest.mark.skipif(SIZE == 1, reason="needs a late peer")
def test_a_late_rank_past_the_groups_timeout_names_itself(torch_world):
    """On Gloo, the group's own timeout (1 s) passes: the ranks on time get
    CommTimeoutError and Gloo closes their connections 1 s later; the rank that comes
    after that gets Gloo's "Connection closed by peer" as a CommFailedError, which said
    "rank ?" when the wait's first look found the work failed. Each error names its
    rank. (On MPI the late rank's call matches the others' abandoned one and completes.)"""
    import torch.distributed as tdist

    pg = tdist.new_group(WORLD, timeout=datetime.timedelta(seconds=1), pg_options="gloo")
    t = torch.ones(2)
    tdist.all_reduce(t, group=pg)  # (the communicator is made)
    if RANK == SIZE - 1:
        time.sleep(LATE_S + 1.0)  # past Gloo's own timeout on the others (1 s + 1 s)
    with pytest.raises(McrdlError) as info:
        tdist.all_reduce(t, group=pg)
    assert f"rank {RANK}:" in str(info.value), info.value


# --- defect 19: exact unless asked ---------------------------------------------------------
def _weights(rank, count=64, salt=0):
    """Values int8 cannot carry exactly (a rank's shard), the same wherever computed."""
    return torch.from_numpy(np.random.default_rng(1000 * salt + rank).normal(size=count)
                            .astype(np.float32))


def _shared_dir():
    """One directory every rank sees (rank 0's temporary one)."""
    import tempfile

    box = [tempfile.mkdtemp(prefix="mcrdl-seams-ckpt-") if RANK == 0 else None]
    import torch.distributed as tdist

    tdist.broadcast_object_list(box, src=0)
    return box[0]


@pytest.mark.skipif(SIZE == 1, reason="a gather of one rank has nothing to compress")
def test_exact_scope_and_checkpoints_under_lossy_all_gather(monkeypatch, torch_world):
    """Under MCRDL_COMPRESSION=all_gather=int8 an all-gather is lossy (checked first);
    inside mcrdl_torch.exact() (and mcrdl_core.exact()), DTensor.full_tensor(), a full
    state dict and a torch.distributed.checkpoint save + load of an FSDP2 model give
    the parameters bit for bit. Before, each gave int8-rounded weights."""
    import shutil

    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    monkeypatch.setenv("MCRDL_COMPRESSION", "all_gather=int8")
    whole = torch.cat([_weights(r) for r in WORLD])
    out = torch.empty_like(whole)
    tdist.all_gather_into_tensor(out, _weights(RANK))
    assert not torch.equal(out, whole), "the codec did not apply: nothing is tested"
    for backend in BACKENDS:
        dist.all_gather_into_tensor(out, _weights(RANK), backend=backend)
        assert not torch.equal(out, whole), backend
    for scope in (dist.exact, mcrdl_core.exact):
        with scope():
            tdist.all_gather_into_tensor(out, _weights(RANK))
            assert torch.equal(out, whole)
            for backend in BACKENDS:
                out.zero_()
                dist.all_gather_into_tensor(out, _weights(RANK), backend=backend)
                assert torch.equal(out, whole), backend
    mesh = init_device_mesh("cpu", (SIZE,))
    dt = DTensor.from_local(_weights(RANK), mesh, [Shard(0)], run_check=False)
    assert torch.equal(dt.full_tensor(), whole)

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8))
        with torch.no_grad():  # int8 cannot carry these: any codec shows
            for i, p in enumerate(m.parameters()):
                p.copy_(torch.from_numpy(np.random.default_rng(i).normal(size=p.shape)
                                         .astype(np.float32)))
        expected = {k: v.detach().clone() for k, v in m.state_dict().items()}
        fully_shard(m, mesh=mesh)
        return m, expected

    m, expected = model()
    full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    for k, v in expected.items():
        assert torch.equal(full[k], v), k
    where = _shared_dir()
    try:
        dcp.save({"model": get_model_state_dict(m)}, checkpoint_id=where)
        m2, _ = model()
        with torch.no_grad():
            for p in m2.parameters():
                p.to_local().zero_()
        sd = {"model": get_model_state_dict(m2)}
        dcp.load(sd, checkpoint_id=where)
        for k, v in expected.items():
            assert torch.equal(sd["model"][k].full_tensor(), v), k
    finally:
        tdist.barrier()
        if RANK == 0:
            shutil.rmtree(where, ignore_errors=True)
    assert not mcrdl_core.base.exact.active()  # (the scopes closed)
