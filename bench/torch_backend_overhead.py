"""What the registered torch backend costs per call: ``dist.all_reduce`` on torch's Gloo
group, on an "mcrdl" group (torch -> McrdlProcessGroup -> core), and the same op
through ``mcrdl_torch`` directly (no torch.distributed in between), side by side.

    mpiexec -n 2 .venv/bin/python bench/torch_backend_overhead.py [--sizes 4 4096 1048576]

The default group is torch's Gloo; the mcrdl group is made with
``dist.new_group(backend="mcrdl")`` (the creator's subgroup path). Batches of calls are
interleaved (bench/timing.py: Williams order, a barrier before each batch); the
figure is the median over rounds of the slowest rank's time per call, in µs.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import interleaved_batches  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 4096, 1 << 20], help="bytes")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--backend", default="mpi", help="the core backend mcrdl uses (pg_options)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    import mcrdl_torch

    mc = dist.new_group(backend="mcrdl", pg_options=a.backend)
    rank = dist.get_rank()
    for nbytes in a.sizes:
        t = torch.ones(max(nbytes // 4, 1))
        calls = max(5, min(200, (1 << 22) // max(nbytes, 1)))
        fns = [lambda: dist.all_reduce(t), lambda: dist.all_reduce(t, group=mc),
               lambda: mcrdl_torch.all_reduce(t, backend=a.backend)]
        times = interleaved_batches(fns, [calls] * 3, a.rounds)
        med = np.median(times, axis=1) * 1e6
        if rank == 0:
            print(f"{nbytes:>9} B  torch gloo {med[0]:9.1f} µs   torch mcrdl({a.backend}) "
                  f"{med[1]:9.1f} µs   mcrdl_torch({a.backend}) {med[2]:9.1f} µs   "
                  f"pg overhead {med[1] - med[2]:+.1f} µs", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
