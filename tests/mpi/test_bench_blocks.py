"""``mcrdl bench`` and the sweep's blocks under mpiexec: every rank runs the same blocks
(the plan is the slowest rank's), the figures are the same on every rank, the A/A
control is the policy's backend whatever the order of ``--backends``, and the JSON holds
every column of every point, the verdicts and the load. Structure only: no timing is
asserted."""
import json
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mcrdl_core as mc
from conftest import RANK, SIZE
from mcrdl_core.tools import cli, sweep

COMM = MPI.COMM_WORLD


def test_measure_rounds_is_the_same_on_every_rank():
    mc.get_runtime()
    cols = ["mpi", "auto", "mpi@2"]
    got = sweep.measure_rounds("all_reduce", 8, cols, 3)
    assert list(got) == cols
    assert all(len(t) == sweep.whole_cycles(3, 3) for t in got.values())  # whole cycles
    assert all((t > 0).all() for t in got.values())
    mine = np.stack([got[c] for c in cols])
    assert np.array_equal(mine, COMM.bcast(mine))  # the slowest rank's, everywhere


def test_send_recv_blocks_with_idle_ranks():
    """Ranks beyond the pair idle through send_recv's blocks and still agree on them."""
    mc.get_runtime()
    got = sweep.measure_rounds("send_recv", 8, ["mpi"], 2)
    assert np.array_equal(got["mpi"], COMM.bcast(got["mpi"]))


@pytest.mark.parametrize("order", [["mpi", "gloo"], ["gloo", "mpi"]])
def test_bench_control_and_json(order):
    rt = mc.get_runtime()
    if rt.unavailable_reason("gloo") is not None:
        pytest.skip(f"gloo unavailable: {rt.unavailable_reason('gloo')}")
    folder = COMM.bcast(tempfile.mkdtemp(prefix="mcrdl-bench-") if RANK == 0 else None)
    assert cli.main(["bench", "--ops", "all_reduce", "barrier", "--sizes", "8",
                     "--backends", *order, "--control", "--trials-scale", "0.05",
                     "--out", folder]) == 0
    COMM.Barrier()
    if RANK == 0:
        with open(os.path.join(folder, f"bench-n{SIZE}.json"), encoding="utf-8") as f:
            out = json.load(f)
        cols = {(r["op"], r["bytes"], r["backend"]) for r in out["rows"]}
        assert cols == {(op, b, c) for op, b in (("all_reduce", 8), ("barrier", 0))
                        for c in order + ["auto", "mpi@2"]}
        assert out["auto_vs_best"]["points"] == 2
        assert set(out["auto_vs_best"]["control"]["totals_us"]) == {"mpi", "mpi@2"}
        assert out["load"]["hosts"] and isinstance(out["load"]["warnings"], list)
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    COMM.Barrier()
