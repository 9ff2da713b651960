"""barrier() picks its backend with a CUDA probe when the backend named for the call
handles CUDA buffers only (nccl), and with a host probe otherwise. Single process; the
NCCL backend is made "available" and its barrier recorded at the backend boundary, so
the selection that runs is the runtime's own."""
import pytest

import mcrdl_core as core
from mcrdl_backends.nccl import NCCLBackend
from mcrdl_core.memory import cuda as mc_cuda
from mcrdl_core.base.ops import Op
from mcrdl_core.dispatch.api import barrier_probe
from mcrdl_core.engine.work import CompletedWork


@pytest.fixture
def rt(monkeypatch):
    rt = core.init()
    monkeypatch.setattr(rt, "_backends", dict(rt._backends))
    monkeypatch.setattr(rt, "_unavailable", {**rt._unavailable, "nccl": None})
    monkeypatch.setattr(rt, "choices", {})
    monkeypatch.setattr(rt, "override", {})
    monkeypatch.setattr(rt.world, "backend", None)
    monkeypatch.setattr(mc_cuda, "current_device", lambda: 0, raising=False)
    rt.nccl_barriers = []

    def barrier(self, group):
        rt.nccl_barriers.append(group)
        return CompletedWork("nccl", Op.BARRIER, group)

    monkeypatch.setattr(NCCLBackend, "barrier", barrier)
    return rt


def test_explicit_nccl_barrier_reaches_nccl(rt):
    core.barrier(backend="nccl")
    w = core.barrier(backend="nccl", async_op=True)
    assert w.wait() and rt.nccl_barriers == [rt.world, rt.world]


def test_group_default_nccl_barrier_reaches_nccl(rt):
    rt.world.backend = "nccl"  # what init_process_group("nccl") sets
    core.barrier()
    assert rt.nccl_barriers == [rt.world]


def test_override_nccl_barrier_reaches_nccl(rt):
    rt.override = {"barrier": "nccl"}  # MCRDL_BACKEND=barrier=nccl
    core.barrier()
    assert rt.nccl_barriers == [rt.world]


def test_host_barriers_keep_the_host_probe(rt):
    core.barrier()
    core.barrier(backend="auto")
    core.barrier(backend="mpi")
    assert rt.nccl_barriers == []
    probe = barrier_probe(rt, rt.world, None)
    assert probe.device.kind == "cpu"
    cuda_probe = barrier_probe(rt, rt.world, "nccl")
    assert cuda_probe.device.kind == "cuda" and cuda_probe.nbytes == 1


def test_debug_mode_checks_an_nccl_barrier(rt, monkeypatch):
    monkeypatch.setattr(rt, "debug", True)
    core.barrier(backend="nccl")
    assert rt.nccl_barriers == [rt.world]
