"""Which backend runs a call: explicit argument > MCRDL_BACKEND > tuning table > policy;
and every rank picks the same one, so auto-selected calls still line up."""
import pytest
import torch

import mcrdl_core as core
import mcrdl_torch as dist
from conftest import SIZE
from mcrdl_core.base.ops import Op
from mcrdl_core.dispatch.selection import TuningTable

TABLE = {"schema": "mcrdl.tuning/1", "entries": [
    {"op": "all_reduce", "world_size": SIZE, "device": "cpu", "dtype_class": "float",
     "ranges": [[64, "gloo"], [4096, "mpi"], [None, "gloo"]]}]}


@pytest.fixture
def rt():
    rt = core.get_runtime()
    yield rt
    rt.set_table(None)
    rt.set_override(None)


def pick(rt, nbytes, backend=None, dtype=torch.float32):
    buf = dist.tensors.to_buffer(torch.zeros(max(nbytes // 4, 1), dtype=dtype))
    return rt.select(Op.ALL_REDUCE, rt.world, buf, backend, core.ReduceOp.SUM).name


def test_policy_without_table(rt):
    assert pick(rt, 8) == "mpi"  # host buffers: mpi first, then gloo


def test_table_then_override_then_explicit(rt):
    rt.set_table(TuningTable(TABLE))
    assert [pick(rt, 8), pick(rt, 64), pick(rt, 68), pick(rt, 4096), pick(rt, 8192)] == \
           ["gloo", "gloo", "mpi", "mpi", "gloo"]
    assert pick(rt, 8, dtype=torch.int32) == "gloo"  # no int entry: the float entry serves
    buf = dist.tensors.to_buffer(torch.zeros(2))
    assert rt.select(Op.BROADCAST, rt.world, buf, None).name == "mpi"  # op not in table: policy
    rt.set_override("all_reduce=mpi")
    assert pick(rt, 8) == "mpi"  # MCRDL_BACKEND beats the table
    assert pick(rt, 8, backend="gloo") == "gloo"  # explicit beats everything
    rt.set_override(None)
    assert pick(rt, 8, backend="auto") == "gloo"  # "auto" means: consult the table


def test_auto_calls_are_correct_across_sizes(rt):
    rt.set_table(TuningTable(TABLE))
    for n in (1, 16, 17, 1024, 1025, 5000):
        t = torch.ones(n)
        dist.all_reduce(t, backend="auto")
        assert torch.equal(t, torch.full((n,), float(SIZE)))


def test_group_default_backend(rt):
    g = dist.new_group(list(range(SIZE)), backend="gloo")
    buf = dist.tensors.to_buffer(torch.zeros(2))
    assert rt.select(Op.ALL_REDUCE, g, buf, None, core.ReduceOp.SUM).name == "gloo"
    t = torch.ones(2)
    dist.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((2,), float(SIZE)))
