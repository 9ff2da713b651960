"""The fault-injection plan: which launches run which cases of job.py, and what each
surviving rank must see. Shared by tests/test_faults.py (asserts) and
tests/faults/table.py (prints the table of docs/reliability.md).

Outcomes are exception class names as job.py reports them, ``ok`` for a call that
returned. ``within`` bounds the seconds the reporting rank's case may take (the
timeout plus a margin; ``0.5`` for a refusal that must be immediate). An Expect lists
one outcome unless two come from a race that no setting of ours decides (a peer that
dies: whether the library sees it at once depends on the moment). Two equal timeouts
racing is not such a case: Gloo's own timeout is set 1 s later than ``MCRDL_TIMEOUT``
(backends/gloo.py), so MCR-DL's diagnosis comes first, and ``straggler_async`` checks
that where Gloo's clock starts half a second before MCR-DL's.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
TIMEOUT_S = 3.0  # MCRDL_TIMEOUT of every launch
MARGIN_S = 3.0  # what a reporting rank may take past it (a loaded 2-core machine)
BOUND = TIMEOUT_S + MARGIN_S
KILLED = "killed by the launcher"  # an outcome: the rank was ended before it reported


@dataclass
class Expect:
    case: str  # as job.py reports it
    rank: int  # the surviving / calling rank that must report
    outcomes: tuple  # acceptable outcomes
    within: float = BOUND  # seconds
    note: str = ""  # what the table says about it


@dataclass
class Launch:
    name: str
    cases: list
    expects: list
    launcher: str = "mpiexec"  # or "mpiexec-tolerant": -disable-auto-cleanup
    env: dict = field(default_factory=dict)
    rcs: tuple = (0,)  # acceptable exit statuses of the launch
    hard_timeout: float = 90.0  # seconds: past this the launch counts as a hang
    in_test: bool = True  # run by tests/test_faults.py (else only by table.py)
    note: str = ""


def _straggler(case, backend, rank=0, first=True):
    kind = "first call" if first else "later call"
    return [Expect(f"{case}:{backend}", rank, ("CommTimeoutError",),
                   note=f"{kind}: CommTimeoutError naming op, group, backend, rank"),
            Expect(f"{case}:{backend} (next call)", rank, ("BrokenGroupError",), 0.5,
                   note="next call on the group: BrokenGroupError at once")]


# A rank that exits mid-transfer: (outcomes, within, note) by "mpi" or by the Gloo case.
# The survivor's wait sees the peer's process gone (same machine: Runtime.peers_gone,
# every 0.25 s of a wait) well before MCRDL_TIMEOUT, whatever the library does.
_SOON = TIMEOUT_S  # seconds: the error must come before MCR-DL's timeout would (the
# outcome's class, CommFailedError, already rules the timeout out; this bounds the time)
_CRASH = {
    "mpi": (("CommFailedError",), _SOON,
            "rank 0: CommFailedError naming the exited rank, before the timeout (MCR-DL sees "
            "the process gone; earlier MPICH's failed on-node copy, CMA, sometimes came "
            "first); exits without MPI_Finalize"),
    "crash_collective": (("CommFailedError",), _SOON,
                         "rank 0: CommFailedError (Gloo sees the closed connection at once)"),
    "crash_p2p": (("CommFailedError",), _SOON,
                  "rank 0: CommFailedError: Gloo reads the reset when the peer died inside a "
                  "message; between messages MCR-DL sees the process gone"),
}


def _debug(kind, backend):
    return [Expect(f"mismatch_{kind}+debug:{backend}", r, ("MismatchError",), BOUND,
                   "MismatchError on every rank, before any library sees the call")
            for r in (0, 1)]


LAUNCHES = [
    # two launches (of the same kind) that tests/test_faults.py runs side by side: the
    # cases of one launch wait out their timeouts one after the other
    Launch("stragglers", [
        "straggler_first:mpi", "straggler_later:mpi", "straggler_first_r:mpi",
        "straggler_first:gloo", "straggler_later:gloo", "straggler_async:gloo",
        "straggler_first_r:gloo"],
        _straggler("straggler_first", "mpi") + _straggler("straggler_later", "mpi", first=False)
        + _straggler("straggler_first_r", "mpi", rank=1) + _straggler("straggler_first", "gloo")
        + _straggler("straggler_later", "gloo", first=False)
        + _straggler("straggler_async", "gloo", first=False)
        + _straggler("straggler_first_r", "gloo", rank=1),
        hard_timeout=150),
    Launch("undetected mismatches", [
        "mismatch_op:mpi", "mismatch_root:mpi", "mismatch_size:mpi", "mismatch_dtype:mpi",
        "mismatch_op:gloo", "mismatch_root:gloo"],
        [Expect("mismatch_op:mpi", r, ("CommTimeoutError",),
                note="both ranks: CommTimeoutError (the two ops never match)") for r in (0, 1)]
        + [Expect("mismatch_root:mpi", r, ("ok",),
                  note="no error: each rank believes it is the root; data not moved") for r in (0, 1)]
        + [Expect("mismatch_size:mpi", 0, ("ok",),
                  note="smaller side returns (partial data), no error"),
           Expect("mismatch_size:mpi", 1, ("CommTimeoutError",),
                  note="larger side: CommTimeoutError")]
        + [Expect("mismatch_dtype:mpi", r, ("ok",),
                  note="no error: bytes reduced as each rank's own type (wrong values)")
           for r in (0, 1)]
        + [Expect(f"mismatch_{k}:gloo", r, ("CommTimeoutError",),
                  note="both ranks: CommTimeoutError (Gloo's own timeout, 1 s later, "
                       "never closes the connection first)")
           for k in ("op", "root") for r in (0, 1)],
        hard_timeout=150),
    Launch("first Gloo call of the process with rank 0 late", ["straggler_first_r:gloo"],
           [Expect("straggler_first_r:gloo", 1, ("CommTimeoutError",),
                   note="the bootstrap exchange of Gloo's store address (MPI Ibcast) times out"),
            Expect("straggler_first_r:gloo (next call)", 1, ("BrokenGroupError",), 0.5,
                   note="next call: BrokenGroupError at once (the process's runtime is broken)")]),
    Launch("debug mode, tuning tables, unwaited async work", [
        *[f"mismatch_{k}:{b}" for b in ("mpi", "gloo") for k in ("op", "size", "root", "dtype")],
        "table_corrupt:auto", "table_truncated:auto", "table_foreign:auto",
        "table_missing_backend:auto",
        "async_unwaited_destroy:mpi", "async_unwaited_destroy:gloo", "async_unwaited_exit:mpi"],
        [e for b in ("mpi", "gloo") for k in ("op", "size", "root", "dtype") for e in _debug(k, b)]
        + [Expect(f"table_{k}:auto", r, ("ok",),
                  note="warning naming the file; the policy picks; result checked")
           for k in ("corrupt", "truncated", "foreign", "missing_backend") for r in (0, 1)]
        + [Expect(f"async_unwaited_destroy:{b}", r, ("ok",),
                  note="destroy_process_group() waits for it; result checked")
           for b in ("mpi", "gloo") for r in (0, 1)]
        + [Expect("async_unwaited_exit:mpi", r, ("ok",), note="process exits 0, no hang")
           for r in (0, 1)],
        env={"MCRDL_DEBUG": "1"}),
    Launch("gloo size mismatch without debug", ["mismatch_size:gloo"],
           [Expect("mismatch_size:gloo", 1, ("CommFailedError", KILLED),
                   note="rank 0 aborts inside Gloo (gloo::EnforceNotMet, SIGABRT: the "
                        "library's own abort); rank 1: CommFailedError, unless hydra, "
                        "ending the job for rank 0's signal, kills it first")],
           rcs=(6, 134), note="a library abort that only MCRDL_DEBUG=1 prevents"),
    Launch("gloo dtype mismatch without debug", ["mismatch_dtype:gloo"],
           [Expect("mismatch_dtype:gloo", 1, ("CommFailedError", KILLED),
                   note="rank 0 aborts inside Gloo (SIGABRT); rank 1: CommFailedError, "
                        "unless the launcher kills it first")],
           rcs=(6, 134), in_test=False),
    *[Launch(f"{case} on {b}, rank 1 exits mid-transfer", [f"{case}:{b}"],
             [Expect(f"{case}:{b}", 0, outcomes, within, note=note)],
             launcher="mpiexec-tolerant", rcs=(1,))
      for case in ("crash_collective", "crash_p2p") for b in ("mpi", "gloo")
      for outcomes, within, note in [_CRASH[b if b == "mpi" else case]]],
    *[Launch(f"{case} on {b}, rank 1 SIGKILLed", [f"{case}:{b}"], [],
             rcs=(9, 137), in_test=case == "kill_collective" and b == "mpi",
             launcher="mpiexec-tolerant",
             note="hydra ends the whole job when a rank dies by a signal, even with "
                  "-disable-auto-cleanup: no hang")
      for case in ("kill_collective", "kill_p2p") for b in ("mpi", "gloo")],
]


def env(extra=None) -> dict:
    e = dict(os.environ)
    e.update(MCRDL_TIMEOUT=str(TIMEOUT_S), MCRDL_TUNING_TABLE="none", PYTHONUNBUFFERED="1",
             PATH=f"{BIN}{os.pathsep}{e.get('PATH', '')}")
    e.pop("MCRDL_DEBUG", None)
    e.update(extra or {})
    return e


def command(launch: Launch, nranks: int = 2) -> list:
    mpiexec = shutil.which("mpiexec", path=str(BIN)) or "mpiexec"
    cmd = [mpiexec, "-n", str(nranks)]
    if launch.launcher == "mpiexec-tolerant":
        cmd.append("-disable-auto-cleanup")
    return cmd + [sys.executable, str(HERE / "job.py"), *launch.cases]


@dataclass
class Result:
    launch: Launch
    rc: int | None  # None: killed at the hard timeout (a hang)
    wall: float
    records: list
    output: str

    def record(self, case, rank):
        return next((r for r in self.records if r["case"] == case and r["rank"] == rank), None)


def run(launch: Launch, tmp: str | None = None) -> Result:
    extra = dict(launch.env)
    if tmp:
        extra["FAULT_TMP"] = tmp
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command(launch), cwd=HERE, env=env(extra), capture_output=True,
                              text=True, timeout=launch.hard_timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        rc, out = None, text(exc.stdout) + text(exc.stderr)
    wall = time.perf_counter() - t0
    return Result(launch, rc, wall, parse(out), out)


def parse(out: str) -> list:
    """The ``FAULT {json}`` records in a launch's output. mpiexec merges the ranks'
    stdout, so one line may hold two records back to back: each is decoded from its
    own ``FAULT {`` on, as far as its JSON goes."""
    decoder, records = json.JSONDecoder(), []
    for chunk in out.split("FAULT {")[1:]:
        try:
            records.append(decoder.raw_decode("{" + chunk)[0])
        except ValueError:
            pass
    return records


def problems(res: Result) -> list:
    """What in ``res`` breaks the plan (empty when all is as expected)."""
    out = []
    if res.rc is None:
        out.append(f"launch '{res.launch.name}' hung past {res.launch.hard_timeout} s")
    elif res.rc not in res.launch.rcs:
        out.append(f"launch '{res.launch.name}' exited {res.rc}, expected one of "
                   f"{res.launch.rcs}")
    if "terminate called without an active exception" in res.output:
        out.append(f"launch '{res.launch.name}': a helper thread aborted the process at exit")
    for e in res.launch.expects:
        r = res.record(e.case, e.rank)
        if r is None:
            if KILLED not in e.outcomes or res.rc is None:
                out.append(f"{e.case}: rank {e.rank} reported nothing")
        elif r["outcome"] not in e.outcomes:
            out.append(f"{e.case}: rank {e.rank} got {r['outcome']} ({r['message'][:200]}), "
                       f"expected {e.outcomes}")
        elif r["seconds"] > e.within:
            out.append(f"{e.case}: rank {e.rank} took {r['seconds']} s, more than {e.within} s")
    return out
