"""The cross-mesh pipeline table: schedules x reshard methods, in one job.

    mcrdl cluster run --hosts 2 --ranks-per-host 2 --rate 1gbit -- \\
        .venv/bin/python bench/jax_pipeline_table.py [--repeats 5] [--steps 8] \\
        [--json out.json] [-- app options, e.g. --backend gloo]
    .venv/bin/python bench/jax_pipeline_table.py --plot mpi.json gloo.json --png out.png

Runs ``bench/apps/jax_mesh_pipeline.py``'s training (stage 0 on the first half of the
ranks, stage 1 on the rest; ``--tp cols`` by default, so stage 1 holds h replicated)
for every row below, ``--repeats`` times in a rotated order inside one MPI job (so
compiles and sub-communicators are paid once), and prints per row: samples/s (median
over repeats, each the slowest rank's), its ratio to the reference row (blocking 1F1B
with send/recv), the share of time stage 0 and stage 1 spent in communication calls,
the peak bytes of activations kept per stage, and the largest parameter difference
from the one-process reference (checked in the first repeat). The A/A row repeats the
reference configuration: its ratio is the noise floor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                      "intra_op_parallelism_threads=1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "apps"))

import jax_mesh_pipeline as app  # noqa: E402
import mcrdl_jax as mj  # noqa: E402

ROWS = [  # (label, schedule, comm, method)
    ("GPipe, blocking, send/recv", "gpipe", "blocking", "send_recv"),
    ("GPipe, blocking, broadcast", "gpipe", "blocking", "broadcast"),
    ("1F1B, blocking, send/recv (reference)", "1f1b", "blocking", "send_recv"),
    ("1F1B, blocking, broadcast", "1f1b", "blocking", "broadcast"),
    ("1F1B, non-blocking, send/recv", "1f1b", "nonblocking", "send_recv"),
    ("1F1B, non-blocking, broadcast", "1f1b", "nonblocking", "broadcast"),
    ("eager 1F1B, non-blocking, send/recv", "eager1f1b", "nonblocking", "send_recv"),
    ("eager 1F1B, non-blocking, broadcast", "eager1f1b", "nonblocking", "broadcast"),
    ("1F1B, blocking, send/recv (A/A)", "1f1b", "blocking", "send_recv"),
]
REF = 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="a bar chart of samples/s per row")
    ap.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                    help="draw --png from these --json files of earlier runs (one bar "
                         "colour per file, e.g. one per backend) instead of running")
    ap.add_argument("rest", nargs="*", help="options of jax_mesh_pipeline.py (after --)")
    a = ap.parse_args(argv)
    if a.plot:
        return plot_runs(a.png or "jax-pipeline.png", load_runs(a.plot))
    base = ["--steps", str(a.steps), "--tp", "cols", "--micro", "4", "--batch", "256",
            "--dim", "256", "--hidden", "1024", "--out", "256", "--lr", "0.05", *a.rest]
    rank = mj.get_rank()
    results = {i: [] for i in range(len(ROWS))}
    extra = {}
    for r in range(a.repeats):
        order = list(range(len(ROWS)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            label, schedule, comm, method = ROWS[i]
            argv_i = base + ["--schedule", schedule, "--comm", comm, "--method", method]
            if r == 0:
                argv_i.append("--check")
            mj.barrier(backend="mpi")
            args_i = app.parser().parse_args(argv_i)
            res = app.train(args_i)
            slowest = float(mj.all_reduce(jax_f32(res["seconds"]), "max", backend="mpi"))
            samples = (args_i.steps - 1) * args_i.batch * args_i.micro
            results[i].append(samples / slowest)
            share = [float(v) for v in mj.all_gather(jax_f32(res["comm_share"]),
                                                     backend="mpi")]
            peak = [float(v) for v in mj.all_gather(jax_f32(res["peak_activation_bytes"]),
                                                    backend="mpi")]
            e = extra.setdefault(i, {"share": [], "peak": peak})
            e["share"].append(share)
            if r == 0:
                diffs = [v for k, v in res.items() if k.endswith("_max_diff")]
                e["diff"] = float(mj.all_reduce(jax_f32(max(diffs)), "max", backend="mpi"))
    if rank != 0:
        return
    n = mj.get_world_size()
    half = n // 2
    med = {i: statistics.median(v) for i, v in results.items()}
    print(f"jax_pipeline_table: {n} ranks, {a.repeats} repeats x {a.steps} steps "
          f"(first not timed), options {' '.join(base)}, load {os.getloadavg()[0]:.2f}")
    print("| schedule, reshards | samples/s | vs reference | comm share stage 0 / 1 | "
          "peak activations stage 0 / 1 (KiB) | max param diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, (label, *_rest) in enumerate(ROWS):
        e = extra[i]
        sh = [statistics.median(s[q] for s in e["share"]) for q in range(n)]
        s0, s1 = statistics.mean(sh[:half]), statistics.mean(sh[half:])
        p0, p1 = max(e["peak"][:half]) / 1024, max(e["peak"][half:]) / 1024
        print(f"| {label} | {med[i]:.0f} | {med[i] / med[REF]:.2f} | {s0:.2f} / {s1:.2f} | "
              f"{p0:.1f} / {p1:.1f} | {e['diff']:.1e} |")
    if a.png:
        be = base[base.index("--backend") + 1] if "--backend" in base else "auto"
        plot_runs(a.png, [(f"{be} (load {os.getloadavg()[0]:.1f})", results)])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": [r[0] for r in ROWS], "samples_per_s": results,
                       "extra": extra, "options": base, "load": os.getloadavg()}, f,
                      indent=1)


def load_runs(files: list) -> list:
    """(label, {row: samples/s of every repeat}) of each --json file: labelled by its app
    options' --backend and its load average."""
    runs = []
    for f in files:
        with open(f) as fh:
            d = json.load(fh)
        opts = d["options"]
        be = opts[opts.index("--backend") + 1] if "--backend" in opts else "auto"
        reps = {int(k): v for k, v in d["samples_per_s"].items()}
        runs.append((f"{be} (load {d['load'][0]:.1f})", reps))
    return runs


def plot_runs(path: str, runs: list) -> None:
    """Samples/s per row of one or more runs side by side ((label, {row: repeats})):
    bars of medians, a dot per repeat, each bar's ratio to its own run's reference row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5))
    k = len(runs)
    h = 0.8 / k
    for j, (label, reps) in enumerate(runs):
        med = {i: statistics.median(v) for i, v in reps.items()}
        ys = [len(ROWS) - 1 - i + (k - 1 - j - (k - 1) / 2) * h for i in range(len(ROWS))]
        ax.barh(ys, [med[i] for i in range(len(ROWS))], height=h, label=label)
        for i, y in enumerate(ys):
            ax.plot(reps[i], [y] * len(reps[i]), "k.", ms=3)
            ax.annotate(f"{med[i] / med[REF]:.2f}x", (max(reps[i]), y), va="center",
                        fontsize=7, xytext=(3, 0), textcoords="offset points")
    ax.set_yticks(range(len(ROWS)))
    ax.set_yticklabels([r[0] for r in ROWS][::-1], fontsize=8)
    ax.set_xlabel("samples/s (bar: median; dots: repeats; ratio to the run's reference row)")
    ax.set_title("JAX pipeline across two meshes", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.margins(x=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def jax_f32(v):
    import jax.numpy as jnp
    return jnp.float32(v)


if __name__ == "__main__":
    main()
