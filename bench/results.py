"""docs/results.md: each seed paper's end-to-end claim beside the same kind of program here.

    sudo .venv/bin/python bench/results.py --quick     # a few minutes: 2x2 at 1 Gbit/s, 1 repeat
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
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "apps"))
from launching import OUT, ROOT  # noqa: E402

RESULTS = OUT / "results"
PAGE = ROOT / "docs" / "results.md"

#: (paper, its claim, the app here, what it is, needs (an importable module or None),
#:  the claim's lower bound as a ratio to the best single library, a note where short)
CLAIMS = [
    ("MCR-DL (mix-and-match)", "DLRM 1.25-1.33x", "dlrm",
     "bench/apps/dlrm.py, communication-heavy shape (26 tables, one row per lookup)", None,
     1.25, "the emulated hosts share 2 cores, so codec and compute take turns"),
    ("MCR-DL (mix-and-match)", "DeepSpeed-MoE 1.31-1.45x", "ds_moe",
     "DeepSpeed's MoE layer, unchanged (bench/apps/ds_moe.py)", "deepspeed", 1.31,
     "4 ranks on 2 cores: bound by the CPU at 4x1"),
    ("MCR-DL (mix-and-match)", "Megatron-style dense transformer 1.20x", None,
     "tensor-parallel layers inside each host, data-parallel across (not built yet)", None,
     1.20, ""),
    ("Compression (ZeRO++-style codecs)", "FSDP training 31.7% faster, loss within 0.5%",
     "fsdp", "bench/apps/fsdp.py: a 4-layer GPT-style LM with FSDP2 (not HuggingFace GPT-2:"
     " transformers is not installed here)", None, 1.317, ""),
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


def measure(layouts: list, quick: bool) -> None:
    """Run the apps table on each layout, every app of CLAIMS that can run here."""
    import table  # (the apps table, in this process)

    apps = [c[2] for c in CLAIMS if c[2] and _available(c[4])]
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, rate, hosts, ranks in layouts:
        argv = ["--ranks", str(ranks), "--cluster", rate, "--hosts", str(hosts), "--tune",
                "--apps", *apps, "--shape", "comm-cap", "--codecs", "bf16,int8"]
        argv += (["--steps", "6", "--repeats", "1", "--tune-sizes", "4", "64K", "1M", "4M"]
                 if quick else
                 ["--steps", "20", "--repeats", "3", "--loss-steps", "200"])
        a = table.parse(argv)
        load0 = os.getloadavg()[0]
        rows = table.run_config(a, rate, hosts, [ranks])
        (RESULTS / f"{name}.json").write_text(json.dumps({
            "layout": name, "machine": _machine(), "load": [load0, os.getloadavg()[0]],
            "command": "sudo .venv/bin/python bench/apps/table.py " + " ".join(argv),
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "rows": rows}, indent=1))


def _row(claim, result) -> str:
    paper, said, app, what, needs, bound, short = claim
    if app is None:
        return f"| {paper}: {said} | {what} | - | - | - | - | - | not measured |"
    if not _available(needs) and result is None:
        return (f"| {paper}: {said} | {what} | - | - | - | - | - | needs `pip install "
                f"{needs}` |")
    rows = [r for r in (result or {}).get("rows", []) if r["app"] == app]
    if not rows:
        return f"| {paper}: {said} | {what} | - | - | - | - | - | not run on this layout |"
    by = {r["variant"]: r for r in rows}
    single = max((r for r in rows if r["variant"] in ("gloo (torch)", "mcrdl: mpi",
                                                      "mcrdl: gloo")),
                 key=lambda r: r["samples_per_s"])
    coded = next(r for r in rows if "+" in r["variant"])
    aa = by.get("mcrdl: mpi (A/A)")
    aa_ratio = aa["samples_per_s"] / by["mcrdl: mpi"]["samples_per_s"] if aa else None
    ratio = coded["samples_per_s"] / single["samples_per_s"]
    loss = (f"{coded['final_loss_rel_diff']:+.2%} after {coded['loss_steps']} steps"
            if "final_loss_rel_diff" in coded else
            f"max {coded['loss_max_rel_diff_vs_gloo']:.0e} vs gloo")
    verdict = "" if ratio >= bound else f" **short of {bound:.2f}x**" + (
        f": {short}" if short else "")
    return (f"| {paper}: {said} | {what} | {single['variant']} {single['samples_per_s']:.0f} "
            f"| {coded['variant']} {coded['samples_per_s']:.0f} | {ratio:.2f}x{verdict} | "
            f"{'-' if aa_ratio is None else f'{aa_ratio:.2f}'} | {loss} | "
            f"{'; '.join(coded.get('ran', [])) or '-'} |")


def render(layouts: list) -> str:
    """The page from the JSON of ``layouts`` in RESULTS (missing ones say so)."""
    out = ["# Results: each paper's claim beside ours", "",
           "Made by `sudo .venv/bin/python bench/results.py` (`--quick`: one layout, one "
           "repeat, no loss run); do not edit by hand. Ratios are MCR-DL's variant (tuned, "
           "codecs allowed) over the best single library (the fastest of torch's Gloo and "
           "MCR-DL forced to MPI or to Gloo), samples/s the median of rotated repeats; A/A "
           "is forced MPI run twice (the noise). Commands and conditions under each table.",
           ""]
    for name, rate, hosts, ranks in layouts:
        path = RESULTS / f"{name}.json"
        result = json.loads(path.read_text()) if path.exists() else None
        out += [f"## {hosts} emulated hosts x {ranks // hosts} ranks at {rate}", "",
                "| claim | program here | best single (samples/s) | MCR-DL | ratio | A/A | "
                "loss | ran |", "|---|---|---|---|---|---|---|---|"]
        out += [_row(c, result) for c in CLAIMS]
        if result:
            out += ["", f"`{result['command']}`; {result['machine']}; load average "
                        f"{result['load'][0]:.1f} -> {result['load'][1]:.1f}."]
        else:
            out += ["", f"Not measured yet: `sudo .venv/bin/python bench/results.py` runs it."]
        out.append("")
    out += ["## Cross-mesh resharding and the JAX pipeline", "",
            "Resharding microbenchmarks (the paper: up to 10x over send/recv): "
            "[resharding.md](resharding.md#benchmark); the JAX overlap/pipeline table: "
            "[benchmarks.md](benchmarks.md#jax-overlap-and-pipelines).", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one layout, 6 steps, 1 repeat")
    p.add_argument("--render", action="store_true", help="only write the page from the JSON")
    p.add_argument("--page", type=Path, default=PAGE)
    a = p.parse_args(argv)
    layouts = QUICK if a.quick else LAYOUTS
    if not a.render:
        measure(layouts, a.quick)
    a.page.write_text(render(layouts))
    print(f"wrote {a.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
