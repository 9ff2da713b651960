"""Single-process tests: the import guard, Buffers over DLPack, the tuning table's
lookup and validation, and selection precedence."""
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from mcrdl_core.memory import alloc
from mcrdl_core import dtypes as dt
from mcrdl_core.memory.buffer import Buffer, as_buffer
from mcrdl_core.base.errors import DtypeError, InvalidArgumentError, TableError
from mcrdl_core.dispatch.selection import TuningTable, parse_override


def test_core_imports_no_framework():
    code = ("import sys, numpy as np, mcrdl_core, mcrdl_backends.mpi\n"
            "b = mcrdl_core.as_buffer(np.ones(3))\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'jaxlib', 'cupy')]\n"
            "assert not bad, bad\nprint('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr


@pytest.mark.parametrize("tdtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                    torch.int8, torch.uint8, torch.int32, torch.int64])
def test_buffer_from_torch_dlpack_is_zero_copy(tdtype):
    t = torch.arange(12).to(tdtype).reshape(3, 4)
    b = Buffer.from_dlpack(t)
    assert b.shape == (3, 4) and b.ptr == t.data_ptr() and b.nbytes == t.numel() * t.element_size()
    assert b.dtype.name == str(tdtype).split(".")[-1]
    h = b.host()
    np.testing.assert_array_equal(h.astype(np.float64), t.double().numpy())
    h[0, 0] = 7  # writes land in the tensor: same memory
    assert t[0, 0].item() == 7


def test_buffer_strides_span_and_lifetime():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = as_buffer(t.t())
    assert b.shape == (4, 3) and b.strides == (1, 4) and not b.is_contiguous
    assert b.span() == (t.data_ptr(), t.data_ptr() + 48)
    view = b.host()
    del t, b  # the view keeps the producer's memory alive
    assert view[3, 2] == 11.0


@pytest.mark.parametrize("tdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [Buffer.from_dlpack, as_buffer,
                                  lambda t: as_buffer(t).flat(1, 2)])
def test_buffer_host_view_does_not_keep_its_tensor_forever(tdtype, make):
    """A Buffer caches its host view, whose base keeps the memory's owner alive. The
    view must not hold the Buffer itself: NumPy arrays are invisible to the garbage
    collector, so that cycle was never freed and every tensor a compressed call viewed
    leaked (17 MB per all-to-all call in the DLRM app)."""
    import gc
    import weakref

    t = torch.arange(6, dtype=torch.float32).to(tdtype)
    gone = weakref.ref(t)
    b = make(t)
    view = b.host()
    assert float(view[-1]) == (5.0 if b.numel == 6 else 2.0)
    del t
    assert gone() is not None  # the Buffer (and its view) still need the memory
    del b
    assert gone() is not None  # the view alone keeps it too
    del view
    gc.collect()
    assert gone() is None


def test_buffer_refuses_strides_that_are_not_whole_elements():
    raw = np.zeros(16, np.uint8)
    odd = np.ndarray((3,), np.float32, buffer=raw, strides=(5,))  # 5-byte steps
    with pytest.raises(InvalidArgumentError, match=r"np\.ascontiguousarray"):
        Buffer.from_numpy(odd)
    assert Buffer.from_numpy(np.zeros(8, np.float32)[::2]).strides == (2,)


def test_buffer_numpy_bfloat16_and_readonly():
    a = np.arange(4).astype(ml_dtypes.bfloat16)
    b = as_buffer(a)
    assert b.dtype is dt.bfloat16 and b.host().dtype == ml_dtypes.bfloat16
    a.flags.writeable = False
    assert as_buffer(a).readonly
    ro = np.ones(3)
    ro.flags.writeable = False
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":  # versioned DLPack carries the flag
        assert Buffer.from_dlpack(ro).readonly
    assert Buffer.from_dlpack(np.ones(3)).readonly is False


def test_buffer_flat_views_and_empty():
    b = alloc.empty((6,), "int32")
    b.host()[:] = np.arange(6)
    v = b.flat(2, 3)
    np.testing.assert_array_equal(v.host(), [2, 3, 4])
    with pytest.raises(ValueError, match="outside"):
        b.flat(4, 3)


def test_unsupported_dtypes_raise():
    with pytest.raises(DtypeError, match="unknown dtype"):
        dt.lookup("float8")
    with pytest.raises(DtypeError, match="lanes"):
        dt.from_dlpack_code(dt.DL_FLOAT, 32, 4)


def _table(ranges, op="all_reduce", world=2):
    return {"schema": "mcrdl.tuning/1", "entries": [
        {"op": op, "world_size": world, "device": "cpu", "dtype_class": "float",
         "ranges": ranges}]}


def test_table_lookup_at_range_edges():
    t = TuningTable(_table([[1024, "mpi"], [65536, "gloo"], [None, "mpi"]]))
    look = lambda b: t.lookup("all_reduce", 2, "cpu", "float", b)  # noqa: E731
    assert [look(0), look(1024), look(1025), look(65536), look(65537), look(1 << 40)] == \
           ["mpi", "mpi", "gloo", "gloo", "mpi", "mpi"]
    assert look(None) == "mpi"  # uneven all-to-all: the largest range
    assert t.lookup("all_reduce", 3, "cpu", "float", 8) is None  # other world size: miss
    assert t.lookup("all_gather", 2, "cpu", "float", 8) is None
    bounded = TuningTable(_table([[1024, "gloo"]]))
    assert bounded.lookup("all_reduce", 2, "cpu", "float", 1025) is None  # past the last bound


@pytest.mark.parametrize("bad, reason", [
    ([], "no ranges"),
    ([[None, "mpi"], [10, "gloo"]], "null only last"),
    ([[10, "mpi"], [10, "gloo"]], "must increase"),
    ([[10]], r"expected \[max_bytes or null, backend\]"),
    ([["10", "mpi"]], "expected"),
])
def test_table_validation(bad, reason, tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(_table(bad)))
    with pytest.raises(TableError, match=f"{p}.*{reason}"):
        TuningTable.load(str(p))


def test_table_field_errors():
    with pytest.raises(TableError, match="field 'world_size'"):
        TuningTable({"schema": "mcrdl.tuning/1", "entries": [{"op": "x"}]})
    with pytest.raises(TableError, match="'entries' must be a list"):
        TuningTable({"schema": "mcrdl.tuning/1"})


def test_override_parsing():
    assert parse_override("mpi") == {"*": "mpi"}
    assert parse_override("all_reduce=gloo, all_to_all=mpi") == {"all_reduce": "gloo",
                                                                  "all_to_all": "mpi"}
    assert parse_override("") == {}
