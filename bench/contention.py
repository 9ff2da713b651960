"""How a small call's wait fares when the host is busy: MCR-DL against raw mpi4py under
the same load (issue 24 point 4).

Run on 2 ranks, with and without a second job loading the same cores:

    mpiexec -n 2 .venv/bin/python bench/contention.py
    .venv/bin/python bench/loadgen.py --ranks 2 -- mpiexec -n 2 .venv/bin/python bench/contention.py

Paths, float32 ``reduce_scatter_tensor`` (and all_reduce) at 64 B and 1 KiB per rank,
interleaved in the rounds of a Williams design (``timing.interleaved_batches``: an MPI
barrier before each batch, the slowest rank's time): raw blocking mpi4py, raw
nonblocking + a ``Test`` loop (how MCR-DL waits), and ``mcrdl_torch`` with
``backend="mpi"`` (blocking) and ``backend="gloo"``. Printed per path: the median and the
90th percentile over rounds of the per-call time, and the ratio of MCR-DL's median to raw
blocking mpi4py's. The load average at the start and the end is printed with them.
"""
from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
import torch
from mpi4py import MPI

import mcrdl_torch as dist
from timing import COMM, interleaved_batches


def _test_loop(req) -> None:
    while not req.Test():
        pass


def paths(nbytes: int, n: int) -> dict:
    c = max(nbytes // 4, 1)
    big, small = np.ones(c * n, np.float32), np.ones(c, np.float32)
    tbig, tsmall = torch.ones(c * n), torch.ones(c)
    return {
        "reduce_scatter mpi4py blocking": lambda: COMM.Reduce_scatter_block(big, small, MPI.SUM),
        "reduce_scatter mpi4py I+Test": lambda: _test_loop(
            COMM.Ireduce_scatter_block(big, small, MPI.SUM)),
        "reduce_scatter mcrdl mpi": lambda: dist.reduce_scatter_tensor(tsmall, tbig, backend="mpi"),
        "reduce_scatter mcrdl gloo": lambda: dist.reduce_scatter_tensor(tsmall, tbig,
                                                                        backend="gloo"),
        "all_reduce mpi4py blocking": lambda: COMM.Allreduce(MPI.IN_PLACE, small, MPI.SUM),
        "all_reduce mcrdl mpi": lambda: dist.all_reduce(tsmall, backend="mpi"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--sizes", default="64,1024")
    args = ap.parse_args()
    dist.init_process_group()
    n, rank = dist.get_world_size(), dist.get_rank()
    load0 = os.getloadavg()
    for nbytes in (int(s) for s in args.sizes.split(",")):
        p = paths(nbytes, n)
        names, fns = list(p), list(p.values())
        for fn in fns:
            for _ in range(5):
                fn()
        times = interleaved_batches(fns, [args.calls] * len(fns), args.rounds) * 1e6
        if rank == 0:
            print(f"\n{nbytes} B per rank, {n} ranks, {times.shape[1]} rounds of {args.calls} "
                  "calls, µs per call (slowest rank):")
            print(f"{'path':34s} {'median':>9s} {'p90':>9s} {'vs raw':>7s}")
            raw = {}
            for i, k in enumerate(names):
                med, p90 = statistics.median(times[i]), float(np.percentile(times[i], 90))
                op = k.split()[0]
                raw.setdefault(op, med)
                print(f"{k:34s} {med:9.2f} {p90:9.2f} {med / raw[op]:6.2f}x", flush=True)
    if rank == 0:
        print(f"\nload average (1, 5, 15 min): start {load0}, end {os.getloadavg()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
