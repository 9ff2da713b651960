"""``mcrdl trace DIR`` and ``mcrdl explain``: the flight recorder's dumps read together,
and a tuning table's choices said in words.

``mcrdl trace DIR`` reads every ``rank-N.json`` in DIR (the dumps of one job, written by
``observe/recorder.py``) and prints, first line, what went wrong
(``observe/analyze.py``: the first call where the ranks part, which ranks differ, what
each side was doing), then where each rank was and the straggler table. ``--json``
prints the same as one JSON object. Exit status: 0 when the ranks agree, 1 when it found
a problem, 2 when the input cannot be read (no dumps, a truncated or foreign file, dumps
of two jobs: ``--job`` picks one).

``mcrdl explain``: what a tuning table (``--table``, default the one in force) chooses
for an op at given sizes, with the entry and range that choose it, without launching a
job. ``mcrdl_core.get_runtime().explain(op, buffer)`` says the same inside a job, with
the backends that are really available and the group's and MCRDL_BACKEND's names.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..base.errors import McrdlError
from ..dispatch import selection as _selection
from ..observe import analyze as _analyze
from ..observe.recorder import SCHEMA


class BadInput(Exception):
    """Dumps that cannot be read together; the message says what to do."""


def load(folder: str, job: str | None = None) -> list:
    """The dumps of one job in ``folder`` (``job``: which, where several are there)."""
    if not os.path.isdir(folder):
        raise BadInput(f"{folder} is not a directory; give the directory the dumps are in "
                       "(MCRDL_TRACE_DIR, or the one a CommTimeoutError names)")
    names = sorted(n for n in os.listdir(folder) if n.startswith("rank-") and n.endswith(".json"))
    if not names:
        raise BadInput(f"no flight-recorder dumps (rank-N.json) in {folder}: a job writes them "
                       "on a fault, on SIGUSR1 or on mcrdl_core.dump_trace()")
    dumps = []
    for n in names:
        path = os.path.join(folder, n)
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise BadInput(f"{path} is not a complete dump ({type(exc).__name__}: {exc}); it "
                           "was cut off or is not one: remove it to read the others (its rank "
                           "then counts as having left no dump)") from None
        if not isinstance(d, dict) or d.get("schema") != SCHEMA or not d.get("complete") \
                or not isinstance(d.get("entries"), list) or not isinstance(d.get("rank"), int):
            raise BadInput(f"{path} is not a flight-recorder dump of schema {SCHEMA!r}; remove "
                           "it to read the others")
        dumps.append(d)
    jobs: dict = {}
    for d in dumps:
        jobs.setdefault(d.get("job"), []).append(d["rank"])
    if job is not None:
        if job not in jobs:
            raise BadInput(f"no dumps of job {job!r} in {folder}; it holds {_jobs(jobs)}")
        dumps = [d for d in dumps if d.get("job") == job]
    elif len(jobs) > 1:
        raise BadInput(f"{folder} holds dumps of {len(jobs)} jobs: {_jobs(jobs)}; pass "
                       "--job JOB to read one (or give each job its own MCRDL_TRACE_DIR)")
    seen: dict = {}
    for d in dumps:
        if d["rank"] in seen:
            raise BadInput(f"two dumps of rank {d['rank']} of job {d.get('job')!r} in {folder}")
        seen[d["rank"]] = d
    return dumps


def _jobs(jobs: dict) -> str:
    return "; ".join(f"{j} (ranks {', '.join(map(str, sorted(r)))})" for j, r in jobs.items())


def _clock(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def report(dumps: list) -> dict:
    """The verdict, each rank's place and the straggler table."""
    v = _analyze.verdict(dumps)
    by = {d["rank"]: d for d in dumps}
    world = max(d.get("world_size", 1) for d in dumps)
    places = {}
    for r in range(world):
        d = by.get(r)
        if d is None:
            places[r] = "no dump"
            continue
        pend = _analyze.pending(d)
        where = (f"{pend['state']} in {_analyze.call_text(pend)} on "
                 f"{_analyze.group_name(by, pend['group'])} since {_clock(pend['t_issue'])}"
                 if pend else "in no call")
        places[r] = f"{where}; dump: {d.get('reason')} at {_clock(d['time'])}, " \
                    f"{len(d['entries'])} calls kept"
    return {"verdict": v, "job": dumps[0].get("job"), "world_size": world,
            "ranks": places, "stragglers": _analyze.stragglers(dumps)}


def cmd_trace(argv) -> int:
    p = argparse.ArgumentParser(prog="mcrdl trace",
                                description="Read a job's flight-recorder dumps and say where "
                                            "the ranks diverged (docs/reliability.md).")
    p.add_argument("dir", help="the directory of the dumps (rank-N.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--job", help="which job's dumps, where the directory holds several")
    args = p.parse_args(argv)
    try:
        dumps = load(args.dir, args.job)
        rep = report(dumps)
    except BadInput as exc:
        print(f"mcrdl trace: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as exc:  # a dump of the schema, but mangled
        print(f"mcrdl trace: a dump in {args.dir} has the schema's name but not its fields "
              f"({type(exc).__name__}: {exc}); remove the file that was edited", file=sys.stderr)
        return 2
    v = rep["verdict"]
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        print(v["line"])
        print(f"job {rep['job']}, {rep['world_size']} ranks:")
        for r, place in rep["ranks"].items():
            print(f"  rank {r}: {place}")
        st = rep["stragglers"]
        if st["calls"]:
            print("last to arrive (seconds after the median of the others):")
            for key, seq, op, last, late in st["calls"]:
                print(f"  {op} #{seq} on {_analyze.group_name({d['rank']: d for d in dumps}, key)}"
                      f": rank {last}, {late:.6f} s")
            print("  per rank: " + ", ".join(f"rank {r} last {n}x, {s:.6f} s in all"
                                             for r, (n, s) in sorted(st["ranks"].items())))
    return 1 if v["problem"] else 0


def _size(text: str) -> int:
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def cmd_explain(argv) -> int:
    p = argparse.ArgumentParser(prog="mcrdl explain",
                                description="What a tuning table chooses for an op at given "
                                            "sizes, and which entry and range choose it.")
    p.add_argument("--table", help="the table (default: the one in force, MCRDL_TUNING_TABLE "
                                   "or the default location)")
    p.add_argument("--op", default="all_reduce")
    p.add_argument("--ranks", type=int, required=True, help="the group's size")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype-class", default="float", choices=("float", "int"))
    p.add_argument("--bytes", default="4,4K,64K,1M,16M",
                   help="comma-separated message sizes (per-rank payload: 4K, 1M, ...)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        sizes = [_size(s) for s in args.bytes.split(",") if s.strip()]
    except ValueError:
        print(f"mcrdl explain: --bytes {args.bytes!r}: give sizes such as 4,4K,1M", file=sys.stderr)
        return 2
    try:
        path = args.table or _selection.default_path()
        table = _selection.TuningTable.load(path) if os.path.exists(path) or args.table else None
    except McrdlError as exc:
        print(f"mcrdl explain: {exc}", file=sys.stderr)
        return 2
    policy = _selection.POLICY.get(args.device, ())
    rows = []
    for b in sizes:
        where = None if table is None else _selection.table_range(
            table, args.op, args.ranks, args.device, args.dtype_class, b, args.hosts)
        if where is None or where[3] is None:
            why = ("no table" if table is None else "no range of the table"
                   if where is None else "the table's range lost its verification")
            rows.append({"bytes": b, "choice": None, "rule": f"policy ({why}): the first of "
                         f"{', '.join(policy)} that is available and can run the call"})
            continue
        entry, lo, hi, name = where
        kind = "algorithm" if _selection.is_algorithm(name) else "backend"
        rows.append({"bytes": b, "choice": name, "rule": f"table {table.path}: {entry}, range "
                     f"{_selection.fmt_bytes(lo)}-{_selection.fmt_bytes(hi)} ({kind}; "
                     "unless a backend is named, or it cannot run there: then the policy)"})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{args.op} {_analyze.fmt_bytes(r['bytes']):>9}: {r['choice'] or 'policy':<8} "
                  f"{r['rule']}")
    return 0


def main(argv) -> int:
    """``mcrdl trace ...`` / ``mcrdl explain ...`` (argv[0] is the command)."""
    try:
        return cmd_trace(argv[1:]) if argv[0] == "trace" else cmd_explain(argv[1:])
    except BrokenPipeError:  # (| head): the reader has what it wanted
        sys.stderr.close()
        return 0
