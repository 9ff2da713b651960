"""Group identity: members agree on a group whatever other ranks do.

A group's key is its member list (in the order given) and how many groups of that list
the member made before, so groups made by their members only (torch's
``use_local_synchronization``) do not shift the groups made later, and members that are
out of step (a caught error on some ranks) are told at communicator creation, on every
rank, instead of hanging inside MPI or exchanging data with the wrong group.
"""
import numpy as np
import pytest

import mcrdl_core as mc
from conftest import RANK, SIZE
from mcrdl_core.base.errors import MismatchError

needs3 = pytest.mark.skipif(SIZE < 3, reason="needs 3 ranks")


@needs3
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_groups_made_by_members_only_do_not_shift_later_groups(backend):
    ga = mc.new_group([0, 1]) if RANK in (0, 1) else None  # rank 2 does not call it
    gb = mc.new_group([2, 1])  # every rank calls it; group rank 0 is global rank 2
    if RANK in (1, 2):
        x = np.full(3, RANK + 1.0, np.float32)
        mc.all_reduce(x, group=gb, backend=backend)
        assert np.array_equal(x, np.full(3, 5.0, np.float32))
        y = np.full(2, float(RANK), np.float32)
        mc.broadcast(y, src=2, group=gb, backend=backend)
        assert np.array_equal(y, np.full(2, 2.0, np.float32))
    if ga is not None:
        z = np.full(2, RANK + 10.0, np.float32)
        mc.all_reduce(z, group=ga, backend=backend)
        assert np.array_equal(z, np.full(2, 21.0, np.float32))
    mc.barrier()


@needs3
def test_members_out_of_step_get_mismatch_error_on_every_rank():
    """Rank 1 makes [0, 1] where ranks 0 and 2 make [0, 1, 2]: making the group's
    communicator raises MismatchError on all three at once (it hung inside
    MPI_Comm_create_group, or returned wrong sums, while groups were numbered by a
    per-process counter). The failed group counts as never made, so the ranks are in
    step again afterwards."""
    if RANK >= 3:
        mc.new_group([0, 1, 2])
    else:
        with pytest.raises(MismatchError, match="creating the communicator of group|found members"):
            mc.new_group([0, 1] if RANK == 1 else [0, 1, 2])
    g = mc.new_group([0, 1, 2])
    if RANK < 3:
        x = np.ones(4, np.float32)
        mc.all_reduce(x, group=g, backend="mpi")
        assert np.array_equal(x, np.full(4, 3.0, np.float32))
    mc.barrier()  # the world is still usable


@pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
def test_members_use_new_groups_in_different_orders():
    """Rank 0 calls on ga then gb, the others on gb then ga (async): communicators are
    made in new_group, so neither first call waits for the other members' first call
    (with communicators made lazily at the first call, this timed out)."""
    ga, gb = mc.new_group([0, 1]), mc.new_group([1, 0])
    if RANK > 1:
        return
    xa, xb = np.full(2, 1.0 + RANK, np.float32), np.full(2, 10.0 + RANK, np.float32)
    calls = [(xa, ga), (xb, gb)] if RANK == 0 else [(xb, gb), (xa, ga)]
    works = [mc.all_reduce(x, group=g, async_op=True, backend="mpi") for x, g in calls]
    for w in works:
        w.wait()
    assert np.array_equal(xa, np.full(2, 3.0, np.float32))
    assert np.array_equal(xb, np.full(2, 21.0, np.float32))
