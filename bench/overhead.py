"""Per-call overhead of mcrdl_torch.all_reduce over calling mpi4py directly.

Run: mpiexec -n 2 .venv/bin/python bench/overhead.py [--calls N] [--rounds R]

8-byte all-reduce (two float32). All paths are timed call by call, interleaved in
rounds so that machine noise hits them alike; reported: the median per-call latency of
each (slowest rank per call), the ratio, and the microseconds MCR-DL adds per call.
"auto (table)" selects through a tuning table (an in-memory one that says mpi), so the
table lookup is part of the figure; the comm logger is off except on the "logger on"
row. Last, the cost of the logger when off: the one attribute test each call makes.
"""
from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np
import torch
from mpi4py import MPI

import mcrdl_core
import mcrdl_torch as dist
from mcrdl_core.logger import logger
from mcrdl_core.selection import SCHEMA, TuningTable
from timing import COMM, per_call_times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per path per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group()
    rt = mcrdl_core.get_runtime()
    n = dist.get_world_size()
    table = TuningTable({"schema": SCHEMA, "entries": [
        {"op": "all_reduce", "world_size": n, "hosts": len(rt.bootstrap.hosts), "device": "cpu",
         "dtype_class": "float", "ranges": [[None, "mpi"]]}]}, "<overhead benchmark>")
    raw = np.ones(2, dtype=np.float32)
    t = torch.ones(2)
    paths = {
        "mpi4py Allreduce (raw)": lambda: COMM.Allreduce(MPI.IN_PLACE, raw, MPI.SUM),
        "mcrdl_torch.all_reduce backend='mpi'": lambda: dist.all_reduce(t, backend="mpi"),
        "mcrdl_torch.all_reduce (policy pick)": lambda: dist.all_reduce(t),
        "mcrdl_torch.all_reduce auto (table)": lambda: dist.all_reduce(t, backend="auto"),
        "mcrdl_torch.all_reduce auto, logger on": lambda: dist.all_reduce(t, backend="auto"),
        "mcrdl_torch.all_reduce backend='gloo'": lambda: dist.all_reduce(t, backend="gloo"),
    }
    samples = {k: [] for k in paths}
    lg = logger()
    for _ in range(args.rounds):
        for name, fn in paths.items():
            rt.set_table(table if "auto" in name else None)
            if "logger on" in name:
                lg.enable()
            samples[name].extend(per_call_times(fn, args.calls))
            lg.disable()
            lg.clear()
    med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    if dist.get_rank() == 0:
        base = med["mpi4py Allreduce (raw)"]
        print(f"8-byte all_reduce on {dist.get_world_size()} ranks, "
              f"{args.rounds} rounds x {args.calls} calls per path, median per call:")
        print(f"{'path':42s} {'median µs':>10s} {'ratio':>7s} {'added µs':>9s}")
        for k, v in med.items():
            print(f"{k:42s} {v:10.2f} {v / base:7.2f} {v - base:9.2f}")
        reps = 1_000_000
        off = timeit.timeit("rt.logger.enabled and None", globals={"rt": rt}, number=reps)
        print(f"comm logger off: {off / reps * 1e9:.0f} ns per call (the one check each call "
              f"makes; bound: 1 µs)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
