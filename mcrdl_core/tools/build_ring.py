"""Build the flight recorder's ring in C (``mcrdl_core/observe/ring.c``).

Run ``python -m mcrdl_core.tools.build_ring`` once after installing (``make install``
does): it compiles with ``$CC``, else ``cc``, else ``gcc``, against this Python's
headers, into ``mcrdl_core/observe/ring`` + the extension suffix. Without it the
recorder keeps the same entries in Python columns, at a few tenths of a µs more per
call (``observe/recorder.py``; ``mcrdl info`` says which is in use).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

from .build_codecs import compiler
from .compile import build_with, main

SOURCE = Path(__file__).resolve().parent.parent / "observe" / "ring.c"


def target() -> Path:
    """Where the module goes: next to its source, named for this Python."""
    return SOURCE.with_name("ring" + sysconfig.get_config_var("EXT_SUFFIX"))


def build(quiet: bool = False) -> Path:
    """Compile the module; return its path. Raises RuntimeError with the compiler's
    output (or what to install) if it cannot."""
    return build_with(compiler(), "no C compiler found (cc, gcc or $CC): install one "
                      "(e.g. apt install gcc) or set CC; without it the recorder runs in "
                      "Python", lambda cc, tmp: [
                          cc, "-O2", "-shared", "-fPIC", "-Wall", "-Wextra",
                          "-Wno-unused-parameter", "-I" + sysconfig.get_paths()["include"],
                          str(SOURCE), "-o", tmp], SOURCE, target(), quiet)


if __name__ == "__main__":
    main(build)
