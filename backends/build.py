"""Build the MPI backend's compiled hot path (``mpi_fast.c``) against the MPI library
mpi4py loads.

Run ``python -m mcrdl_backends.build`` once after installing (``make install`` does):
it compiles with the ``mpicc`` of the environment (``$MPICC``, else the one next to
this Python, else the first on PATH: the ``mpich`` wheel puts it in the venv's bin)
and writes the module next to this file. Without it, or with ``MCRDL_MPI_FAST=0``, the
MPI backend's fast path issues through mpi4py: the same calls and results, at a few
µs more per call. ``mcrdl info`` says which is in use and why.

The module is written under a temporary name and renamed into place, so ranks that
build at the same time never load half a file.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

import mpi4py

from mcrdl_core.tools.compile import compile_into, main

SOURCE = Path(__file__).with_name("mpi_fast.c")


def target() -> Path:
    """Where the built module goes: next to this file, named for this Python."""
    return SOURCE.with_name("mpi_fast" + sysconfig.get_config_var("EXT_SUFFIX"))


def mpicc() -> str | None:
    """The MPI compiler wrapper to build with, or None if there is none."""
    if os.environ.get("MPICC"):
        return os.environ["MPICC"]
    here = Path(sys.executable).with_name("mpicc")
    return str(here) if here.exists() else shutil.which("mpicc")


def build(quiet: bool = False) -> Path:
    """Compile the module; return its path. Raises RuntimeError with the compiler's
    output (and what to install) if it cannot."""
    cc = mpicc()
    if cc is None:
        raise RuntimeError("no mpicc found: install the mpich wheel (pip install mpich) or "
                           "set MPICC to your MPI's compiler wrapper")
    return compile_into(lambda tmp: [
        cc, "-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter",
        "-I" + sysconfig.get_paths()["include"], "-I" + mpi4py.get_include(), str(SOURCE),
        "-o", tmp], SOURCE, target(), quiet)


if __name__ == "__main__":
    main(build)
