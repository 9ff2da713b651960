"""The "mcrdl" process group registers a per-device backend for CPU (the group's Gloo
process group), so torch code that asks for one works: ``_get_backend(cpu)``,
``_get_pg_default_device`` and ``torch.distributed.checkpoint.async_save``
(which failed with "A CPU backend must be enabled")."""
import shutil
import tempfile

import pytest
import torch
import torch.distributed as tdist

from conftest import RANK, SIZE


@pytest.fixture
def world():
    import mcrdl_autoload

    mcrdl_autoload.register()
    if not tdist.is_initialized():
        tdist.init_process_group("mcrdl")
    yield tdist.group.WORLD


def test_cpu_backend_is_registered(world):
    from torch.distributed.distributed_c10d import _get_pg_default_device

    assert world._get_backend(torch.device("cpu")) is not None
    assert _get_pg_default_device(world) == torch.device("cpu")
    sub = tdist.new_group(list(range(SIZE))[::-1])
    assert sub._get_backend(torch.device("cpu")) is not None
    t = torch.full((2,), float(RANK))
    tdist.all_reduce(t, group=sub)  # still MCR-DL's call
    assert torch.equal(t, torch.full((2,), float(sum(range(SIZE)))))


def test_dcp_async_save(world):
    import torch.distributed.checkpoint as dcp

    root = [tempfile.mkdtemp(prefix="mcrdl-dcp-") if RANK == 0 else None]
    tdist.broadcast_object_list(root, src=0)
    state = {"w": torch.arange(4.0) + RANK, "step": torch.tensor(3)}
    dcp.async_save(state, checkpoint_id=root[0]).result()
    tdist.barrier()
    back = {"w": torch.zeros(4), "step": torch.tensor(0)}
    try:
        dcp.load(back, checkpoint_id=root[0])
        assert int(back["step"]) == 3
    finally:
        tdist.barrier()  # every rank has read it before rank 0 removes it
        if RANK == 0:
            shutil.rmtree(root[0], ignore_errors=True)
