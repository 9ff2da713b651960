"""Launch the differential fuzzer (``job.py``) under mpiexec, report failures with their
seed, and shrink a failing program by dropping steps.

    python tests/fuzz/driver.py --ranks 3 --seeds 0:40          # a fixed set of seeds
    python tests/fuzz/driver.py --ranks 4 --minutes 30          # long mode (mcrdl fuzz)
    python tests/fuzz/driver.py --ranks 3 --program FILE        # replay a saved program

A hang is a failure: every wait inside MCR-DL times out after ``MCRDL_TIMEOUT`` (20 s
here) and names the step; a launch stuck past its own limit is killed, and the step each
rank had reached (``progress.RANK``) is reported. At 4 ranks the job emulates 2 hosts of
2 ranks (``MCRDL_RANKS_PER_HOST=2``), so the two-level algorithms run hierarchical.
Exit status: 0 when every program passed, 1 when one failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
JOB = HERE / "job.py"
WAIT_TIMEOUT = 20  # s, MCRDL_TIMEOUT inside the job
LAUNCH_S = 180.0  # s, the longest one launch runs programs in long mode


def _mpiexec() -> str:
    here = Path(sys.executable).parent
    exe = shutil.which("mpiexec", path=str(here)) or shutil.which("mpiexec")
    if not exe:
        raise SystemExit("mcrdl fuzz: mpiexec not found; install the mpich extra "
                         "(pip install 'mcr-dl[mpich]') or run `make install`")
    return exe


def env_for(ranks: int) -> dict:
    env = dict(os.environ)
    env.update(MCRDL_TIMEOUT=str(WAIT_TIMEOUT), MCRDL_TUNING_TABLE="none", JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}"
               f"{env.get('PATH', '')}")
    env.pop("MCRDL_DEBUG", None)  # each program sets its own debug mode
    env.pop("MCRDL_BACKEND", None)
    env.pop("MCRDL_COMPRESSION", None)
    if ranks == 4:
        env["MCRDL_RANKS_PER_HOST"] = "2"
    else:
        env.pop("MCRDL_RANKS_PER_HOST", None)
    return env


def run_job(ranks: int, out: Path, *, seeds: str | None = None, program: dict | None = None,
            steps: int = 24, minutes: float = 0.0, limit: float = 600.0,
            keep_going: bool = False) -> dict:
    """One launch; its report: {"ran": [...], "failed": None or {...}, "rc": int} (a
    hang or crash becomes a failure naming the step each rank was at)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, str(JOB), "--out", str(out),
           "--steps", str(steps)]
    if program is not None:
        (out / "program.json").write_text(json.dumps(program))
        cmd += ["--program", str(out / "program.json")]
    else:
        cmd += ["--seeds", seeds]
    if minutes:
        cmd += ["--minutes", str(minutes)]
    if keep_going:
        cmd += ["--keep-going"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env_for(ranks), capture_output=True, text=True,
                              timeout=limit)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["pkill", "-9", "-f", str(out)], check=False)
        rc, log = -9, (exc.stdout or b"").decode(errors="replace") if isinstance(
            exc.stdout, bytes) else (exc.stdout or "")
    res = out / "result.json"
    report = json.loads(res.read_text()) if res.exists() else {"ran": [], "failed": None}
    report["rc"] = rc
    if report["failed"] is None and rc != 0:
        where = {p.name.split(".")[1]: p.read_text().strip() for p in out.glob("progress.*")}
        seed = min((int(v.split()[0]) for v in where.values()), default=None)
        prog = program
        if prog is None and seed is not None:
            sys.path.insert(0, str(HERE))
            import program as P
            prog = P.make_program(seed, ranks, steps, 2 if ranks == 4 else 0)
        report["failed"] = {"seed": seed, "program": prog, "failures": [
            f"the launch ended with status {rc} (hung past {limit:.0f} s or crashed); each rank "
            f"was at (seed step): {where}; output: {log[-3000:]}"]}
    return report


def shrink(ranks: int, prog: dict, work: Path, budget_s: float = 240.0, steps: int = 24,
           fail_lines=()) -> dict:
    """The smallest program found (by dropping steps, halving the chunk each round) that
    still fails, within ``budget_s`` seconds of launches."""
    t0 = time.monotonic()
    best = prog
    first = min((int(f.split()[1]) for f in fail_lines if f.startswith("step ")), default=None)
    if first is not None:  # first: everything after the first failing step dropped
        trial = dict(best, steps=[s for s in best["steps"] if s["i"] <= first])
        if run_job(ranks, work / "shrink", program=trial, steps=steps, limit=180)["failed"]:
            best = trial
    chunk = max(1, len(best["steps"]) // 2)
    while chunk >= 1 and time.monotonic() - t0 < budget_s:
        i, changed = 0, False
        while i < len(best["steps"]) and time.monotonic() - t0 < budget_s:
            trial = dict(best, steps=best["steps"][:i] + best["steps"][i + chunk:])
            if trial["steps"]:
                rep = run_job(ranks, work / "shrink", program=trial, steps=steps, limit=180)
                if rep["failed"]:
                    best, changed = trial, True
                    continue
            i += chunk
        if not changed:
            chunk //= 2
    return best


def show(fail: dict) -> str:
    return "\n".join(["seed %s failed:" % fail.get("seed")] +
                     ["  " + f[:1500] for f in fail["failures"][:8]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mcrdl fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--seeds", help="A:B, the seeds A..B-1 (default: from 0 until --minutes)")
    ap.add_argument("--minutes", type=float, default=0.0, help="long mode: run this long")
    ap.add_argument("--steps", type=int, default=24, help="steps per program")
    ap.add_argument("--program", help="replay a saved program (JSON)")
    ap.add_argument("--out", help="where failing programs are saved (default: a temp dir)")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--shrink-seconds", type=float, default=240.0)
    ap.add_argument("--keep-going", action="store_true",
                    help="go on with the next seeds after a failure (long mode always does)")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="mcrdl-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    failures = []

    def handle(fail):
        print(show(fail), flush=True)
        prog = fail.get("program")
        if prog is None:
            return
        path = out / f"seed{fail['seed']}-r{a.ranks}.json"
        path.write_text(json.dumps(prog, indent=1))
        if not a.no_shrink:
            small = shrink(a.ranks, prog, out, a.shrink_seconds, a.steps, fail["failures"])
            path = out / f"seed{fail['seed']}-r{a.ranks}-shrunk.json"
            path.write_text(json.dumps(small, indent=1))
            print(f"  shrunk to {len(small['steps'])} of {len(prog['steps'])} steps:", flush=True)
            for st in small["steps"]:
                print("   ", json.dumps(st), flush=True)
        print(f"  replay: python tests/fuzz/driver.py --ranks {a.ranks} --program {path}",
              flush=True)
        failures.append(fail)

    if a.program:
        rep = run_job(a.ranks, out / "job", program=json.loads(Path(a.program).read_text()),
                      steps=a.steps)
        if rep["failed"]:
            a.no_shrink = True
            handle(rep["failed"])
        print(f"program: {'FAILED' if failures else 'passed'}")
        return 1 if failures else 0
    t0 = time.monotonic()
    lo, hi = (int(v) for v in a.seeds.split(":")) if a.seeds else (0, 1 << 30)
    ran = 0
    while lo < hi:
        left = a.minutes * 60 - (time.monotonic() - t0) if a.minutes else 0.0
        if a.minutes and left <= 5:
            break
        # long mode: a fresh launch every few minutes (a process that has run thousands
        # of programs holds thousands of jitted executables)
        chunk = min(left, LAUNCH_S)
        rep = run_job(a.ranks, out / "job", seeds=f"{lo}:{hi}", steps=a.steps,
                      minutes=max(chunk, 6) / 60 if a.minutes else 0.0,
                      limit=(chunk + 240) if a.minutes else 900.0)
        ran += len(rep["ran"]) - (1 if rep["failed"] and rep["failed"]["seed"] in rep["ran"] else 0)
        if not rep["failed"]:
            if not rep["ran"]:
                print(f"mcrdl fuzz: the job ran no program (status {rep['rc']})")
                return 1
            lo = rep["ran"][-1] + 1
            if not a.minutes:
                break
            continue
        handle(rep["failed"])
        lo = (rep["failed"]["seed"] if rep["failed"]["seed"] is not None else lo) + 1
        if not (a.minutes or a.keep_going):
            break
    took = time.monotonic() - t0
    print(f"mcrdl fuzz: {a.ranks} ranks, {ran} programs passed, {len(failures)} failed "
          f"({took / 60:.1f} min); failing programs in {out}" if failures else
          f"mcrdl fuzz: {a.ranks} ranks, {ran} programs passed, 0 failed ({took / 60:.1f} min)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
