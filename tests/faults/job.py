"""One fault-injection job (run by tests/test_faults.py and tests/faults/table.py).

    mpiexec -n 2 python tests/faults/job.py CASE [CASE ...]
    mpiexec -n 2 -disable-auto-cleanup python tests/faults/job.py kill_collective:mpi

Each CASE is ``name:backend``. Every rank runs the cases in order; for each one it prints
one line ``FAULT {json}`` with the case, its rank, the outcome (``ok`` or the exception's
class name), the seconds it took and the message's first 300 characters. Cases that
leave their group broken run on a group of their own (``new_group``), so several of
them share one launch; the ranks meet on a fresh group between cases. A case that breaks
the whole runtime (``straggler_first_r:gloo``: the bootstrap exchange of Gloo's store
address times out) or kills a rank must come last. A case's straggler
rank sleeps ``MCRDL_TIMEOUT`` + 2 s, so that its peer's timeout has fired.
"""
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import torch

import mcrdl_torch as dist
from mcrdl_core.base.errors import McrdlError

TIMEOUT = float(os.environ.get("MCRDL_TIMEOUT", "3"))
dist.init_process_group()
RANK, SIZE = dist.get_rank(), dist.get_world_size()
BIG = int(os.environ.get("FAULT_BIG_ELEMS", 16 << 20))  # 64 MiB of float32


def report(case, outcome, seconds, message=""):
    print("FAULT " + json.dumps({"case": case, "rank": RANK, "outcome": outcome,
                                 "seconds": round(seconds, 2), "message": message[:300]}),
          flush=True)


def run(case, fn):
    t0 = time.perf_counter()
    try:
        fn()
    except McrdlError as exc:
        report(case, type(exc).__name__, time.perf_counter() - t0, str(exc))
        return exc
    except Exception as exc:  # a library's own error: reported as such, not hidden
        report(case, type(exc).__name__, time.perf_counter() - t0, str(exc))
        return exc
    report(case, "ok", time.perf_counter() - t0)
    return None


def meet():
    """Both ranks here before the next case (a fresh group each time: the cases' groups
    may be broken)."""
    import mcrdl_core

    engine = mcrdl_core.get_runtime().engine
    engine.timeout = 10 * TIMEOUT  # a peer may still be in its own timeout
    try:
        dist.barrier(group=dist.new_group(list(range(SIZE))), backend="mpi"
                     if dist.available_backends()["mpi"] is None else "gloo")
    finally:
        engine.timeout = TIMEOUT


def linger():
    time.sleep(TIMEOUT + 2)


# --- a rank that never makes the call -------------------------------------------------
def straggler(backend, later, first_rank=0, lag=None):
    """``lag`` (seconds): the call is async and waited that long after it was issued, so
    the library's clock starts before MCR-DL's (which starts at the wait); MCR-DL's
    CommTimeoutError must still come first (Gloo's own timeout is set 1 s later)."""
    g = dist.new_group(list(range(SIZE)))
    t = torch.ones(4)
    kind = "async" if lag is not None else "later" if later else "first"
    name = f"straggler_{kind}{'_r' if first_rank else ''}:{backend}"
    if later:
        run(name + " (warm-up)", lambda: dist.all_reduce(t, group=g, backend=backend))

    def call():
        if lag is None:
            return dist.all_reduce(t, group=g, backend=backend)
        work = dist.all_reduce(t, group=g, backend=backend, async_op=True)
        time.sleep(lag)
        return work.wait()

    if RANK == first_rank:
        exc = run(name, call)
        if exc is not None:  # the group is broken now: the next call refuses at once
            run(name + " (next call)", lambda: dist.all_reduce(t, group=g, backend=backend))
    else:
        linger()


# --- a rank killed in the middle of a transfer -----------------------------------------
def _die_soon(how, delay=0.05):
    """End this process ``delay`` s from now, in the middle of the transfers: by SIGKILL
    (``kill``), or by ``os._exit(1)`` (``crash``: a process that dies without a signal,
    which hydra's -disable-auto-cleanup leaves its peers running after)."""
    die = ((lambda: os.kill(os.getpid(), signal.SIGKILL)) if how == "kill"
           else (lambda: os._exit(1)))
    threading.Timer(delay, die).start()


def dead_collective(backend, how):
    t = torch.ones(BIG)
    dist.all_reduce(t[:4], backend=backend)  # communicators made: the death hits transfers
    if RANK == SIZE - 1:
        _die_soon(how)
    run(f"{how}_collective:{backend}", lambda: [dist.all_reduce(t, backend=backend)
                                               for _ in range(200)])


def dead_p2p(backend, how):
    t = torch.ones(BIG)
    dist.all_reduce(t[:4], backend=backend)  # communicators made: the death hits transfers
    if RANK == 1:
        _die_soon(how)
        for _ in range(200):
            dist.send(t, 0, backend=backend)
    elif RANK == 0:
        run(f"{how}_p2p:{backend}", lambda: [dist.recv(t, 1, backend=backend)
                                            for _ in range(200)])


# --- mismatched collectives ------------------------------------------------------------
def mismatch(kind, backend):
    g = dist.new_group(list(range(SIZE)))
    name = f"mismatch_{kind}{'+debug' if dist_debug() else ''}:{backend}"
    t = torch.ones(4)
    if kind == "op":
        fn = (lambda: dist.all_reduce(t, group=g, backend=backend)) if RANK == 0 else \
             (lambda: dist.broadcast(t, 0, group=g, backend=backend))
    elif kind == "size":
        t = torch.ones(4 if RANK == 0 else 1 << 16)
        fn = lambda: dist.all_reduce(t, group=g, backend=backend)  # noqa: E731
    elif kind == "root":
        fn = lambda: dist.broadcast(t, RANK, group=g, backend=backend)  # noqa: E731
    elif kind == "dtype":
        t = torch.ones(4, dtype=torch.float32 if RANK == 0 else torch.float64)
        fn = lambda: dist.all_reduce(t, group=g, backend=backend)  # noqa: E731
    run(name, fn)


def dist_debug():
    import mcrdl_core

    return mcrdl_core.get_runtime().debug


# --- tuning tables ---------------------------------------------------------------------
def table(kind, backend):
    """A bad table: a warning, the policy picks, the result is right."""
    from mcrdl_core.dispatch.runtime import get_runtime
    from mcrdl_core.dispatch.selection import SCHEMA, fingerprint, table_from_env

    path = os.path.join(os.environ.get("FAULT_TMP", "/tmp"), f"mcrdl-fault-{kind}-{RANK}.json")
    def entry(name):
        return {"op": "all_reduce", "world_size": SIZE, "hosts": 1, "device": "cpu",
                "dtype_class": "float", "ranges": [[None, name]]}
    body = {
        "corrupt": "{not json",
        "truncated": json.dumps({"schema": SCHEMA, "machine": fingerprint(),
                                 "entries": [entry("gloo")]})[:60],
        "foreign": json.dumps({"schema": SCHEMA, "machine": {**fingerprint(), "host": "elsewhere",
                                                             "cpu": "another CPU"},
                               "entries": [entry("gloo")]}),
        "missing_backend": json.dumps({"schema": SCHEMA, "machine": fingerprint(),
                                       "entries": [entry("nosuch")]}),
    }[kind]
    with open(path, "w") as f:
        f.write(body)

    def go():
        os.environ["MCRDL_TUNING_TABLE"] = path
        get_runtime().set_table(table_from_env())
        t = torch.full((8,), float(RANK + 1))
        dist.all_reduce(t)
        expect = SIZE * (SIZE + 1) / 2
        if not torch.equal(t, torch.full((8,), expect)):
            raise AssertionError(f"wrong result {t.tolist()}, expected {expect}")
    run(f"table_{kind}:auto", go)
    os.environ["MCRDL_TUNING_TABLE"] = "none"


# --- async work never waited -----------------------------------------------------------
def async_unwaited(backend, where):
    t = torch.full((1024,), float(RANK + 1))
    w = dist.all_reduce(t, async_op=True, backend=backend)
    del w

    def go():
        if where == "destroy":
            dist.destroy_process_group()
            expect = SIZE * (SIZE + 1) / 2
            if not torch.equal(t, torch.full((1024,), expect)):
                raise AssertionError("destroy_process_group returned before the work was done")
    run(f"async_unwaited_{where}:{backend}", go)


CASES = {
    "straggler_first": lambda b: straggler(b, later=False),
    "straggler_first_r": lambda b: straggler(b, later=False, first_rank=SIZE - 1),
    "straggler_later": lambda b: straggler(b, later=True),
    "straggler_async": lambda b: straggler(b, later=True, lag=0.5),
    "kill_collective": lambda b: dead_collective(b, "kill"),
    "kill_p2p": lambda b: dead_p2p(b, "kill"),
    "crash_collective": lambda b: dead_collective(b, "crash"),
    "crash_p2p": lambda b: dead_p2p(b, "crash"),
    "mismatch_op": lambda b: mismatch("op", b),
    "mismatch_size": lambda b: mismatch("size", b),
    "mismatch_root": lambda b: mismatch("root", b),
    "mismatch_dtype": lambda b: mismatch("dtype", b),
    "table_corrupt": lambda b: table("corrupt", b),
    "table_truncated": lambda b: table("truncated", b),
    "table_foreign": lambda b: table("foreign", b),
    "table_missing_backend": lambda b: table("missing_backend", b),
    "async_unwaited_destroy": lambda b: async_unwaited(b, "destroy"),
    "async_unwaited_exit": lambda b: async_unwaited(b, "exit"),
}

if __name__ == "__main__":
    for i, arg in enumerate(sys.argv[1:]):
        if i:
            meet()
        name, _, backend = arg.partition(":")
        CASES[name](backend)
    print(f"FAULTJOB rank {RANK} done", flush=True)
