"""What the flight recorder costs a call on the fast path (docs/reliability.md).

    python bench/recorder_cost.py [--pairs 6] [--calls 20000] [--ranks 2]

Launches ``--pairs`` pairs of 2-rank jobs (mpiexec), one with the recorder on (the
default, MCRDL_TRACE_ENTRIES=4096) and one with it off (``MCRDL_TRACE_ENTRIES=0``),
alternately, so that a change in the machine's load meets both alike. Each job times
blocking calls of 4 float32 elements on MPI through the bound fast path of mcrdl_torch
(``all_reduce``, ``broadcast``) and of the NumPy core (``mcrdl_core.all_reduce`` on an
ndarray): rounds of ``--calls`` calls, the median round per call. The table gives per
op the median over the jobs of each setting, on minus off, and the A/A row: the same
setting's even jobs against its odd ones (what noise alone makes of a difference). ``--inproc``: one job instead, whose rounds alternate between two recorded groups and
one whose plans carry no recorder description (the state every plan has under
``MCRDL_TRACE_ENTRIES=0``), the fastest round of each kept: jobs differ from each other
by more than the recorder costs on a shared machine, rounds of one job much less. Also ``--micro``: the recorder's own steps (an entry made and appended,
its end time set) timed in one process, without MPI.

Figures mean something on a quiet machine only: the load average is printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ("torch.all_reduce", "torch.broadcast", "numpy.all_reduce")
#: --inproc times these too: a gather of tensors, a list form, and a pipeline's step
#: (isend to the next rank, blocking recv from the previous one, wait)
MORE = ("torch.all_gather_into_tensor", "torch.all_gather (list of 2)",
        "torch.isend+recv+wait")


def job(calls: int, rounds: int) -> None:
    """One job's timings (run under mpiexec): rank 0 prints one JSON line."""
    import numpy as np
    import torch

    import mcrdl_core as core
    import mcrdl_torch as dist

    core.init()
    t = torch.ones(4)
    a = np.ones(4, np.float32)
    fns = {"torch.all_reduce": lambda: dist.all_reduce(t, backend="mpi"),
           "torch.broadcast": lambda: dist.broadcast(t, 0, backend="mpi"),
           "numpy.all_reduce": lambda: core.all_reduce(a, backend="mpi")}
    out = {}
    for name, fn in fns.items():
        for _ in range(2000):  # warm: the memo, the bound closure
            fn()
        per = []
        for _ in range(rounds):
            dist.barrier(backend="mpi")
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t0) / calls)
        out[name] = statistics.median(per)
    if core.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def inproc(calls: int, rounds: int) -> None:
    """One job, rounds interleaved (run under mpiexec): the same calls on three groups of
    every rank, two recorded ("on", "on2": the A/A pair) and one whose plans carry no
    recorder description (what MCRDL_TRACE_ENTRIES=0 gives every plan), its bound
    closures made again from them. Rank 0 prints one JSON line."""
    import numpy as np
    import torch

    import mcrdl_core as core
    import mcrdl_torch as dist

    rt = core.init()
    groups = {k: core.new_group(backend="mpi") for k in ("on", "on2", "off")}
    t = torch.ones(4)
    a = np.ones(4, np.float32)
    n, me = core.get_world_size(), core.get_rank()
    big = torch.empty(4 * n)
    parts = [torch.empty(4) for _ in range(n)]
    nxt, prv = (me + 1) % n, (me - 1) % n
    got = torch.empty(4)

    def step(g):
        w = dist.isend(t, nxt, group=g)
        dist.recv(got, prv, group=g)
        w.wait()

    def fns(g):
        return {"torch.all_reduce": lambda: dist.all_reduce(t, group=g),
                "torch.broadcast": lambda: dist.broadcast(t, 0, group=g),
                "numpy.all_reduce": lambda: core.all_reduce(a, group=g),
                "torch.all_gather_into_tensor":
                    lambda: dist.all_gather_into_tensor(big, t, group=g),
                "torch.all_gather (list of 2)": lambda: dist.all_gather(parts, t, group=g),
                "torch.isend+recv+wait": lambda: step(g)}
    table = {k: fns(g) for k, g in groups.items()}
    for k in table:
        for fn in table[k].values():
            for _ in range(100):
                fn()
    off = groups["off"]
    for key, v in list(rt.choices.items()):
        if getattr(v, "desc", None) is not None and v.desc[0] is off:
            v.desc = None  # (an instance attribute: this plan records nothing now)
        elif isinstance(key, tuple) and off in key and callable(v):
            del rt.choices[key]  # a bound call of the off group: made again, without
    per = {k: {op: [] for op in OPS + MORE} for k in table}
    orders = (("on", "off", "on2"), ("off", "on2", "on"), ("on2", "on", "off"))
    for r in range(rounds):
        for op in OPS + MORE:
            for k in orders[r % 3]:  # (each group in each place alike: the first block
                # after another op's pays for the switch)
                fn = table[k][op]
                for _ in range(200):
                    fn()
                dist.barrier(backend="mpi")
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                per[k][op].append((time.perf_counter() - t0) / calls)
    if core.get_rank() == 0:  # every round's figure; main() pairs them round by round
        print("RESULT " + json.dumps(per), flush=True)


def micro() -> dict:
    """The recorder's own steps on one call, timed alone (µs)."""
    from mcrdl_core.observe import recorder as rec
    from mcrdl_core.world.group import Group

    g = Group(0, [0], 0)
    desc = rec.describe(g, "all_reduce", None, "mpi", rule="policy")
    note, end = rec.call, rec.end

    def step():  # what an explicit entry adds to a blocking call (its note, then its end)
        end(note(desc, 4))

    # many short repeats, the fastest kept: on a shared machine some run undisturbed
    n = 2000
    best = min(timeit.repeat(step, number=n, repeat=500)) / n
    empty = min(timeit.repeat(lambda: None, number=n, repeat=500)) / n
    return {"entry_us": round((best - empty) * 1e6, 4)}


def launch(on: bool, calls: int, rounds: int, ranks: int, mode: str = "--job") -> dict:
    env = dict(os.environ, MCRDL_TUNING_TABLE="none", PYTHONUNBUFFERED="1",
               MCRDL_TRACE_ENTRIES="4096" if on else "0")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, __file__, mode,
           "--calls", str(calls), "--rounds", str(rounds)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the job failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--micro", action="store_true", help="the recorder's steps alone")
    p.add_argument("--inproc", action="store_true",
                   help="one job, rounds interleaved: recorded groups against one without")
    p.add_argument("--inproc-job", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.job:
        job(a.calls, a.rounds)
        return
    if a.inproc_job:
        inproc(a.calls, a.rounds)
        return
    if a.inproc:
        load = os.getloadavg()
        r = launch(True, a.calls, a.rounds, a.ranks, "--inproc-job")
        end = os.getloadavg()
        print(f"one {a.ranks}-rank job, {a.rounds} rounds of {a.calls} calls per group "
              f"interleaved (on, off, on2 back to back in each round, in rotated order); on and off: the "
              f"median round; on-off and A/A: the median over rounds of the round's "
              f"difference; load average {load[0]:.2f} at start, {end[0]:.2f} at end")
        print(f"{'op':<28} {'on µs':>8} {'off µs':>8} {'on-off':>8} {'A/A on2-on':>11}")
        med = statistics.median
        for op in OPS + MORE:
            on, on2, off = (r[k][op] for k in ("on", "on2", "off"))
            print(f"{op:<28} {med(on) * 1e6:8.3f} {med(off) * 1e6:8.3f} "
                  f"{med(x - y for x, y in zip(on, off)) * 1e6:8.3f} "
                  f"{med(x - y for x, y in zip(on2, on)) * 1e6:11.3f}")
        return
    load = os.getloadavg()
    if a.micro:
        print(json.dumps(dict(micro(), load=[round(x, 2) for x in load])))
        return
    runs = {True: [], False: []}
    for _ in range(a.pairs):
        for on in (True, False):
            runs[on].append(launch(on, a.calls, a.rounds, a.ranks))
    end = os.getloadavg()
    print(f"recorder on (MCRDL_TRACE_ENTRIES=4096) vs off (0): {a.pairs} pairs of "
          f"{a.ranks}-rank jobs, {a.rounds} rounds of {a.calls} calls; load average "
          f"{load[0]:.2f} at start, {end[0]:.2f} at end")
    print(f"{'op':<18} {'on µs':>8} {'off µs':>8} {'on-off':>8} {'A/A on':>8} {'A/A off':>8}")
    for op in OPS:
        on = [r[op] * 1e6 for r in runs[True]]
        off = [r[op] * 1e6 for r in runs[False]]
        # A/A: the even jobs of one setting against its odd ones (interleaved in time)
        aa_on = statistics.median(on[::2]) - statistics.median(on[1::2]) if len(on) > 1 \
            else float("nan")
        aa_off = statistics.median(off[::2]) - statistics.median(off[1::2]) if len(off) > 1 \
            else float("nan")
        print(f"{op:<18} {statistics.median(on):8.3f} {statistics.median(off):8.3f} "
              f"{statistics.median(on) - statistics.median(off):8.3f} {aa_on:8.3f} "
              f"{aa_off:8.3f}")


if __name__ == "__main__":
    main()
