"""Deadlock freedom when libraries are mixed (world size 2; other sizes skip).

Rank 0 posts a large MPI isend to rank 1, then a blocking Gloo all-reduce. Rank 1 does
a blocking MPI recv, then the same all-reduce. MPICH moves a large message only while
the sender calls into MPI, so:

- naive: rank 0 blocks inside Gloo (torch's Work.wait), never calls MPI again, rank 1
  never leaves its recv, never joins the all-reduce: rank 0's wait can only time out;
- MCR-DL: rank 0's wait for the all-reduce polls the MPI request as well, the message
  moves, rank 1 joins, and both finish.

On one node MPICH would otherwise move a large message by a single copy (Linux CMA)
that the receiver performs alone; the launcher (test_multirank.py) sets
MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD high so that the message takes the pipelined
shared-memory path, which, like network transports, needs the sender to progress.
"""
import datetime
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as tdist
from mpi4py import MPI

import mcrdl_core
import mcrdl_torch as dist
from conftest import RANK, SIZE

pytestmark = [
    pytest.mark.skipif(SIZE != 2, reason="the scenario is written for 2 ranks"),
    pytest.mark.skipif(os.environ.get("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD") is None,
                       reason="set MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD=2147483647 (as "
                              "test_multirank.py does), else MPICH's receiver copies alone"),
]
NBYTES = 64 << 20  # far above MPICH's eager limit: needs sender-side progress
NAIVE_TIMEOUT_S = 5.0


def test_naive_waiting_in_one_library_hangs():
    """Raw mpi4py + raw Gloo, each waited in its own library: rank 0's Gloo wait times out."""
    rt = mcrdl_core.get_runtime()
    gloo = rt.backend("gloo")
    opts = tdist.ProcessGroupGloo._Options()
    opts._devices = [gloo._device()]
    opts._timeout = datetime.timedelta(seconds=NAIVE_TIMEOUT_S)
    pg = tdist.ProcessGroupGloo(tdist.PrefixStore("naive", gloo.store()), RANK, SIZE, opts)
    comm = MPI.COMM_WORLD.Dup()
    comm.Barrier()
    big = np.ones(NBYTES, dtype=np.uint8) if RANK == 0 else np.zeros(NBYTES, dtype=np.uint8)
    t = torch.ones(4)
    start = time.perf_counter()
    if RANK == 0:
        req = comm.Isend(big, dest=1, tag=7)
        with pytest.raises(RuntimeError, match="(?i)timed? ?out"):
            pg.allreduce([t]).wait()  # blocks inside Gloo; MPI gets no progress
        hung_for = time.perf_counter() - start
        req.Wait()  # now MPI progresses; rank 1's recv can finish
        assert hung_for >= NAIVE_TIMEOUT_S * 0.9
    else:
        comm.Recv(big, source=0, tag=7)
        recv_done = time.perf_counter() - start
        # the message only arrived once rank 0 had given up on Gloo and called MPI
        assert recv_done >= NAIVE_TIMEOUT_S * 0.9, f"recv finished after {recv_done:.2f} s"
        assert big[0] == 1 and big[-1] == 1
        with pytest.raises(RuntimeError):  # rank 0 is gone from this all-reduce
            pg.allreduce([t]).wait()
    comm.Barrier()
    comm.Free()


def test_runtime_wait_does_not_hang():
    """The same program through MCR-DL completes, well inside the naive timeout."""
    big = torch.ones(NBYTES, dtype=torch.uint8) if RANK == 0 else torch.zeros(NBYTES, dtype=torch.uint8)
    t = torch.full((4,), float(RANK + 1))
    dist.barrier(backend="mpi")
    start = time.perf_counter()
    if RANK == 0:
        w = dist.isend(big, 1, backend="mpi")
        dist.all_reduce(t, backend="gloo")
        w.wait()
    else:
        dist.recv(big, 0, backend="mpi")
        dist.all_reduce(t, backend="gloo")
        assert int(big[0]) == 1 and int(big[-1]) == 1
    elapsed = time.perf_counter() - start
    assert torch.equal(t, torch.full((4,), 3.0))
    assert elapsed < NAIVE_TIMEOUT_S, f"took {elapsed:.2f} s"
