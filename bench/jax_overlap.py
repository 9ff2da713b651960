"""Overlap of a non-blocking mcrdl_jax all-reduce with compute that does not need it.

    mcrdl cluster run --hosts 2 --rate 1gbit -- .venv/bin/python bench/jax_overlap.py \\
        --backend gloo [--bytes 16M] [--repeats 5] [--json out.json]

One step = a ``--bytes`` float32 all-reduce (a gradient) and ``--compute`` ms of matmuls
that do not depend on it (the next layer's work), measured as:

- ``comm`` alone (the blocking all-reduce) and ``compute`` alone (the jitted matmuls);
- eager: ``blocking`` (all_reduce, then the matmuls) and ``non-blocking``
  (``h = all_reduce(g, async_op=True)``, the matmuls, ``wait(h)``);
- jit: the same two written inside one ``jax.jit`` function (``mcrdl_jax.wait`` inside),
  and the non-blocking one with ``wait(h, after=c)``, which pins the matmuls between
  the start and the wait (XLA's scheduler may otherwise put them after the wait).
- ``blocking (A/A)``: the eager blocking step measured a second time, in the same
  rotation: the spread between the two is the noise floor.

The configurations run in a rotated order in every repeat (``--repeats``, each the
median of ``--iters`` steps); the table gives the median over repeats, the sum and max
of comm and compute, and each step's ratio to them. The compute is calibrated on rank 0
to ``--compute`` ms (default: the measured comm time) and the count broadcast. XLA runs
single-threaded per process (``XLA_FLAGS``, unless set): an emulated host is one core
of this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                      "intra_op_parallelism_threads=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mcrdl_jax as mj  # noqa: E402


def parse_bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


CPU = {}  # name -> this process's CPU seconds per step (every thread: Gloo's too)


def timed(fn, iters: int, name: str | None = None) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls, the ranks aligned by a barrier
    before each; with ``name``, also records the process's CPU seconds per call."""
    out, cpu = [], []
    for _ in range(iters):
        mj.barrier(backend="mpi")
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if name is not None:
        CPU.setdefault(name, []).append(statistics.median(cpu))
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="16M")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--compute", type=float, default=None, help="ms of matmuls per step")
    ap.add_argument("--dim", type=int, default=384, help="matmul size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rank = mj.get_rank()
    be = a.backend
    g = jnp.ones(parse_bytes(a.bytes) // 4, jnp.float32) * (rank + 1)
    x0 = jnp.eye(a.dim, dtype=jnp.float32) * 0.5

    def make_mm(k):
        @jax.jit
        def mm(x):
            for _ in range(k):
                x = jnp.tanh(x @ x0)
            return x
        return mm

    # calibrate: comm alone, one matmul, then the count for --compute ms (rank 0 decides)
    comm = lambda: mj.all_reduce(g, backend=be).block_until_ready()  # noqa: E731
    comm()
    t_comm = timed(comm, a.iters)
    one = make_mm(8)
    one(x0).block_until_ready()
    t_one = timed(lambda: one(x0).block_until_ready(), a.iters) / 8
    target = (a.compute / 1e3) if a.compute else t_comm
    k = int(mj.broadcast(jnp.int32(max(1, round(target / t_one))), src=0, backend="mpi"))
    mm = make_mm(k)
    mm(x0).block_until_ready()

    def eager_blocking():
        y = mj.all_reduce(g, backend=be)
        c = mm(x0)
        jax.block_until_ready((y, c))

    def eager_nonblocking():
        h = mj.all_reduce(g, backend=be, async_op=True)
        c = mm(x0)
        c.block_until_ready()
        mj.wait(h).block_until_ready()

    @jax.jit
    def jit_blocking_fn(g, x):
        return mj.all_reduce(g, backend=be), mm(x)

    @jax.jit
    def jit_nonblocking_fn(g, x):
        h = mj.all_reduce(g, backend=be, async_op=True)
        c = mm(x)
        return mj.wait(h), c

    @jax.jit
    def jit_pinned_fn(g, x):
        h = mj.all_reduce(g, backend=be, async_op=True)
        c = mm(x)
        return mj.wait(h, after=c), c

    configs = {
        "comm": comm,
        "compute": lambda: mm(x0).block_until_ready(),
        "eager blocking": eager_blocking,
        "eager non-blocking": eager_nonblocking,
        "jit blocking": lambda: jax.block_until_ready(jit_blocking_fn(g, x0)),
        "jit non-blocking": lambda: jax.block_until_ready(jit_nonblocking_fn(g, x0)),
        "jit non-blocking, wait(after=)": lambda: jax.block_until_ready(jit_pinned_fn(g, x0)),
        "eager blocking (A/A)": eager_blocking,
    }
    ref = float(sum(range(1, mj.get_world_size() + 1)))
    for name, fn in configs.items():  # warm up (compiles) and check the result once
        fn()
    y, _ = jit_nonblocking_fn(g, x0)
    assert float(y[0]) == ref and float(y[-1]) == ref, (float(y[0]), ref)
    names = list(configs)
    runs = {n: [] for n in names}
    for r in range(a.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            runs[n].append(timed(configs[n], a.iters, n))
    med = {n: statistics.median(v) for n, v in runs.items()}
    worst = {n: float(mj.all_reduce(jnp.float32(med[n]), "max", backend="mpi")) for n in names}
    if rank == 0:
        c, m = worst["comm"], worst["compute"]
        print(f"jax_overlap: {a.bytes} all-reduce via {be}, {k} matmuls {a.dim}^2, "
              f"{mj.get_world_size()} ranks, {a.repeats} repeats x {a.iters} steps, "
              f"load {os.getloadavg()[0]:.2f}")
        print("| step | ms (median, slowest rank) | / max(comm, compute) | / sum | "
              "CPU ms per step, rank 0 |")
        print("| --- | --- | --- | --- | --- |")
        for n in names:
            t = worst[n]
            print(f"| {n} | {t * 1e3:.1f} | {t / max(c, m):.2f} | {t / (c + m):.2f} | "
                  f"{statistics.median(CPU[n]) * 1e3:.0f} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"backend": be, "bytes": a.bytes, "matmuls": k, "dim": a.dim,
                           "median_s": worst, "runs_rank0": runs, "cpu_rank0": CPU,
                           "load": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
