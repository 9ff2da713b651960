"""Timing helpers of bench/: every rank times each call (overhead.py) or each batch of
calls (cross_framework.py); the figure is the slowest rank's. (`mcrdl bench` has its
own interleaved sweep: mcrdl_core/tools/sweep.py.)"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mcrdl_core.tools.sweep import round_order

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



def williams_order(k: int, rounds: int) -> list[list[int]]:
    """At least ``rounds`` rounds (whole squares), each running all ``k`` functions once:
    the rows of ``mcrdl tune``'s Williams design (``sweep.round_order``: a balanced Latin
    square, and its mirror when k is odd), so that over every 2k rounds (k rounds for
    even k) each function runs at each position equally often and directly follows every
    other one equally often. Every function's batches are spread evenly over the run, so
    slow drifts of the machine fall on all alike."""
    period = k if k % 2 == 0 else 2 * k
    return round_order(k, period * -(-max(rounds, 1) // period))


def interleaved_batches(fns, calls, rounds: int, settle_s: float = 2e-4) -> np.ndarray:
    """Seconds per call, shape (len(fns), rounds'), rounds' >= ``rounds``: in each round
    every function runs one batch of ``calls[i]`` back-to-back calls, in the order of a
    Williams design (williams_order; the same on every rank), an MPI barrier before
    each batch, the collector off. A batch's figure is its time / its calls, the
    slowest rank's (max over ranks)."""
    import gc

    order = williams_order(len(fns), rounds)
    out = np.zeros((len(fns), len(order)))
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        for r, row in enumerate(order):
            for i in row:
                fn, k = fns[i], calls[i]
                time.sleep(settle_s)  # let the previous library's helper threads go idle
                COMM.Barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                out[i, r] = (time.perf_counter() - t0) / k
    finally:
        if was_on:
            gc.enable()
    worst = np.empty_like(out)
    COMM.Allreduce(out, worst, op=MPI.MAX)
    return worst
