"""A small load generator: another job busy on the same cores, to measure what MCR-DL's
tuning does on a shared machine (docs/tuning.md, "Measuring under load").

Two kinds of load:

* ``--mode mpi`` (default): a second MPI job of ``--ranks`` ranks (2) that alternates a
  few milliseconds of NumPy work with small MPI all-reduces, as a training job beside
  yours would; its ranks spin in MPI's waits, so they hold their cores.
* ``--mode spin``: ``--ranks`` plain processes, each a busy loop of NumPy work.

Use it around a command (load starts, the command runs, load stops; the command's exit
status is returned)::

    .venv/bin/python bench/loadgen.py -- mpiexec -n 2 .venv/bin/mcrdl tune -o /tmp/t.json

or alone for ``--seconds`` (default: until Ctrl-C)::

    .venv/bin/python bench/loadgen.py --seconds 600 &

It prints, when it stops, how much work each rank did (steps per second), so that two
loaded runs can be compared.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)


def work(ms: float, a: np.ndarray) -> None:
    """About ``ms`` milliseconds of arithmetic on ``a`` (in place, no allocation)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        np.multiply(a, 1.0000001, out=a)
        np.add(a, 1e-7, out=a)


def worker(mode: str, seconds: float | None, compute_ms: float, nbytes: int) -> int:
    """One rank (``mpi``) or process (``spin``) of load, until ``seconds`` pass or a
    SIGTERM/SIGINT; prints its steps per second at the end."""
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    a = np.ones(1 << 14)
    comm = buf = None
    if mode == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        buf = np.ones(max(nbytes // 8, 1))
    t0 = time.perf_counter()
    steps = 0
    while True:
        work(compute_ms, a)
        if comm is not None:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            buf.fill(1.0)
            # every rank stops together: a rank leaving alone would hang the others
            done = comm.allreduce(1 if stop or (seconds and time.perf_counter() - t0 > seconds)
                                  else 0, op=MPI.MAX)
        else:
            done = stop or (seconds and time.perf_counter() - t0 > seconds)
        steps += 1
        if done:
            break
    rank = comm.Get_rank() if comm is not None else os.getpid()
    print(f"loadgen {mode} {rank}: {steps / (time.perf_counter() - t0):.0f} steps/s",
          file=sys.stderr, flush=True)
    return 0


def start(args) -> list[subprocess.Popen]:
    """The load's processes (an mpiexec job, or ``--ranks`` spinning processes)."""
    cmd = [sys.executable, HERE, "--worker", "--mode", args.mode, "--compute-ms",
           str(args.compute_ms), "--bytes", str(args.bytes)]
    if args.seconds:
        cmd += ["--seconds", str(args.seconds)]
    if args.mode == "mpi":
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
        return [subprocess.Popen([mpiexec, "-n", str(args.ranks)] + cmd)]
    return [subprocess.Popen(cmd) for _ in range(args.ranks)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT if len(procs) == 1 else signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("mpi", "spin"), default="mpi")
    ap.add_argument("--ranks", type=int, default=2, help="ranks or processes of load (2)")
    ap.add_argument("--seconds", type=float, help="stop after this long (default: never)")
    ap.add_argument("--compute-ms", type=float, default=2.0,
                    help="NumPy work between two all-reduces, ms (2)")
    ap.add_argument("--bytes", type=int, default=4096, help="all-reduce size (4096)")
    ap.add_argument("--warmup", type=float, default=3.0,
                    help="seconds of load before the command starts (3)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- COMMAND...: run it under load, then stop the load")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.mode, args.seconds, args.compute_ms, args.bytes)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    procs = start(args)
    try:
        if not command:
            while all(p.poll() is None for p in procs):
                time.sleep(0.5)
            return 0
        time.sleep(args.warmup)  # let the load average see it
        return subprocess.call(command)
    except KeyboardInterrupt:
        return 130
    finally:
        stop(procs)


if __name__ == "__main__":
    sys.exit(main())
