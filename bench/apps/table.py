"""The apps table: DLRM and MoE (bench/apps/dlrm.py, moe.py) on torch's Gloo and on
MCR-DL's registered backend, one host, samples per second and communication share.

    .venv/bin/python bench/apps/table.py --ranks 2 3 [--steps 15] [--repeats 3] [--tune]
    .venv/bin/python bench/apps/table.py --ranks 2 --cluster 1gbit --tune   # emulated cluster

Per app and rank count it launches (``mpiexec -n N``, the programs unchanged but for
``init_process_group(backend, pg_options=...)``):

- ``gloo (torch)``: ``init_process_group("gloo")``, the CPU PyTorch user's baseline;
- ``mcrdl: mpi`` / ``mcrdl: gloo``: every op forced to one library (``pg_options``);
- ``mcrdl: mixed``: all_to_all on one library, all_reduce on the other (both ways);
- ``mcrdl: tuned``: no choice given; the tuning table decides per op and size. With
  ``--tune`` the table is measured first (``mcrdl tune`` on all_reduce and all_to_all
  at the apps' message sizes, on the same ranks), into bench/out/apps_tuning.json.

Every variant's losses are compared with the Gloo baseline's (the same seeds: they
differ only by the order of reductions). Runs are repeated ``--repeats`` times in
rotated order and the median samples/s is reported (this machine is shared: noisy).
Writes bench/out/apps_table.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = ROOT / "bench" / "out"
BIN = Path(sys.executable).parent

VARIANTS = [("gloo (torch)", "gloo", None), ("mcrdl: mpi", "mcrdl", "mpi"),
            ("mcrdl: gloo", "mcrdl", "gloo"),
            ("mcrdl: a2a mpi, ar gloo", "mcrdl", "all_to_all=mpi,all_reduce=gloo"),
            ("mcrdl: a2a gloo, ar mpi", "mcrdl", "all_to_all=gloo,all_reduce=mpi"),
            ("mcrdl: tuned", "mcrdl", "")]


def _env(table: str | None) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["MCRDL_TUNING_TABLE"] = table or "none"
    env.setdefault("MCRDL_TIMEOUT", "120")
    env.pop("MCRDL_BACKEND", None)
    return env


def mpiexec() -> str:
    exe = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
    if not exe:
        raise SystemExit("mpiexec not found: install the mpich extra (pip install 'mcr-dl[mpich]')")
    return exe


def launcher(n: int, cluster: str | None) -> list:
    """``mpiexec -n N``, or the emulated cluster: 2 hosts, N/2 ranks each, links shaped
    to ``cluster`` (tc's units, e.g. 1gbit)."""
    if not cluster:
        return [mpiexec(), "-n", str(n)]
    if n % 2:
        raise SystemExit(f"--cluster runs 2 hosts with the same number of ranks: {n} ranks "
                         "do not split; use even --ranks")
    return [str(BIN / "mcrdl"), "cluster", "run", "--hosts", "2", "--ranks-per-host",
            str(n // 2), "--rate", cluster, "--"]


def tune(n: int, path: Path, cluster: str | None = None) -> None:
    cmd = launcher(n, cluster) + [str(BIN / "mcrdl"), "tune", "--ops", "all_reduce",
           "all_to_all", "--sizes", "4", "4K", "64K", "256K", "1M", "2M", "4M", "--output",
           str(path)]
    print("tuning:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=_env(str(path)), cwd=ROOT, timeout=1200,
                   stdout=subprocess.DEVNULL)


def launch(app: str, n: int, backend: str, options, steps: int, table: str | None,
           cluster: str | None = None) -> dict:
    out = OUT / f"apps_{app}_{n}.json"
    cmd = launcher(n, cluster) + [sys.executable, str(HERE / f"{app}.py"), "--backend",
           backend, "--steps", str(steps), "--json", str(out)]
    if options:
        cmd += ["--pg-options", options]
    proc = subprocess.run(cmd, env=_env(table if backend == "mcrdl" and options == "" else None),
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--apps", nargs="+", default=["dlrm", "moe"])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tune", action="store_true", help="measure the tuning table first")
    p.add_argument("--table", default=None,
                   help="tuning table of the 'tuned' variant (default bench/out/apps_tuning"
                        "[_cluster_RATE].json)")
    p.add_argument("--cluster", default=None, metavar="RATE",
                   help="run on the emulated cluster (mcrdl cluster run: 2 hosts, links of "
                        "RATE, e.g. 1gbit) instead of one host")
    a = p.parse_args()
    if a.table is None:
        a.table = str(OUT / (f"apps_tuning_cluster_{a.cluster}.json" if a.cluster
                             else "apps_tuning.json"))
    OUT.mkdir(parents=True, exist_ok=True)
    table = Path(a.table)
    if a.tune:
        for n in a.ranks:
            tune(n, table, a.cluster)
    if not table.exists():
        raise SystemExit(f"no tuning table at {table}: run with --tune (or pass --table)")
    rows = []
    for app in a.apps:
        for n in a.ranks:
            runs = {name: [] for name, _, _ in VARIANTS}
            for rep in range(a.repeats):
                k = rep % len(VARIANTS)
                for name, backend, options in VARIANTS[k:] + VARIANTS[:k]:
                    runs[name].append(launch(app, n, backend, options, a.steps, str(table),
                                              a.cluster))
            base = runs["gloo (torch)"]
            base_sps = statistics.median(r["samples_per_s"] for r in base)
            for name, _, _ in VARIANTS:
                rs = runs[name]
                sps = statistics.median(r["samples_per_s"] for r in rs)
                diff = max(abs(x - y) / max(abs(y), 1e-12)
                           for r in rs for x, y in zip(r["losses"], base[0]["losses"]))
                rows.append({"app": app, "ranks": n, "where": a.cluster or "one host",
                             "variant": name, "samples_per_s": sps,
                             "vs_gloo": sps / base_sps,
                             "comm_share": statistics.median(r["comm_share"] for r in rs),
                             "loss_max_rel_diff_vs_gloo": diff, "repeats": len(rs)})
                print(f"{app} n={n} {name:26s} {sps:10.0f} samples/s  x{sps / base_sps:.2f}  "
                      f"comm {rows[-1]['comm_share']:.0%}  loss diff {diff:.1e}", flush=True)
    name = f"apps_table_cluster_{a.cluster}.json" if a.cluster else "apps_table.json"
    (OUT / name).write_text(json.dumps(rows, indent=1))
    print("\n| app | where | ranks | variant | samples/s | vs gloo | comm share | loss diff vs gloo |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['app']} | {r['where']} | {r['ranks']} | {r['variant']} | {r['samples_per_s']:.0f} | "
              f"{r['vs_gloo']:.2f}x | {r['comm_share']:.0%} | "
              f"{r['loss_max_rel_diff_vs_gloo']:.0e} |")


if __name__ == "__main__":
    main()
