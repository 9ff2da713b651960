"""What biases a sweep's columns: the experiment behind the blocks of `mcrdl tune` and
`mcrdl bench` (mcrdl_core/tools/sweep.py, docs/tuning.md "Measuring").

    mpiexec -n 2 .venv/bin/python bench/column_bias.py [--op all_reduce] [--bytes 8]

1. **What a call leaves for the next one.** The mpi and auto calls are timed one by one
   (slowest rank, median over 60 repetitions) right after a barrier, after the barrier
   following a pause (0.2 ms, the old sweep's settle; 2 ms), and after one or ten Gloo
   calls: the first calls pay for the ranks' skew, cold caches and Gloo's threads.
2. **Old design against blocks.** Columns mpi, gloo, auto and the A/A control mpi@2 in
   the same Williams rounds, measured as the old sweep did (one call per column per
   round, a 0.2 ms pause and a barrier before each) and as blocks (the sweep's
   ``measure_rounds``). Under a table that runs mpi everywhere (``--table``, default the
   one in force), auto/mpi and mpi@2/mpi should read 1.00; the ratio of medians is
   printed per design.

Run it on a quiet machine (the load average is printed); figures under load describe
the load.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from mcrdl_core.dispatch import api
from mcrdl_core.dispatch.runtime import init
from mcrdl_core.tools import sweep

COMM = MPI.COMM_WORLD


def trace(fn, before, pause_s: float, calls: int = 12, reps: int = 60) -> np.ndarray:
    """Median (over ``reps``) of the slowest rank's time of each of ``calls`` calls made
    right after ``before()``, a pause and a barrier."""
    t = np.zeros((reps, calls))
    with sweep.collector_off():
        for r in range(reps):
            before()
            if pause_s:
                time.sleep(pause_s)
            COMM.Barrier()
            for i in range(calls):
                t0 = time.perf_counter()
                fn()
                t[r, i] = time.perf_counter() - t0
    COMM.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return np.median(t, axis=0)


def old_design(fns, rounds: int, pause_s: float = 2e-4) -> np.ndarray:
    """Seconds per call (slowest rank), one call per column per round after a pause and
    a barrier: the sweep before blocks."""
    def barrier():
        time.sleep(pause_s)
        COMM.Barrier()

    order = sweep.round_order(len(fns), sweep.whole_cycles(len(fns), rounds))
    with sweep.collector_off():
        t = sweep.timed_blocks(fns, order, [(0, 1)] * len(fns), barrier)
    COMM.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="all_reduce", choices=sweep.HIER_OPS + (
        "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "barrier"))
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=120, help="rounds of part 2's old design")
    args = ap.parse_args()
    rt = init()
    say = print if rt.rank == 0 else (lambda *a, **k: None)
    say(f"{args.op} {args.bytes} B, {rt.world_size} ranks, load average "
        f"{os.getloadavg()[0]:.2f}; table: {getattr(rt.table, 'path', None)}")
    mk = {b: sweep.make_call(args.op, args.bytes, b) for b in ("mpi", "gloo", "auto")}
    for fn in mk.values():
        for _ in range(5):
            fn()

    def none():
        pass

    def gloo_times(n):
        def run():
            for _ in range(n):
                mk["gloo"]()
        return run

    say("\n1. µs per call, calls 1-12 after the barrier (slowest rank, median of 60):")
    for label, before, pause in (("barrier", none, 0), ("0.2 ms pause", none, 2e-4),
                                 ("2 ms pause", none, 2e-3), ("1 gloo call", gloo_times(1), 0),
                                 ("10 gloo calls", gloo_times(10), 0)):
        for b in ("mpi", "auto"):
            m = trace(mk[b], before, pause) * 1e6
            say(f"  after {label:13s} {b:4s}: " + " ".join(f"{x:5.1f}" for x in m))

    cols = ["mpi", "gloo", "auto", "mpi@2"]
    fns = [mk["mpi"], mk["gloo"], mk["auto"], sweep.make_call(args.op, args.bytes, "mpi")]
    old = np.median(old_design(fns, args.rounds), axis=1)
    new = sweep.measure_point(args.op, args.bytes, cols, sweep.trials_for(args.bytes))
    say("\n2. medians (µs) and ratios to mpi, columns in one set of Williams rounds:")
    for name, med in (("one call after 0.2 ms + barrier", dict(zip(cols, old))),
                      ("blocks (measure_rounds)", new)):
        say(f"  {name:32s}: " + ", ".join(f"{c} {med[c] * 1e6:.1f}" for c in cols)
            + f" | auto/mpi {med['auto'] / med['mpi']:.3f}, mpi@2/mpi "
              f"{med['mpi@2'] / med['mpi']:.3f}")
    say(f"load average at the end {os.getloadavg()[0]:.2f}")
    api.barrier(backend="mpi")


if __name__ == "__main__":
    main()
