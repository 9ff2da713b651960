"""A job of faults for the flight recorder (tests/test_trace_faults.py launches it):

    mpiexec -n 3 -disable-auto-cleanup python tests/trace_job.py BACKEND KIND [KIND ...]

Each KIND is one fault, on a group of all ranks of its own (made up front, so a fault
breaks only its group), after two calls that complete: its dumps go to
``$TRACE_BASE/KIND`` (MCRDL_TRACE_DIR is set per phase, and the ring emptied, as if each
phase were a job of its own). The ranks meet on mpi4py's COMM_WORLD between phases.
Kinds: missing (rank 1 skips an all-reduce and waits in a barrier on another group),
ops (rank 1 calls all_gather_into_tensor where the others all_reduce), sizes (rank 2
all-reduces 8 elements, the others 4), backends (rank 2 on the other backend), codecs
(rank 0 bf16, the others fp16, on MPI), slow (rank 2 arrives 2 x MCRDL_TIMEOUT late), killed
(rank 2 kills itself before the all-reduce; must be last). A rank whose call returned
(MPI completes some mismatches with wrong data) dumps by ``dump_trace()``. Each rank prints ``PHASE
KIND rank R: OUTCOME``.

The killed rank is a child process (``_stand_in``): hydra ends every rank still running
once one of its processes dies, even under ``-disable-auto-cleanup`` (fresh-clone runs
lost a survivor's dump so, or left it half-written as ``rank-1.json.PID.tmp``), so
hydra's own process of rank 2 outlives the killed child until every survivor has written
its dump, then dies by the same signal. The survivors see exactly a dead peer (its
sockets closed, its calls never made), and each ends only once every survivor's dump is
there.
"""
import os
import signal
import sys
import time

DEADLINE_S = 90.0  # for the survivors' dumps of the killed phase (each takes seconds)


def _dumps(base: str, size: int, dead: int = 2) -> list:
    return [os.path.join(base, "killed", f"rank-{r}.json") for r in range(size) if r != dead]


def _wait_for(paths, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not all(map(os.path.exists, paths)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stand_in() -> None:
    """Rank 2 of a job with the killed phase: fork before MPI starts; the child returns and
    is rank 2 (MPI, the runtime, the phases); this process, the one hydra launched, waits
    for it and, when it was killed, for the survivors' dumps, then ends as it did."""
    if "killed" not in sys.argv[2:] or os.environ.get("PMI_RANK") != "2":
        return
    child = os.fork()
    if child == 0:
        return
    status = os.waitpid(child, 0)[1]
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) == signal.SIGKILL:
            _wait_for(_dumps(os.environ["TRACE_BASE"], int(os.environ["PMI_SIZE"])), DEADLINE_S)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


_stand_in()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mcrdl_core as core  # noqa: E402
from mcrdl_core.observe import recorder  # noqa: E402

BACKEND, KINDS = sys.argv[1], sys.argv[2:]
OTHER = "gloo" if BACKEND == "mpi" else "mpi"
BASE = os.environ["TRACE_BASE"]
T = float(os.environ.get("MCRDL_TIMEOUT", "2"))

rt = core.init()
rank = rt.rank
groups = {k: core.new_group(backend=BACKEND) for k in KINDS}
side = core.new_group(backend=BACKEND)  # the missing call's rank waits here
world = MPI.COMM_WORLD


def fault(kind: str, g) -> None:
    x = np.full(1024 if kind == "codecs" else 4, rank + 1.0, np.float32)
    g.timeout = 30.0  # two calls that complete (the second makes the group's
    core.all_reduce(x, group=g)  # communicator of the other backend: on a loaded
    core.all_reduce(x, group=g, backend=OTHER)  # machine more than MCRDL_TIMEOUT)
    g.timeout = None
    if kind == "missing":
        if rank == 1:
            core.barrier(group=side)
        else:
            core.all_reduce(x, group=g)
    elif kind == "ops":
        if rank == 1:
            core.all_gather_into_tensor(np.zeros(4 * rt.world_size, np.float32), x, group=g)
        else:
            core.all_reduce(x, group=g)
    elif kind == "sizes":
        core.all_reduce(np.ones(8 if rank == 2 else 4, np.float32), group=g)
    elif kind == "backends":
        core.all_reduce(x, group=g, backend=OTHER if rank == 2 else BACKEND)
    elif kind == "codecs":
        # two codecs of one message size, on MPI: the ring completes with wrong data (Gloo
        # aborts the process on messages of two sizes, gloo::EnforceNotMet, before any dump)
        core.all_reduce(x, group=g, compression="bf16" if rank == 0 else "fp16", backend="mpi")
    elif kind == "slow":
        if rank == 2:
            time.sleep(2 * T + 1)
        core.all_reduce(x, group=g)
    elif kind == "killed":
        if rank == 2:
            world.Barrier()  # (the others' last meeting; then it dies)
            os.kill(os.getpid(), signal.SIGKILL)
        world.Barrier()
        core.all_reduce(x, group=g)
    else:
        raise SystemExit(f"unknown kind {kind}")


for kind in KINDS:
    os.environ["MCRDL_TRACE_DIR"] = os.path.join(BASE, kind)
    recorder.clear()
    try:
        fault(kind, groups[kind])
        # the call returned here (MPI completes mismatched ops or codecs of one message
        # size with wrong data, and a size mismatch on the smaller side): dump, as a
        # program that found its results wrong would
        outcome = f"ok, dumped {core.dump_trace()}"
    except core.McrdlError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(f"PHASE {kind} rank {rank}: {outcome}", flush=True)
    if kind == "killed":  # a survivor that ends first ends the job (the launcher then
        _wait_for(_dumps(BASE, world.Get_size()), DEADLINE_S)  # kills the ranks left)
    else:
        req = world.Ibarrier()  # the slow rank's phase ends later than the others'
        deadline = time.monotonic() + 4 * T + 10
        while not req.Test() and time.monotonic() < deadline:
            time.sleep(0.01)
