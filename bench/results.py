"""docs/results.md: each seed paper's end-to-end claim beside the same kind of program here.

    sudo .venv/bin/python bench/results.py --quick     # 2x2 at 1 Gbit/s, 1 run per variant:
                                                       # ~20 min on 2 cores (4 of them the tune)
    sudo .venv/bin/python bench/results.py             # 2x2 and 4x1 at 1 and 10 Gbit/s, 3 repeats,
                                                       # 200-step losses (hours on 2 cores)
    .venv/bin/python bench/results.py --render         # the page again from bench/out/results/

For every claim (``CLAIMS``) it runs the apps table (``bench/apps/table.py``, in this
process: the same variants, tunes and rotated repeats) on each layout of ``LAYOUTS``
(``QUICK`` with ``--quick``), keeps the rows as JSON in ``bench/out/results/`` (one file
per layout, with the machine, the command and the load average around it), and writes
the page: per claim and layout, the best single library, MCR-DL's variant, their ratio,
the A/A row (the noise), the loss check and the command. Where a program is not here
(or its package is missing) the row says so instead of a figure; where a ratio falls
below the paper's, the page says so, with the reason noted in ``CLAIMS``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "apps"))
from launching import OUT, ROOT  # noqa: E402

RESULTS = OUT / "results"
PAGE = ROOT / "docs" / "results.md"

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _fsdp_model() -> str:
    """What the FSDP row trains here: GPT-2 where transformers is installed."""
    if importlib.util.find_spec("transformers") is not None:
        return ("bench/apps/fsdp.py: HuggingFace GPT-2 (`GPT2LMHeadModel` from a config: 4 "
                "layers, width 256, vocab 512) sharded with FSDP2 (`fully_shard`)")
    return ("bench/apps/fsdp.py: a 4-layer GPT-style LM of its own with FSDP2 (transformers "
            "is not installed: `pip install 'mcr-dl[apps]'` for GPT-2)")


#: (paper, its claim, the app here, what it is, needs (an importable module or None),
#:  the claim's lower bound as a ratio to the best single library, why we fall short
#:  where we do)
CLAIMS = [
    ("MCR-DL (mix-and-match)", "DLRM 1.25-1.33x (32 A100)", "dlrm",
     "bench/apps/dlrm.py: DLRM, embedding tables model-parallel over all_to_all, MLPs "
     "data-parallel; communication-heavy shape (26 tables, one row per lookup); codecs "
     "allowed on all_to_all", None,
     1.25, "the emulated hosts share 2 cores, so codecs and compute take turns"),
    ("MCR-DL (mix-and-match)", "DeepSpeed-MoE 1.31-1.45x (256 V100)", "ds_moe",
     f"bench/apps/ds_moe.py: DeepSpeed's own MoE layer (deepspeed {_version('deepspeed')}, "
     "CPU), unchanged, "
     "capacity 1.25; codecs allowed on all_to_all", "deepspeed", 1.31,
     "4 ranks on 2 cores: the step is bound by the CPU, not by the link"),
    ("MCR-DL (mix-and-match)", "Megatron-DeepSpeed dense transformer 1.20x", "megatron",
     "bench/apps/megatron.py: tensor-parallel column/row-parallel attention and MLP over "
     "the ranks of each host, data-parallel gradient all_reduce across hosts (4 layers, "
     "width 256); codecs allowed on all_reduce, chosen per group (auto)", None,
     1.20, "the TP all-reduces (128 KiB) are below the codecs' 256 KiB floor and run inside "
     "a host, so only the cross-host gradient all-reduce can gain; the 2 cores are shared"),
    ("Compression (collective-level codecs)", "PyTorch-FSDP training 31.7% faster, similar "
     "accuracy", "fsdp", _fsdp_model(), None, 1.317,
     "the codecs run on the same 2 cores as the model's compute"),
]

#: (name, link rate, hosts, ranks) of the full page and of --quick
LAYOUTS = [("2x2-1gbit", "1gbit", 2, 4), ("4x1-1gbit", "1gbit", 4, 4),
           ("2x2-10gbit", "10gbit", 2, 4), ("4x1-10gbit", "10gbit", 4, 4)]
QUICK = [("2x2-1gbit", "1gbit", 2, 4)]


def _available(module: str | None) -> bool:
    return module is None or importlib.util.find_spec(module) is not None


def _machine() -> str:
    model = ""
    try:
        for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} cores {model}".strip()


def measure(layouts: list, quick: bool, only: list | None = None) -> None:
    """Run the apps table on each layout, every app of CLAIMS that can run here, one app
    after another; one JSON per layout in RESULTS, rewritten after each app, so a run cut
    short keeps what it measured. An app whose run fails is tried once more, then its row
    says it failed (with the launcher's last line) and the next app runs."""
    import table  # (the apps table, in this process)

    apps = [c[2] for c in CLAIMS if c[2] and _available(c[4]) and (not only or c[2] in only)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, rate, hosts, ranks in layouts:
        tuning = RESULTS / f"tuning-{name}.json"
        argv = ["--ranks", str(ranks), "--cluster", rate, "--hosts", str(hosts),
                "--table", str(tuning), "--shape", "comm-cap", "--codecs", "bf16,int8"]
        argv += (["--steps", "6", "--repeats", "1", "--tune-sizes", "4", "64K", "1M", "4M"]
                 if quick else
                 ["--steps", "20", "--repeats", "3", "--loss-steps", "200"])
        # the full run tunes every layout afresh; --quick reuses a table of this layout
        tune = ["--tune"] if not (quick and tuning.exists()) else []
        load0, t0 = os.getloadavg()[0], time.time()
        rows, failed, retried = [], {}, {}
        path, kept = RESULTS / f"{name}.json", {}
        if only and path.exists():  # --apps: the other apps' rows stay as they were
            kept = json.loads(path.read_text())
            rows = [r for r in kept["rows"] if r["app"] not in apps]
            failed = {k: v for k, v in kept.get("failed", {}).items() if k not in apps}
            retried = {k: v for k, v in kept.get("retried", {}).items() if k not in apps}
        for i, app in enumerate(apps):
            a = table.parse(argv + (tune if i == 0 else []) + ["--apps", app])
            for attempt in (1, 2):
                try:
                    rows += table.run_config(a, rate, hosts, [ranks])
                    if app in failed:  # the second attempt ran: say so
                        retried[app] = failed.pop(app)
                    break
                except SystemExit as exc:
                    lines = [x for x in str(exc).splitlines() if x.strip()]
                    failed[app] = f"attempt {attempt}: {lines[-1][-200:] if lines else exc}"
                    print(f"results: {app} failed ({failed[app]})", flush=True)
                    a.tune = False
            run = {"apps": apps, "load": [load0, os.getloadavg()[0]],
                   "seconds": time.time() - t0,
                   "command": "sudo .venv/bin/python bench/apps/table.py " + " ".join(
                       argv + ["--tune", "--apps", *apps]),
                   "when": datetime.datetime.now(datetime.timezone.utc).isoformat(
                       timespec="minutes")}
            path.write_text(json.dumps({
                "layout": name, "quick": quick, "machine": _machine(), **run,
                "earlier": kept.get("earlier", []) + ([{k: kept[k] for k in run if k in kept}]
                                                      if kept else []),
                "rows": rows, "failed": failed, "retried": retried}, indent=1))


#: the variants "best single library" is the fastest of (table.SINGLE)
SINGLE = ("gloo (torch)", "mcrdl: mpi", "mcrdl: gloo")
_EMPTY = " - | - | - | - | - |"  # best single, MCR-DL, ratio, A/A, loss; then ran, tuned


def figures(claim, result) -> dict | None:
    """One claim's figures on one layout's result: the best single library's row, MCR-DL's
    variant (tuned, codecs allowed), their ratio, the A/A ratio, the lossless tuned
    variant's ratio; None where the app has no rows there."""
    app = claim[2]
    rows = [r for r in (result or {}).get("rows", []) if r["app"] == app]
    if not rows:
        return None
    by = {r["variant"]: r for r in rows}
    single = max((r for r in rows if r["variant"] in SINGLE), key=lambda r: r["samples_per_s"])
    coded = next(r for r in rows if "+" in r["variant"])
    aa = by.get("mcrdl: mpi (A/A)")
    tuned = by.get("mcrdl: tuned")
    return {"single": single, "coded": coded,
            "ratio": coded["samples_per_s"] / single["samples_per_s"],
            "aa": aa["samples_per_s"] / by["mcrdl: mpi"]["samples_per_s"] if aa else None,
            "tuned": tuned["samples_per_s"] / single["samples_per_s"] if tuned else None}


def _noisy(f: dict) -> bool:
    """Two equal runs (A/A) differed at least as much as MCR-DL from the best single:
    the ratio is not a figure."""
    return f["aa"] is not None and abs(math.log(f["aa"])) >= abs(math.log(f["ratio"]))


def _row(claim, result) -> str:
    """The table row of one claim on one layout (``result``: its JSON, or None)."""
    paper, said, app, what, needs, bound, short = claim
    head = f"| {paper}: {said} | {what} |"
    if app is None:
        return f"{head}{_EMPTY} not measured | - |"
    if not _available(needs) and result is None:
        return f"{head}{_EMPTY} needs `pip install {needs}` | - |"
    f = figures(claim, result)
    if f is None:
        why = (result or {}).get("failed", {}).get(app)
        return f"{head}{_EMPTY} {f'failed: {why}' if why else 'not run on this layout'} | - |"
    single, coded, ratio = f["single"], f["coded"], f["ratio"]
    loss = (f"{coded['final_loss_rel_diff']:+.2%} after {coded['loss_steps']} steps"
            if "final_loss_rel_diff" in coded else
            f"max {coded['loss_max_rel_diff_vs_gloo']:.0e} vs gloo")
    verdict = ("" if ratio >= bound else f" **short of {bound:.2f}x**") + (
        " (within the A/A's noise)" if _noisy(f) else "")
    aa = "-" if f["aa"] is None else f"{f['aa']:.2f}"
    tuned = "-" if f["tuned"] is None else f"{f['tuned']:.2f}x"
    return (f"{head} {single['variant']} {single['samples_per_s']:.0f} "
            f"| {coded['variant']} {coded['samples_per_s']:.0f} | {ratio:.2f}x{verdict} | "
            f"{aa} | {loss} | {'; '.join(coded.get('ran', [])) or '-'} | {tuned} |")


FULL = "sudo .venv/bin/python bench/results.py"

#: the cross-mesh resharding paper beside this project's resharding benchmark (figures
#: from docs/resharding.md, "Figures": emulated hosts at 1 Gbit/s, MPI, 64 MiB, median
#: of 5 rounds, load average 4.5-6.5; they are not re-measured by this script)
RESHARDING = [
    "| claim | program here | ours | verdict |", "|---|---|---|---|",
    "| broadcast-based resharding up to 10x over send/recv (micro-benchmarks) | "
    "`bench/resharding.py`, 1 rank -> 4 hosts x 4 (5x4, 20 ranks) | 767 ms against 9209 ms "
    "for send/recv: **12.0x** (12.0-12.5x over runs); 4.25x over send/recv + all-gather | met |",
    "| (same) | 1 rank -> 4 hosts x 1 (5x1) | 686 ms against 2283 ms: 3.33x | "
    "the link bound for 4 receivers |",
    "| (same) | 1D -> 2D, rows -> columns (4x2) | 661 ms against 629 ms: **0.95x** | "
    "short: every method must bring the whole tensor into each destination host, so the "
    "lower bounds are equal (561-566 ms) and send/recv is already near it |",
    "| overlapping-friendly schedule (eager 1F1B) +10% GPT-3, +50% U-Transformer end to end "
    "| `bench/apps/jax_mesh_pipeline.py` (GPipe, 1F1B, eager 1F1B over `reshard`) | "
    "2 meshes, each one host of 2 ranks, at 1 Gbit/s (`bench/jax_pipeline_table.py`, 5 "
    "rotated repeats): eager 1F1B with broadcast reshards **1.42x** blocking 1F1B with "
    "send/recv on MPI and **1.48x** on Gloo (A/A 1.01, 1.05; a second pair 1.42x, 1.35x); "
    "parameters within 1.5e-08 of the one-process run | met (goal 1.25x); with 4 hosts of "
    "1 rank 0.99x (MPI): each stage-1 host must take in the whole activation over its own "
    "link, so broadcast saves nothing there, and 4 ranks on 2 cores leave no CPU to "
    "overlap |",
]


def render(layouts: list = None) -> str:
    """The page from the JSON in RESULTS of ``layouts`` (default: every layout of the
    full run; one not measured says so and gives the command that measures it)."""
    layouts = LAYOUTS if layouts is None else layouts
    out = ["# Results: each paper's claim beside ours", "",
           f"Made by `{FULL}` (`--quick`: 2 hosts x 2 ranks at 1 Gbit/s only, 6 steps, one "
           "run per variant, no 200-step loss run: about 20 minutes on the 2-core VM, 4 of them "
           "the tune, which a second --quick reuses); "
           "`--render` writes this page again from `bench/out/results/`. Do not edit by hand.",
           "",
           "Each row is one unchanged PyTorch program on the emulated cluster "
           "([cluster.md](cluster.md): network namespaces of one machine, links shaped by "
           "`tc`), launched by `bench/apps/table.py` under six variants in rotated order. "
           "**best single**: the fastest of torch's own Gloo and MCR-DL forced to MPI or to "
           "Gloo for every op. **MCR-DL**: the tuned variant with codecs allowed on the "
           "program's heavy op (`mcrdl: tuned + OP bf16+int8`: the tuning table measured on "
           "those hosts first, `MCRDL_COMPRESSION=OP=auto:bf16+int8`, so a codec runs only "
           "where the table or the calibration says it pays). **ratio**: its samples/s over "
           "the best single's (the papers' end-to-end ratio). **A/A**: forced MPI run twice, "
           "second over first: how far two equal runs differ here. **loss**: the largest "
           "relative difference of any step's loss from torch Gloo's run (same seeds), or "
           "with the full run the final loss after 200 steps against forced MPI's. **ran**: "
           "the library (and codec) each op ran on. **tuned**: the lossless tuned variant's "
           "ratio.", ""]
    short, missing, quick = [], [], []
    for name, rate, hosts, ranks in layouts:
        path = RESULTS / f"{name}.json"
        result = json.loads(path.read_text()) if path.exists() else None
        per = ranks // hosts
        out += [f"## {hosts} emulated hosts x {per} rank{'s' if per > 1 else ''} at {rate}", "",
                "| claim | program here | best single (samples/s) | MCR-DL | ratio | A/A | "
                "loss | ran | tuned |", "|---|---|---|---|---|---|---|---|---|"]
        out += [_row(c, result) for c in CLAIMS]
        if result:
            if result.get("quick"):
                quick.append(name)
            kind = ("**--quick figures**: one run per variant (no median), 6 timed steps, "
                    "the tune at 4 sizes; " if result.get("quick") else
                    "medians of rotated repeats; ")
            runs = result.get("earlier", []) + [result]
            out += ["", kind + "; ".join(
                f"`{r['command']}` (as run by `{FULL}{' --quick' if result.get('quick') else ''}"
                f"{' --apps ' + ' '.join(r['apps']) if len(runs) > 1 else ''}`, {r['when']}, "
                f"load average {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end)"
                for r in runs) + f"; {result['machine']} (the emulated hosts and every rank "
                "share its cores; one run per variant shows direction, not precision)."]
            for app, why in result.get("retried", {}).items():
                out.append(f"{app} ran on its second attempt (the first: {why}).")
            if ranks // hosts == 1:
                out.append("With one rank per host the Megatron-style app has TP groups of "
                           "one: it runs as pure data parallelism.")
            for app, why in result.get("failed", {}).items():
                said = next((c[1] for c in CLAIMS if c[2] == app), app)
                short.append(f"- {name}, {said}: no figure: {why}; `{FULL}"
                             f"{' --quick' if result.get('quick') else ''}` measures it again.")
            for c in CLAIMS:
                f = figures(c, result)
                if f is not None and f["ratio"] < c[5]:
                    noise = (" the A/A differed as much, so this run measured the machine's "
                             "other load more than the program; and" if _noisy(f) else "")
                    short.append(f"- {name}, {c[1]}: {f['ratio']:.2f}x against the paper's "
                                 f"{c[5]:.2f}x (A/A {f['aa'] or 0:.2f}):{noise} {c[6]}.")
        else:
            missing.append(name)
            out += ["", f"Not measured yet: `{FULL}` measures it (3 rotated repeats, 20 "
                        "steps, 200-step losses; hours on 2 cores)."]
        out.append("")
    out += ["## Cross-mesh resharding", "",
            "From [resharding.md](resharding.md#benchmark) (emulated hosts at 1 Gbit/s, MPI, "
            "64 MiB, median of 5 rounds, load average 4.5-6.5; its commands are there); "
            "the JAX pipeline table: [benchmarks.md](benchmarks.md#jax-overlap-and-pipelines).",
            "", *RESHARDING, ""]
    out += ["## Where we fall short, and why", ""]
    if short or len(missing) < len(layouts):
        out += short or ["- No measured row is below its paper's ratio."]
    if missing:
        out.append(f"- Not measured: {', '.join(missing)} (`{FULL}`).")
    if quick:
        out.append(f"- {', '.join(quick)}: --quick figures, one run per variant (no median): "
                   "where the A/A is far from 1.00, the ratios beside it show direction only; "
                   f"`{FULL}` (3 rotated repeats, medians) gives the figures.")
    out += ["- The papers ran on GPU clusters (V100/A100, InfiniBand); here the hosts are "
            "network namespaces of one 2-core VM: the compute is CPU compute, two orders of "
            "magnitude slower per byte moved than the papers' GPUs, and the codecs, the "
            "model and every rank share the same 2 cores.",
            "- Two-level algorithms (`hier`) are measured by the tune as candidates for the "
            "world's all_reduce and all_to_all; the Megatron-style app's DP groups hold one "
            "rank per host and its TP groups one host, so neither is a two-level group.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one layout, 6 steps, 1 repeat")
    p.add_argument("--render", action="store_true", help="only write the page from the JSON")
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--apps", nargs="+", default=None, metavar="APP",
                   help="measure only these apps of CLAIMS again; the layout's other rows "
                        "are kept")
    a = p.parse_args(argv)
    if not a.render:
        measure(QUICK if a.quick else LAYOUTS, a.quick, a.apps)
    a.page.write_text(render())
    print(f"wrote {a.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
