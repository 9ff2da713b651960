"""Timing helper of bench/overhead.py: every rank times each call; the figure for a
call is the slowest rank's. (`mcrdl bench` has its own interleaved sweep: sweep.py.)"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def per_call_times(fn, iters: int, warmup: int = 10) -> np.ndarray:
    """Seconds per call (max over ranks), each call timed alone after a barrier-free warm-up."""
    for _ in range(warmup):
        fn()
    COMM.Barrier()
    out = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
    worst = np.empty_like(out)
    COMM.Allreduce(out, worst, op=MPI.MAX)
    return worst

