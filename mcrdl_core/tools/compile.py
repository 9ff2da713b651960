"""Compile an extension module in place, atomically (the MPI backend's ``mpi_fast`` and
the torch frontend's ``_facts`` are built this way).

``compile_into(command, source, out)`` runs ``command(tmp)``, a compiler command that
writes the module to ``tmp``, a temporary file next to ``out``, then renames it into
place, so that processes which import the module while it is rebuilt (ranks building
at the same time) never load half a file; a failure raises RuntimeError with the
command and the compiler's output and leaves nothing behind.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable


def compile_into(command: Callable[[str], list[str]], source: Path, out: Path,
                 quiet: bool = False) -> Path:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = command(tmp)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building {source.name} failed ({' '.join(cmd)}):\n"
                               f"{done.stdout}{done.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not quiet:
        print(f"built {out} with {cmd[0]}")
    return out


def build_with(cc: str | None, missing: str, command: Callable[[str, str], list[str]],
               source: Path, out: Path, quiet: bool = False) -> Path:
    """``compile_into`` with the compiler ``cc`` (``command(cc, tmp)``), or a
    RuntimeError saying ``missing`` (what to install) where there is none."""
    if cc is None:
        raise RuntimeError(missing)
    return compile_into(lambda tmp: command(cc, tmp), source, out, quiet)


def main(build: Callable[[], Path]) -> None:
    """A build module's ``__main__``: run ``build``; exit with its error's text."""
    try:
        build()
    except RuntimeError as exc:
        sys.exit(str(exc))
