"""What the apps' launchers share (``table.py``, ``fb_dlrm.py``, ``bench/demo_cluster.py``):
the variants a program is timed under, the environment of a run, the launcher (one host
or the emulated cluster) and the tune of the apps' message sizes.

This module runs in the launching process only: it imports neither torch nor MCR-DL, and
nothing in this folder that it could import back (``table.py`` and ``fb_dlrm.py`` both
sit above it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = ROOT / "bench" / "out"
BIN = Path(sys.executable).parent

CODECS = "fp16,bf16"  # default of --codecs: what "tuned + codecs" allows, on all_to_all


#: the ops whose codecs the "tuned + codecs" variant allows, per app (default: all_to_all,
#: the exchanges of DLRM and MoE); FSDP moves its weights and gradients by all-gather and
#: reduce-scatter, the Megatron-style app its activations (TP) and gradients (DP) by
#: all-reduce
CODEC_OPS = {"fsdp": ("all_gather", "reduce_scatter"), "megatron": ("all_reduce",)}
_SHORT = {"all_to_all": "a2a", "all_gather": "ag", "reduce_scatter": "rs", "all_reduce": "ar"}


def codec_variant(codecs: str, app: str | None = None) -> tuple:
    """The tuned variant that allows ``codecs`` (comma-separated) on the app's
    communication-heavy ops (``CODEC_OPS``): the tuning table's compressed
    measurements decide where, and which, pays (``auto:``)."""
    allowed = "+".join(c for c in codecs.split(",") if c)
    ops = CODEC_OPS.get(app, ("all_to_all",))
    spec = ",".join(f"{op}=auto:{allowed}" for op in ops)
    return (f"mcrdl: tuned + {'/'.join(_SHORT[op] for op in ops)} {allowed}", "mcrdl", "",
            {"MCRDL_COMPRESSION": spec}, True)


def variants(codecs: str, app: str | None = None) -> list:
    """(name, torch backend, pg_options, extra environment, uses the tuning table)."""
    return [("gloo (torch)", "gloo", None, {}, False),
            ("mcrdl: mpi", "mcrdl", "mpi", {}, False),
            ("mcrdl: gloo", "mcrdl", "gloo", {}, False),
            ("mcrdl: tuned", "mcrdl", "", {}, True),
            codec_variant(codecs, app),
            ("mcrdl: mpi (A/A)", "mcrdl", "mpi", {}, False)]


def run_env(table: str | None, extra: dict | None = None) -> dict:
    """The environment of one run: the venv's ``bin`` first on PATH, the tuning table
    (``none`` for the variants that do not use it), no backend or codec inherited from
    the caller's environment, then ``extra``."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["MCRDL_TUNING_TABLE"] = table or "none"
    env.setdefault("MCRDL_TIMEOUT", "120")
    env.pop("MCRDL_BACKEND", None)
    env.pop("MCRDL_COMPRESSION", None)
    env.update(extra or {})
    return env


def mpiexec() -> str:
    exe = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
    if not exe:
        raise SystemExit("mpiexec not found: install the mpich extra (pip install 'mcr-dl[mpich]')")
    return exe


def launcher(n: int, cluster: str | None, hosts: int = 2) -> list:
    """``mpiexec -n N``, or the emulated cluster: ``hosts`` hosts, N/hosts ranks each,
    links shaped to ``cluster`` (tc's units, e.g. 1gbit)."""
    if not cluster:
        return [mpiexec(), "-n", str(n)]
    if n % hosts:
        raise SystemExit(f"--cluster runs {hosts} hosts with the same number of ranks: {n} "
                         "ranks do not split; change --ranks or --hosts")
    return [str(BIN / "mcrdl"), "cluster", "run", "--hosts", str(hosts), "--ranks-per-host",
            str(n // hosts), "--rate", cluster, "--"]


#: the message sizes (bytes per rank) the apps' tune measures
TUNE_SIZES = ("4", "4K", "64K", "256K", "1M", "2M", "4M", "8M")


def tune(n: int, path: Path, cluster: str | None = None, hosts: int = 2,
         codecs: str = CODECS, ops: tuple = ("all_reduce", "all_to_all"),
         sizes: tuple = TUNE_SIZES, timeout: float = 1200, trials_scale: float = 1.0,
         echo=print) -> None:
    """``mcrdl tune`` of ``ops`` at the apps' sizes into ``path``, the compressed variants
    of ``codecs`` measured as candidates (for the "tuned + codecs" variant);
    ``trials_scale`` < 1 for a quicker, less certain table; ``echo`` gets the command line."""
    cmd = (launcher(n, cluster, hosts) + [str(BIN / "mcrdl"), "tune", "--ops", *ops,
                                          "--sizes", *sizes]
           + (["--compression", codecs] if codecs else [])
           + (["--trials-scale", f"{trials_scale:g}"] if trials_scale != 1.0 else [])
           + ["--output", str(path)])
    echo("tuning: " + " ".join(cmd))
    proc = subprocess.run(cmd, env=run_env(str(path)), cwd=ROOT, timeout=timeout,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:  # its log only where it failed (else torch's and MPI's chatter)
        raise SystemExit(f"{' '.join(cmd)} failed (exit status {proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
