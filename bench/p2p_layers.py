"""Where a pipeline step's time goes: ``isend`` + blocking ``recv`` + ``wait`` through
``mcrdl_torch``, layer by layer, against mpi4py (docs/benchmarks.md, per-call overhead).

    mpiexec -n 2 .venv/bin/python bench/p2p_layers.py [--calls 2000] [--rounds 30]

Each form sends 2 float32 to the next rank and receives 2 from the previous one, in
one job, its blocks rotated every round (``--calls`` calls timed after 200 untimed, the
slowest rank's per-call time, the median over rounds):

- ``Sendrecv``: mpi4py's one call, the baseline of ``bench/overhead.py --table ops``;
- ``Isend + Recv + Wait``: the same three calls in mpi4py;
- ``bound closures``: the fast path's bound calls of ``mcrdl_torch`` called directly
  (what a call costs past the frontend: the per-call checks, the compiled issue and
  poll, the Work's registration and wait, and the flight recorder's entries);
- the same on a group whose plans carry no recorder entry (the recorder's share);
- ``mcrdl_torch``: the frontend's calls (its tensor facts, the call key, the lookup).

The differences between neighbouring rows are the layers' costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import mcrdl_core as core
import mcrdl_torch as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    rt = core.init()
    comm = MPI.COMM_WORLD
    me, n = comm.rank, comm.size
    nxt, prv = (me + 1) % n, (me - 1) % n
    x, y = np.ones(2, np.float32), np.empty(2, np.float32)
    t, u = torch.ones(2), torch.empty(2)
    on, off = core.new_group(backend="mpi"), core.new_group(backend="mpi")

    def frontend(g):
        def step():
            w = dist.isend(t, nxt, group=g)
            dist.recv(u, prv, group=g)
            w.wait()
        return step

    for g in (on, off):  # the bound closures exist after a few calls
        for _ in range(50):
            frontend(g)()
    for key, v in list(rt.choices.items()):  # the off group's plans: no recorder entry
        if getattr(v, "desc", None) is not None and v.desc[0] is off:
            v.desc = None
        elif isinstance(key, tuple) and off in key and callable(v):
            del rt.choices[key]  # (made again from the plan, without an entry)
    for _ in range(50):
        frontend(off)()

    def bound(g):
        send = rt.choices[(dist._K_SEND, t.dtype, nxt, g, None, True)]
        recv = rt.choices[(dist._K_RECV, u.dtype, prv, g, None, False)]
        tp, up = t.data_ptr(), u.data_ptr()

        def step():
            w = send(tp, 2, 0, t)
            recv(up, 2, 0, u)
            w.wait()
        return step

    def sendrecv():
        comm.Sendrecv(x, nxt, 0, y, prv, 0)

    def three():
        r = comm.Isend(x, nxt, 0)
        comm.Recv(y, prv, 0)
        r.Wait()

    forms = {"Sendrecv (mpi4py)": sendrecv, "Isend + Recv + Wait (mpi4py)": three,
             "bound closures, no recorder": bound(off), "bound closures": bound(on),
             "mcrdl_torch isend + recv + wait": frontend(on)}
    names = list(forms)
    per = {k: [] for k in names}
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            f = forms[k]
            for _ in range(200):
                f()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                f()
            v = np.array([(time.perf_counter() - t0) / a.calls * 1e6])
            comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MAX)
            per[k].append(v[0])
    if me == 0:
        print(f"{n} ranks, {a.rounds} rounds of {a.calls} steps, medians of the slowest "
              f"rank, load average {os.getloadavg()[0]:.2f}")
        prev = None
        for k in names:
            m = statistics.median(per[k])
            step = "" if prev is None else f"  (+{m - prev:.2f} over the row above)"
            print(f"{k:34s} {m:6.2f} µs{step}")
            prev = m


if __name__ == "__main__":
    main()
