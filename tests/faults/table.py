"""Run every launch of the fault plan (tests/faults/plan.py) and print the markdown table
of docs/reliability.md: fault, backend, call, rank, outcome, seconds.

    .venv/bin/python tests/faults/table.py [--jobs 3] [--only SUBSTRING] > table.md

Launches run ``--jobs`` at a time (they mostly sit in timeouts). Exits 1 if a launch
broke the plan (a hang, an unexpected outcome or exit status, an abort at exit), and
lists what broke after the table.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import plan


def _fault_and_call(case: str, note: str = ""):
    """('a rank never makes the call', 'first call') and the like, from a case name."""
    name, _, backend = case.partition(":")
    extra = ""
    if " (" in backend:
        backend, extra = backend.split(" (", 1)
        extra = extra.rstrip(")")
    debug = name.endswith("+debug")
    name = name.replace("+debug", "")
    faults = {
        "straggler_first": ("a rank never makes the call (rank 1 late)", "first call"),
        "straggler_first_r": ("a rank never makes the call (rank 0 late)", "first call"),
        "straggler_later": ("a rank never makes the call (rank 1 late)", "later call"),
        "straggler_async": ("a rank never makes the call (rank 1 late)",
                            "later call, async, waited 0.5 s after it was issued"),
        "crash_collective": ("rank 1 exits (os._exit) during 64 MiB all_reduces", "later call"),
        "crash_p2p": ("rank 1 exits (os._exit) during 64 MiB sends", "later call"),
        "kill_collective": ("rank 1 SIGKILLed during 64 MiB all_reduces", "later call"),
        "kill_p2p": ("rank 1 SIGKILLed during 64 MiB sends", "later call"),
        "mismatch_op": ("rank 0 all_reduce, rank 1 broadcast", "first call"),
        "mismatch_size": ("sizes differ (4 vs 65536 elements)", "first call"),
        "mismatch_root": ("roots differ (each rank names itself)", "first call"),
        "mismatch_dtype": ("dtypes differ (float32 vs float64)", "first call"),
        "table_corrupt": ("tuning table: not JSON", "first call"),
        "table_truncated": ("tuning table: truncated", "first call"),
        "table_foreign": ("tuning table: from another machine", "first call"),
        "table_missing_backend": ("tuning table: names a backend that is not there",
                                  "first call"),
        "async_unwaited_destroy": ("async work never waited, then destroy_process_group()",
                                   "first call"),
        "async_unwaited_exit": ("async work never waited, then interpreter exit", "first call"),
    }
    fault, call = faults.get(name, (name, ""))
    if name == "straggler_first_r" and backend.startswith("gloo") and "bootstrap" in note:
        fault += ", first Gloo call of the process"
    if name.startswith("mismatch"):
        fault += ", MCRDL_DEBUG=1" if debug else ", no debug"
    if extra == "next call":
        call = "the call after it"
    elif extra:
        call = extra
    return fault, backend, call


def rows(results) -> list:
    out = []
    for res in results:
        launch = res.launch
        for e in launch.expects:
            r = res.record(e.case, e.rank)
            fault, backend, call = _fault_and_call(e.case, e.note)
            outcome = r["outcome"] if r else (plan.KILLED if plan.KILLED in e.outcomes
                                              else "nothing reported")
            secs = f"{r['seconds']:.2f}" if r else "-"
            out.append((fault, backend, call, str(e.rank), outcome, secs, e.note))
        if not launch.expects:
            fault, backend, call = _fault_and_call(launch.cases[0])
            status = "hung" if res.rc is None else f"job ended, exit {res.rc}"
            out.append((fault, backend, call, "all", status, f"{res.wall:.1f} (launch)",
                        launch.note))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3, help="launches at a time")
    ap.add_argument("--only", default="", help="run only launches whose name contains this")
    args = ap.parse_args(argv)
    launches = [launch for launch in plan.LAUNCHES if args.only in launch.name]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda launch: plan.run(launch, tmp), launches))
    print(f"2 ranks, MCRDL_TIMEOUT={plan.TIMEOUT_S:g} s, {platform.node()}, "
          f"Python {platform.python_version()}; seconds: the reporting rank's time in the "
          "case (for a launch the launcher ended: the launch's wall time)\n")
    print("| fault | backend | call | rank | outcome | seconds | what happens |")
    print("|---|---|---|---|---|---|---|")
    for row in rows(results):
        print("| " + " | ".join(row) + " |")
    print()
    print("| launch | exit status | wall s |")
    print("|---|---|---|")
    for res in results:
        print(f"| {res.launch.name} | {'hung' if res.rc is None else res.rc} | {res.wall:.1f} |")
    bad = [p for res in results for p in plan.problems(res)]
    if bad:
        print("\nBroke the plan:\n" + "\n".join(f"- {p}" for p in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
