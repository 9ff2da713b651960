"""Fixtures for tests run on every rank under mpiexec. Every rank collects the same
tests in the same order, so collectives line up; each rank asserts its own result."""
import os

# The JAX tests here are about host arrays (HLO of host callbacks, errors raised from
# them, float32 references, auto choosing mpi): on a GPU machine JAX would put every
# array on the GPU, where auto takes nccl (two ranks on one GPU cannot run it) and
# matmuls use TF32. GPU arrays have their own tests (tests/test_jax_local.py, marked
# gpu) and bench/gpu_check.py. Set JAX_PLATFORMS yourself to run these on a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import mcrdl_torch as dist

BACKENDS = ["mpi", "gloo"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12}

dist.init_process_group()
RANK, SIZE = dist.get_rank(), dist.get_world_size()
# the subgroup lists its ranks in reverse so group ranks differ from global ranks
SUB_RANKS = {1: [0], 2: [1, 0]}.get(SIZE, [SIZE - 1, 0])
GROUPS = {"world": None, "sub": dist.new_group(SUB_RANKS)}


def members(name):
    return list(range(SIZE)) if name == "world" else SUB_RANKS


#: the group params of ``grp``; at 1 rank the subgroup is the world again ([0]), so the
#: 1-rank launch runs each such test once (about 1800 items and 25 s fewer) and leaves
#: subgroups to the 2- and 3-rank launches, where they differ from the world
GROUP_PARAMS = ["world", "sub"] if SIZE > 1 else ["world"]


@pytest.fixture(params=GROUP_PARAMS)
def grp(request):
    """(group object, its global ranks, my position); skips ranks outside the group."""
    ranks = members(request.param)
    if RANK not in ranks:
        pytest.skip("this rank is not a member of the subgroup")
    return GROUPS[request.param], ranks, ranks.index(RANK)


def values(rank, count, dtype, salt=0):
    """Deterministic small integers 1..5, exact in every dtype (sums and products of up
    to 3 ranks stay exact); every rank can compute every other rank's input."""
    v = (np.arange(count) * 7 + rank * 3 + salt) % 5 + 1
    return torch.tensor(v, dtype=torch.float64).to(dtype)


def assert_equal(actual, expected):
    expected = torch.as_tensor(expected).to(actual.dtype).reshape(actual.shape)
    tol = TOL.get(actual.dtype)
    if tol is None:
        assert torch.equal(actual, expected), f"rank {RANK}: got {actual} expected {expected}"
    else:
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol,
                                   msg=lambda m: f"rank {RANK}: {m}")


def finish(result, async_op):
    if async_op:
        assert isinstance(result, dist.Work), f"async_op=True returned {result!r}"
        result.wait()
        assert result.is_completed()
    else:
        assert result is None


#: seconds after which a test still running ends its rank and writes down every
#: thread's Python stack: the backstop for a test stuck inside C, which pytest-timeout's
#: signal (120 s in the launches) cannot interrupt. mpi4jax's primitives under jit block
#: in MPI with no timeout of their own; a jitted send or gather whose peer never comes
#: would otherwise hold the launch until its hard limit (1200 s) with no word of where.
#: The rank leaves with exit status 1, mpiexec then ends the others, and the launch fails
#: in minutes. Longer than pytest-timeout's 120 s, so a test stuck in Python code still
#: fails on its own and the suite goes on. The stacks go to ``rank<N>.stuck.txt`` in
#: MCRDL_RESULTS_DIR (the launcher prints them with the failure), else in the rank's
#: pytest temp directory (kept when the rank ends this way): not to stderr, which
#: pytest's capture holds while a test runs and loses when the process ends this way.
HARD_STOP_S = float(os.environ.get("MCRDL_TEST_HARD_STOP_S", "240"))
_DIAG = {}  # "stacks": the open file of the stacks; "first_failure": its test id


@pytest.fixture(autouse=True)
def _hard_stop(request):
    import faulthandler

    if "stacks" not in _DIAG:
        out_dir = os.environ.get("MCRDL_RESULTS_DIR") or str(request.config.option.basetemp)
        os.makedirs(out_dir, exist_ok=True)
        _DIAG["stacks"] = open(os.path.join(out_dir, f"rank{RANK}.stuck.txt"), "w")
    faulthandler.dump_traceback_later(HARD_STOP_S, exit=True, file=_DIAG["stacks"])
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def torch_world():
    """torch.distributed's default group on the "mcrdl" backend for one module's tests.
    After it, every rank waits for the others: the next module's init_process_group
    reuses MASTER_PORT (set by the first one), and a rank that got there while rank 0
    still held this module's store server would join the dead server (the core runtime
    outlives torch's group, so its barrier can do the wait)."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        tdist.init_process_group("mcrdl")
    yield
    tdist.destroy_process_group()
    dist.barrier()


def pytest_runtest_logreport(report):
    """This rank's first failure, written at once to ``rank<N>.first_failure.txt`` in
    MCRDL_RESULTS_DIR: the ranks run in step, so after one rank fails a collective the
    others can fail or hang in every later one, and pytest prints its reports only at the
    end of the session, which a hung launch never reaches. The launcher prints the file
    with the failure."""
    out_dir = os.environ.get("MCRDL_RESULTS_DIR")
    if not report.failed or not out_dir or "first_failure" in _DIAG:
        return
    _DIAG["first_failure"] = report.nodeid
    with open(os.path.join(out_dir, f"rank{RANK}.first_failure.txt"), "w") as f:
        f.write(f"{report.nodeid} ({report.when}):\n{report.longreprtext[-6000:]}\n")


def pytest_sessionfinish(session, exitstatus):
    """Each rank writes its own tally for the launcher (test_multirank.py) to read, since
    the ranks' terminal output interleaves."""
    import json
    import os

    out_dir = os.environ.get("MCRDL_RESULTS_DIR")
    if not out_dir:
        return
    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    tally = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
             for k in ("passed", "failed", "skipped", "error")}
    tally["exitstatus"] = int(exitstatus)
    tally["passed_ids"] = [r.nodeid for r in stats.get("passed", []) if r.when == "call"]
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(tally, f)
    # No rank leaves before every rank has written its tally: a process that recorded a
    # fault (tests of timeouts do) exits without MPI_Finalize, and mpiexec then kills the
    # ranks still running. A bounded nonblocking barrier on MPI's own world.
    import time

    from mpi4py import MPI

    req, deadline = MPI.COMM_WORLD.Ibarrier(), time.monotonic() + 300
    while not req.Test() and time.monotonic() < deadline:
        time.sleep(0.01)


def pytest_configure(config):
    """One base temp dir per rank: ranks sharing pytest's would race to clean it up."""
    import tempfile

    if not config.option.basetemp:
        config.option.basetemp = tempfile.mkdtemp(prefix=f"mcrdl-pytest-rank{RANK}-")
        config.add_cleanup(lambda: __import__("shutil").rmtree(config.option.basetemp, True))
