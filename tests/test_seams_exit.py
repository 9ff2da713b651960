"""A job in which any rank failed exits non-zero (issue 48, defect 17; DESIGN.md, "A
failure is visible").

Rank 1 of 3 dies of an uncaught exception while ranks 0 and 2 are in an all-reduce on
MPI or on Gloo (tests/faults/uncaught_job.py); the survivors handle their error, so only
rank 1 failed. Before the fix rank 1 lingered in the exit barrier and MPI_Finalize, the
survivors waited out MCRDL_TIMEOUT, and the exit guard's ``os._exit(0)`` made mpiexec
return 0. Now the job must end with a non-zero status well before MCRDL_TIMEOUT, with
rank 1's traceback and the reason in its output. Each backend is launched three times
(two launches at a time): the outcome must not depend on timing."""
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "faults"))
import plan  # noqa: E402

TIMEOUT_S = 12.0  # MCRDL_TIMEOUT of the launches: the survivors' wait must not reach it
REPEATS = 3


def _launch(backend: str) -> dict:
    cmd = [str(plan.BIN / "mpiexec"), "-n", "3", sys.executable,
           str(plan.HERE / "uncaught_job.py"), backend]
    # a short exit barrier: with the old exit, rank 1 left it before the survivors'
    # timeout, which is what made the job return 0
    env = plan.env({"MCRDL_TIMEOUT": str(TIMEOUT_S), "MCRDL_FAULT_GRACE_S": "1"})
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=4 * TIMEOUT_S + 30)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        out = "".join(b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                      for b in (exc.stdout, exc.stderr))
    end = time.time()
    raised = re.search(r"RAISED (\d+\.\d+)", out)
    return {"rc": rc, "out": out, "after": end - float(raised.group(1)) if raised else None}


@pytest.fixture(scope="module")
def launches():
    todo = [b for b in ("mpi", "gloo") for _ in range(REPEATS)]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(_launch, todo))
    return {b: [r for t, r in zip(todo, done) if t == b] for b in ("mpi", "gloo")}


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_an_uncaught_exception_on_one_rank_fails_the_job_at_once(launches, backend):
    for i, r in enumerate(launches[backend]):
        tail = r["out"][-4000:]
        assert r["rc"] is not None, f"launch {i}: hung\n{tail}"
        assert r["after"] is not None, f"launch {i}: rank 1 never raised\n{tail}"
        assert r["rc"] != 0, f"launch {i}: the job exited 0 although rank 1 failed\n{tail}"
        assert "RuntimeError: rank 1 dies of an uncaught exception" in r["out"], tail
        assert "uncaught RuntimeError" in r["out"] and "MPI_Abort" in r["out"], tail
        # ended long before the survivors' wait would have timed out
        assert r["after"] < TIMEOUT_S - 2, (f"launch {i}: the job ended {r['after']:.1f} s "
                                            f"after rank 1 raised\n{tail}")
