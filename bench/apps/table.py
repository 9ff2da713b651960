"""The apps table: DLRM and MoE (bench/apps/dlrm.py, moe.py; an FSDP2 transformer,
bench/apps/fsdp.py, with ``--apps fsdp``; a Megatron-style tensor- and data-parallel
transformer, bench/apps/megatron.py, with ``--apps megatron``; DeepSpeed's MoE layer,
bench/apps/ds_moe.py, with ``--apps ds_moe``; facebookresearch/dlrm's program,
bench/apps/fb_dlrm.py, with ``--apps fb_dlrm --dlrm CHECKOUT``) on torch's Gloo and on
MCR-DL's registered backend, samples per second and communication share.

    .venv/bin/python bench/apps/table.py --ranks 2 3 [--steps 15] [--repeats 3] [--tune]
    sudo .venv/bin/python bench/apps/table.py --ranks 4 --cluster 1gbit --hosts 2 --tune
    sudo .venv/bin/python bench/apps/table.py --ranks 4 --cluster 1gbit --hosts 2 --shape comm
    .venv/bin/python bench/apps/table.py --quick          # a few minutes, one host
    sudo .venv/bin/python bench/apps/table.py --all       # the whole table (about 2 h)

Per app and rank count it launches (``mpiexec -n N``, the programs unchanged but for
``init_process_group(backend, pg_options=...)``):

- ``gloo (torch)``: ``init_process_group("gloo")``, the CPU PyTorch user's baseline;
- ``mcrdl: mpi`` / ``mcrdl: gloo``: every op forced to one library (``pg_options``);
- ``mcrdl: tuned``: no choice given; the tuning table decides per op and size (lossless);
- ``mcrdl: tuned + a2a fp16+bf16``: the same table, and the job allows the codecs of
  ``--codecs`` on its all-to-alls (``MCRDL_COMPRESSION=all_to_all=auto:fp16+bf16``): the
  table's compressed all-to-all measurements decide where (and which) pays; for
  ``fsdp`` the codecs are allowed on its all-gathers and reduce-scatters instead, for
  ``megatron`` on its all-reduces (``launching.CODEC_OPS``);
- ``mcrdl: mpi (A/A)``: forced MPI again, the noise floor;
- with ``--mixed``: all_to_all on one library, all_reduce on the other (both ways).

With ``--tune`` the table is measured first (``mcrdl tune`` on all_reduce and all_to_all
at the apps' message sizes, the compressed all-to-alls as candidates, on the same ranks), into
bench/out/apps_tuning*.json. ``--cluster RATE --hosts H`` runs everything on the
emulated cluster (H hosts, N/H ranks each).

``--shape comm`` runs the apps in communication-heavy shapes (``SHAPES``: less compute
per byte exchanged, as on GPUs), ``--shape comm-cap`` the same with MoE's experts at a
fixed capacity (even all-to-alls, as DeepSpeed's MoE layer); "vs best single" divides by the fastest of the single
libraries (``SINGLE``).

Every variant's losses are compared with the Gloo baseline's (the same seeds: they
differ only by the order of reductions). ``--loss-steps N`` also runs each variant once
for N steps and reports its final loss against forced MPI's (uncompressed). Runs are
repeated ``--repeats`` times in rotated order and the median samples/s is reported (this
machine is shared: noisy).
Writes bench/out/apps_table.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from fb_dlrm import launch as fb_dlrm_launch
from launching import CODECS, OUT, ROOT, launcher, run_env, tune, variants

HERE = Path(__file__).resolve().parent
#: the run the others' losses are compared with: uncompressed
REFERENCE = "mcrdl: mpi"


#: the apps' shapes (``--shape``): their defaults, and communication-heavy ones that
#: move the same kind of exchanges with less compute per byte -- what a GPU cluster
#: sees, whose compute is two orders of magnitude faster than these CPU cores while
#: its network is not. DLRM as on Criteo data (26 sparse features, one row each) with
#: small MLPs; MoE with a wider hidden size (more bytes per token on the all-to-alls)
#: and narrow experts. ``comm-cap``: the same, MoE with a fixed expert capacity of 1.25
#: (DeepSpeed's and GShard's layer, Switch Transformer's training factor): even
#: all-to-alls, padded, no rank waiting for the busiest expert.
#: DeepSpeed's MoE layer (``ds_moe``, ``pip install deepspeed``; not in the default
#: ``--apps``) always runs at a fixed capacity (its default 1.25), in MoE's shapes.
_COMM = {"dlrm": ["--tables", "26", "--bag", "1", "--bottom", "64", "--top", "64"],
         "moe": ["--hidden", "512", "--ffn", "128", "--tokens", "1024"],
         "ds_moe": ["--hidden", "512", "--ffn", "128", "--tokens", "1024"], "fsdp": [],
         "megatron": []}
SHAPES = {"default": {"dlrm": [], "moe": [], "ds_moe": [], "fsdp": [], "megatron": []},
          "comm": _COMM,
          "comm-cap": {**_COMM, "moe": _COMM["moe"] + ["--capacity-factor", "1.25"]}}

#: the single libraries: "best single library" is the fastest of these (median samples/s)
SINGLE = ("gloo (torch)", "mcrdl: mpi", "mcrdl: gloo")

MIXED = [("mcrdl: a2a mpi, ar gloo", "mcrdl", "all_to_all=mpi,all_reduce=gloo", {}, False),
         ("mcrdl: a2a gloo, ar mpi", "mcrdl", "all_to_all=gloo,all_reduce=mpi", {}, False)]


def launch(app: str, n: int, variant, steps: int, table: str | None,
           cluster: str | None = None, hosts: int = 2, shape: str = "default",
           dlrm: str | None = None) -> dict:
    if app == "fb_dlrm":
        return fb_dlrm_run(dlrm, n, variant, steps, table, cluster, hosts)
    _, backend, options, extra, tuned = variant
    out = OUT / f"apps_{app}_{n}.json"
    cmd = launcher(n, cluster, hosts) + [sys.executable, str(HERE / f"{app}.py"), "--backend",
           backend, "--steps", str(steps), "--json", str(out)] + SHAPES[shape][app]
    if options:
        cmd += ["--pg-options", options]
    out.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env=run_env(table if tuned else None, extra),
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        if not out.exists():
            raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        # the run finished and wrote its result, then a library failed at exit (torch's
        # Gloo aborts so now and then while the interpreter finalizes): keep the result
        print(f"note: {variant[0]}: exit status {proc.returncode} after writing its result",
              flush=True)
    return json.loads(out.read_text())


def fb_dlrm_run(dlrm: str, n: int, variant, steps: int, table: str | None,
                cluster: str | None, hosts: int) -> dict:
    """One run of facebookresearch/dlrm's program (``bench/apps/fb_dlrm.py``, checkout
    ``dlrm``) as an app's result: ``steps`` global batches of 2048, timed after the
    first sixth (its print interval); its last printed loss is its one loss; no
    communication share (the program does not time its communication)."""
    a = argparse.Namespace(dlrm=dlrm, ranks=n, cluster=cluster, hosts=hosts, table=table,
                           batch=2048, batches=steps, print_freq=max(1, steps // 6),
                           rows=20000)
    r = fb_dlrm_launch(a, variant)
    return {"samples_per_s": r["samples_per_s"], "losses": [r["loss"]], "comm_share": None}


#: what --all runs: (cluster rate or None for one host, hosts, ranks)
ALL = [(None, 1, [2, 3]), ("1gbit", 2, [4]), ("1gbit", 4, [4]), ("10gbit", 2, [4]),
       ("10gbit", 4, [4])]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--apps", nargs="+", default=["dlrm", "moe"],
                   choices=["dlrm", "moe", "ds_moe", "fb_dlrm", "fsdp", "megatron"],
                   help="fsdp: GPT-2 (transformers) sharded with FSDP2 (its codecs on "
                        "all_gather and reduce_scatter); "
                        "megatron: tensor parallel inside each host, data parallel across "
                        "(its codecs on all_reduce); "
                        "ds_moe: DeepSpeed's MoE layer, unchanged (needs deepspeed); "
                        "fb_dlrm: facebookresearch/dlrm's dlrm_s_pytorch.py, unchanged "
                        "(needs --dlrm)")
    p.add_argument("--dlrm", default=None, metavar="CHECKOUT",
                   help="a checkout of facebookresearch/dlrm, for --apps fb_dlrm "
                        "(pip install scikit-learn tensorboard)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tune", action="store_true", help="measure the tuning table first")
    p.add_argument("--tune-sizes", nargs="+", default=None, metavar="SIZE",
                   help="the sizes --tune measures (default: launching.TUNE_SIZES, 4 B-8 MiB)")
    p.add_argument("--table", default=None,
                   help="tuning table of the 'tuned' variant (default bench/out/apps_tuning"
                        "[_cluster_RATE].json)")
    p.add_argument("--cluster", default=None, metavar="RATE",
                   help="run on the emulated cluster (mcrdl cluster run: --hosts hosts, "
                        "links of RATE, e.g. 1gbit) instead of one host")
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts (--cluster; 2)")
    p.add_argument("--mixed", action="store_true",
                   help="also the two per-op mixes (all_to_all on one library, all_reduce "
                        "on the other)")
    p.add_argument("--codecs", default=CODECS,
                   help="codecs the 'tuned + a2a' variant allows on all_to_all, measured by "
                        f"the tune as candidates (default {CODECS})")
    p.add_argument("--loss-steps", type=int, default=0, metavar="N",
                   help="also run each variant once for N steps (the issue's 200) and report "
                        f"its final loss against '{REFERENCE}' (uncompressed)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="default",
                   help="the apps' shapes: their defaults, or communication-heavy ones "
                        "(SHAPES: less compute per byte exchanged, as on GPUs)")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: 6 steps, 1 repeat, no loss run; tunes only if no table")
    p.add_argument("--all", action="store_true",
                   help="the whole table: one host (2, 3 ranks), then 2x2 and 4x1 emulated "
                        "hosts at 1 and 10 Gbit/s (sudo), each tuned, 20 steps, 3 repeats, "
                        "200-step losses (about 2 h here)")
    a = p.parse_args(argv)
    if "fb_dlrm" in a.apps and not a.dlrm:
        p.error("--apps fb_dlrm runs facebookresearch/dlrm's program: pass its checkout "
                "as --dlrm PATH (git clone https://github.com/facebookresearch/dlrm)")
    if a.quick:
        a.steps, a.repeats, a.loss_steps = 6, 1, 0
    if a.all:
        a.steps, a.repeats, a.loss_steps, a.tune = 20, 3, 200, True
    return a


def run_config(a, cluster, hosts: int, ranks: list) -> list:
    """The rows of one configuration (one host, or ``hosts`` emulated hosts at ``cluster``)."""
    where = f"{hosts}x{{n}} {cluster}" if cluster else "one host"
    table = Path(a.table or OUT / (f"apps_tuning_cluster_{cluster}_{hosts}h.json" if cluster
                                   else "apps_tuning.json"))
    if a.tune or (a.quick and not table.exists()):
        for n in ranks:
            tune(n, table, cluster, hosts, a.codecs,
                 ops=("all_reduce", "all_to_all") + (("all_gather", "reduce_scatter")
                                                     if "fsdp" in a.apps else ()),
                 **({"sizes": tuple(a.tune_sizes)} if a.tune_sizes else {}))
    if not table.exists():
        raise SystemExit(f"no tuning table at {table}: run with --tune (or pass --table)")
    rows = []
    for app in a.apps:
        vs = variants(a.codecs, app) + (MIXED if a.mixed else [])
        for n in ranks:
            runs = {v[0]: [] for v in vs}
            for rep in range(a.repeats):
                k = rep % len(vs)
                for v in vs[k:] + vs[:k]:
                    r = launch(app, n, v, a.steps, str(table), cluster, hosts, a.shape, a.dlrm)
                    runs[v[0]].append(r)
                    # each run as it ends: a table cut off by a time limit still says these
                    print(f"  {app} n={n} repeat {rep + 1}: {v[0]:26s} "
                          f"{r['samples_per_s']:10.0f} samples/s", flush=True)
            final = {}
            if a.loss_steps:
                for v in vs:
                    r = launch(app, n, v, a.loss_steps, str(table), cluster, hosts, a.shape,
                               a.dlrm)
                    final[v[0]] = r["losses"][-1]
            base = runs["gloo (torch)"]
            base_sps = statistics.median(r["samples_per_s"] for r in base)
            best_sps = max(statistics.median(r["samples_per_s"] for r in runs[s])
                           for s in SINGLE)
            for name, *_ in vs:
                rs = runs[name]
                sps = statistics.median(r["samples_per_s"] for r in rs)
                diff = max(abs(x - y) / max(abs(y), 1e-12)
                           for r in rs for x, y in zip(r["losses"], base[0]["losses"]))
                ran = sorted({f"{op}: {'/'.join(names)}" for r in rs
                              for op, names in r.get("ran", {}).items()})
                row = {"app": app, "ranks": n, "where": where.format(n=n // hosts),
                       "ran": ran, "variant": name, "samples_per_s": sps,
                       "vs_gloo": sps / base_sps, "vs_best_single": sps / best_sps,
                       "shape": a.shape,
                       "comm_share": _median_share(rs),
                       "loss_max_rel_diff_vs_gloo": diff, "repeats": len(rs)}
                if final:
                    ref = final[REFERENCE]
                    row.update({"loss_steps": a.loss_steps, "final_loss": final[name],
                                "final_loss_rel_diff": (final[name] - ref) / abs(ref)})
                rows.append(row)
                tail = (f"  loss@{a.loss_steps} {final[name]:.5f} "
                        f"({row['final_loss_rel_diff']:+.2%})" if final else "")
                print(f"{app} n={n} {where.format(n=n // hosts)} {name:26s} {sps:10.0f} "
                      f"samples/s  x{sps / base_sps:.2f}  (best single x{sps / best_sps:.2f})  "
                      f"comm {_share(row['comm_share'])}  "
                      f"loss diff {diff:.1e}{tail}  ran {'; '.join(ran) or '-'}", flush=True)
    return rows


def main(argv=None):
    a = parse(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if a.all:
        rows, name = [], "apps_table_all.json"
        for cluster, hosts, ranks in ALL:
            rows += run_config(a, cluster, hosts, ranks)
            (OUT / name).write_text(json.dumps(rows, indent=1))  # a cut-off run keeps these
    else:
        rows = run_config(a, a.cluster, a.hosts if a.cluster else 1, a.ranks)
        name = (f"apps_table_cluster_{a.cluster}_{a.hosts}h.json" if a.cluster
                else "apps_table.json")
        if a.shape != "default":
            name = name.replace(".json", f"_{a.shape}.json")
    (OUT / name).write_text(json.dumps(rows, indent=1))
    plot(rows, OUT / name.replace(".json", ".png"))
    losses = any("final_loss" in r for r in rows)
    print("\n| app | where | ranks | variant | samples/s | vs gloo | vs best single | comm share "
          "| loss diff vs gloo |" + (" final loss (vs mpi) |" if losses else "") + " ran |")
    print("| --- " * (10 + losses) + "|")
    for r in rows:
        fl = (f" {r['final_loss']:.4f} ({r['final_loss_rel_diff']:+.2%}) |"
              if "final_loss" in r else (" - |" if losses else ""))
        print(f"| {r['app']} | {r['where']} | {r['ranks']} | {r['variant']} | "
              f"{r['samples_per_s']:.0f} | {r['vs_gloo']:.2f}x | {r['vs_best_single']:.2f}x | "
              f"{_share(r['comm_share'])} | "
              f"{r['loss_max_rel_diff_vs_gloo']:.0e} |{fl} {'; '.join(r['ran'])} |")


def _median_share(runs) -> float | None:
    """The median communication share of ``runs``; None where the app does not time it."""
    shares = [r["comm_share"] for r in runs if r.get("comm_share") is not None]
    return statistics.median(shares) if shares else None


def _share(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def plot(rows, path: Path) -> None:
    """Samples/s relative to torch's Gloo, one group of bars per (app, ranks, where)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["app"], r["ranks"], r["where"]) for r in rows))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys) * len(names) / 3), 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [next((r["vs_gloo"] for r in rows if (r["app"], r["ranks"], r["where"]) == k
                      and r["variant"] == name), 0) for k in keys]
        ax.bar([i + j * width for i in range(len(keys))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([f"{app} n={n}\n{where}" for app, n, where in keys])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("samples/s vs torch gloo (median of repeats)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
