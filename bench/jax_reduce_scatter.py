"""mcrdl_jax.reduce_scatter under jax.jit on MPI: MPI's reduce-scatter through the host
callback, against what the jit path did before (mpi4jax's all-reduce, then this rank's
slice), side by side in one run.

    mpiexec -n 2 .venv/bin/python bench/jax_reduce_scatter.py [--sizes 65536,1048576,...]

Per size (bytes of each rank's input, S): the median seconds per call of each variant
(slowest rank, interleaved batches: bench/timing.py), and the bytes the library call
writes into each rank: S/n for the reduce-scatter, S for the all-reduce (every rank
gets the whole reduction and keeps 1/n of it). A ring or Rabenseifner all-reduce is a
reduce-scatter followed by an all-gather, so at large sizes the all-reduce variant
should take about twice as long; at small sizes the callback's fixed cost shows.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import mcrdl_core as mc  # noqa: E402
import mcrdl_jax as mj  # noqa: E402
from timing import COMM, interleaved_batches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,65536,1048576,8388608",
                    help="bytes of each rank's float32 input, comma-separated")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    n, rank = COMM.Get_size(), COMM.Get_rank()
    import mpi4jax
    from mpi4py import MPI

    comm = mc.get_runtime().backend("mpi").comm(mc.get_runtime().group(None))
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        count = max(size // 4 // n, 1) * n
        x = jnp.arange(count, dtype=jnp.float32) + rank
        k = count // n
        new = jax.jit(lambda v: mj.reduce_scatter(v, backend="mpi"))
        old = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm)[rank * k:(rank + 1) * k])
        np.testing.assert_array_equal(np.asarray(new(x)), np.asarray(old(x)))
        fns = [lambda: new(x).block_until_ready(), lambda: old(x).block_until_ready()]
        calls = [max(1, min(200, (1 << 24) // max(size, 1)))] * 2
        t = np.median(interleaved_batches(fns, calls, args.rounds), axis=1)
        rows.append((count * 4, t[0], t[1], count * 4 // n, count * 4))
    if rank == 0:
        print(f"{n} ranks, jax.jit on mpi; seconds per call (median, slowest rank)")
        print(f"{'S (bytes)':>10} {'reduce_scatter':>15} {'allreduce+slice':>16} {'ratio':>6} "
              f"{'bytes in, rs':>13} {'bytes in, ar':>13}")
        for s, a, b, ra, rb in rows:
            print(f"{s:>10} {a:>15.3e} {b:>16.3e} {b / a:>6.2f} {ra:>13} {rb:>13}")


if __name__ == "__main__":
    main()
