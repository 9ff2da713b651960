"""An uneven all-to-all where one rank's own counts happen to be equal: every rank must
issue the same MPI collective (MPI_Ialltoallv), chosen by the call's form (split sizes
given), never by one rank's counts; the next collective on the group then works."""
import numpy as np
import pytest

import mcrdl_core as mc
from conftest import RANK, SIZE

INS = {0: [1, 1, 1], 1: [1, 2, 3], 2: [1, 4, 5]}
OUTS = {0: [1, 1, 1], 1: [1, 2, 4], 2: [1, 3, 5]}


@pytest.mark.skipif(SIZE != 3, reason="the split table is written for 3 ranks")
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_uneven_call_with_one_rank_locally_even(backend):
    ins, outs = INS[RANK], OUTS[RANK]
    inp = np.full(sum(ins), float(RANK), np.float32)
    out = np.zeros(sum(outs), np.float32)
    mc.all_to_all_single(out, inp, outs, ins, backend=backend)
    assert np.array_equal(out, np.concatenate([np.full(c, float(k), np.float32)
                                               for k, c in enumerate(outs)]))
    x = np.ones(3, np.float32)
    mc.all_reduce(x, backend=backend)
    assert np.array_equal(x, np.full(3, 3.0, np.float32))


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_even_form_still_exchanges_blocks(backend):
    inp = np.arange(2 * SIZE, dtype=np.float32) + 100 * RANK
    out = np.zeros(2 * SIZE, np.float32)
    mc.all_to_all_single(out, inp, backend=backend)
    assert np.array_equal(out, np.concatenate([np.arange(2 * RANK, 2 * RANK + 2, dtype=np.float32)
                                               + 100 * k for k in range(SIZE)]))
