"""The comm logger inside the runtime: each call recorded with op, bytes (S of the
nccl-tests formulas), backend and group size; the straggler view across ranks."""
import pytest
import torch

import mcrdl_core
import mcrdl_torch as dist
from conftest import SIZE
from mcrdl_core.observe.logger import logger


@pytest.fixture
def log():
    lg = logger()
    lg.clear()
    lg.enable()
    yield lg
    lg.disable()
    lg.clear()


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_calls_are_logged(log, backend):
    x = torch.ones(256)
    for _ in range(3):
        dist.all_reduce(x, backend=backend)
    out = torch.zeros(256 * SIZE)
    w = dist.all_gather_into_tensor(out, x, async_op=True, backend=backend)
    w.wait()
    rows = {r["op"]: r for r in log.rows()}
    assert rows["all_reduce"]["calls"] == 3 and rows["all_reduce"]["bytes"] == 1024
    assert rows["all_reduce"]["backend"] == backend and rows["all_reduce"]["ranks"] == SIZE
    assert rows["all_gather"]["bytes"] == 1024 * SIZE  # S = count x ranks x itemsize
    r = rows["all_reduce"]
    assert r["busbw_Bps"] == pytest.approx(r["algbw_Bps"] * 2 * (SIZE - 1) / SIZE)


def test_logger_off_records_nothing():
    lg = logger()
    lg.disable()
    lg.clear()
    dist.all_reduce(torch.ones(4), backend="mpi")
    assert lg.records == []


def test_straggler_view(log):
    for _ in range(2):
        dist.all_reduce(torch.ones(64), backend="mpi")
    view = mcrdl_core.stragglers()
    assert len(view) == 1
    v = view[0]
    assert v["min_s"] <= v["own_s"] <= v["max_s"] and 0 <= v["slowest_rank"] < SIZE
    assert len(log.records) == 2  # the view's own all-gather is not logged
