"""The two-level all-reduce and all-to-all (``backend="hier"``) against the flat ones,
side by side.

Run on ranks that share hosts, e.g. the emulated cluster (2 hosts x 2 ranks, 1 Gbit/s):

    sudo .venv/bin/mcrdl cluster run --hosts 2 --ranks-per-host 2 --rate 1gbit -- \\
        .venv/bin/python bench/hier.py

Paths per size (float32; ``--op all_reduce``: SUM through ``mcrdl_core.all_reduce``;
``--op all_to_all``: an even ``all_to_all_single`` of that many bytes per rank): flat on
MPI, flat on Gloo, ``hier:mpi`` (every step on MPI), ``hier`` (each step's backend by
the usual order: here the policy's, MPI), and flat MPI again as the A/A control. Every
path runs in batches interleaved in the rounds of a Williams design
(``timing.interleaved_batches``: a barrier before each batch, the slowest rank's time).
Printed: the median µs per call over rounds and each path's ratio to flat MPI, with the
load average at the start and the end.
"""
from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

import mcrdl_core as core
from timing import COMM, interleaved_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4096,65536,1048576,4194304",
                    help="bytes per rank, comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--op", choices=("all_reduce", "all_to_all"), default="all_reduce")
    args = ap.parse_args()
    core.init()
    rt = core.get_runtime()
    load0 = os.getloadavg()
    paths = ["mpi", "gloo", "hier:mpi", "hier", "mpi (A/A)"]
    if COMM.rank == 0:
        print(f"{rt.world_size} ranks, {rt.bootstrap.topology()}; {args.op} float32, "
              f"{args.rounds} rounds; median µs per call (slowest rank)")
        print(f"{'bytes':>9}  " + "  ".join(f"{p:>11}" for p in paths) + "   hier:mpi/mpi")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = max(nbytes // 4 // rt.world_size, 1) * rt.world_size
        x, out = np.ones(count, np.float32), np.empty(count, np.float32)
        if args.op == "all_reduce":
            fns = [lambda b=p.split()[0]: core.all_reduce(x, backend=b) for p in paths]
        else:
            fns = [lambda b=p.split()[0]: core.all_to_all_single(out, x, backend=b)
                   for p in paths]
        calls = [max(2, min(200, (1 << 22) // max(nbytes, 1)))] * len(fns)
        for f in fns:  # warm-up: sub-groups and communicators made
            f()
        t = interleaved_batches(fns, calls, args.rounds)
        med = [statistics.median(row) * 1e6 for row in t]
        if COMM.rank == 0:
            print(f"{nbytes:>9}  " + "  ".join(f"{m:>11.1f}" for m in med)
                  + f"   {med[2] / med[0]:.2f}x (A/A {med[4] / med[0]:.2f}x)")
    if COMM.rank == 0:
        print(f"load average (1, 5, 15 min): start {load0}, end {os.getloadavg()}")


if __name__ == "__main__":
    main()
