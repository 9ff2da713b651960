"""Bad input gets a clear error before anything is sent; debug mode reports the rank
that disagrees; a wait that cannot finish raises a diagnostic instead of hanging.
After each error the next collective still works (nothing half-sent)."""
import json
import logging
import time

import numpy as np
import pytest
import torch

import mcrdl_core as core
import mcrdl_torch as dist
from conftest import GROUPS, RANK, SIZE, SUB_RANKS
from mcrdl_core.base.errors import (BackendUnavailableError, CommTimeoutError, DtypeError,
                                    InvalidArgumentError, MismatchError, TableError,
                                    UnsupportedError)
from mcrdl_core.dispatch.selection import TuningTable, table_from_env

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")


@pytest.fixture(autouse=True)
def still_works():
    yield
    t = torch.ones(3)
    dist.all_reduce(t, backend="mpi")
    assert torch.equal(t, torch.full((3,), float(SIZE)))


def test_unknown_backend_lists_available():
    with pytest.raises(BackendUnavailableError, match=r"'mpi', 'gloo'|Available here"):
        dist.all_reduce(torch.ones(2), backend="shmem")


def test_backend_that_cannot_do_it_says_which_can():
    class ToyBackend(core.Backend):  # a backend that only all-reduces float32
        name = "toy"

        def unsupported_reason(self, op, device, dtype, reduce_op=None):
            if op is not core.Op.ALL_REDUCE or dtype is not core.dtypes.float32:
                return f"toy cannot do {op} on {dtype.name}"

    core.register_backend("toy", ToyBackend)
    try:
        with pytest.raises(UnsupportedError, match=r"toy cannot do all_reduce on int32.*"
                                                   r"Backends that can: \['mpi', 'gloo'\]"):
            dist.all_reduce(torch.ones(2, dtype=torch.int32), backend="toy")
    finally:
        core.world.backend.REGISTRY.pop("toy")
        core.get_runtime()._unavailable.pop("toy", None)


def test_unsupported_dtype_and_device():
    with pytest.raises(DtypeError, match="complex64"):
        dist.all_reduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(InvalidArgumentError, match="meta"):
        dist.all_reduce(torch.ones(2, device="meta"))
    with pytest.raises(InvalidArgumentError, match="expected a torch.Tensor"):
        dist.all_reduce([1.0, 2.0])


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_reduce_op_dtype_mismatch(backend):
    with pytest.raises(UnsupportedError, match="AVG needs a floating dtype"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), dist.ReduceOp.AVG, backend=backend)
    with pytest.raises(UnsupportedError, match="BXOR is bitwise"):
        dist.all_reduce(torch.ones(2), dist.ReduceOp.BXOR, backend=backend)
    with pytest.raises(InvalidArgumentError, match="unknown reduce op"):
        dist.all_reduce(torch.ones(2), "median", backend=backend)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_mismatched_list_sizes(backend):
    n = SIZE
    outs = [torch.zeros(4) for _ in range(n)]
    outs[-1] = torch.zeros(5)
    with pytest.raises(InvalidArgumentError, match=r"tensor_list\[%d\] has 5 elements" % (n - 1)):
        dist.all_gather(outs, torch.ones(4), backend=backend)
    with pytest.raises(InvalidArgumentError, match="one per rank"):
        dist.all_gather([torch.zeros(4)] * (n + 1), torch.ones(4), backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"input_list\[%d\] has 5" % (n - 1)):
        dist.reduce_scatter(torch.zeros(4), outs, backend=backend)
    with pytest.raises(InvalidArgumentError, match="output_tensor has"):
        dist.all_gather_into_tensor(torch.zeros(4 * n + 1), torch.ones(4), backend=backend)
    with pytest.raises(InvalidArgumentError, match="dtypes differ"):
        dist.all_gather_into_tensor(torch.zeros(4 * n, dtype=torch.int32), torch.ones(4),
                                    backend=backend)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_wrong_split_sums(backend):
    n = SIZE
    with pytest.raises(InvalidArgumentError, match=r"sum to .* but dim 0 of the tensor is"):
        dist.all_to_all_single(torch.zeros(n), torch.ones(n), [1] * n, [2] * n, backend=backend)
    with pytest.raises(InvalidArgumentError, match="split sizes for a group of"):
        dist.all_to_all_single(torch.zeros(n), torch.ones(n), [1] * (n + 1), None,
                               backend=backend)
    if n > 1:
        with pytest.raises(InvalidArgumentError, match="not divisible by the group size"):
            dist.all_to_all_single(torch.zeros(n + 1), torch.ones(n + 1), backend=backend)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_non_contiguous_or_read_only_output(backend):
    with pytest.raises(InvalidArgumentError, match="not contiguous.*contiguous\\(\\)"):
        dist.all_reduce(torch.zeros(4, 4).t(), backend=backend)
    ro = np.ones(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        core.all_reduce(ro, backend=backend)
    # a non-contiguous *input* is fine: it is copied
    out = torch.zeros(SIZE * 4)
    x = torch.arange(8.0).reshape(4, 2)[:, 0]
    dist.all_gather_into_tensor(out, x, backend=backend)
    assert torch.equal(out, x.repeat(SIZE))


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_ranks_outside_group(backend):
    with pytest.raises(InvalidArgumentError, match="src 5 is not in group 'world'"):
        dist.broadcast(torch.ones(2), src=5, backend=backend)
    with pytest.raises(InvalidArgumentError, match="dst -1 is not in"):
        dist.send(torch.ones(2), -1, backend=backend)
    with pytest.raises(InvalidArgumentError, match="outside the world"):
        dist.new_group([0, SIZE + 3])
    sub, ranks = GROUPS["sub"], SUB_RANKS
    if RANK not in ranks:
        with pytest.raises(InvalidArgumentError, match="not a member"):
            dist.all_reduce(torch.ones(2), group=sub, backend=backend)
    elif SIZE == 3:
        with pytest.raises(InvalidArgumentError, match="src 1 is not in group"):
            dist.broadcast(torch.ones(2), src=1, group=sub, backend=backend)


def test_malformed_table_files(tmp_path, caplog):
    cases = {
        "corrupt.json": "{not json",
        "truncated.json": '{"schema": "mcrdl.tuning/1", "entries": [{"op": "all_re',
        "schema.json": json.dumps({"schema": "mcrdl.tuning/0", "entries": []}),
        "ranges.json": json.dumps({"schema": "mcrdl.tuning/1", "entries": [
            {"op": "all_reduce", "world_size": 2, "device": "cpu", "dtype_class": "float",
             "ranges": [[4096, "mpi"], [1024, "gloo"]]}]}),
    }
    reasons = {"corrupt.json": "not valid JSON", "truncated.json": "not valid JSON",
               "schema.json": "schema is 'mcrdl.tuning/0'", "ranges.json": "must increase"}
    for name, text in cases.items():
        p = tmp_path / f"r{RANK}-{name}"
        p.write_text(text)
        with pytest.raises(TableError, match=f"{p}.*{reasons[name]}"):
            TuningTable.load(str(p))
    with pytest.raises(TableError, match="cannot read"):
        TuningTable.load(str(tmp_path / "missing.json"))
    # from the environment: a warning naming the file, and the policy carries on
    bad = tmp_path / f"r{RANK}-corrupt.json"
    mp = pytest.MonkeyPatch()
    mp.setenv("MCRDL_TUNING_TABLE", str(bad))
    with caplog.at_level(logging.WARNING, logger="mcrdl.selection"):
        assert table_from_env() is None
    mp.undo()
    assert str(bad) in caplog.text and "default policy" in caplog.text


@needs2
def test_timeout_names_op_group_backend_rank():
    t = torch.ones(2)
    if RANK == 0:
        w = dist.all_reduce(t, async_op=True, backend="mpi")
        with pytest.raises(CommTimeoutError, match=r"rank 0: all_reduce on group 'world' .* "
                                                   r"via backend 'mpi' did not complete within 0.3 s"):
            w.wait(timeout=0.3)
        w.wait()  # the others join late; the work is still valid
    else:
        time.sleep(1.0)
        dist.all_reduce(t, backend="mpi")
    assert torch.equal(t, torch.full((2,), float(SIZE)))


@needs2
class TestDebugMode:
    @pytest.fixture(autouse=True)
    def debug(self):
        rt = core.get_runtime()
        rt.debug = True
        yield
        rt.debug = False

    @pytest.mark.parametrize("backend", ["mpi", "gloo"])
    def test_shape_mismatch_names_rank(self, backend):
        t = torch.ones(5 if RANK == 1 else 4)
        with pytest.raises(MismatchError, match=r"group rank 1 \(global 1\) has elements per "
                                                r"rank 5 where group rank 0 has 4"):
            dist.all_reduce(t, backend=backend)

    def test_dtype_and_backend_mismatch(self):
        t = torch.ones(4, dtype=torch.float64 if RANK == 1 else torch.float32)
        with pytest.raises(MismatchError, match="has dtype float64 where group rank 0 has float32"):
            dist.all_reduce(t, backend="mpi")
        with pytest.raises(MismatchError, match="has backend gloo where group rank 0 has mpi"):
            dist.all_reduce(torch.ones(4), backend="gloo" if RANK == 1 else "mpi")

    def test_root_mismatch(self):
        with pytest.raises(MismatchError, match="has root"):
            dist.broadcast(torch.ones(4), src=min(RANK, 1), backend="mpi")

    def test_inconsistent_splits(self):
        n = SIZE
        ins = [1] * n
        outs = [1] * n
        if RANK == 0:
            ins = [2] + [1] * (n - 1)  # sends 2 to itself: fine; but says 2 to... itself
            outs = [1] * n             # while expecting 1 from itself: inconsistent
        with pytest.raises(MismatchError, match="group rank 0 sends 2 elements to group rank 0, "
                                                "which expects 1"):
            dist.all_to_all_single(torch.zeros(sum(outs)), torch.ones(sum(ins)), outs, ins,
                                   backend="mpi")

    def test_consistent_call_passes(self):
        t = torch.ones(4)
        dist.all_reduce(t, backend="gloo")
        assert torch.equal(t, torch.full((4,), float(SIZE)))
