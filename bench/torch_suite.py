"""Run torch's own distributed test suite (``torch.testing._internal.distributed.
distributed_test``) against the "mcrdl" backend and against gloo, side by side.

    .venv/bin/python bench/torch_suite.py                  # both backends, the default set
    .venv/bin/python bench/torch_suite.py --backends mcrdl -k all_gather_coalesced
    .venv/bin/python bench/torch_suite.py --list           # the selected test names

The suite's ``_DistTestBase`` gates many tests on the backend's *name* ("gloo"), read
from ``BACKEND`` when the module is imported. This driver imports it with
``BACKEND=gloo`` so those gates are open, then points the module's ``BACKEND`` at the
backend under test, so ``init_process_group`` (and the few tests that branch on the name
at run time) see "mcrdl". Each test spawns ``WORLD_SIZE`` processes (``spawn`` start
forked: the children inherit the patched module), which call
``init_process_group(backend, init_method="file://...", rank=r, world_size=n)``, the
launch of item 14 of the torch-backend issue. All tests of one backend run in one
interpreter (``--worker``), one backend after the other.

Selected by default: the collective, point-to-point and CPU DistributedDataParallel
tests (names below); CUDA/NCCL-only tests skip themselves on a CPU machine. Results go
to ``bench/out/torch_suite.json`` and a table on stdout (pass / fail / skip per backend,
and every test whose outcome differs).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import unittest
from pathlib import Path

os.environ.setdefault("BACKEND", "gloo")  # open the name-gated tests (see docstring)
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="mcrdl-torch-suite-"))
os.environ.setdefault("MCRDL_TUNING_TABLE", "none")
os.environ.setdefault("MCRDL_TIMEOUT", "60")
for _v in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "HYDRA_CONTROL_FD",
           "RANK", "MASTER_PORT"):
    os.environ.pop(_v, None)  # each test makes its own rendezvous

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402

import mcrdl_autoload  # noqa: E402

mcrdl_autoload.register()
dt.BACKEND = os.environ.get("MCRDL_SUITE_BACKEND", "gloo")

SELECT = re.compile(r"^test_(all_reduce|reduce|broadcast|all_gather|gather|scatter|all_to_all|"
                    r"barrier|send_recv|isend|irecv|batch_isend_irecv|DistributedDataParallel|"
                    r"ddp_)")
EXCLUDE = re.compile(r"cuda|gpu|nccl|Gpu|GPU|_multigpu|device_id")


class TestMcrdlSuite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """The suite's tests, run in spawned processes (``MultiProcessTestCase``)."""

    def setUp(self):
        super().setUp()
        # fork: the children inherit the patched BACKEND and the imports (spawn would
        # import torch again in every child of every test)
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


def names(pattern: str | None) -> list[str]:
    found = [n for n in unittest.TestLoader().getTestCaseNames(TestMcrdlSuite)
             if SELECT.search(n) and not EXCLUDE.search(n)]
    if pattern:
        found = [n for n in found if re.search(pattern, n)]
    return found


#: where a worker reports each outcome as it comes: the driver's stdout (a descriptor it
#: hands down), since the worker's own stdout and stderr go to a log
_PROGRESS = (os.fdopen(int(os.environ["MCRDL_SUITE_FD"]), "w")
             if os.environ.get("MCRDL_SUITE_FD") else sys.stderr)


class _Record(unittest.TextTestResult):
    """Keeps each test's outcome and time."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.rows: dict = {}
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.perf_counter()
        super().startTest(test)

    def _row(self, test, outcome, detail=""):
        self.rows[test._testMethodName] = {"outcome": outcome, "detail": detail[-1500:],
                                           "seconds": round(time.perf_counter() - self._t0, 2)}
        print(f"{dt.BACKEND:6s} {outcome:5s} {self.rows[test._testMethodName]['seconds']:6.1f}s "
              f"{test._testMethodName}", file=_PROGRESS, flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._row(test, "pass")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._row(test, "skip", str(reason))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._row(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._row(test, "fail", self._exc_info_to_string(err, test))


def worker(tests: list[str], out: str) -> None:
    """Run ``tests`` on ``dt.BACKEND`` in this interpreter; write the outcomes to ``out``."""
    suite = unittest.TestSuite(TestMcrdlSuite(n) for n in tests)
    with open(os.devnull, "w") as sink:
        result = unittest.TextTestRunner(stream=sink, resultclass=_Record, verbosity=0).run(suite)
    Path(out).write_text(json.dumps(result.rows))


def run_backend(backend: str, tests: list[str], timeout: float) -> dict:
    """All ``tests`` on ``backend`` in one child interpreter (a hang ends it)."""
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    fd = os.dup(sys.stdout.fileno())
    env = dict(os.environ, MCRDL_SUITE_BACKEND=backend, MCRDL_SUITE_FD=str(fd))
    cmd = [sys.executable, __file__, "--worker", out, "-k", "^(" + "|".join(tests) + ")$"]
    log = Path(out).with_suffix(".log")
    try:
        with open(log, "w") as sink:  # the children's chatter; outcomes come from ``out``
            subprocess.run(cmd, env=env, timeout=timeout, stdout=sink, stderr=subprocess.STDOUT,
                           pass_fds=(fd,))
    except subprocess.TimeoutExpired:
        pass
    finally:
        os.close(fd)
    rows = json.loads(Path(out).read_text() or "{}") if Path(out).stat().st_size else {}
    for n in tests:
        rows.setdefault(n, {"outcome": "hang", "detail": "no result (the run ended first)",
                            "seconds": None})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["gloo", "mcrdl"])
    ap.add_argument("-k", help="regular expression on test names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per backend")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "torch_suite.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tests = names(args.k)
    if args.worker:
        worker(tests, args.worker)
        return 0
    if args.list:
        print("\n".join(tests))
        print(f"{len(tests)} tests", file=sys.stderr)
        return 0
    t_all = time.perf_counter()
    results = {b: run_backend(b, tests, args.timeout) for b in args.backends}
    wall = time.perf_counter() - t_all
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"world_size": os.environ["WORLD_SIZE"],
                                          "seconds": round(wall, 1), "results": results},
                                         indent=1))
    print(f"\n{len(tests)} tests, world size {os.environ['WORLD_SIZE']}, {wall:.0f} s")
    for b in args.backends:
        c = {k: sum(1 for r in results[b].values() if r["outcome"] == k)
             for k in ("pass", "fail", "skip", "hang")}
        print(f"{b:6s}: {c['pass']} pass, {c['fail']} fail, {c['skip']} skip, {c['hang']} hang")
    if len(args.backends) > 1:
        diff = [n for n in tests if len({results[b][n]["outcome"] for b in args.backends}) > 1]
        for n in diff:
            print(f"  differs: {n}: " + ", ".join(f"{b} {results[b][n]['outcome']}"
                                                   for b in args.backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
