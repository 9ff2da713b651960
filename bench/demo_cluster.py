"""The demo's training comparison: where mixing and codecs pay, on 2 emulated hosts.

    sudo .venv/bin/python bench/demo_cluster.py [--steps 10] [--rate 1gbit] [--repeats 1] [--tune]

``make demo`` runs it last. It builds an emulated cluster (``mcrdl cluster``, docs/cluster.md:
network namespaces, links shaped by tc, addresses in 198.18.0.0/15, removed after each
run) of 2 hosts x 1 rank at 1 Gbit/s and trains two unchanged torch.distributed programs
for a few steps each:

- ``bench/apps/dlrm.py`` in its communication-heavy shape (26 embedding tables, one row
  per lookup, small MLPs: the apps table's ``--shape comm``): the embeddings move by an
  ``all_to_all_single`` of ~6.5 MiB per rank each way per step;
- ``bench/apps/fsdp.py``: a 4-layer transformer LM sharded with FSDP2, whose parameters
  are all-gathered and gradients reduce-scattered every step (~1.6 MiB per rank and layer);

each on three variants: torch's own Gloo (``init_process_group("gloo")``), MCR-DL with
one library (every op on MPI, the fastest single library between these hosts), and
MCR-DL tuned with codecs allowed (``MCRDL_COMPRESSION=OP=auto:bf16+int8`` on the
all-to-all, or on the all-gather and reduce-scatter; the tuning table measured here
decides per op and size which codec, if any, pays). It prints a summary of at most ten
lines first (what ran, what auto chose and why, samples/s and speed-ups, the loss
against the exact run: the uncompressed one-library run, same seeds), then writes
``bench/out/demo_cluster.csv`` and ``.png``.

The tuning table (``mcrdl tune`` of those three ops at 512 KiB and 2 MiB per rank, the
codecs as candidates) is kept in ``bench/out/demo_cluster_tuning.json`` and
reused by later runs (``--tune`` measures it again). Where an emulated cluster cannot be
built (not root, no ``ip``/``tc``), it prints one line saying why and what to run instead,
and exits 0: the rest of ``make demo`` stands on its own.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "apps"))
from launching import OUT, codec_variant, tune  # noqa: E402

CODECS = "bf16,int8"
#: (app, its arguments, what it is, the ops its codecs are allowed on)
APPS = [("dlrm", ["--tables", "26", "--bag", "1", "--bottom", "64", "--top", "64"],
         "DLRM, embedding all-to-all"),
        ("fsdp", [], "FSDP2 transformer LM, all-gather + reduce-scatter")]
#: the exact run that the codec run's loss is compared with (same seeds, uncompressed)
EXACT = "mcrdl: mpi"
TUNE_OPS = ("all_to_all", "all_gather", "reduce_scatter")
TUNE_SIZES = ("512K", "2M")


def variants(app: str, codecs: str = CODECS, threads: int | None = None) -> list:
    """torch's Gloo, MCR-DL on one library, MCR-DL tuned with codecs allowed; with
    ``threads``, each rank's intra-op threads (``OMP_NUM_THREADS``) for all three."""
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    name, backend, options, extra, tuned = codec_variant(codecs, app)
    return [("gloo (torch)", "gloo", None, dict(env), False),
            (EXACT, "mcrdl", "mpi", dict(env), False),
            (name, backend, options, {**extra, **env}, tuned)]


def cannot_run(reason: str) -> str:
    """The one line printed where the comparison cannot run here."""
    return (f"demo comparison on emulated hosts skipped: {reason.rstrip('.')}. "
            "To see it: sudo make demo (or sudo .venv/bin/python bench/demo_cluster.py); "
            "on one host: .venv/bin/python bench/apps/table.py --quick")


def why_not_here() -> str | None:
    """None where an emulated cluster can be built and the ranks launched, else why not."""
    try:
        from mcrdl_core.cluster.system import why_not_allowed
    except ImportError as exc:  # a checkout without the install
        return f"MCR-DL is not installed ({exc}); run make install"
    reason = why_not_allowed()
    if reason:
        return reason
    bin_ = Path(sys.executable).parent
    if not (bin_ / "mcrdl").exists() or not (bin_ / "mpiexec").exists():
        return f"{bin_} holds no mcrdl or mpiexec; run make install"
    return None


def _fmt_ran(ran: dict) -> str:
    """``{"all_to_all": ["mpi+int8:256@a2a"], ...}`` -> "all_to_all: mpi+int8:256@a2a";
    the ops that ran compressed only (the others ran plain on the table's backend)."""
    parts = [f"{op}: {'/'.join(names)}" for op, names in sorted(ran.items())
             if any("+" in x for x in names)]
    return "; ".join(parts) or "no codec paid (all plain)"


def why(table: dict | None, ran: dict) -> str:
    """What the tuning table said about the compressed variants that ran: the size
    ranges where the tune measured them beating the fastest plain backend by its margin."""
    if not table:
        return ""
    out = []
    for e in table.get("entries", []):
        c = e.get("compressed")
        names = ran.get(e["op"], [])
        if not c or not any("+" in x for x in names):
            continue
        plain = e["ranges"][-1][1]
        used = {x.split(":")[0] + "@" + x.split("@")[-1] for x in names if "+" in x}
        prev, where, start = None, [], False
        for hi, vs in c["ranges"]:
            won = bool(vs) and vs[0] in used
            if won and where and where[-1][1] == prev:
                where[-1] = (where[-1][0], hi)  # adjacent ranges: one span
            elif won:
                where.append((prev, hi))
            prev = hi
        where = ["at every size" if lo is None and hi is None else
                 f"up to {_size(hi)}" if lo is None else
                 f"above {_size(lo)}" if hi is None else f"{_size(lo)}-{_size(hi)}"
                 for lo, hi in where]
        if where:
            out.append((e["op"], f">= {c.get('margin', 1.1):.1f}x plain {plain} in the tune "
                                 f"{', '.join(where)} per rank"))
    reasons = {}  # ops with the same reason in one clause
    for op, text in out:
        reasons.setdefault(text, []).append(op)
    return "; ".join(f"{', '.join(ops)}: {text}" for text, ops in reasons.items())


def _size(b: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b} B"


def summary(rows: list, meta: dict) -> list:
    """At most ten lines: what ran and where, then per app its samples/s on each variant
    with the speed-ups, what auto chose and why, and the loss against the exact run.
    ``rows``: one dict per (app, variant) as ``main`` writes them to the CSV."""
    lines = [f"demo comparison: {meta['hosts']} emulated hosts x {meta['ranks_per_host']} "
             f"rank, links {meta['rate']} (tc), {meta['steps']} timed steps per run, "
             f"{meta['repeats']} run(s) each (median), load average {meta['load']}"]
    for app in dict.fromkeys(r["app"] for r in rows):
        rs = [r for r in rows if r["app"] == app]
        by = {r["variant"]: r for r in rs}
        gloo, exact, coded = by["gloo (torch)"], by[EXACT], rs[-1]
        best = max(gloo["samples_per_s"], exact["samples_per_s"])
        lines.append(f"{rs[0]['what']}: samples/s torch gloo {gloo['samples_per_s']:.0f} | "
                     f"mcrdl one library (mpi) {exact['samples_per_s']:.0f} "
                     f"({exact['samples_per_s'] / gloo['samples_per_s']:.2f}x) | "
                     f"mcrdl tuned + codecs {coded['samples_per_s']:.0f} "
                     f"({coded['samples_per_s'] / gloo['samples_per_s']:.2f}x gloo, "
                     f"{coded['samples_per_s'] / best:.2f}x best single)")
        reason = f" ({coded['why']})" if coded.get("why") else ""
        lines.append(f"  auto chose {coded['ran']}{reason}")
        lines.append(f"  loss after {coded['loss_steps']} steps {coded['final_loss']:.4f} vs "
                     f"exact {exact['final_loss']:.4f} ({coded['loss_rel_diff']:+.2%}); "
                     f"torch gloo {gloo['final_loss']:.4f}")
    lines.append(f"wrote {meta['csv']} and {meta['png']} ({meta['seconds']:.0f} s)")
    return lines[:10]


def plot(rows: list, path: Path) -> None:
    """Samples/s of each variant relative to torch's Gloo, one group of bars per app."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apps = list(dict.fromkeys(r["app"] for r in rows))
    labels = ["torch gloo", "mcrdl one library", "mcrdl tuned + codecs"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for j, label in enumerate(labels):
        vals = [[r for r in rows if r["app"] == a][j]["vs_gloo"] for a in apps]
        bars = ax.bar([i + (j - 1) * 0.27 for i in range(len(apps))], vals, 0.27, label=label)
        ax.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax.set_xticks(range(len(apps)))
    ax.set_xticklabels([next(r["what"] for r in rows if r["app"] == a) for a in apps],
                       fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("samples/s vs torch gloo")
    ax.set_title(f"{rows[0]['where']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after 3 untimed)")
    p.add_argument("--repeats", type=int, default=1, help="runs per variant, rotated; median")
    p.add_argument("--rate", default="1gbit", help="link rate per host and direction (tc units)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--codecs", default=CODECS, help="codecs the tuned variant allows")
    p.add_argument("--tune", action="store_true", help="measure the tuning table again")
    p.add_argument("--apps", nargs="+", default=[a for a, *_ in APPS],
                   choices=[a for a, *_ in APPS])
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    reason = why_not_here()
    if reason:
        print(cannot_run(reason), flush=True)
        return 0
    import table as apps_table  # (imports matplotlib lazily; after the check: fast refusal)

    t0, load0 = time.monotonic(), _load()
    a.out.mkdir(parents=True, exist_ok=True)
    n = a.hosts * a.ranks_per_host
    where = f"{a.hosts} emulated hosts x {a.ranks_per_host} rank, {a.rate}"
    tpath = a.out / f"demo_cluster_tuning_{a.hosts}x{a.ranks_per_host}_{a.rate}.json"
    retune = a.tune or not tpath.exists()
    apps = [x for x in APPS if x[0] in a.apps]
    print(f"running {'a tune and ' if retune else ''}{3 * a.repeats * len(apps)} "
          f"short trainings on {where} (a minute or two; the summary, then the details)",
          flush=True)
    details = []  # printed after the summary, which comes first
    if retune:
        t1 = time.monotonic()
        tune(n, tpath, a.rate, a.hosts, a.codecs, ops=TUNE_OPS, sizes=TUNE_SIZES, timeout=300,
             trials_scale=0.5, echo=details.append)
        details.append(f"  tuned in {time.monotonic() - t1:.0f} s into {tpath}")
    tdata = json.loads(tpath.read_text())
    rows = []
    for app, args, what in apps:
        apps_table.SHAPES.setdefault("demo", {})[app] = args
        # the emulated hosts share this machine's cores: a share each, as torchrun gives
        # several processes of one node (else every rank runs a thread per core)
        vs = variants(app, a.codecs, threads=max(1, (os.cpu_count() or 1) // n))
        runs = {v[0]: [] for v in vs}
        for rep in range(a.repeats):
            for v in vs[rep % len(vs):] + vs[:rep % len(vs)]:
                t1 = time.monotonic()
                r = apps_table.launch(app, n, v, a.steps, str(tpath), a.rate, a.hosts, "demo")
                r["wall_s"] = time.monotonic() - t1
                runs[v[0]].append(r)
                details.append(f"  {app}: {v[0]:30s} {r['samples_per_s']:9.1f} samples/s "
                               f"({r['wall_s']:.0f} s)")
        gloo_sps = statistics.median(r["samples_per_s"] for r in runs["gloo (torch)"])
        exact_loss = runs[EXACT][0]["losses"][-1]
        for name, *_ in vs:
            rs = runs[name]
            sps = statistics.median(r["samples_per_s"] for r in rs)
            ran = {op: sorted({x for r in rs for x in r.get("ran", {}).get(op, [])})
                   for op in {op for r in rs for op in r.get("ran", {})}}
            loss = rs[0]["losses"][-1]
            rows.append({"app": app, "what": what, "where": where, "variant": name,
                         "samples_per_s": sps, "vs_gloo": sps / gloo_sps,
                         "loss_steps": len(rs[0]["losses"]), "final_loss": loss,
                         "loss_rel_diff": (loss - exact_loss) / abs(exact_loss),
                         "ran": _fmt_ran(ran) if name.startswith("mcrdl: tuned") else
                         "; ".join(f"{op}: {'/'.join(x)}" for op, x in sorted(ran.items())),
                         "why": why(tdata, ran) if name.startswith("mcrdl: tuned") else "",
                         "runs": len(rs)})
    csv_path, png_path = a.out / "demo_cluster.csv", a.out / "demo_cluster.png"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, png_path)
    meta = {"hosts": a.hosts, "ranks_per_host": a.ranks_per_host, "rate": a.rate,
            "steps": a.steps, "repeats": a.repeats, "load": f"{load0} -> {_load()}",
            "csv": csv_path.relative_to(Path.cwd()) if csv_path.is_relative_to(Path.cwd())
            else csv_path, "png": png_path.name, "seconds": time.monotonic() - t0}
    print("\n".join(summary(rows, meta)), flush=True)
    print("details:\n" + "\n".join(details), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
