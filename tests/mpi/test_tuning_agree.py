"""Every rank reaches the same tuning decisions: rank 0 decides and broadcasts, even when
the ranks' own figures differ; ``mcrdl tune`` (a tiny grid, its verification pass
included) leaves one table that every rank reads alike; the stale-table report says
on which ranks an entry is off. No timing is asserted."""
import json
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mcrdl_core as mc
from conftest import RANK, SIZE
from mcrdl_core.tools import cli, tuning
from mcrdl_core.observe.logger import CommLogger
from mcrdl_core.dispatch.selection import TuningTable
from mcrdl_core.tools.stragglers import stale_ranks

COMM = MPI.COMM_WORLD
KEY = ("all_reduce", SIZE, 1, "cpu", "float")


def agreed(value) -> bool:
    return len(set(COMM.allgather(json.dumps(value, sort_keys=True)))) == 1


def own_figures():
    """Per-round figures that differ per rank: on rank r gloo looks 3x faster at the
    (r % 3)-th size, so a rank deciding alone would choose differently."""
    rng = np.random.default_rng(RANK)
    out = {}
    for i, s in enumerate((64, 1024, 16384)):
        mpi = 1e-4 * np.exp(rng.normal(0, 0.05, 30))
        out[s] = {"mpi": mpi, "gloo": mpi * (0.3 if i == RANK % 3 else 1.5)}
    return out


def test_decisions_are_rank_zeros():
    rt = mc.get_runtime()
    table = tuning.on_root(rt, lambda: tuning.merge_table(
        None, tuning.build_entries({KEY: own_figures()}), tuning.fingerprint()))
    assert agreed(table["entries"])
    if RANK == 0:
        assert table["entries"][0]["ranges"] == [[64, "gloo"], [None, "mpi"]]


def test_remeasured_points_are_rank_zeros_choice():
    """Ranks whose figures would pick different points to measure again all measure
    rank 0's, in the same order (else their collectives would not line up)."""
    rt = mc.get_runtime()
    mpi = np.full(12, 1e-4)
    gloo = mpi * 0.8
    gloo[:3] *= 1.5  # 9 of 12 rounds: undecided
    res = {"all_reduce": {s: {"mpi": mpi.copy(), "gloo": (gloo if s == 4 << RANK else mpi).copy()}
                          for s in (4, 8, 16, 32)}}
    log = []

    def measure(op, size, cols, n):
        log.append((op, size, n))
        return {c: res[op][size][c][:n] for c in cols}
    tuning.remeasure_undecided(rt, res, "cpu", measure, passes=1)
    assert log == [("all_reduce", 4, 12)] and agreed(log)


def test_stale_report_names_the_ranks():
    pts = [{"bytes": 4096, "auto": "mpi", "auto_s": 1e-4, "single_s": {"mpi": 1e-4, "gloo": 3e-4},
            "rounds": 30, "verdict": "ok", "against": None, "ratio": None}]
    table = TuningTable({"schema": "mcrdl.tuning/2", "machine": tuning.fingerprint(),
                         "entries": [{"op": "all_reduce", "world_size": SIZE, "hosts": 1,
                                      "device": "cpu", "dtype_class": "float",
                                      "ranges": [[None, "mpi"]],
                                      "verification": {"when": "t", "points": pts}}]})
    lg = CommLogger()
    for _ in range(25):  # the last rank runs 5x slower than verified
        lg.record("all_reduce", 4096, "mpi", SIZE, 5e-4 if RANK == SIZE - 1 else 1.1e-4)
    rows = stale_ranks(log=lg, table=table)
    assert agreed(rows)
    if SIZE > 1:
        assert [(r["op"], r["bytes"], r["flagged_on"]) for r in rows] == \
            [("all_reduce", 4096, [SIZE - 1])]


@pytest.fixture(scope="module")
def tuned():
    if SIZE > 2:
        # the 2-rank launch runs it, and test_multirank.py / test_cluster.py run
        # `mcrdl tune` on 4 ranks of 2 emulated hosts; at 3 ranks the tune and its
        # verification pass took 15 s of the 2-core machine's suite
        pytest.skip("mcrdl tune agreement runs in the 2-rank launch")
    folder = COMM.bcast(tempfile.mkdtemp(prefix="mcrdl-agree-") if RANK == 0 else None)
    path = os.path.join(folder, "tuning.json")
    rt = mc.get_runtime()
    before = rt.table
    assert cli.main(["tune", "--sizes", "4", "4K", "--ops", "all_reduce", "send_recv",
                     "--trials-scale", "0.05", "-o", path]) == 0
    COMM.Barrier()
    yield path
    assert rt.table is before  # tune leaves the table in force as it found it
    COMM.Barrier()
    if RANK == 0:
        os.remove(path)
        os.rmdir(folder)


def test_tune_writes_one_verified_table_every_rank_reads_alike(tuned):
    table = TuningTable.load(tuned)
    assert agreed(table.data["entries"])
    assert {e["op"] for e in table.data["entries"]} == {"all_reduce", "send", "recv"}
    for e in table.data["entries"]:
        assert e["measured"]["sizes"] == [4, 4096]
        v = e["verification"]
        assert v["points"] and all(p["verdict"] in ("ok", "lost", "unsure") for p in v["points"])
    load = table.data["machine"]["load"]
    assert load["hosts"] and isinstance(load["warnings"], list)
    for size in (4, 4096):  # the same choice on every rank
        assert agreed(table.lookup("all_reduce", SIZE, "cpu", "float", size))


def test_verify_only_rewrites_nothing(tuned):
    before = open(tuned, encoding="utf-8").read() if RANK == 0 else None
    status = cli.main(["tune", "--verify", "--ops", "all_reduce", "--trials-scale", "0.05",
                       "-o", tuned])
    assert status in (0, 1) and agreed(status)
    if RANK == 0:
        assert open(tuned, encoding="utf-8").read() == before
