"""What MCR-DL adds per call over calling mpi4py (and mpi4jax) directly.

Run (2 ranks; from the checkout):
    MCRDL_TUNING_TABLE=none mpiexec -n 2 .venv/bin/python bench/overhead.py [--calls N] [--rounds R] [--table ops|all_reduce|both] [--split BYTES]

Every op (``--table ops``): all_reduce, broadcast, reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single (even, and by split sizes), the list forms
(all_gather into a list, reduce_scatter from a list, all_to_all of lists: "run" = the
list is chunks of one tensor, "apart" = separate tensors, which the fast path stages),
gather and scatter (root 0, its list apart), an isend/irecv ring, isend + blocking recv +
wait and irecv + blocking send + wait (against one ``Sendrecv``), batch_isend_irecv of
the ring (against Irecv + Isend + Waitall), barrier, and an A/A row (the raw all-reduce
measured twice: the noise floor of the table) through ``mcrdl_torch``, blocking and
async + wait, each interleaved with the same mpi4py call: blocking against the blocking
call, async + wait against the nonblocking call + ``Wait`` (``Iallreduce(...).Wait()``;
the ring: Irecv + Isend + Waitall), with async's excess over the blocking call beside
it. Twice: with ``backend="mpi"`` (explicit), then ``backend="auto"`` through an
in-memory tuning table whose entry for every op has two ranges, mpi up to ``--split``
bytes (default 1024) and mpi above (the bound call by table range).

The all-reduce table (``--table all_reduce``):

float32 SUM all-reduce of 8 B, 1 KiB and 64 KiB. Every path runs in batches of
``--calls`` back-to-back calls, interleaved with the others in the rounds of a Williams
design (``timing.interleaved_batches``: an MPI barrier before each batch, the slowest
rank's time), so that the load of a shared machine falls on all paths alike. Reported
per path: the median over rounds of the per-call time, and what it adds over the
raw mpi4py ``Allreduce`` of the same size.

Paths: raw mpi4py (blocking ``Allreduce``, and ``Iallreduce`` polled with ``Test``:
what MCR-DL issues); ``mcrdl_core.all_reduce`` on a NumPy array; ``mcrdl_torch.all_reduce``
with ``backend="mpi"``, with ``backend="auto"`` (selection through an in-memory tuning
table that says mpi, so the table lookup is part of the figure; ``--split BYTES``: two
ranges, so auto picks the call's range per call), ``async_op=True``
then ``wait()``, and auto with the comm logger on (switched on and off around each
call: two attribute stores); ``mcrdl_jax.all_reduce`` eager on a JAX array, next to
the cost of the smallest eager JAX op with a result (``x + 1``, no communication: what
the JAX runtime alone costs per call on this machine). jit: one
jitted program running K=100 all-reduces in a ``lax.fori_loop`` (each scaled by 1/n
to stay finite), through ``mcrdl_jax.all_reduce`` and through ``mpi4jax.allreduce``;
their figures are per all-reduce (a program's time / K), and the jit rows compare
against mpi4jax's program instead of the raw call.
"""
from __future__ import annotations

import argparse
import statistics
import timeit

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
import torch
from mpi4py import MPI

import mcrdl_core
import mcrdl_jax
import mcrdl_torch as dist
from mcrdl_core.observe.logger import logger
from mcrdl_core.dispatch.selection import SCHEMA, TuningTable
from timing import COMM, interleaved_batches

K = 100  # all-reduces per jitted program


def jitted(allreduce, n: int):
    scale = 1.0 / n

    @jax.jit
    def program(x):
        return jax.lax.fori_loop(0, K, lambda i, y: allreduce(y) * scale, x)

    return program


def _test_loop(req) -> None:
    while not req.Test():
        pass


def paths_for(nbytes: int, n: int) -> dict:
    count = max(nbytes // 4, 1)
    raw = np.ones(count, np.float32)
    arr = np.ones(count, np.float32)
    t = torch.ones(count)
    xj = jnp.ones(count, jnp.float32)
    lg = logger()

    def logged():
        lg.enabled = True
        dist.all_reduce(t, backend="auto")
        lg.enabled = False

    def mpi4jax_allreduce(y):
        out = mpi4jax.allreduce(y, op=MPI.SUM, comm=COMM)
        return out[0] if isinstance(out, tuple) else out

    prog_mcrdl = jitted(mcrdl_jax.all_reduce, n)
    prog_mpi4jax = jitted(mpi4jax_allreduce, n)
    return {
        "mpi4py Allreduce (raw)": (lambda: COMM.Allreduce(MPI.IN_PLACE, raw, MPI.SUM), 1),
        "mpi4py Iallreduce + Test loop": (lambda: _test_loop(
            COMM.Iallreduce(MPI.IN_PLACE, raw, MPI.SUM)), 1),
        "mcrdl_core.all_reduce (NumPy)": (lambda: mcrdl_core.all_reduce(arr), 1),
        "mcrdl_torch backend='mpi'": (lambda: dist.all_reduce(t, backend="mpi"), 1),
        "mcrdl_torch auto (table)": (lambda: dist.all_reduce(t, backend="auto"), 1),
        "mcrdl_torch async + wait": (
            lambda: dist.all_reduce(t, backend="auto", async_op=True).wait(), 1),
        "mcrdl_torch auto, logger on": (logged, 1),
        "mcrdl_jax eager": (lambda: mcrdl_jax.all_reduce(xj).block_until_ready(), 1),
        "jax x + 1 (no communication)": (lambda: (xj + 1).block_until_ready(), 1),
        "jit: mpi4jax, per op": (lambda: prog_mpi4jax(xj).block_until_ready(), K),
        "jit: mcrdl_jax, per op": (lambda: prog_mcrdl(xj).block_until_ready(), K),
    }


def _wait_all(works) -> None:
    for w in works:
        w.wait()


def op_paths(nbytes: int, n: int, rank: int, backend: str = "mpi") -> dict:
    """{op: (raw mpi4py call, mcrdl_torch blocking call, raw mpi4py nonblocking call +
    Wait, mcrdl_torch async + wait)} for every op of the issue list, float32 of
    ``nbytes`` per rank's block, ``backend`` "mpi", or "auto" under a table that says
    mpi (the same library underneath: the difference is MCR-DL's own cost). An async
    call is set against the nonblocking call a user of mpi4py would write for it
    (``Iallreduce(...).Wait()``), since the library's nonblocking collectives cost more
    than its blocking ones."""
    c = max(nbytes // 4, 1)
    SUM, IN_PLACE = MPI.SUM, MPI.IN_PLACE
    a, b = np.ones(c, np.float32), np.ones(c * n, np.float32)
    big_in, big_out = np.ones(c * n, np.float32), np.ones(c * n, np.float32)
    t, tb = torch.ones(c), torch.ones(c * n)
    tin, tout = torch.ones(c * n), torch.ones(c * n)
    counts = [c] * n
    displs = [i * c for i in range(n)]
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    ra, sa = np.ones(c, np.float32), np.ones(c, np.float32)
    rt_, st_ = torch.ones(c), torch.ones(c)
    splits = [1] * n  # rows of c elements: the uneven (split-sizes) form of the same call
    tin2, tout2 = torch.ones(n, c), torch.ones(n, c)

    def raw_reduce():
        if rank == 0:
            COMM.Reduce(IN_PLACE, a, SUM, 0)
        else:
            COMM.Reduce(a, None, SUM, 0)

    def raw_ireduce():
        if rank == 0:
            COMM.Ireduce(IN_PLACE, a, SUM, 0).Wait()
        else:
            COMM.Ireduce(a, None, SUM, 0).Wait()

    def raw_ring():
        MPI.Request.Waitall([COMM.Irecv(ra, prv, 7), COMM.Isend(sa, nxt, 7)])

    be = backend

    def ring(async_op):
        return lambda: _wait_all([dist.irecv(rt_, prv, tag=7, backend=be),
                                  dist.isend(st_, nxt, tag=7, backend=be)])

    def four(raw, iraw, call):
        return (raw, lambda: call(False), iraw, lambda: call(True).wait())

    def raw_sendrecv():
        COMM.Sendrecv(sa, nxt, 7, ra, prv, 7)

    def isend_recv():
        w = dist.isend(st_, nxt, tag=7, backend=be)
        dist.recv(rt_, prv, tag=7, backend=be)
        w.wait()

    def irecv_send():
        w = dist.irecv(rt_, prv, tag=7, backend=be)
        dist.send(st_, nxt, tag=7, backend=be)
        w.wait()

    ring_ops = [dist.P2POp(dist.irecv, rt_, prv, None, 7), dist.P2POp(dist.isend, st_, nxt, None, 7)]

    def batch():
        _wait_all(dist.batch_isend_irecv(ring_ops, backend=be))

    # the list forms: chunks of one tensor (one run), or separate tensors (staged)
    run_out = list(torch.ones(c * n).split(c))
    apart_out = [torch.ones(c) for _ in range(n)]
    run_in = list(torch.ones(c * n).split(c))
    apart_in = [torch.ones(c) for _ in range(n)]
    a2a_out = list(torch.ones(c * n).split(c))
    gather_list = [torch.ones(c) for _ in range(n)] if rank == 0 else None
    bg = np.ones(c * n, np.float32) if rank == 0 else None

    def raw_gather():
        COMM.Gather(a, bg, 0)

    def raw_igather():
        COMM.Igather(a, bg, 0).Wait()

    def raw_scatter():
        COMM.Scatter(bg, a, 0)

    def raw_iscatter():
        COMM.Iscatter(bg, a, 0).Wait()

    vspec_in = [big_in, (counts, displs), MPI.FLOAT]
    vspec_out = [big_out, (counts, displs), MPI.FLOAT]
    return {
        "all_reduce": four(lambda: COMM.Allreduce(IN_PLACE, a, SUM),
                           lambda: COMM.Iallreduce(IN_PLACE, a, SUM).Wait(),
                           lambda x: dist.all_reduce(t, backend=be, async_op=x)),
        "broadcast": four(lambda: COMM.Bcast(a, 0), lambda: COMM.Ibcast(a, 0).Wait(),
                          lambda x: dist.broadcast(t, 0, backend=be, async_op=x)),
        "reduce": four(raw_reduce, raw_ireduce,
                       lambda x: dist.reduce(t, 0, backend=be, async_op=x)),
        "all_gather_into_tensor": four(
            lambda: COMM.Allgather(a, b), lambda: COMM.Iallgather(a, b).Wait(),
            lambda x: dist.all_gather_into_tensor(tb, t, backend=be, async_op=x)),
        "reduce_scatter_tensor": four(
            lambda: COMM.Reduce_scatter_block(big_in, a, SUM),
            lambda: COMM.Ireduce_scatter_block(big_in, a, SUM).Wait(),
            lambda x: dist.reduce_scatter_tensor(t, tin, backend=be, async_op=x)),
        "all_to_all_single": four(
            lambda: COMM.Alltoall(big_in, big_out), lambda: COMM.Ialltoall(big_in, big_out).Wait(),
            lambda x: dist.all_to_all_single(tout, tin, backend=be, async_op=x)),
        "all_to_all_single (splits)": four(
            lambda: COMM.Alltoallv(vspec_in, vspec_out),
            lambda: COMM.Ialltoallv(vspec_in, vspec_out).Wait(),
            lambda x: dist.all_to_all_single(tout2, tin2, splits, splits, backend=be,
                                             async_op=x)),
        "all_gather (list, run)": four(
            lambda: COMM.Allgather(a, b), lambda: COMM.Iallgather(a, b).Wait(),
            lambda x: dist.all_gather(run_out, t, backend=be, async_op=x)),
        "all_gather (list, apart)": four(
            lambda: COMM.Allgather(a, b), lambda: COMM.Iallgather(a, b).Wait(),
            lambda x: dist.all_gather(apart_out, t, backend=be, async_op=x)),
        "reduce_scatter (list, run)": four(
            lambda: COMM.Reduce_scatter_block(big_in, a, SUM),
            lambda: COMM.Ireduce_scatter_block(big_in, a, SUM).Wait(),
            lambda x: dist.reduce_scatter(t, run_in, backend=be, async_op=x)),
        "reduce_scatter (list, apart)": four(
            lambda: COMM.Reduce_scatter_block(big_in, a, SUM),
            lambda: COMM.Ireduce_scatter_block(big_in, a, SUM).Wait(),
            lambda x: dist.reduce_scatter(t, apart_in, backend=be, async_op=x)),
        "all_to_all (list, run)": four(
            lambda: COMM.Alltoallv(vspec_in, vspec_out),
            lambda: COMM.Ialltoallv(vspec_in, vspec_out).Wait(),
            lambda x: dist.all_to_all(a2a_out, run_in, backend=be, async_op=x)),
        "all_to_all (list, apart)": four(
            lambda: COMM.Alltoallv(vspec_in, vspec_out),
            lambda: COMM.Ialltoallv(vspec_in, vspec_out).Wait(),
            lambda x: dist.all_to_all(apart_out, apart_in, backend=be, async_op=x)),
        "gather (root 0, apart)": four(
            raw_gather, raw_igather,
            lambda x: dist.gather(t, gather_list, 0, backend=be, async_op=x)),
        "scatter (root 0, apart)": four(
            raw_scatter, raw_iscatter,
            lambda x: dist.scatter(t, gather_list, 0, backend=be, async_op=x)),
        "isend/irecv ring": (raw_ring, ring(True), raw_ring, ring(True)),
        "isend + recv + wait": (raw_sendrecv, isend_recv, raw_sendrecv, isend_recv),
        "irecv + send + wait": (raw_sendrecv, irecv_send, raw_sendrecv, irecv_send),
        "batch_isend_irecv ring": (raw_ring, batch, raw_ring, batch),
        "barrier": four(COMM.Barrier, lambda: COMM.Ibarrier().Wait(),
                        lambda x: dist.barrier(backend=be, async_op=x)),
        "A/A: raw all_reduce twice": (
            lambda: COMM.Allreduce(IN_PLACE, a, SUM), lambda: COMM.Allreduce(IN_PLACE, a, SUM),
            lambda: COMM.Iallreduce(IN_PLACE, a, SUM).Wait(),
            lambda: COMM.Iallreduce(IN_PLACE, a, SUM).Wait()),
    }


def every_op(args, n: int) -> None:
    """The per-op table, interleaved: raw mpi4py blocking against mcrdl_torch blocking,
    raw mpi4py nonblocking + Wait against mcrdl_torch async + wait."""
    rank = dist.get_rank()
    for backend, nbytes in ((b, int(s)) for b in ("mpi", "auto") for s in args.sizes.split(",")):
        paths = op_paths(nbytes, n, rank, backend)
        fns = [f for four in paths.values() for f in four]
        for fn in fns:
            for _ in range(5):
                fn()
        times = interleaved_batches(fns, [args.calls] * len(fns), args.rounds)
        med = [statistics.median(times[i]) * 1e6 for i in range(len(fns))]
        if rank == 0:
            how = ("'mpi'" if backend == "mpi" else
                   f"'auto' (a table of two ranges per op, mpi up to {args.split or 1024} B and "
                   "above)")
            print(f"\n{nbytes} B float32 per rank, {n} ranks, {times.shape[1]} rounds, backend "
                  f"{how}, median per call (slowest rank), µs:")
            print(f"{'':28s} {'blocking':>26s}   {'async + wait':>35s}")
            print(f"{'op':28s} {'mpi4py':>8s} {'mcrdl':>8s} {'added':>8s}   {'mpi4py I*':>9s} "
                  f"{'mcrdl':>8s} {'added':>8s} {'vs blk':>8s}")
            for j, op in enumerate(paths):
                raw, ours, iraw, asy = med[4 * j:4 * j + 4]
                print(f"{op:28s} {raw:8.2f} {ours:8.2f} {ours - raw:+8.2f}   {iraw:9.2f} "
                      f"{asy:8.2f} {asy - iraw:+8.2f} {asy - raw:+8.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per batch (jit: programs / 20)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sizes", default="8,1024,65536", help="message sizes in bytes")
    ap.add_argument("--split", type=int, default=None, metavar="BYTES",
                    help="the tuning table's all_reduce entry in two ranges, mpi up to BYTES "
                         "and mpi above (auto then runs a call by table range) instead of "
                         "one open range; --table ops: where every op's two ranges meet "
                         "(default 1024)")
    ap.add_argument("--table", choices=["all_reduce", "ops", "both"], default="both",
                    help="all_reduce: every frontend's all-reduce (JAX too); ops: every op "
                         "through mcrdl_torch against its raw mpi4py call")
    args = ap.parse_args()
    dist.init_process_group()
    rt = mcrdl_core.get_runtime()
    n = dist.get_world_size()
    if args.table in ("ops", "both"):  # every op: two ranges, mpi and mpi
        two = [[args.split or 1024, "mpi"], [None, "mpi"]]
        rt.set_table(TuningTable({"schema": SCHEMA, "entries": [
            {"op": op, "world_size": n, "hosts": len(rt.bootstrap.hosts), "device": "cpu",
             "dtype_class": "float", "ranges": two}
            for op in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                       "all_to_all", "gather", "scatter", "send", "recv", "barrier")]},
            "<overhead benchmark>"))
        every_op(args, n)
    rt.set_table(TuningTable({"schema": SCHEMA, "entries": [
        {"op": "all_reduce", "world_size": n, "hosts": len(rt.bootstrap.hosts), "device": "cpu",
         "dtype_class": "float",
         "ranges": [[None, "mpi"]] if args.split is None else [[args.split, "mpi"], [None, "mpi"]]}
    ]}, "<overhead benchmark>"))
    for nbytes in (int(s) for s in args.sizes.split(",")) if args.table != "ops" else ():
        paths = paths_for(nbytes, n)
        names = list(paths)
        fns = [paths[k][0] for k in names]
        calls = [args.calls if paths[k][1] == 1 else max(args.calls // 20, 2) for k in names]
        for fn in fns:  # compile, create communicators, fill the memos
            for _ in range(5):
                fn()
        times = interleaved_batches(fns, calls, args.rounds)  # s per call, (paths, rounds)
        logger().clear()
        med = {k: statistics.median(times[i]) * 1e6 / paths[k][1] for i, k in enumerate(names)}
        if dist.get_rank() == 0:
            print(f"\n{nbytes} B float32 all_reduce, {n} ranks, {times.shape[1]} rounds, "
                  f"median per call (slowest rank):")
            print(f"{'path':32s} {'µs':>9s} {'added µs':>9s}")
            for k, v in med.items():
                base = med["jit: mpi4jax, per op" if k.startswith("jit") else
                           "mpi4py Allreduce (raw)"]
                print(f"{k:32s} {v:9.2f} {v - base:+9.2f}", flush=True)
    if dist.get_rank() == 0:
        reps = 1_000_000
        off = timeit.timeit("rt.logger.enabled and None", globals={"rt": rt}, number=reps)
        print(f"\ncomm logger off: {off / reps * 1e9:.0f} ns per call (the one check each call "
              "makes)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
