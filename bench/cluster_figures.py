"""Crossover tables and plots of `mcrdl tune` and `mcrdl bench` on emulated clusters,
next to the single host (the figures of docs/cluster.md).

    sudo .venv/bin/python bench/cluster_figures.py run [--max-bytes 4M] [--trials-scale 0.25]
    .venv/bin/python bench/cluster_figures.py report [--out bench/out/cluster]

``run`` measures, one configuration after another (never two at once: they would share
the CPU): 2 and 4 ranks on this host (plain mpiexec), then 2 hosts x 1 rank and
2 hosts x 2 ranks at 1 Gbit/s and at 10 Gbit/s (``mcrdl cluster run``). Each writes its
own tuning table (``tuning.json``, so no configuration overwrites another's entries)
and bench files (``bench-n*.json/csv/png``, ``auto`` using that table) into
``OUT/<config>/``. ``report`` turns them into markdown tables (``OUT/report.md``) and
one plot per op (``OUT/<op>.png``: latency of mpi and gloo per configuration).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
#: name -> (hosts or None for one host, ranks per host, rate)
CONFIGS = {"local-2": (None, 2, None), "2x1-1gbit": (2, 1, "1gbit"),
           "2x1-10gbit": (2, 1, "10gbit"), "local-4": (None, 4, None),
           "2x2-1gbit": (2, 2, "1gbit"), "2x2-10gbit": (2, 2, "10gbit")}
PLOT_OPS = ("all_reduce", "all_gather", "broadcast", "all_to_all")
SHOW_SIZES = (4, 256, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20)  # rows of the bench table


def _launch(cfg, program: list[str]) -> list[str]:
    hosts, rph, rate = cfg
    if hosts is None:
        return [str(BIN / "mpiexec"), "-n", str(rph), *program]
    return [str(BIN / "mcrdl"), "cluster", "run", "--hosts", str(hosts), "--ranks-per-host",
            str(rph), "--rate", rate, "--", *program]


def run(args) -> None:
    names = args.configs or list(CONFIGS)
    for name in names:
        d = Path(args.out) / name
        d.mkdir(parents=True, exist_ok=True)
        table = d / "tuning.json"
        env = dict(os.environ, MCRDL_TUNING_TABLE="none", MCRDL_TIMEOUT="600",
                   PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        sizes = (["--sizes", *args.sizes] if args.sizes else ["--max-bytes", args.max_bytes])
        sizes += ["--trials-scale", str(args.trials_scale)]
        if args.ops:
            sizes += ["--ops", *args.ops]
        steps = [["tune", *sizes, "--output", str(table)], ["bench", *sizes, "--out", str(d)]]
        for step in [s for s in steps if s[0] in args.steps]:
            if step[0] == "bench":  # auto uses the table just measured here
                env["MCRDL_TUNING_TABLE"] = str(table)
            cmd = _launch(CONFIGS[name], [str(BIN / "mcrdl"), *step])
            print(f"== {name}: {' '.join(cmd)}", flush=True)
            with open(d / f"{step[0]}.log", "w", encoding="utf-8") as log:
                rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)
            if rc != 0:
                sys.exit(f"{name} {step[0]} failed (exit {rc}): see {d / (step[0] + '.log')}")


def _fmt(b) -> str:
    if b is None:
        return "∞"
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def _ranges(entry) -> str:
    """[[1024, "mpi"], [None, "gloo"]] -> "mpi ≤ 1 KiB < gloo"."""
    out = []
    for hi, be in entry["ranges"]:
        out.append(be if hi is None else f"{be} ≤ {_fmt(hi)} <")
    return " ".join(out)


def report(args) -> None:
    out = Path(args.out)
    present = [n for n in CONFIGS if (out / n / "tuning.json").exists()]
    tables = {n: json.loads((out / n / "tuning.json").read_text()) for n in present}
    benches = {}
    for n in present:
        files = sorted((out / n).glob("bench-n*.json"))
        if files:
            benches[n] = json.loads(files[0].read_text())
    lines = ["### Crossover tables (`mcrdl tune`): message size per rank -> fastest backend",
             "", "| op | " + " | ".join(present) + " |", "|---" * (len(present) + 1) + "|"]
    ops = []
    for t in tables.values():
        for e in t["entries"]:
            if e["op"] not in ops:
                ops.append(e["op"])
    for op in ops:
        cells = []
        for n in present:
            e = next((e for e in tables[n]["entries"] if e["op"] == op), None)
            cells.append(_ranges(e) if e else "")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "### `mcrdl bench`: latency (µs) of mpi / gloo at chosen sizes", "",
              "| op | bytes | " + " | ".join(benches) + " |", "|---" * (len(benches) + 2) + "|"]
    for op in PLOT_OPS + ("reduce_scatter", "send_recv"):
        sizes = sorted({r["bytes"] for b in benches.values() for r in b["rows"] if r["op"] == op})
        for size in [s for s in sizes if s in SHOW_SIZES]:
            cells = []
            for b in benches.values():
                lat = {r["backend"]: r["latency_us"] for r in b["rows"]
                       if r["op"] == op and r["bytes"] == size}
                cells.append(" / ".join(f"{lat[k]:.0f}" if k in lat else "-"
                                        for k in ("mpi", "gloo")))
            lines.append(f"| {op} | {_fmt(size)} | " + " | ".join(cells) + " |")
    verdicts = [f"- {n}: auto within max(5%, 2 µs) of the best backend at "
                f"{b['auto_vs_best']['within']} of {b['auto_vs_best']['points']} points"
                for n, b in benches.items()]
    lines += ["", *verdicts, ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    _plots(benches, out)


def _plots(benches: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mcrdl_core.tools.cli import latency_axes

    fig, axes = plt.subplots(1, len(PLOT_OPS), figsize=(5 * len(PLOT_OPS), 4.2), squeeze=False)
    colors = dict(zip(benches, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, op in zip(axes.flat, PLOT_OPS):
        for n, b in benches.items():
            for be, style in (("mpi", "-"), ("gloo", "--")):
                pts = sorted((r["bytes"], r["latency_us"]) for r in b["rows"]
                             if r["op"] == op and r["backend"] == be)
                if pts:
                    ax.plot(*zip(*pts), style, color=colors[n], marker=".", label=f"{n} {be}")
        latency_axes(ax, op)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="lower center",
               ncol=min(len(handles), 6))
    fig.suptitle("mpi (solid) and gloo (dashed) on one host and on emulated clusters")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out / "cluster-latency.png", dpi=80)
    print(f"wrote {out / 'report.md'}, {out / 'cluster-latency.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("run", "report"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cluster"))
    ap.add_argument("--max-bytes", default="4M", help="largest size tuned and benched (4M)")
    ap.add_argument("--trials-scale", type=float, default=1.0,
                    help="passed to mcrdl tune/bench (fewer trials: faster, noisier)")
    ap.add_argument("--sizes", nargs="+", help="exactly these sizes (e.g. 4 4K 64K 1M)")
    ap.add_argument("--ops", nargs="+", help="only these ops (default: every tuned op)")
    ap.add_argument("--steps", nargs="+", choices=("tune", "bench"), default=["tune", "bench"])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                    help="only these configurations (default: all)")
    args = ap.parse_args()
    run(args) if args.mode == "run" else report(args)


if __name__ == "__main__":
    main()
