"""facebookresearch/dlrm's ``dlrm_s_pytorch.py``, unchanged, timed on torch's Gloo and on
the registered "mcrdl" backend: the apps table's variants for a client we do not write.

    git clone https://github.com/facebookresearch/dlrm /tmp/dlrm
    pip install scikit-learn tensorboard          # what dlrm_s_pytorch.py imports
    sudo .venv/bin/python bench/apps/fb_dlrm.py /tmp/dlrm --ranks 4 --cluster 1gbit \\
        --hosts 2 --table bench/out/apps_tuning_cluster_1gbit_2h.json --codecs bf16,int8

Each variant runs under ``python -m mcrdl_torch.run``, which sets torch's rendezvous
variables from MPI (the program would otherwise point every host at 127.0.0.1; Gloo's
baseline needs them as much). The program picks its backend with ``--dist-backend`` and
calls ``init_process_group`` itself, so the forced variants name their library with
``MCRDL_BACKEND`` instead of ``pg_options``; the tuned ones load the table
(``MCRDL_TUNING_TABLE``), the last one also allows the codecs on the all-to-alls
(``MCRDL_COMPRESSION``), as in ``bench/apps/table.py``. Random data in a Criteo-like
shape (26 tables of 64-wide embeddings, one index per lookup, 13 dense features),
``--batches`` global mini-batches of ``--batch``, drawn through ``fb_dlrm_data.py``:
the program's own numbers, made by whole arrays, since its per-sample loops took the
CPU from the other ranks' steps. Samples/s come from the program's own ms/it after
its first print interval (warm-up), the median of ``--repeats`` rotated runs. Each
run's last printed loss is reported against forced MPI's (the same seeds everywhere).
The communication share is not measured: the program is not instrumented.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

from launching import launcher, run_env, variants  # (this folder is on sys.path: run as a script)

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"Finished training it (\d+)/\d+ of epoch \d+, ([\d.]+) ms/it, loss ([\d.]+)")


def args_of(a) -> list:
    emb = "-".join([str(a.rows)] * 26)
    return ["--arch-sparse-feature-size=64", f"--arch-embedding-size={emb}",
            "--arch-mlp-bot=13-256-64", "--arch-mlp-top=256-64-1", "--data-generation=random",
            f"--mini-batch-size={a.batch}", f"--num-batches={a.batches}",
            "--num-indices-per-lookup=1", "--num-indices-per-lookup-fixed=True",
            f"--print-freq={a.print_freq}", "--print-time", "--loss-function=bce",
            "--round-targets=True", "--numpy-rand-seed=123"]


def launch(a, variant) -> dict:
    """One run of ``variant`` (``launching.variants``); the program runs in the checkout,
    so the paths given are made absolute here."""
    name, backend, options, extra, tuned = variant
    dlrm = Path(a.dlrm).resolve()
    table = str(Path(a.table).resolve()) if tuned and a.table else None
    env = run_env(table, {**extra, **({"MCRDL_BACKEND": options} if options else {})})
    cmd = launcher(a.ranks, a.cluster, a.hosts) + [
        sys.executable, "-m", "mcrdl_torch.run", str(HERE / "fb_dlrm_data.py"),
        str(dlrm / "dlrm_s_pytorch.py"), f"--dist-backend={backend}"] + args_of(a)
    proc = subprocess.run(cmd, env=env, cwd=dlrm, capture_output=True, text=True,
                          timeout=900)
    found = [(int(i), float(ms), float(loss)) for i, ms, loss in LINE.findall(proc.stdout)]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{name}: {' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    timed = [ms for i, ms, _ in found if i > a.print_freq] or [found[-1][1]]
    return {"samples_per_s": a.batch / (statistics.mean(timed) / 1e3), "loss": found[-1][2]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dlrm", help="a checkout of facebookresearch/dlrm")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--cluster", default=None, metavar="RATE")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--table", required=True, help="the tuning table of the tuned variants")
    p.add_argument("--codecs", default="bf16,int8")
    p.add_argument("--batch", type=int, default=2048, help="global mini-batch")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--print-freq", type=int, default=10)
    p.add_argument("--rows", type=int, default=20000, help="rows per embedding table")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], metavar="VARIANT",
                   help="variants not to run, by name ('mcrdl: gloo', 'mcrdl: tuned')")
    a = p.parse_args(argv)
    vs = [v for v in variants(a.codecs) if v[0] not in a.skip]
    runs = {v[0]: [] for v in vs}
    for rep in range(a.repeats):
        k = rep % len(vs)
        for v in vs[k:] + vs[:k]:
            runs[v[0]].append(launch(a, v))
            print(f"{v[0]:30s} {runs[v[0]][-1]['samples_per_s']:10.0f} samples/s  "
                  f"loss {runs[v[0]][-1]['loss']:.6f}", flush=True)
    med = {n: statistics.median(r["samples_per_s"] for r in rs) for n, rs in runs.items()}
    best = max(med[n] for n in ("gloo (torch)", "mcrdl: mpi", "mcrdl: gloo") if n in med)
    ref = runs["mcrdl: mpi"][0]["loss"]
    print(f"\nfacebookresearch/dlrm, {a.ranks} ranks"
          f"{f', {a.hosts} hosts at {a.cluster}' if a.cluster else ''}, median of {a.repeats}:")
    print("| variant | samples/s | vs best single | last loss (vs forced mpi) |")
    print("|---|---|---|---|")
    for name, rs in runs.items():
        loss = rs[0]["loss"]
        print(f"| {name} | {med[name]:.0f} | {med[name] / best:.2f}x | {loss:.6f} "
              f"({(loss - ref) / ref:+.3%}) |")


if __name__ == "__main__":
    main()
