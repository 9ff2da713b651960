"""Timing helpers of bench/: every rank times each call (per_call_times) or blocks of
calls interleaved in a Williams design (interleaved_batches: overhead.py,
cross_framework.py, ...); the figure is the slowest rank's. The blocks are those of
`mcrdl bench` and `mcrdl tune` (mcrdl_core/tools/sweep.py), with the calls per block
chosen by the caller."""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mcrdl_core.tools.sweep import (block_plan, collector_off, round_order, timed_blocks,
                                    whole_cycles)

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
    return round_order(k, whole_cycles(k, rounds))


def interleaved_batches(fns, calls, rounds: int, discard=None) -> np.ndarray:
    """Seconds per call, shape (len(fns), rounds'), rounds' >= ``rounds``: in each round
    every function runs one block, in the order of a Williams design (williams_order;
    the same on every rank): an MPI barrier, ``discard[i]`` untimed calls, then
    ``calls[i]`` timed back to back, the collector off (``mcrdl tune``'s blocks:
    sweep.timed_blocks). A block's figure is its timed calls' time / ``calls[i]``, the
    slowest rank's (max over ranks). ``discard``: a count per function; by default
    ``sweep.block_plan``'s (calls enough to last ``sweep.DISCARD_S``, from the slowest
    rank's time of a call after a warm-up one). Why: the first calls after the barrier
    pay for its skew, cold caches and what the previous function's library left running
    (Gloo's threads); the design only spreads such costs evenly, it does not remove
    them."""
    def barrier():
        COMM.Barrier()

    def slowest(a):
        COMM.Allreduce(MPI.IN_PLACE, a, op=MPI.MAX)

    order = williams_order(len(fns), rounds)
    with collector_off():
        if discard is None:
            discard = [d for d, _ in block_plan(fns, 1, barrier, slowest)]
        out = timed_blocks(fns, order, list(zip(discard, calls)), barrier)
    slowest(out)
    return out
