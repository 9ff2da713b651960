"""``mcrdl tune --compression int8`` on a tiny size grid, then ``auto:int8`` calls that
follow the table it wrote: a valid table, one choice on every rank, results equal to
NumPy within the codec's bound (whichever variant won: the timings are not asserted).
Then the same table with its compressed ranges edited to name a variant, so that the
table's backend and algorithm are seen to be the ones that run."""
import json
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mcrdl_core as mc
from conftest import RANK, SIZE
from mcrdl_core.tools import cli
from mcrdl_core.compress import auto
from mcrdl_core.dispatch.selection import TuningTable
from test_compress import data, local_round_trip, rel

pytestmark = pytest.mark.skipif(SIZE < 2, reason="one rank compresses nothing")
SIZES = (4 << 10, 256 << 10)  # bytes per rank
BOUND = 9.5e-3  # int8: relative L2 of one round trip on N(0, 1) data (measured x ~1.3)


def agreed(value) -> bool:
    return len(set(MPI.COMM_WORLD.allgather(value))) == 1


def _tuned(*ops):
    """The table ``mcrdl tune --compression int8 --ops OPS`` writes (rank 0) into a
    shared path, in force for the module's tests (the runtime's table is put back)."""
    folder = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mcrdl-tune-") if RANK == 0 else None)
    path = os.path.join(folder, "tuning.json")
    assert cli.main(["tune", "--compression", "int8", "--sizes", *map(str, SIZES),
                     "--ops", *ops, "--trials-scale", "0.05", "-o", path]) == 0
    MPI.COMM_WORLD.Barrier()
    table = TuningTable.load(path)
    rt = mc.get_runtime()
    before = rt.table
    yield rt, table
    rt.set_table(before)
    MPI.COMM_WORLD.Barrier()
    if RANK == 0:
        os.remove(path)
        os.rmdir(folder)


@pytest.fixture(scope="module")
def tuned():
    yield from _tuned("all_gather", "reduce_scatter")


def check_calls(salt):
    """auto:int8 all-gather and reduce-scatter at every tuned size, against NumPy;
    returns what auto chose per (op, size) (the same on every rank, asserted)."""
    picks = {}
    for nbytes in SIZES:
        n = nbytes // 4
        x = data(RANK, n, salt)
        out = np.empty(SIZE * n, np.float32)
        mc.all_gather_into_tensor(out, x, compression="auto:int8")
        exact = np.concatenate([data(k, n, salt) for k in range(SIZE)])
        assert rel(out, exact) < BOUND, nbytes
        big = data(RANK, SIZE * n, salt + 1)
        mine = np.empty(n, np.float32)
        mc.reduce_scatter_tensor(mine, big, compression="auto:int8")
        total = sum(data(k, SIZE * n, salt + 1).astype(np.float64) for k in range(SIZE))
        assert rel(mine, total[RANK * n:(RANK + 1) * n]) < BOUND * (SIZE - 1), nbytes
        for op in ("all_gather", "reduce_scatter"):
            picks[(op, nbytes)] = auto.describe("auto:int8", op, SIZE, n)
            assert agreed(picks[(op, nbytes)]), picks
    return picks


def test_tune_writes_compressed_candidates_and_auto_follows_them(tuned):
    rt, table = tuned
    assert agreed(json.dumps(table.data["entries"], sort_keys=True))
    hosts = rt.bootstrap.hosts_in(range(SIZE))
    for op in ("all_gather", "reduce_scatter"):
        entry = [e for e in table.data["entries"] if e["op"] == op][0]
        assert entry["compressed"]["codecs"] == ["int8"]
        assert all("+" not in b for _, b in entry["ranges"])  # plain calls stay plain
        for _, variants in entry["compressed"]["ranges"]:
            assert all(v.split("+")[1].split("@")[0] == "int8" for v in variants)
        assert table.lookup_compressed(op, SIZE, "cpu", "float", SIZES[1], hosts) is not None
    rt.set_table(table)
    picks = check_calls(salt=1)
    for (op, nbytes), pick in picks.items():
        codecs, variants = table.lookup_compressed(op, SIZE, "cpu", "float", nbytes, hosts)
        want = f"int8@{variants[0][2]} on {variants[0][0]}" if variants else "plain"
        assert pick == want, (op, nbytes, variants)


def test_variants_named_by_the_table_are_the_ones_that_run(tuned):
    rt, table = tuned
    data_ = json.loads(json.dumps(table.data))
    for e in data_["entries"]:
        chosen = "gloo+int8@ring" if e["op"] == "all_gather" else "mpi+int8@a2a"
        e["compressed"]["ranges"] = [[SIZES[0], []], [None, [chosen]]]
    rt.set_table(TuningTable(data_))
    picks = check_calls(salt=2)
    assert picks == {("all_gather", SIZES[0]): "plain", ("reduce_scatter", SIZES[0]): "plain",
                     ("all_gather", SIZES[1]): "int8@ring on gloo",
                     ("reduce_scatter", SIZES[1]): "int8@a2a on mpi"}
    n = SIZES[1] // 4
    x = data(RANK, n, 3)
    out = np.empty(SIZE * n, np.float32)
    mc.all_gather_into_tensor(out, x, compression="auto:int8")
    for k in range(SIZE):  # one int8 encoding per block: bit-identical to a round trip
        assert np.array_equal(out[k * n:(k + 1) * n], local_round_trip("int8", data(k, n, 3)))


@pytest.fixture(scope="module")
def tuned_a2a():
    """The compressed all-to-all measured as a candidate (issue 25 item 3)."""
    yield from _tuned("all_to_all")


def test_tune_measures_the_compressed_all_to_all_and_auto_follows_it(tuned_a2a):
    rt, table = tuned_a2a
    assert agreed(json.dumps(table.data["entries"], sort_keys=True))
    entry = [e for e in table.data["entries"] if e["op"] == "all_to_all"][0]
    assert entry["compressed"]["codecs"] == ["int8"]
    for _, variants in entry["compressed"]["ranges"]:
        assert all(v.endswith("+int8@a2a") for v in variants), variants
    # the table edited to name the compressed variant above the small size: the even
    # call of the large size and every uneven call (the largest range) compress, with
    # each block bit-identical to its sender's local round trip
    data_ = json.loads(json.dumps(table.data))
    data_["entries"][data_["entries"].index(entry)]["compressed"]["ranges"] = \
        [[SIZES[0], []], [None, ["gloo+int8@a2a"]]]
    rt.set_table(TuningTable(data_))
    for nbytes, want in ((SIZES[0], "plain"), (SIZES[1], "int8@a2a on gloo")):
        n = nbytes // 4 // SIZE  # elements per peer: the selection size is the whole input
        x = data(RANK, SIZE * n, 4)
        out = np.empty_like(x)
        mc.all_to_all_single(out, x, compression="auto:int8")
        for k in range(SIZE):
            block = data(k, SIZE * n, 4)[RANK * n:(RANK + 1) * n]
            got = out[k * n:(k + 1) * n]
            if want == "plain":
                assert np.array_equal(got, block), nbytes
            else:
                assert np.array_equal(got, local_round_trip("int8", block)), nbytes
    splits = [3 + k for k in range(SIZE)]  # uneven: rank k gets 3 + k rows from each
    x = data(RANK, sum(splits), 5)
    out = np.empty((3 + RANK) * SIZE, np.float32)
    mc.all_to_all_single(out, x, [3 + RANK] * SIZE, splits, compression="auto:int8")
    offs = np.cumsum([0] + splits)
    for k in range(SIZE):
        block = data(k, sum(splits), 5)[offs[RANK]:offs[RANK + 1]]
        assert np.array_equal(out[k * (3 + RANK):(k + 1) * (3 + RANK)],
                              local_round_trip("int8", block))
